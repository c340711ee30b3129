//! Mail a bridge taken for gone was to keep and never saw, or saw and had not written. A
//! bridge keeps the mail of the absent agents it holds, and the others keep it only once
//! they take that bridge for gone (`Directory::keeps_mail_of`). What reached the stream in
//! between — after the last batch the gone bridge acknowledged (once what it routed to its
//! Grid and Synapse agents was written, its own messages as well as the others'), before
//! the others took it for gone — would wait for it to come back. So each bridge still here
//! reads that stretch of the stream again, from the gone bridge's consumer's
//! acknowledgement floor (or, if older, from where its last heartbeat said what it
//! acknowledged unwritten begins: `UnwrittenFloor`) to the stream's end, and keeps each
//! message for the agents the gone bridge held — what it had acknowledged, or routed
//! through as it put its last heartbeat (or its floors record, if that is later), only for
//! the agents whose deliveries of it that heartbeat said were not written (`Unwritten`).
//! Keeping is once fleet-wide (a kept message's record key is used once), so every bridge
//! doing this, and the gone bridge applying the same messages if it restarts, keep one
//! copy between them.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::link::{NatsLink, Ready};
use super::stretch::{READ_AGAIN_AT_MOST, Stretch, start_after};
use super::wire::{Heartbeat, Names, Replica, Unwritten};
use crate::core::{Core, Delivery, Envelope, Kind, MovedHere};

/// How many times a failed read of the stretch is taken up again.
const TRIES: u32 = 3;

/// Who the gone bridge held, as this bridge knew them just before it took it for gone.
pub struct Held {
    /// Every agent it held: the messages of the stretch are kept for them.
    pub all: HashSet<String>,
    /// Agents that moved from it to this bridge lately (`core::Moves`): what reached the
    /// stream while the gone bridge held them was its to keep, and nobody else kept it, so
    /// it is kept here (`Stage`).
    pub moved: Vec<MovedHere>,
    /// Its last heartbeat as the watch brought it, if it brought one: where it said its
    /// deliveries not written begin (`UnwrittenFloor`).
    pub last_beat: Option<Heartbeat>,
}

/// The stretch of the stream a gone bridge missed.
struct Missed {
    /// Its first and last sequences.
    first: u64,
    last: u64,
    /// The gone bridge's consumer's acknowledgement floor: what it missed up to this, or
    /// to where `unwritten` tells, is kept only for the agents `unwritten` names, each from
    /// its floor.
    acknowledged: u64,
    unwritten: Unwritten,
}

impl Missed {
    /// Whom of `all` the message at `sequence` is kept for (`None`: all of them).
    fn kept_for(&self, sequence: u64, all: &HashSet<String>) -> Option<HashSet<String>> {
        if self.unwritten.for_all(sequence, self.acknowledged) {
            return None;
        }
        let unwritten = |agent: &&String| self.unwritten.of(agent).is_some_and(|f| f <= sequence);
        Some(all.iter().filter(unwritten).cloned().collect())
    }
}

/// The floors a gone bridge's stretch is read by, from its heartbeat as the bucket `kept` it
/// and as the watch brought it (`watched`), and its floors `record`. Where the heartbeats
/// known are of one run, the latest put of that run among the three: each put's floors
/// cover every batch acknowledged unwritten before it (a late batch waits for both
/// carriers), so the latest says the least again. Otherwise (a run restarted, or a bridge
/// that does not number its puts) what the heartbeats say together.
fn floors_to_read(
    kept: Option<Heartbeat>,
    watched: Option<Heartbeat>,
    record: Option<Heartbeat>,
) -> Unwritten {
    let beats: Vec<&Heartbeat> = kept.iter().chain(&watched).collect();
    if let Some(first) = beats.first()
        && beats.iter().all(|beat| beat.same_run_as(first))
    {
        let record = record.as_ref().filter(|record| record.same_run_as(first));
        let latest = (beats.iter().copied().chain(record)).max_by_key(|put| put.put);
        return latest.map_or_else(Unwritten::default, Heartbeat::unwritten);
    }
    match (kept, watched) {
        (Some(kept), Some(watched)) => kept.unwritten().and(watched.unwritten()),
        (kept, watched) => {
            (kept.or(watched).as_ref()).map_or_else(Unwritten::default, Heartbeat::unwritten)
        }
    }
}

