//! The journal: stored messages written ahead of the database.
//!
//! A message is acknowledged once its record is in the journal: one `write` (for many
//! records, on a runtime thread), no SQLite on the way. The writer thread puts the records into the
//! database afterwards, many in a transaction (mod.rs). Like a commit
//! in SQLite's log with `synchronous = NORMAL`, a record handed to the kernel survives the
//! process being killed; an OS crash or power loss can take back the latest ones. At
//! start-up the records the database does not hold yet (numbered after `journal.applied`) are put in,
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
use std::sync::Arc;

/// The journal's folder inside `data_dir`.
pub(super) const DIR: &str = "journal";
/// A segment's size before the next record starts a new one.
const SEGMENT_BYTES: u64 = 16 << 20;
const HEADER_BYTES: usize = 16;
/// The write buffer's capacity kept after a larger record.
const SHRINK_BYTES: usize = 64 * 1024;
const EXTENSION: &str = "log";

/// The appending end, used under the store's lock. Records are added under it (`record`)
/// and written in rounds: `take_round` under the lock, the `write` without it (so that a
/// slow write holds up no one adding records meanwhile), `end_round` under it again. One
/// round at a time.
pub(super) struct Journal {
    dir: PathBuf,
    file: Arc<File>,
    path: PathBuf,
    /// Bytes of the current segment already written.
    len: u64,
    /// The number of the next record.
    next: u64,
    /// Records not written yet, and the first one's number.
    pending: Vec<u8>,
    pending_first: u64,
    /// A failed round's cleared buffer, kept for the next round. (A written round's buffer
    /// goes on to the database's writer: `end_round`.)
    spare: Vec<u8>,
    /// Closed segments, oldest first, each with the number of its last record: removed
    /// once the database holds that record (`take_applied`).
    closed: VecDeque<(PathBuf, u64)>,
    /// Rounds taken, for tests of how records share them.
    #[cfg(test)]
    pub(super) rounds: u64,
}

impl Journal {
    /// Starts a new segment in `dir`, its first record numbered `next`.
    pub(super) fn create(dir: &Path, next: u64) -> io::Result<Journal> {
        std::fs::create_dir_all(dir)?;
        let path = segment_path(dir, next);
        Ok(Journal {
            dir: dir.to_owned(),
            file: Arc::new(open_segment(&path)?),
            path,
            len: 0,
            next,
            pending: Vec::new(),
            pending_first: next,
            spare: Vec::new(),
            closed: VecDeque::new(),
            #[cfg(test)]
            rounds: 0,
        })
    }

