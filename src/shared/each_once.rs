//! Lists that keep each value once, in the order first given, in time linear in the list:
//! client-chosen lists (mentions, members) may be long, and a `contains` per value would
//! make keeping them quadratic.

use std::hash::Hash;

use foldhash::HashSet;

/// Lists up to this long are checked by a scan, which for a handful of short strings is
/// faster than hashing and allocates nothing.
const SCAN: usize = 16;

/// Appends `value` to `list` unless it holds it already; `seen` mirrors `list` once it
/// outgrows a scan. Returns whether it was appended.
pub fn push_once<T: Eq + Hash + Clone>(list: &mut Vec<T>, seen: &mut HashSet<T>, value: T) -> bool {
    if list.len() < SCAN {
        if list.contains(&value) {
            return false;
        }
    } else {
        if seen.is_empty() {
            seen.extend(list.iter().cloned());
        }
        if !seen.insert(value.clone()) {
            return false;
        }
    }
    list.push(value);
    true
}

/// `list` with each value at its first place only.
pub fn each_once<T: Eq + Hash + Clone>(list: Vec<T>) -> Vec<T> {
    let mut kept = Vec::with_capacity(list.len());
    let mut seen = HashSet::default();
    for value in list {
        push_once(&mut kept, &mut seen, value);
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_kept_once_in_their_first_order_past_the_scan_too() {
        let list: Vec<u32> = (0..100).chain(0..100).chain([5, 200, 5]).collect();
        let expected: Vec<u32> = (0..100).chain([200]).collect();
        assert_eq!(each_once(list), expected);
        assert_eq!(each_once(vec!["b", "a", "b"]), ["b", "a"]);
    }
}