/// Where an agent that moved here from the gone bridge is, as the stretch is read — which
/// says what of the stretch nobody but this bridge would keep for it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    /// Here, or anywhere but the gone bridge: it was sent what it was to get.
    Here,
    /// Held by the gone bridge, online there or away: what reached the stream meanwhile the
    /// gone bridge did not apply, or did not write, or did not keep.
    AtGone,
}

impl Stage {
    /// Where an agent is at the start of the stretch, from its first presence in it here or
    /// on the gone bridge (`None`: none; `refused`: its join here never reached the fleet).
    fn at_start(first: Option<(bool, Kind)>, refused: bool) -> Stage {
        match first {
            // Left here: it was here.
            Some((true, kind)) if kind != Kind::PresenceJoin => Stage::Here,
            // Came here from the gone bridge, where it was away; or left the gone bridge,
            // or connected there, having been away (held there, or by a bridge that kept
            // its mail itself: kept once per message all the same).
            Some(_) => Stage::AtGone,
            // Its join here is older than the stretch: the gone bridge applied it (and kept
            // what came before); one NATS refused was never in the stream.
            None if refused => Stage::AtGone,
            None => Stage::Here,
        }
    }

    /// Where an agent is after a presence change here or on the gone bridge.
    fn after(here: bool) -> Stage {
        match here {
            true => Stage::Here,
            false => Stage::AtGone,
        }
    }
}

/// The agents that moved here from the gone bridge, and whom the messages read are kept
/// for at that point (by each one's `Stage`).
#[derive(Default)]
struct Away {
    moved: HashSet<String>,
    kept_for: HashSet<String>,
}

impl Away {
    fn set(&mut self, name: &str, stage: Stage) {
        if !self.moved.contains(name) {
            return;
        }
        match stage {
            Stage::Here => self.kept_for.remove(name),
            Stage::AtGone => self.kept_for.insert(name.to_owned()),
        };
    }
}

/// Keeps, for the agents `bridge` held, the mail it did not apply before it was taken for
/// gone; then releases what the router held back for them. Logs what it could not read.
pub async fn keep(
    link: Arc<NatsLink>,
    ready: Arc<Ready>,
    core: Arc<Core>,
    bridge: String,
    held: Held,
) {
    // Released however this ends (a panic below included): held-back mail never stays
    // held for good.
    let _release = ReleaseOnDrop {
        core: &core,
        bridge: &bridge,
    };
    if !held.all.is_empty() || !held.moved.is_empty() {
        let reader = Reader {
            link: &link,
            ready: &ready,
            core: &core,
            bridge: &bridge,
            held: &held,
        };
        reader.read_missed().await;
    }
}

/// Releases the mail held back for `bridge` when dropped.
struct ReleaseOnDrop<'a> {
    core: &'a Core,
    bridge: &'a str,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.core.router.release_mail_of(self.bridge);
    }
}

/// What reading one gone bridge's missed stretch needs.
struct Reader<'a> {
    link: &'a NatsLink,
    ready: &'a Ready,
    core: &'a Core,
    bridge: &'a str,
    held: &'a Held,
}

