//! The shared scratchpad file(s): new entries are read and routed like network messages;
//! messages for programs that are not connected are appended.
//!
//! The bridge only appends, each entry in one `write` on a file opened for appending, and
//! never rewrites or truncates. It remembers, in the store, which file (device and inode)
//! it read and how far, and the hash of every entry it routed, so after a restart, a move
//! or a truncation by someone else no entry is routed twice and none is skipped: a file
//! that is new (another inode) or shorter than what was read is read again from the start,
//! and entries already seen are passed over. Entries without an id get one derived from
//! their text, so even one routed just before a crash is recognised when read again.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::db::Position;
use super::wire::{self, Entry};
use super::{Grid, Source};
use crate::core::derived_uuid;

fn hash(entry_text: &str) -> String {
    Sha256::digest(entry_text.trim().as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Grid {
    pub async fn watch_scratchpads(self: Arc<Self>) {
        let every = Duration::from_millis(self.config.scratchpad_poll_ms.max(10));
        let paths = self.config.scratchpad.0.clone();
        loop {
            for path in &paths {
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
        let read =
            tokio::task::spawn_blocking(move || read_from(&owned, stored.unwrap_or_default()))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
        let Some((mut position, text)) = read else {
            return Ok(());
        };
        let (entries, consumed) = wire::parse_entries(&text);
        let mut seen = Vec::with_capacity(entries.len());
        for entry in entries {
            let digest = hash(entry.text);
            if self.db.seen(&digest).await.map_err(|e| e.to_string())? {
                continue;
            }
            self.route_entry(entry, &digest).await;
            seen.push(digest);
        }
        position.offset += consumed as u64;
        if stored != Some(position) || !seen.is_empty() {
            self.db
                .advance(&key, position, seen)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    async fn route_entry(&self, entry: Entry<'_>, digest: &str) {
        let result = match entry.message {
            Ok(mut msg) => {
                if !entry.text.contains(&msg.id) {
                    // No id in the entry: one derived from its text, the same every read.
                    msg.id = format!("msg-{}", derived_uuid("grid-entry", digest));
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
            // The error answers the entry by the id it would have had.
            invalid
                .id
                .get_or_insert_with(|| format!("msg-{}", derived_uuid("grid-entry", digest)));
            self.report(&invalid).await;
        }
    }

    /// Appends `message` as an entry to the first scratchpad, in one write. The entry is
    /// marked seen first, so the watcher does not route it back.
    pub async fn append_to_scratchpad(&self, message: &Value) -> Result<(), String> {
        let Some(path) = self.config.scratchpad.0.first().cloned() else {
            return Ok(());
        };
        let entry = wire::entry(message);
        self.db
            .mark_seen(hash(&entry))
            .await
            .map_err(|e| e.to_string())?;
        tokio::task::spawn_blocking(move || append(&path, &entry))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
    }
}

/// Reads what is new in `path` since `position`: `None` when the file is absent or has
/// nothing new. A file that is not the one read before, or is shorter than what was read,
/// is read from its start.
fn read_from(path: &Path, position: Position) -> std::io::Result<Option<(Position, String)>> {
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    let mut position = position;
    if position.dev != meta.dev() || position.ino != meta.ino() || meta.len() < position.offset {
        position = Position {
            dev: meta.dev(),
            ino: meta.ino(),
            offset: 0,
        };
    }
    if meta.len() == position.offset {
        return Ok(Some((position, String::new())));
    }
    file.seek(SeekFrom::Start(position.offset))?;
    let mut bytes = Vec::with_capacity((meta.len() - position.offset) as usize);
    file.take(meta.len() - position.offset)
        .read_to_end(&mut bytes)?;
    // An entry cut mid-character by a writer in progress is left for the next read.
    let text = match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            let valid = e.utf8_error().valid_up_to();
            let mut bytes = e.into_bytes();
            bytes.truncate(valid);
            String::from_utf8(bytes).unwrap_or_default()
        }
    };
    Ok(Some((position, text)))
}

/// Appends `entry` in one write, starting on a fresh line.
fn append(path: &PathBuf, entry: &str) -> std::io::Result<()> {
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
        format!("\n{entry}")
    } else {
        entry.to_owned()
    };
    file.write_all(text.as_bytes())?;
    file.flush()
}
