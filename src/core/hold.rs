//! Holds a source of deliveries keeps on them, to learn when they are done with.
//!
//! The source offers its hold to its deliveries (`Delivery::offer`); a recipient that
//! writes or keeps the message for an agent whose mail is kept for it when it is away (a
//! holding mailbox, an offline sink) takes a copy of the delivery that holds it, naming
//! that agent (`Delivery::held_copy_for`; the router names a holding mailbox's session's
//! agent), and whatever carries that copy on (a mailbox's backlog, a
//! queue's writer, a stream's output) keeps it. Once the source let its own go and the
//! last of those is written, kept or dropped, the hold is done. A fleet's applier
//! acknowledges a batch to the stream only then: a bridge killed before has the batch read
//! again by the others. A bridge alone keeps the ids of messages not yet done with, to
//! route them again as it starts (`store::redelivery`). Recipients whose protocol replays
//! from history do not hold, so one that reads slowly holds nothing back.
//!
//! A hold made by `Outstanding::naming` also tells, until it is done, which agents' copies
//! still hold it (`HeldBy::holders`): a batch acknowledged before it was written is read
//! again, after a kill, only for those (`federation::unwritten`), and a message pending as
//! a bridge stops or is killed is routed again, as it starts, only to those
//! (`store::redelivery`, through `Outstanding::naming_dropping`).

use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use tokio_util::sync::{CancellationToken, DropGuard};

/// What an `Outstanding` keeps alive: it says the hold is done as it drops.
trait Guard: Send + Sync {
    /// What a copy taken up for `recipient` keeps (`None`: one that holds for others, or
    /// cannot say for whom).
    fn taken_by(self: Arc<Self>, recipient: Option<&str>) -> Arc<dyn Guard>;
}

/// A guard that tells nothing of who holds it.
struct Plain<G>(G);

impl<G: Send + Sync + 'static> Guard for Plain<G> {
    fn taken_by(self: Arc<Self>, _: Option<&str>) -> Arc<dyn Guard> {
        self
    }
}

/// Two holds kept as one (`Outstanding::both`): a copy takes up each.
struct Both(Outstanding, Outstanding);

impl Guard for Both {
    fn taken_by(self: Arc<Self>, recipient: Option<&str>) -> Arc<dyn Guard> {
        let (a, b) = (&self.0.guard, &self.1.guard);
        Arc::new(Plain((
            a.clone().taken_by(recipient),
            b.clone().taken_by(recipient),
        )))
    }
}

/// A hold that counts its copies by recipient (`Outstanding::naming`): done once its
/// source and every copy let it go.
struct Naming<G: WatchesHolders> {
    holders: Arc<Mutex<Holders>>,
    /// Told as the holders change, and dropped once the hold is done.
    watch: G,
}

/// What a naming hold tells as its holders change, and drops once it is done
/// (`Outstanding::naming_dropping`): its `Drop` says the hold is done.
pub trait WatchesHolders: Send + Sync + 'static {
    /// The source let the hold go, or a copy did.
    fn holders_changed(&self) {}
}

impl WatchesHolders for DropGuard {}

/// The source's share of a naming hold, which deliveries are offered: once it drops, the
/// holders are all known, and nothing takes the hold up any more.
struct Source<G: WatchesHolders>(Arc<Naming<G>>);

impl<G: WatchesHolders> Guard for Source<G> {
    fn taken_by(self: Arc<Self>, recipient: Option<&str>) -> Arc<dyn Guard> {
        let naming = self.0.clone();
        let slot = naming.holders.lock().take_up(recipient);
        Arc::new(Taken { naming, slot })
    }
}

impl<G: WatchesHolders> Drop for Source<G> {
    fn drop(&mut self) {
        self.0.holders.lock().source_let_go = true;
        self.0.watch.holders_changed();
    }
}

/// A copy's share of a naming hold: counted for its recipient until it drops.
struct Taken<G: WatchesHolders> {
    naming: Arc<Naming<G>>,
    /// The recipient's slot in `Holders`; `None` for one not named.
    slot: Option<usize>,
}

impl<G: WatchesHolders> Guard for Taken<G> {
    fn taken_by(self: Arc<Self>, _: Option<&str>) -> Arc<dyn Guard> {
        self
    }
}

impl<G: WatchesHolders> Drop for Taken<G> {
    fn drop(&mut self) {
        self.naming.holders.lock().let_go(self.slot);
        self.naming.watch.holders_changed();
    }
}

/// How many copies of a naming hold each recipient keeps.
#[derive(Default)]
struct Holders {
    /// Each recipient, stored once per hold, not per copy, with its copies. Most holds
    /// have one or two: they are looked through, until `MOST_LOOKED_THROUGH`.
    copies: Vec<(Box<str>, u32)>,
    /// Each recipient's slot in `copies`, once there are more.
    slot_of: Option<foldhash::HashMap<Box<str>, usize>>,
    /// Copies taken up for no named recipient.
    unnamed: u32,
    /// Whether the source let its share go: until then, more copies may be taken up.
    source_let_go: bool,
}

