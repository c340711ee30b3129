//! How far this bridge has routed the fleet's stream, for what waits for it to catch up
//! (its doors as it starts, a card held back) and for the publisher, which checks the
//! order of its publishes by their sequences. A stream deleted and made again by hand
//! begins its sequences anew, so a place in the stream names which stream it is in, by
//! when the stream was made, as well as a sequence: a place in the old stream is not
//! taken for one in the new.

use std::cmp::Ordering;

use time::OffsetDateTime;
use tokio::sync::watch;

/// A place in the fleet's stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Place {
    /// When the stream was made (none before this bridge read any).
    pub stream: Option<OffsetDateTime>,
    pub sequence: u64,
}

impl Place {
    /// Where the stream `info` tells of ended when it was asked.
    pub fn end_of(info: &async_nats::jetstream::stream::Info) -> Place {
        Place {
            stream: Some(info.created),
            sequence: info.state.last_sequence,
        }
    }

    /// Whether routing, having reached this place, has routed everything up to `end`. A
    /// stream made after `end`'s has: the messages of the one before are gone with it.
    pub fn reached(&self, end: &Place) -> bool {
        match self.stream.cmp(&end.stream) {
            Ordering::Less => false,
            Ordering::Equal => self.sequence >= end.sequence,
            Ordering::Greater => true,
        }
    }
}

/// Where this bridge has routed the stream up to, set by the applier alone.
pub struct Routed(watch::Sender<Place>);

impl Default for Routed {
    fn default() -> Routed {
        Routed(watch::Sender::new(Place::default()))
    }
}

impl Routed {
    /// The applier reads, from now, the stream made at `made`. One made again (`anew`)
    /// begins its sequences anew, none of it routed yet; otherwise it is the stream read
    /// before, whose creation time may read otherwise now.
    pub fn reading(&self, made: OffsetDateTime, anew: bool) {
        self.0.send_if_modified(|routed| {
            let sequence = if anew { 0 } else { routed.sequence };
            let place = Place {
                stream: Some(made),
                sequence,
            };
            std::mem::replace(routed, place) != place
        });
    }

    /// Everything up to `sequence` of the stream being read is routed.
    pub fn up_to(&self, sequence: u64) {
        self.0.send_if_modified(|routed| {
            let further = sequence > routed.sequence;
            routed.sequence = routed.sequence.max(sequence);
            further
        });
    }

    /// Where routing stands now.
    pub fn now(&self) -> Place {
        *self.0.borrow()
    }

    /// Resolves once routing has reached `end` (`Place::reached`).
    pub async fn reached(&self, end: Place) {
        let mut routed = self.0.subscribe();
        // The sender is this one, which the caller holds: the wait cannot fail.
        let _ = routed.wait_for(|routed| routed.reached(&end)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn made(seconds: i64) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000 + seconds).unwrap()
    }

    fn at(stream: i64, sequence: u64) -> Place {
        Place {
            stream: Some(made(stream)),
            sequence,
        }
    }

    #[test]
    fn a_place_is_reached_in_its_stream_by_its_sequence_and_by_any_stream_made_since() {
        assert!(at(0, 10).reached(&at(0, 10)));
        assert!(!at(0, 9).reached(&at(0, 10)));
        // Made again: sequences begin anew, and the old stream's messages are gone.
        assert!(at(5, 1).reached(&at(0, 10)));
        assert!(!at(0, 1_000).reached(&at(5, 1)));
        // Nothing read yet reaches nothing, not even the start of a stream.
        assert!(!Place::default().reached(&at(0, 0)));
    }

    #[tokio::test]
    async fn a_stream_made_again_is_routed_from_its_start_and_waited_for_anew() {
        let routed = Routed::default();
        routed.reading(made(0), false);
        routed.up_to(1_000);
        routed.reading(made(0), false);
        assert_eq!(routed.now(), at(0, 1_000), "the same stream read again");

        routed.reading(made(3), false);
        assert_eq!(
            routed.now(),
            at(3, 1_000),
            "its creation time read otherwise"
        );

        routed.reading(made(5), true);
        assert_eq!(
            routed.now(),
            at(5, 0),
            "made again, routed up to none of it"
        );
        // Reaching its end is waited for until routing reaches it there.
        let end = at(5, 3);
        let mut waiting = std::pin::pin!(routed.reached(end));
        assert!(futures_util::poll!(&mut waiting).is_pending());
        routed.up_to(2);
        assert!(futures_util::poll!(&mut waiting).is_pending());
        routed.up_to(3);
        assert!(futures_util::poll!(&mut waiting).is_ready());
    }
}