    /// Adds a record, its payload written by `payload`, for the next `write`; its number.
    pub(super) fn record(&mut self, payload: impl FnOnce(&mut Vec<u8>)) -> u64 {
        if self.pending.is_empty() {
            self.pending_first = self.next;
        }
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

    /// Writes the records added since the last call, all in one round. On failure none of
    /// them is left in the journal.
    #[cfg(test)]
    pub(super) fn write(&mut self) -> io::Result<()> {
        let round = self.take_round();
        let written = round.write();
        self.end_round(round, written).map(drop)
    }

    /// The records added so far, to be written (`Round::write`) without the lock. A full
    /// segment is closed first: no write is in flight to it.
    pub(super) fn take_round(&mut self) -> Round {
        if self.len >= SEGMENT_BYTES {
            self.start_segment();
        }
        #[cfg(test)]
        {
            self.rounds += 1;
        }
        let next = match self.spare.capacity() {
            // Sized like this round, so that the next one is not copied as it grows.
            0 => Vec::with_capacity(self.pending.len().min(SHRINK_BYTES)),
            _ => std::mem::take(&mut self.spare),
        };
        Round {
            file: self.file.clone(),
            start: self.len,
            bytes: std::mem::replace(&mut self.pending, next),
        }
    }

    /// Takes a round's outcome back: written, its records, for the database's writer
    /// (`written_records` reads them). On failure, what the round may have left in the file
    /// is cut off, so that start-up does not put in messages whose senders heard they were
    /// not stored. (The file appends: the next round goes where the cut ends.)
    pub(super) fn end_round(
        &mut self,
        round: Round,
        written: io::Result<()>,
    ) -> io::Result<Vec<u8>> {
        match written {
            Ok(()) => {
                self.len += round.bytes.len() as u64;
                let mut bytes = round.bytes;
                if bytes.capacity() > 2 * bytes.len() {
                    // A small round in a buffer sized for a large one before it: what the
                    // writer's queue holds stays within twice the records, however far
                    // behind it is.
                    bytes.shrink_to_fit();
                }
                Ok(bytes)
            }
            Err(e) => {
                if !round.cut() {
                    // What follows must not come after a torn record, which would end
                    // this segment for start-up: the next round starts a new one.
                    self.len = self.len.max(SEGMENT_BYTES);
                }
                let mut bytes = round.bytes;
                bytes.clear();
                if bytes.capacity() > SHRINK_BYTES {
                    // One large message does not keep its buffer for good.
                    bytes.shrink_to(SHRINK_BYTES);
                }
                self.spare = bytes;
                Err(e)
            }
        }
    }

    /// Closes the current segment and starts the next, named after the first record not
    /// written yet. When that fails, records go on into the current one, and the next
    /// round tries again.
    fn start_segment(&mut self) {
        let first = if self.pending.is_empty() {
            self.next
        } else {
            self.pending_first
        };
        let path = segment_path(&self.dir, first);
        match open_segment(&path) {
            Ok(file) => {
                let closed = std::mem::replace(&mut self.path, path);
                self.file = Arc::new(file);
                self.len = 0;
                self.closed.push_back((closed, first - 1));
            }
            Err(e) => {
                tracing::warn!(error = %e, path = %path.display(), "store: cannot start a journal segment")
            }
        }
    }

    /// The segment being written.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// The closed segments whose records the database holds, all up to `applied`, for
    /// `remove_segments`; they are forgotten here.
    pub(super) fn take_applied(&mut self, applied: u64) -> Vec<PathBuf> {
        let count = self
            .closed
            .iter()
            .take_while(|&&(_, last)| last <= applied)
            .count();
        self.closed.drain(..count).map(|(path, _)| path).collect()
    }
}

/// Removes segments `Journal::take_applied` gave, on a blocking thread when there is a
/// runtime: unlinking 16 MiB of page cache takes 2–3 ms, which on a runtime thread, under
/// the store's lock, stalled every connection's records that long, every quarter second
/// flat out.
pub(super) fn remove_segments(segments: Vec<PathBuf>) {
    if segments.is_empty() {
        return;
    }
    let remove = move || {
        for path in segments {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(error = %e, path = %path.display(), "store: cannot remove a journal segment");
            }
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(remove)),
        Err(_) => remove(),
    }
}

/// Records taken to be written (`Journal::take_round`).
pub(super) struct Round {
    file: Arc<File>,
    /// The segment's length before this round.
    start: u64,
    bytes: Vec<u8>,
}

impl Round {
    pub(super) fn write(&self) -> io::Result<()> {
        (&*self.file).write_all(&self.bytes)
    }

    /// Cuts off what a failed write may have left; false when that fails too.
    pub(super) fn cut(&self) -> bool {
        match self.file.set_len(self.start) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "store: cannot cut a failed write off the journal");
                false
            }
        }
    }
}

fn open_segment(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
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
    read_records(bytes, true)
}

/// The records of a round this process wrote (`Journal::end_round`), as `records` reads
/// them but without checking their CRCs again.
pub(super) fn written_records(bytes: &[u8]) -> impl Iterator<Item = (u64, &[u8])> {
    read_records(bytes, false)
}

