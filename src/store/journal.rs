//! The journal: stored messages written ahead of the database.
//!
//! A message is acknowledged once its record is in the journal: one `write` for a batch
//! of messages, no SQLite on the way. The writer thread puts the records into the
//! database afterwards, in transactions as large as its backlog (mod.rs). Like a commit
//! in SQLite's log with `synchronous = NORMAL`, a record handed to the kernel survives the
//! process being killed; only a power loss can take back the latest ones. At start-up the
//! records the database does not hold yet (numbered after `journal.applied`) are put in,
//! and the journal starts anew.
//!
//! Files: `journal/<number of the first record, 20 digits>.log`, each a run of records,
//! `length of the payload: u32 LE | CRC-32 of number and payload: u32 LE | number: u64 LE
//! | payload`. A segment is closed at `SEGMENT_BYTES` and removed once the database holds
//! all of its records. A record cut short or damaged ends its segment: it was never
//! acknowledged (a failed write is cut off the file before its messages hear of it).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The journal's folder inside `data_dir`.
pub(super) const DIR: &str = "journal";
/// A segment's size before the next record starts a new one.
const SEGMENT_BYTES: u64 = 16 << 20;
const HEADER_BYTES: usize = 16;
const EXTENSION: &str = "log";

/// The appending end, owned by the journal thread.
pub(super) struct Journal {
    dir: PathBuf,
    file: File,
    path: PathBuf,
    /// Bytes of the current segment already written.
    len: u64,
    /// The number of the next record.
    next: u64,
    /// Records of the batch being made, written together by `write`.
    pending: Vec<u8>,
    retired: Retired,
}

impl Journal {
    /// Starts a new segment in `dir`, its first record numbered `next`.
    pub(super) fn create(dir: &Path, next: u64) -> io::Result<Journal> {
        std::fs::create_dir_all(dir)?;
        let path = segment_path(dir, next);
        Ok(Journal {
            dir: dir.to_owned(),
            file: File::create(&path)?,
            path,
            len: 0,
            next,
            pending: Vec::new(),
            retired: Retired::default(),
        })
    }

    /// Adds a record to the batch, its payload written by `payload`; its number.
    pub(super) fn record(&mut self, payload: impl FnOnce(&mut Vec<u8>)) -> u64 {
        let number = self.next;
        self.next += 1;
        let start = self.pending.len();
        self.pending.extend_from_slice(&[0; HEADER_BYTES]);
        self.pending[start + 8..start + 16].copy_from_slice(&number.to_le_bytes());
        payload(&mut self.pending);
        let len = u32::try_from(self.pending.len() - start - HEADER_BYTES)
            .expect("a stored message is far smaller than 4 GiB");
        let crc = crc32fast::hash(&self.pending[start + 8..]);
        self.pending[start..start + 4].copy_from_slice(&len.to_le_bytes());
        self.pending[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
        number
    }

    /// Writes the batch's records. On failure none of them is left in the journal.
    pub(super) fn write(&mut self) -> io::Result<()> {
        let written = self.file.write_all(&self.pending);
        let batch = self.pending.len() as u64;
        self.pending.clear();
        if let Err(e) = written {
            // Part of the batch may be in the file; cut it off, so that start-up does not
            // put in messages whose senders heard they were not stored.
            if let Err(cut) = self.file.set_len(self.len) {
                tracing::error!(error = %cut, path = %self.path.display(), "store: cannot cut a failed write off the journal");
            }
            return Err(e);
        }
        self.len += batch;
        if self.len >= SEGMENT_BYTES {
            let path = segment_path(&self.dir, self.next);
            let file = File::create(&path)?;
            let closed = std::mem::replace(&mut self.path, path);
            self.file = file;
            self.len = 0;
            self.retired.push(closed, self.next - 1);
        }
        Ok(())
    }

    /// The writer thread's handle on the closed segments.
    pub(super) fn retired(&self) -> Retired {
        self.retired.clone()
    }
}

/// Closed segments, oldest first, each with the number of its last record: removed once
/// the database holds that record.
#[derive(Clone, Default)]
pub(super) struct Retired(Arc<Mutex<VecDeque<(PathBuf, u64)>>>);

impl Retired {
    fn push(&self, path: PathBuf, last: u64) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back((path, last));
    }

    /// The database holds every record up to `number`.
    pub(super) fn applied(&self, number: u64) {
        let mut closed = self.0.lock().unwrap_or_else(|e| e.into_inner());
        while closed.front().is_some_and(|(_, last)| *last <= number) {
            let (path, _) = closed.pop_front().expect("checked");
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(error = %e, path = %path.display(), "store: cannot remove a journal segment");
            }
        }
    }
}

fn segment_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:020}.{EXTENSION}"))
}

/// The segments in `dir`, oldest first.
pub(super) fn segments(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut found = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .map(|e| e.map(|e| e.path()))
            .collect::<io::Result<Vec<_>>>()?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e),
    };
    found.retain(|p| p.extension().is_some_and(|x| x == EXTENSION));
    // Zero-padded numbers: name order is number order.
    found.sort();
    Ok(found)
}