impl Reader<'_> {
    /// Reads the stream from after `bridge`'s acknowledgement floor, or from where its
    /// deliveries not written begin if that is older, to its end now (at most
    /// `READ_AGAIN_AT_MOST` messages back), keeping what its agents missed. A failed read is
    /// taken up again where it stopped, `TRIES` times.
    async fn read_missed(&self) {
        let bridge = self.bridge;
        let missed = match self.stretch().await {
            Ok(Some(missed)) => missed,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(bridge, error = %e, "federation: cannot find the mail a gone bridge missed");
                return;
            }
        };
        let (mut next, last) = (missed.first, missed.last);
        let mut kept = 0;
        let mut away = match self.held.moved.is_empty() {
            true => Away::default(),
            false => self.away(next, last).await,
        };
        for tries in 1..=TRIES {
            match self.read_from(&missed, next, &mut kept, &mut away).await {
                Ok(()) => break,
                Err((read_to, e)) => {
                    next = read_to + 1;
                    tracing::warn!(bridge, error = %e, tries, "federation: reading the mail a gone bridge missed failed");
                    if tries < TRIES {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
        if kept > 0 {
            tracing::info!(
                bridge,
                kept,
                "federation: kept the mail a gone bridge missed"
            );
        }
    }

    /// The gone bridge's missed stretch; `None` if it missed nothing.
    async fn stretch(&self) -> Result<Option<Missed>, async_nats::Error> {
        let (link, ready, bridge) = (self.link, self.ready, self.bridge);
        let mut stream = ready.js.get_stream(&link.names.stream).await?;
        let acknowledged = (stream.consumer_info(Names::consumer_of(bridge)).await?)
            .ack_floor
            .stream_sequence;
        // What it acknowledged before it was written is read again too: from the floor its
        // last heartbeat carried, as the bucket holds it (unless it was deleted, by a clean
        // stop) or as the watch brought it (which may lag), or its floors record.
        let read = async |bucket: &async_nats::jetstream::kv::Store| {
            (bucket.get(bridge).await.ok().flatten()).and_then(|value| Heartbeat::read(&value))
        };
        let (kept, record) = (read(&ready.bridges).await, read(&ready.floors).await);
        let unwritten = floors_to_read(kept, self.held.last_beat.clone(), record);
        let floor = start_after(acknowledged, [unwritten.from]);
        let state = &stream.info().await?.state;
        let (last, oldest) = (state.last_sequence, state.first_sequence);
        if floor >= last {
            return Ok(None);
        }
        // Not before the stream's first message (what its limits dropped is not there).
        let first = (floor + 1)
            .max(last.saturating_sub(READ_AGAIN_AT_MOST) + 1)
            .max(oldest);
        if first > floor + 1 {
            tracing::warn!(
                bridge,
                skipped = first - floor - 1,
                "federation: a gone bridge missed more than is read again"
            );
        }
        Ok(Some(Missed {
            first,
            last,
            acknowledged,
            unwritten,
        }))
    }

    /// Where each agent that moved from the gone bridge to this one is at the start of the
    /// stretch from `next` to `last` (`Stage::at_start`), from a read of the stretch made
    /// as `read_from` makes it; if it cannot be read, each is taken for away from the gone
    /// bridge, so that its mail is kept rather than lost.
    async fn away(&self, next: u64, last: u64) -> Away {
        let moved: HashSet<&str> = self.held.moved.iter().map(|m| m.name.as_str()).collect();
        let (here, its_own) = (
            self.link.names.messages_of(&self.link.bridge_id),
            self.link.names.messages_of(self.bridge),
        );
        let mut first = std::collections::HashMap::new();
        let read = self.each_in(next, last, |_, subject, replica| {
            let env = &replica.envelope;
            if let Some(here) = presence_of(&here, &its_own, subject, env)
                && moved.contains(env.from.as_str())
            {
                first.entry(env.from.clone()).or_insert((here, env.kind));
            }
        });
        let failed = read.await.err();
        if let Some((_, e)) = &failed {
            tracing::warn!(bridge = self.bridge, error = %e, "federation: cannot tell when agents moved from a gone bridge; their mail is kept");
        }
        let mut away = Away::default();
        for moved in &self.held.moved {
            let stage = match failed {
                Some(_) => Stage::AtGone,
                None => Stage::at_start(first.get(&moved.name).copied(), moved.join_refused),
            };
            away.moved.insert(moved.name.clone());
            away.set(&moved.name, stage);
        }
        away
    }

    /// Reads the `missed` stretch from `next` on, keeping what `held` missed (adding to
    /// `kept`), and for the agents that moved here what `away` says nobody else kept for
    /// them; on failure, the last sequence read, and why.
    async fn read_from(
        &self,
        missed: &Missed,
        next: u64,
        kept: &mut usize,
        away: &mut Away,
    ) -> Result<(), (u64, async_nats::Error)> {
        let (core, held) = (self.core, self.held);
        let its_own = self.link.names.messages_of(self.bridge);
        let here = self.link.names.messages_of(&self.link.bridge_id);
        self.each_in(next, missed.last, |sequence, subject, replica| {
            let env = &replica.envelope;
            if let Some(here) = presence_of(&here, &its_own, subject, env) {
                away.set(&env.from, Stage::after(here));
            }
            if replica.transient || replica.history || env.kind.is_presence() {
                return;
            }
            let delivery = Arc::new(Delivery::new(replica.envelope));
            *kept += match missed.kept_for(sequence, &held.all) {
                None => core.router.keep_for(&delivery, &held.all),
                Some(late) => core.router.keep_for(&delivery, &late),
            };
            if !away.kept_for.is_empty() {
                *kept += core.router.keep_for(&delivery, &away.kept_for);
            }
        })
        .await
    }

    /// Feeds `each` every message of the stream from `next` to `last`, in order, with its
    /// sequence and the subject it came on; on failure, the last sequence read, and why.
    async fn each_in(
        &self,
        next: u64,
        last: u64,
        mut each: impl FnMut(u64, &str, Replica),
    ) -> Result<(), (u64, async_nats::Error)> {
        let (link, ready) = (self.link, self.ready);
        let read_to = next - 1;
        let stream =
            (ready.js.get_stream(&link.names.stream).await).map_err(|e| (read_to, e.into()))?;
        let mut stretch = (Stretch::from(&stream, next).await).map_err(|e| (read_to, e))?;
        let mut read_to = read_to;
        loop {
            let (sequence, message) = stretch.next().await.map_err(|e| (read_to, e))?;
            match Replica::all_in(&message.payload) {
                Ok(replicas) => {
                    for replica in replicas {
                        each(sequence, message.subject.as_str(), replica);
                    }
                }
                Err(e) => {
                    tracing::error!(sequence, error = %e, "federation: a message on the stream is not one of ours")
                }
            }
            read_to = sequence;
            if sequence >= last {
                return Ok(());
            }
        }
    }
}

/// For a join or leave of an agent on this bridge (`here`) or on the gone bridge
/// (`its_own`), whether it was here; `None` for anything else.
fn presence_of(here: &str, its_own: &str, subject: &str, env: &Envelope) -> Option<bool> {
    if !matches!(env.kind, Kind::PresenceJoin | Kind::PresenceLeave) {
        return None;
    }
    match subject {
        s if s == here => Some(true),
        s if s == its_own => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const JOIN: Kind = Kind::PresenceJoin;
    const LEAVE: Kind = Kind::PresenceLeave;

    #[test]
    fn where_a_moved_agent_starts_the_stretch_follows_its_first_presence() {
        // Joined here in the stretch: it was away from the gone bridge until then.
        assert_eq!(Stage::at_start(Some((true, JOIN)), false), Stage::AtGone);
        // Left here first: it was here.
        assert_eq!(Stage::at_start(Some((true, LEAVE)), true), Stage::Here);
        // Joined the gone bridge first: it was away.
        assert_eq!(Stage::at_start(Some((false, JOIN)), false), Stage::AtGone);
        // Left the gone bridge first: it was online there.
        assert_eq!(Stage::at_start(Some((false, LEAVE)), false), Stage::AtGone);
        // No presence: moved before the stretch, unless its join never reached the fleet.
        assert_eq!(Stage::at_start(None, false), Stage::Here);
        assert_eq!(Stage::at_start(None, true), Stage::AtGone);
    }

    #[test]
    fn an_agent_back_and_forth_is_kept_for_only_while_the_gone_bridge_held_it() {
        let mut away = Away::default();
        away.moved.insert("x".into());
        away.set("x", Stage::Here);
        assert!(away.kept_for.is_empty());
        away.set("x", Stage::after(false));
        assert!(away.kept_for.contains("x"));
        away.set("x", Stage::after(true));
        assert!(away.kept_for.is_empty());
        // Not one of the moved agents: nothing changes.
        away.set("y", Stage::AtGone);
        assert!(away.kept_for.is_empty());
    }

    /// What the gone bridge had acknowledged, or routed through as it put its heartbeat,
    /// is kept only for the agents that heartbeat named, each from its own floor; what
    /// came after, for all.
    #[test]
    fn what_was_acknowledged_is_kept_for_the_agents_behind_from_their_floors() {
        let all: HashSet<String> = ["slow", "late", "prompt"].map(String::from).into();
        let by_agent = [("slow".to_owned(), 100), ("late".to_owned(), 150)];
        let missed = Missed {
            first: 100,
            last: 400,
            acknowledged: 300,
            unwritten: Unwritten {
                from: Some(100),
                by_agent: Some(by_agent.into()),
                through: 350,
            },
        };
        let kept_for = |sequence| {
            let mut names: Vec<String> = missed.kept_for(sequence, &all)?.into_iter().collect();
            names.sort();
            Some(names)
        };
        assert_eq!(kept_for(120), Some(vec!["slow".to_owned()]));
        assert_eq!(
            kept_for(150),
            Some(vec!["late".to_owned(), "slow".to_owned()])
        );
        assert_eq!(
            kept_for(320),
            Some(vec!["late".to_owned(), "slow".to_owned()])
        );
        assert_eq!(kept_for(351), None, "past what the heartbeat told: for all");
        // A heartbeat that names no agent: all of it for all.
        let for_all = Missed {
            unwritten: Unwritten {
                from: Some(100),
                ..Unwritten::default()
            },
            ..missed
        };
        assert_eq!(for_all.kept_for(120, &all), None);
    }

    /// A heartbeat of `run`, its `put`-th put, naming `slow` behind from `floor` and
    /// telling of the stream through `through`.
    fn beat(run: &str, put: u64, floor: u64, through: u64) -> Heartbeat {
        Heartbeat {
            bridge: "gone".to_owned(),
            run: Some(run.to_owned()),
            put,
            at: 0,
            unwritten_from: None,
            unwritten_for: Some([("slow".to_owned(), floor)].into()),
            routed_through: Some(through),
            cards_coming: false,
        }
    }

    /// The latest put of the heartbeats' run is gone by, the floors record's or a
    /// heartbeat's; a record of another run, or heartbeats of two runs, are not.
    #[test]
    fn the_floors_record_is_read_by_where_it_is_the_later_put() {
        let record = beat("run", 7, 300, 500);
        let read = |kept: Option<Heartbeat>, watched: Option<Heartbeat>| {
            floors_to_read(kept, watched, Some(record.clone())).through
        };
        assert_eq!(read(Some(beat("run", 5, 100, 200)), None), 500);
        assert_eq!(
            read(
                Some(beat("run", 5, 100, 200)),
                Some(beat("run", 3, 100, 150))
            ),
            500
        );
        assert_eq!(read(None, Some(beat("run", 6, 100, 200))), 500);
        assert_eq!(read(Some(beat("run", 9, 100, 200)), None), 200, "older");
        let restarted = Some(beat("next run", 1, 100, 200));
        assert_eq!(read(restarted, None), 200, "a run before");
        // Two heartbeats, one later than the record: the latest.
        let (kept, watched) = (beat("run", 8, 100, 250), beat("run", 4, 120, 200));
        assert_eq!(read(Some(kept), Some(watched)), 250);
        // Heartbeats of two runs: the older of what they say.
        let (kept, watched) = (beat("next run", 1, 100, 250), beat("run", 4, 120, 200));
        assert_eq!(read(Some(kept), Some(watched)), 200);
        // No heartbeat known: it cannot be told whose run the record is.
        assert_eq!(read(None, None), 0);
    }
}