/// Recipients of one hold looked for one by one; past that, by a map.
const MOST_LOOKED_THROUGH: usize = 8;

impl Holders {
    fn take_up(&mut self, recipient: Option<&str>) -> Option<usize> {
        let Some(name) = recipient else {
            self.unnamed += 1;
            return None;
        };
        let slot = match &self.slot_of {
            Some(slot_of) => slot_of.get(name).copied(),
            None => self
                .copies
                .iter()
                .position(|(held_by, _)| **held_by == *name),
        };
        let slot = slot.unwrap_or_else(|| self.add(name));
        self.copies[slot].1 += 1;
        Some(slot)
    }

    /// A slot for `name`, new.
    fn add(&mut self, name: &str) -> usize {
        self.copies.push((name.into(), 0));
        let slot = self.copies.len() - 1;
        if let Some(slot_of) = &mut self.slot_of {
            slot_of.insert(name.into(), slot);
        } else if self.copies.len() > MOST_LOOKED_THROUGH {
            let names = self.copies.iter().enumerate();
            let slots = names.map(|(slot, (name, _))| (name.clone(), slot));
            self.slot_of = Some(slots.collect());
        }
        slot
    }

    fn let_go(&mut self, slot: Option<usize>) {
        let count = match slot {
            Some(slot) => &mut self.copies[slot].1,
            None => &mut self.unnamed,
        };
        *count = count.saturating_sub(1);
    }
}

/// A hold a source of deliveries keeps on them (see the module's doc). Once the last clone
/// drops, and with it every copy taken up from it, it is done: the token
/// `Outstanding::new` gave is cancelled, the guard `Outstanding::dropping` took is dropped.
#[derive(Clone)]
pub struct Outstanding {
    guard: Arc<dyn Guard>,
}

impl Outstanding {
    /// A hold, and the token cancelled once it and every clone of it are dropped.
    pub fn new() -> (Outstanding, CancellationToken) {
        let done = CancellationToken::new();
        let guard = Arc::new(Plain(done.clone().drop_guard()));
        (Outstanding { guard }, done)
    }

    /// A hold that drops `guard` once it and every clone of it are dropped: `guard`'s
    /// `Drop` says it is done.
    pub fn dropping(guard: impl Send + Sync + 'static) -> Outstanding {
        Outstanding {
            guard: Arc::new(Plain(guard)),
        }
    }

    /// A hold, and what tells when it is done and, until then, who holds it.
    pub fn naming() -> (Outstanding, HeldBy) {
        let done = CancellationToken::new();
        let (hold, holders) = Self::naming_dropping(done.clone().drop_guard());
        (hold, HeldBy { done, holders })
    }

    /// A hold that tells who holds it (as `naming`), tells `watch` as they change, and
    /// drops it once it is done (as `dropping`).
    pub fn naming_dropping(watch: impl WatchesHolders) -> (Outstanding, HoldersOf) {
        let holders = Arc::<Mutex<Holders>>::default();
        let guard = Arc::new(Source(Arc::new(Naming {
            holders: holders.clone(),
            watch,
        })));
        (Outstanding { guard }, HoldersOf(holders))
    }

    /// One hold that keeps both `a` and `b` (either that is there) until it is done: for a
    /// delivery two sources wait on. A copy takes up each, naming its recipient to both.
    pub fn both(a: Option<Outstanding>, b: Option<Outstanding>) -> Option<Outstanding> {
        match (a, b) {
            (Some(a), Some(b)) => Some(Outstanding {
                guard: Arc::new(Both(a, b)),
            }),
            (a, b) => a.or(b),
        }
    }

    /// It as a delivery is offered it: kept alive by its source alone.
    pub(super) fn offered(&self) -> Offered {
        Offered(Arc::downgrade(&self.guard))
    }
}

/// A hold as a delivery is offered it (`Outstanding::offered`).
pub(super) struct Offered(Weak<dyn Guard>);

impl Offered {
    /// The hold, taken up for a copy held by `recipient` (`None`: one that holds for
    /// others, or cannot say for whom), if its source still keeps it (a hold of
    /// `Outstanding::new` or `dropping`: or a copy does).
    pub(super) fn take_up(&self, recipient: Option<&str>) -> Option<Outstanding> {
        let guard = self.0.upgrade()?;
        Some(Outstanding {
            guard: guard.taken_by(recipient),
        })
    }
}

/// What the source of a naming hold watches (`Outstanding::naming`).
#[derive(Clone)]
pub struct HeldBy {
    done: CancellationToken,
    holders: HoldersOf,
}

