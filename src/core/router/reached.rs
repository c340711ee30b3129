//! Who a message has been given to while it is routed.

use foldhash::HashSet;

/// Sessions (and offline agents) a message has been given to. Fan-outs are usually small:
/// the first few ids live inline, a scan beats hashing until the list grows, and nothing
/// is allocated for the common one-to-a-few message.
#[derive(Default)]
pub(super) struct Reached {
    inline: [u64; Reached::INLINE],
    len: usize,
    spilled: Option<HashSet<u64>>,
    offline: Vec<String>,
    offline_seen: HashSet<String>,
}

impl Reached {
    const INLINE: usize = 32;

    pub(super) fn contains(&self, id: u64) -> bool {
        match &self.spilled {
            Some(set) => set.contains(&id),
            None => self.inline[..self.len].contains(&id),
        }
    }

    /// Records `id`; false when it was there already.
    pub(super) fn insert(&mut self, id: u64) -> bool {
        if let Some(set) = &mut self.spilled {
            return set.insert(id);
        }
        if self.inline[..self.len].contains(&id) {
            return false;
        }
        if self.len < Self::INLINE {
            self.inline[self.len] = id;
            self.len += 1;
        } else {
            let mut set = HashSet::with_capacity_and_hasher(Self::INLINE * 4, Default::default());
            set.extend(self.inline);
            set.insert(id);
            self.spilled = Some(set);
        }
        true
    }

    /// Records an agent reached offline; false when it was already. Linear in the names
    /// of a long fan-out (a group, a message naming many), not quadratic.
    pub(super) fn insert_name(&mut self, name: &str) -> bool {
        crate::shared::each_once::push_once(
            &mut self.offline,
            &mut self.offline_seen,
            name.to_owned(),
        )
    }
}