/// Every whole record in the segment `bytes`, in order, as (number, payload).
pub(super) fn records(bytes: &[u8]) -> impl Iterator<Item = (u64, &[u8])> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        let header = rest.get(..HEADER_BYTES)?;
        let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        let checked = rest.get(8..HEADER_BYTES + len)?;
        if crc32fast::hash(checked) != crc {
            return None;
        }
        let number = u64::from_le_bytes(checked[..8].try_into().expect("8 bytes"));
        rest = &rest[HEADER_BYTES + len..];
        Some((number, &checked[8..]))
    })
}

/// Writing and reading a record's payload: fields one after the other, each text as its
/// length (u32 LE) and bytes; an absent text as length `u32::MAX`.
pub(super) mod fields {
    pub fn put_str(buf: &mut Vec<u8>, text: &str) {
        let len = u32::try_from(text.len()).expect("a stored text is far smaller than 4 GiB");
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(text.as_bytes());
    }

    pub fn put_opt(buf: &mut Vec<u8>, text: Option<&str>) {
        match text {
            Some(text) => put_str(buf, text),
            None => buf.extend_from_slice(&u32::MAX.to_le_bytes()),
        }
    }

    pub fn put_u64(buf: &mut Vec<u8>, n: u64) {
        buf.extend_from_slice(&n.to_le_bytes());
    }

    /// Reads fields back in the order they were put; `None` once the payload is short or
    /// a text is not UTF-8.
    pub struct Fields<'a>(pub &'a [u8]);

    impl<'a> Fields<'a> {
        fn take(&mut self, n: usize) -> Option<&'a [u8]> {
            let (taken, rest) = (self.0.get(..n)?, self.0.get(n..)?);
            self.0 = rest;
            Some(taken)
        }

        pub fn u64(&mut self) -> Option<u64> {
            Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
        }

        pub fn opt(&mut self) -> Option<Option<String>> {
            let len = u32::from_le_bytes(self.take(4)?.try_into().ok()?);
            if len == u32::MAX {
                return Some(None);
            }
            let bytes = self.take(len as usize)?;
            Some(Some(std::str::from_utf8(bytes).ok()?.to_owned()))
        }

        pub fn str(&mut self) -> Option<String> {
            self.opt()?
        }

        /// Whether every byte was read.
        pub fn is_empty(&self) -> bool {
            self.0.is_empty()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(dir: &Path) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        for path in segments(dir).unwrap() {
            let bytes = std::fs::read(path).unwrap();
            out.extend(records(&bytes).map(|(n, p)| (n, p.to_vec())));
        }
        out
    }

    #[test]
    fn records_come_back_in_order_across_segments() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::create(dir.path(), 7).unwrap();
        let big = vec![b'x'; 1 << 20];
        for i in 0..20u8 {
            journal.record(|buf| {
                buf.push(i);
                buf.extend_from_slice(&big);
            });
            journal.write().unwrap();
        }
        assert!(segments(dir.path()).unwrap().len() > 1, "20 MiB fill two");
        let numbers: Vec<(u64, u8)> = read_all(dir.path())
            .iter()
            .map(|(n, p)| (*n, p[0]))
            .collect();
        let expected: Vec<(u64, u8)> = (0..20u8).map(|i| (7 + u64::from(i), i)).collect();
        assert_eq!(numbers, expected);
        // The database holding record 20 frees the first segment (7..=22), not the second.
        journal.retired().applied(20);
        assert_eq!(segments(dir.path()).unwrap().len(), 2);
        journal.retired().applied(22);
        assert_eq!(segments(dir.path()).unwrap().len(), 1);
    }

    #[test]
    fn a_record_cut_short_or_damaged_ends_its_segment() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::create(dir.path(), 1).unwrap();
        for text in ["one", "two", "three"] {
            journal.record(|buf| fields::put_str(buf, text));
        }
        journal.write().unwrap();
        let path = segments(dir.path()).unwrap().remove(0);
        let whole = std::fs::read(&path).unwrap();
        let texts = |bytes: &[u8]| -> Vec<String> {
            records(bytes)
                .map(|(_, p)| fields::Fields(p).str().unwrap())
                .collect()
        };
        assert_eq!(texts(&whole), ["one", "two", "three"]);
        assert_eq!(texts(&whole[..whole.len() - 1]), ["one", "two"]);
        let mut damaged = whole.clone();
        let second = HEADER_BYTES + 4 + 3 + HEADER_BYTES + 4;
        damaged[second] ^= 1;
        assert_eq!(texts(&damaged), ["one"]);
    }

    #[test]
    fn fields_read_back_what_was_put_and_refuse_short_payloads() {
        let mut buf = Vec::new();
        fields::put_str(&mut buf, "héllo");
        fields::put_opt(&mut buf, None);
        fields::put_u64(&mut buf, 42);
        let mut read = fields::Fields(&buf);
        assert_eq!(read.str().as_deref(), Some("héllo"));
        assert_eq!(read.opt(), Some(None));
        assert_eq!(read.u64(), Some(42));
        assert!(read.is_empty());
        assert_eq!(fields::Fields(&buf[..5]).str(), None);
        assert_eq!(fields::Fields(&[0xff, 0xff, 0xff, 0x7f]).str(), None);
    }
}