impl HeldBy {
    /// Of a hold done already.
    pub fn nothing() -> HeldBy {
        let done = CancellationToken::new();
        done.cancel();
        HeldBy {
            done,
            holders: HoldersOf(Arc::default()),
        }
    }

    /// Whether the source let its hold go and every copy that took it up is done.
    pub fn is_done(&self) -> bool {
        self.done.is_cancelled()
    }

    /// Resolves once it is done.
    pub async fn done(&self) {
        self.done.cancelled().await
    }

    /// The recipients whose copies hold it now (`HoldersOf::holders`).
    pub fn holders(&self) -> Option<Vec<String>> {
        self.holders.holders()
    }
}

/// Who holds a naming hold (`Outstanding::naming_dropping`). It does not keep the hold.
#[derive(Clone)]
pub struct HoldersOf(Arc<Mutex<Holders>>);

impl HoldersOf {
    /// The recipients whose copies hold it now; `None` while its source keeps it (more
    /// copies may come, as an own message not yet routed here), or if a copy taken up
    /// for no named recipient (a hub's, holding for others) does. Once its source let it
    /// go, the holders only go.
    pub fn holders(&self) -> Option<Vec<String>> {
        let holders = self.0.lock();
        if !holders.source_let_go || holders.unnamed > 0 {
            return None;
        }
        let held = (holders.copies.iter()).filter(|(_, copies)| *copies > 0);
        Some(held.map(|(name, _)| name.to_string()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut names: Vec<String>) -> Vec<String> {
        names.sort();
        names
    }

    #[test]
    fn a_naming_hold_tells_whose_copies_hold_it_until_it_is_done() {
        let (hold, held_by) = Outstanding::naming();
        let offered = hold.offered();
        let ann = [offered.take_up(Some("ann")), offered.take_up(Some("ann"))];
        let bob = offered.take_up(Some("bob"));
        assert_eq!(
            held_by.holders(),
            None,
            "more may come while its source keeps it"
        );
        drop(hold);
        assert_eq!(sorted(held_by.holders().unwrap()), ["ann", "bob"]);
        drop(bob);
        assert_eq!(held_by.holders().unwrap(), ["ann"]);
        let [first, second] = ann;
        drop(first);
        assert!(!held_by.is_done(), "ann's second copy holds it");
        assert_eq!(held_by.holders().unwrap(), ["ann"]);
        drop(second);
        assert!(held_by.is_done());
        assert!(held_by.holders().unwrap().is_empty());
        // Its source let it go: nothing more takes it up.
        assert!(offered.take_up(Some("cy")).is_none());
    }

    /// Past the recipients looked through one by one, each is found by the map.
    #[test]
    fn a_hold_with_many_holders_counts_each_copy_for_its_own() {
        let (hold, held_by) = Outstanding::naming();
        let names: Vec<String> = (0..20).map(|n| format!("agent-{n:02}")).collect();
        let mut copies: Vec<_> = (names.iter().chain(&names))
            .map(|name| hold.offered().take_up(Some(name)))
            .collect();
        drop(hold);
        assert_eq!(sorted(held_by.holders().unwrap()), names);
        // Each one's second copy goes: its first still holds it.
        copies.truncate(names.len());
        assert_eq!(sorted(held_by.holders().unwrap()), names);
        copies.truncate(5);
        assert_eq!(sorted(held_by.holders().unwrap()), names[..5]);
        drop(copies);
        assert!(held_by.is_done());
    }

    #[test]
    fn a_copy_held_for_nobody_named_leaves_its_holders_untold() {
        let (hold, held_by) = Outstanding::naming();
        let for_others = hold.offered().take_up(None);
        let ann = hold.offered().take_up(Some("ann"));
        drop(hold);
        assert_eq!(held_by.holders(), None);
        drop(for_others);
        assert_eq!(held_by.holders().unwrap(), ["ann"]);
        drop(ann);
        assert!(held_by.is_done());
    }

    #[test]
    fn a_copy_of_two_holds_names_its_recipient_to_each() {
        let (batch, batch_held_by) = Outstanding::naming();
        let (pending, pending_done) = Outstanding::new();
        let both = Outstanding::both(Some(batch), Some(pending)).unwrap();
        let copy = both.offered().take_up(Some("ann"));
        drop(both);
        assert_eq!(batch_held_by.holders().unwrap(), ["ann"]);
        assert!(!pending_done.is_cancelled());
        // A copy taken up again is the same copy.
        let again = copy.as_ref().map(|c| c.offered().take_up(Some("bob")));
        drop(copy);
        assert_eq!(batch_held_by.holders().unwrap(), ["ann"]);
        drop(again);
        assert!(batch_held_by.is_done() && pending_done.is_cancelled());
    }
}