fn read_records(bytes: &[u8], check: bool) -> impl Iterator<Item = (u64, &[u8])> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        let header = rest.get(..HEADER_BYTES)?;
        let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        let checked = rest.get(8..HEADER_BYTES + len)?;
        if check && crc32fast::hash(checked) != crc {
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

    /// Puts the text `write` appends (it must append UTF-8), without a copy of it made
    /// first to learn its length; on an error, nothing.
    pub fn put_with<E>(
        buf: &mut Vec<u8>,
        write: impl FnOnce(&mut Vec<u8>) -> Result<(), E>,
    ) -> Result<(), E> {
        let start = buf.len();
        buf.extend_from_slice(&[0; 4]);
        if let Err(e) = write(buf) {
            buf.truncate(start);
            return Err(e);
        }
        let len =
            u32::try_from(buf.len() - start - 4).expect("a stored text is far smaller than 4 GiB");
        buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
        Ok(())
    }

    /// Puts a number not known yet, to be set with `set_u64`; where it is.
    pub fn put_u64_later(buf: &mut Vec<u8>) -> usize {
        let at = buf.len();
        put_u64(buf, 0);
        at
    }

    pub fn set_u64(buf: &mut [u8], at: usize, n: u64) {
        buf[at..at + 8].copy_from_slice(&n.to_le_bytes());
    }

    /// Reads fields back in the order they were put; `None` once the payload is short, or
    /// a text read as `str` or `opt` is not UTF-8.
    #[derive(Clone, Copy)]
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

        pub fn opt(&mut self) -> Option<Option<&'a str>> {
            match self.opt_bytes()? {
                Some(bytes) => Some(Some(std::str::from_utf8(bytes).ok()?)),
                None => Some(None),
            }
        }

        /// A text's bytes, not checked for UTF-8.
        pub fn opt_bytes(&mut self) -> Option<Option<&'a [u8]>> {
            let len = u32::from_le_bytes(self.take(4)?.try_into().ok()?);
            if len == u32::MAX {
                return Some(None);
            }
            Some(Some(self.take(len as usize)?))
        }

        pub fn bytes(&mut self) -> Option<&'a [u8]> {
            self.opt_bytes()?
        }

        pub fn str(&mut self) -> Option<&'a str> {
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
        remove_segments(journal.take_applied(20));
        assert_eq!(segments(dir.path()).unwrap().len(), 2);
        remove_segments(journal.take_applied(22));
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
                .map(|(_, p)| fields::Fields(p).str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(texts(&whole), ["one", "two", "three"]);
        assert_eq!(texts(&whole[..whole.len() - 1]), ["one", "two"]);
        let mut damaged = whole.clone();
        let second = HEADER_BYTES + 4 + 3 + HEADER_BYTES + 4;
        damaged[second] ^= 1;
        assert_eq!(texts(&damaged), ["one"]);
    }

    /// A write that failed half-way is cut off, and the records after it follow on where
    /// it began (the segment appends).
    #[test]
    fn records_after_a_cut_follow_on_without_a_gap() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::create(dir.path(), 1).unwrap();
        journal.record(|buf| fields::put_str(buf, "one"));
        journal.write().unwrap();
        // What a failed write leaves behind, and its cut.
        (&*journal.file).write_all(b"half a record").unwrap();
        journal.file.set_len(journal.len).unwrap();
        journal.record(|buf| fields::put_str(buf, "two"));
        journal.write().unwrap();
        let texts: Vec<String> = read_all(dir.path())
            .iter()
            .map(|(_, p)| fields::Fields(p).str().unwrap().to_owned())
            .collect();
        assert_eq!(texts, ["one", "two"]);
    }

    /// A round handed on after a larger one does not keep the larger one's buffer: the
    /// writer's queue holds about what the rounds hold.
    #[test]
    fn a_small_round_after_a_large_one_hands_on_a_small_buffer() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::create(dir.path(), 1).unwrap();
        let mut round_of = |records: usize| {
            for _ in 0..records {
                journal.record(|buf| fields::put_str(buf, &"x".repeat(500)));
            }
            let round = journal.take_round();
            let written = round.write();
            journal.end_round(round, written).unwrap()
        };
        let large = round_of(100);
        assert!(large.len() > 50_000);
        let small = round_of(1);
        assert!(small.capacity() <= 2 * small.len(), "{}", small.capacity());
    }

    /// A text written in place is read back as one put with `put_str`; a failed write
    /// leaves nothing of itself.
    #[test]
    fn a_text_written_in_place_reads_back_and_a_failed_one_leaves_nothing() {
        let mut buf = Vec::new();
        fields::put_with(&mut buf, |buf| {
            buf.extend_from_slice(b"{\"a\":1}");
            Ok::<_, ()>(())
        })
        .unwrap();
        let at = fields::put_u64_later(&mut buf);
        let whole = buf.len();
        let failed = fields::put_with(&mut buf, |buf| {
            buf.extend_from_slice(b"half");
            Err("no")
        });
        assert_eq!((failed, buf.len()), (Err("no"), whole));
        fields::set_u64(&mut buf, at, 7);
        let mut read = fields::Fields(&buf);
        assert_eq!(read.str(), Some("{\"a\":1}"));
        assert_eq!(read.u64(), Some(7));
        assert!(read.is_empty());
    }

    #[test]
    fn fields_read_back_what_was_put_and_refuse_short_payloads() {
        let mut buf = Vec::new();
        fields::put_str(&mut buf, "héllo");
        fields::put_opt(&mut buf, None);
        fields::put_u64(&mut buf, 42);
        let mut read = fields::Fields(&buf);
        assert_eq!(read.str(), Some("héllo"));
        assert_eq!(read.opt(), Some(None));
        assert_eq!(read.u64(), Some(42));
        assert!(read.is_empty());
        assert_eq!(fields::Fields(&buf[..5]).str(), None);
        assert_eq!(fields::Fields(&[0xff, 0xff, 0xff, 0x7f]).str(), None);
    }
}
