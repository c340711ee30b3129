//! The shared scratchpad file(s): new entries are read and routed like network messages;
//! messages for programs that are not connected are appended.
//!
//! The bridge only appends, each entry in one `write` on a file opened for appending, and
//! never rewrites or truncates. It remembers, in the store, which file (device and inode)
//! it read, how far, a fingerprint of the file's first bytes and of those just before that
//! point, and the hash of every entry it routed from it. So after a restart or a move no
//! entry is routed twice and none is skipped: a file that is new (another inode) is read
//! from its start and entries already seen are passed over. A file rewritten in place —
//! shorter than what was read, or with another fingerprint, even when truncated and
//! refilled between two reads — is read from its start as new: its seen entries are
//! forgotten, and entries without an id get ids of a new generation, so the same words
//! written again are a new message. Entries without an id get one derived from their text
//! (and generation), so even one routed just before a crash is recognised when read again.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::db::Position;
use super::entry::{self, Entry};
use super::{Grid, Source};
use crate::core::derived_uuid;

fn hash(entry_text: &str) -> String {
    crate::shared::text::hex(&Sha256::digest(entry_text.trim().as_bytes()))
}

impl Grid {
    pub async fn watch_scratchpads(self: Arc<Self>) {
        let every = Duration::from_millis(self.config.scratchpad_poll_ms.max(10));
        loop {
            // As the config has them now: a reload may add or take away a file.
            let paths = self.scratchpads.load_full();
            for path in paths.iter() {
                if let Err(e) = self.read_new_entries(path).await {
                    tracing::warn!(path = %path.display(), error = %e, "grid: cannot read the scratchpad");
                }
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    async fn read_new_entries(&self, path: &Path) -> Result<(), String> {
        let key = path.display().to_string();
        let stored = self.db.position(&key).await.map_err(|e| e.to_string())?;
        let owned = path.to_owned();
        let from = stored.clone().unwrap_or_default();
        let read = tokio::task::spawn_blocking(move || read_from(&owned, from))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let Some(read) = read else {
            return Ok(());
        };
        if read.rewritten {
            self.db.forget_seen(&key).await.map_err(|e| e.to_string())?;
        }
        let (entries, consumed) = entry::parse_entries(&read.text);
        let generation = read.position.generation;
        let mut seen = Vec::with_capacity(entries.len());
        for entry in entries {
            let digest = hash(entry.text);
            if self
                .db
                .seen(&key, &digest)
                .await
                .map_err(|e| e.to_string())?
            {
                continue;
            }
            self.route_entry(entry, &digest, generation).await;
            seen.push(digest);
        }
        let position = read.advanced(consumed);
        if stored.as_ref() != Some(&position) || !seen.is_empty() {
            self.db
                .advance(&key, position, seen)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    async fn route_entry(&self, entry: Entry<'_>, digest: &str, generation: u64) {
        // An entry is answered by its own id, or, when it has none (`validate` then made
        // one up), by one derived from its text: the same every read.
        let entry_id = |id: Option<&str>| match id {
            Some(id) if entry.text.contains(id) => id.to_owned(),
            _ => format!(
                "msg-{}",
                derived_uuid("grid-entry", &entry_key(digest, generation))
            ),
        };
        let result = match entry.message {
            Ok(mut msg) => {
                let id = entry_id(Some(&msg.id));
                if id != msg.id {
                    msg.id = id;
                    if let Value::Object(raw) = &mut msg.raw {
                        raw.insert("id".into(), Value::String(msg.id.clone()));
                    }
                }
                self.accept(msg, Source::Scratchpad).await.map(|_| ())
            }
            Err(invalid) => Err(invalid),
        };
        if let Err(mut invalid) = result {
            tracing::warn!(field = %invalid.field, reason = %invalid.message, "grid: skipped a malformed scratchpad entry");
            invalid.id = Some(entry_id(invalid.id.as_deref()));
            self.report(&invalid).await;
        }
    }

    /// Appends `messages` as entries to the first scratchpad, all in one write, but for
    /// those it holds already (marked seen: a message routed again after a restart). The
    /// entries are marked seen first, so the watcher does not route them back, and
    /// appending until the write ended (`settle_appending`).
    pub async fn append_to_scratchpad(&self, messages: &[&Value]) -> Result<(), String> {
        let Some(path) = self.scratchpads.load().first().cloned() else {
            return Ok(());
        };
        let entries: Vec<String> = messages.iter().map(|m| entry::entry(m)).collect();
        let hashes: Vec<String> = entries.iter().map(|entry| hash(entry)).collect();
        let shown = path.display().to_string();
        let new = self.db.mark_appending(&shown, hashes.clone()).await;
        let new = new.map_err(|e| e.to_string())?;
        // An entry the file holds already (a message routed again after a restart) is not
        // appended twice.
        let (text, marked): (String, Vec<String>) = (entries.into_iter().zip(hashes).zip(new))
            .filter_map(|(entry, new)| new.then_some(entry))
            .unzip();
        if text.is_empty() {
            return Ok(());
        }
        let appended = tokio::task::spawn_blocking(move || append(&path, &text)).await;
        let appended = appended
            .map_err(|e| e.to_string())
            .and_then(|written| written.map_err(|e| e.to_string()));
        let settled = match appended {
            Ok(()) => self.db.appended(&shown, marked).await,
            // Not in the file after all: a later copy of the message appends it.
            Err(_) => self.db.forget_seen_entries(&shown, marked).await,
        };
        if let Err(e) = settled {
            tracing::error!(error = %e, "grid: cannot record how a scratchpad append ended");
        }
        appended
    }
}

/// Settles the appends a bridge killed mid-append left (`Db::appending`), before anything
/// is routed: an entry its file holds stays seen, and one it does not is forgotten, so the
/// message, routed again as the bridge starts, is appended then rather than passed over as
/// in the file already.
///
/// A file that cannot be read is left appending, to be settled at the next start; its
/// entries stay seen meanwhile. One that is not there holds none of them.
pub(super) async fn settle_appending(db: &super::Db) -> Result<(), String> {
    for (path, appending) in db.appending().await.map_err(|e| e.to_string())? {
        let file = PathBuf::from(&path);
        let held = tokio::task::spawn_blocking(move || entries_in(&file)).await;
        let held = match held
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
        {
            Ok(held) => held,
            Err(e) => {
                tracing::error!(path, error = %e, "grid: cannot read the scratchpad to settle its last appends");
                continue;
            }
        };
        let (written, missing): (Vec<String>, Vec<String>) =
            appending.into_iter().partition(|hash| held.contains(hash));
        if !missing.is_empty() {
            tracing::warn!(
                path,
                entries = missing.len(),
                "grid: scratchpad entries a stopped run had not appended are appended when routed again"
            );
        }
        db.appended(&path, written)
            .await
            .map_err(|e| e.to_string())?;
        (db.forget_seen_entries(&path, missing).await).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The hashes of the entries `path` holds (none when it is absent).
fn entries_in(path: &Path) -> std::io::Result<std::collections::HashSet<String>> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e),
    };
    let text = readable(bytes, true);
    let (entries, _) = entry::parse_entries(&text);
    Ok(entries.iter().map(|entry| hash(entry.text)).collect())
}

/// The fingerprint covers this many of the file's first bytes…
const HEAD: u64 = 4096;
/// …and this many of those before where reading stopped.
const TAIL: u64 = 1024;

/// What the key of an entry without an id is derived from: its hash, and the generation of
/// the file it was read from (none for the first, so ids stored without a generation
/// still match).
fn entry_key(digest: &str, generation: u64) -> String {
    match generation {
        0 => digest.to_owned(),
        g => format!("{digest}/{g}"),
    }
}

/// A hash of `head` up to `offset` and of the `TAIL` bytes before `offset`, taken from
/// `around`, the bytes of the file from `around_start` on.
fn fingerprint(head: &[u8], around: &[u8], around_start: u64, offset: u64) -> String {
    let head = &head[..head.len().min(offset as usize)];
    let from = offset.saturating_sub(TAIL).max(around_start) - around_start;
    let to = (offset - around_start).min(around.len() as u64);
    let tail = &around[(from.min(to)) as usize..to as usize];
    let mut hasher = Sha256::new();
    hasher.update(head);
    hasher.update([0xff]);
    hasher.update(tail);
    crate::shared::text::hex(&hasher.finalize())
}

/// What a read of a scratchpad file found.
struct Found {
    /// Where reading started: the stored position, or the start of a file that is new or
    /// was rewritten in place.
    position: Position,
    /// The file is the one read before, but was rewritten in place.
    rewritten: bool,
    /// Its first bytes (up to `HEAD`).
    head: Vec<u8>,
    /// The bytes before `position.offset` (up to `TAIL`).
    before: Vec<u8>,
    /// What follows `position.offset`, as read (`readable`).
    text: String,
    /// The same bytes as the file holds them, which the fingerprint is of.
    raw: Vec<u8>,
}

impl Found {
    /// The position after `consumed` bytes of `text`, with its fingerprint.
    fn advanced(&self, consumed: usize) -> Position {
        let start = self.position.offset - self.before.len() as u64;
        let offset = self.position.offset + consumed as u64;
        let around = [self.before.as_slice(), self.raw.as_slice()].concat();
        Position {
            offset,
            fingerprint: fingerprint(&self.head, &around, start, offset),
            ..self.position.clone()
        }
    }
}

fn read_at(file: &mut std::fs::File, from: u64, len: u64) -> std::io::Result<Vec<u8>> {
    file.seek(SeekFrom::Start(from))?;
    let mut bytes = Vec::new();
    file.take(len).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Reads what is new in `path` since `position`: `None` when the file is absent. A file
/// that is not the one read before is read from its start; so is one rewritten in place
/// (shorter than what was read, or with another fingerprint), in a new generation.
fn read_from(path: &Path, position: Position) -> std::io::Result<Option<Found>> {
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    let mut position = position;
    let same_file = position.dev == meta.dev() && position.ino == meta.ino();
    if !same_file {
        position = Position {
            dev: meta.dev(),
            ino: meta.ino(),
            offset: 0,
            fingerprint: String::new(),
            generation: position.generation,
        };
    }
    let head = read_at(&mut file, 0, HEAD.min(meta.len()))?;
    let mut rewritten = same_file && meta.len() < position.offset;
    let mut before = Vec::new();
    if same_file && !rewritten && position.offset > 0 {
        let start = position.offset.saturating_sub(TAIL);
        before = read_at(&mut file, start, position.offset - start)?;
        rewritten = !position.fingerprint.is_empty()
            && fingerprint(&head, &before, start, position.offset) != position.fingerprint;
    }
    if rewritten {
        position.offset = 0;
        position.fingerprint = String::new();
        position.generation += 1;
        before.clear();
    }
    let bytes = read_at(
        &mut file,
        position.offset,
        meta.len().saturating_sub(position.offset),
    )?;
    let text = readable(bytes.clone(), position.offset == 0);
    Ok(Some(Found {
        position,
        rewritten,
        head,
        before,
        text,
        raw: bytes,
    }))
}

/// The text of `bytes` read from a scratchpad, byte for byte, so that offsets into it are
/// the file's: a character cut by a writer in progress at the end is left for the next
/// read; a byte that is not UTF-8 anywhere else is read as `?` (were it left, every entry
/// after it would wait for good); and a byte-order mark at the file's `start` is read as
/// line ends, so the entry after it starts a line.
fn readable(mut bytes: Vec<u8>, start: bool) -> String {
    const BOM: &[u8] = "\u{feff}".as_bytes();
    if start && bytes.starts_with(BOM) {
        bytes[..BOM.len()].fill(b'\n');
    }
    let mut from = 0;
    while let Err(e) = std::str::from_utf8(&bytes[from..]) {
        let at = from + e.valid_up_to();
        match e.error_len() {
            None => {
                bytes.truncate(at);
                break;
            }
            Some(len) => {
                bytes[at..at + len].fill(b'?');
                from = at + len;
            }
        }
    }
    String::from_utf8(bytes).unwrap_or_default()
}

/// Appends `entries` in one write, starting on a fresh line.
fn append(path: &PathBuf, entries: &str) -> std::io::Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .read(true)
        .open(path)?;
    let len = file.metadata()?.len();
    let mut needs_newline = false;
    if len > 0 {
        let mut last = [0u8; 1];
        file.seek(SeekFrom::Start(len - 1))?;
        file.read_exact(&mut last)?;
        needs_newline = last[0] != b'\n';
    }
    let text = if needs_newline {
        format!("\n{entries}")
    } else {
        entries.to_owned()
    };
    file.write_all(text.as_bytes())?;
    file.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;

    fn message(id: &str) -> Value {
        serde_json::json!({
            "id": id, "timestamp": "2026-01-24T10:00:00Z", "type": "notification",
            "sender": { "agent": "mc" }, "receiver": { "agent": "scout" },
            "content": { "action": "status", "payload": { "text": id } },
        })
    }

    /// A bridge killed between marking entries seen and appending them: as it starts, the
    /// entry the file holds stays seen, and the one it lacks is forgotten, to be appended
    /// when its message is routed again.
    #[tokio::test]
    async fn an_append_a_killed_run_did_not_make_is_forgotten_as_the_bridge_starts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("SCRATCHPAD.md");
        let shown = path.display().to_string();
        let db = super::super::Db::open(Store::open(":memory:").await.unwrap())
            .await
            .unwrap();
        let (written, lost) = (entry::entry(&message("m-1")), entry::entry(&message("m-2")));
        let hashes = vec![hash(&written), hash(&lost)];
        let new = db.mark_appending(&shown, hashes.clone()).await.unwrap();
        assert_eq!(new, [true, true]);
        append(&path, &written).unwrap();

        settle_appending(&db).await.unwrap();
        assert!(db.seen(&shown, &hashes[0]).await.unwrap(), "in the file");
        assert!(
            !db.seen(&shown, &hashes[1]).await.unwrap(),
            "not in the file"
        );
        assert!(db.appending().await.unwrap().is_empty());
        let again = db.mark_appending(&shown, hashes).await.unwrap();
        assert_eq!(
            again,
            [false, true],
            "only the lost entry is appended again"
        );
    }

    #[tokio::test]
    async fn an_append_that_ended_is_not_settled_again() {
        let dir = tempfile::tempdir().unwrap();
        let shown = dir.path().join("SCRATCHPAD.md").display().to_string();
        let db = super::super::Db::open(Store::open(":memory:").await.unwrap())
            .await
            .unwrap();
        let hashes = vec![hash(&entry::entry(&message("m-1")))];
        db.mark_appending(&shown, hashes.clone()).await.unwrap();
        db.appended(&shown, hashes.clone()).await.unwrap();
        assert!(db.appending().await.unwrap().is_empty());
        // The file is gone meanwhile: what it held was appended, and stays seen.
        settle_appending(&db).await.unwrap();
        assert!(db.seen(&shown, &hashes[0]).await.unwrap());
    }

    #[test]
    fn bytes_that_are_not_utf8_are_read_as_question_marks_and_offsets_hold() {
        let mut bytes = b"caf\xe9 au lait\n### [".to_vec();
        let text = readable(bytes.clone(), false);
        assert_eq!(text, "caf? au lait\n### [");
        assert_eq!(text.len(), bytes.len());
        // A character cut at the end by a writer in progress waits for the next read.
        bytes.extend_from_slice(&"é".as_bytes()[..1]);
        assert_eq!(readable(bytes, false), "caf? au lait\n### [");
    }

    #[test]
    fn a_byte_order_mark_at_the_start_is_read_as_line_ends() {
        let bytes = "\u{feff}### [2026-01-24T10:00:00Z]".as_bytes().to_vec();
        assert_eq!(
            readable(bytes.clone(), true),
            "\n\n\n### [2026-01-24T10:00:00Z]"
        );
        assert!(readable(bytes, false).starts_with('\u{feff}'));
    }
}
