//! Messages kept on this bridge alone while NATS was away, waiting to be shared with the
//! fleet's history once it is back (`fleet_log`).
//!
//! Each is written to a file in the bridge's data directory before its sender is told it
//! was accepted, so a bridge restarted before NATS is back still shares it: the file is
//! read back at start-up (up to the limits) and emptied once JetStream holds everything
//! it lists. A message shared twice (a bridge stopped between JetStream's answer and the
//! emptying, or a NATS that came and went without a moment when nothing waited, which
//! keeps the lines it holds already) is harmless: history is kept by id and never routed.
//! Each line is synced on its own: this runs only while NATS is away, for messages that
//! only this bridge's agents take.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, Write};
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::{Mutex, MutexGuard};
use serde::Deserialize;
use tokio::sync::oneshot;

use crate::core::LogError;
use crate::telemetry;

/// A message on its way to the stream, with whom to tell once JetStream holds it (no one,
/// for history).
pub struct Outgoing {
    pub id: String,
    pub payload: Bytes,
    pub accepted: Option<oneshot::Sender<Result<(), LogError>>>,
    /// Done once the message's deliveries on this bridge are, for its publish's
    /// acknowledgement to wait for (`own_deliveries`).
    pub written: Option<crate::core::HeldBy>,
}

impl Outgoing {
    /// History: a message no one waits for, and that is not routed again.
    pub fn history(id: String, payload: Bytes) -> Outgoing {
        Outgoing {
            id,
            payload,
            accepted: None,
            written: None,
        }
    }
}

/// The file in the data directory that lists what waits, one message's JSON a line.
const FILE_NAME: &str = "fleet-unshared.jsonl";

/// Messages, and bytes, that wait at most; past that, the newest stay on this bridge alone
/// (and that is logged).
const LIMIT: usize = 65_536;
const LIMIT_BYTES: usize = 64 * 1024 * 1024;

/// What waits for NATS, in the order it was kept.
pub struct Unshared {
    waiting: Mutex<Waiting>,
    /// The file that lists it; none for a bridge whose store is in memory. Locked before
    /// `waiting` wherever both are.
    file: Option<Mutex<File>>,
}

#[derive(Default)]
struct Waiting {
    queue: VecDeque<Outgoing>,
    bytes: usize,
    /// Taken to be shared, not yet held by JetStream.
    sharing: usize,
}

impl Waiting {
    /// Whether one more message of `size` bytes stays within the limits, counting those
    /// being shared.
    fn has_room(&self, size: usize) -> bool {
        self.queue.len() + self.sharing < LIMIT && self.bytes + size <= LIMIT_BYTES
    }

    /// Whether nothing waits or is being shared: the file may be emptied.
    fn is_settled(&self) -> bool {
        self.queue.is_empty() && self.sharing == 0
    }

    /// Tells the metrics how many wait or are being shared.
    fn count(&self) {
        telemetry::federation_unshared(self.queue.len() + self.sharing);
    }
}

impl Unshared {
    /// What waits in memory only.
    pub fn in_memory() -> Arc<Unshared> {
        Arc::new(Unshared {
            waiting: Mutex::default(),
            file: None,
        })
    }

    /// What waits, listed in `data_dir`'s file: what a previous run left there waits again.
    pub fn open(data_dir: &Path) -> std::io::Result<Arc<Unshared>> {
        let path = data_dir.join(FILE_NAME);
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)?;
        let mut waiting = Waiting::default();
        // A line cut short by a crash is dropped (its sender was not told it was accepted),
        // so that the next line written starts on a line of its own.
        let mut whole = 0;
        let mut reader = BufReader::new(&mut file);
        let mut line = Vec::new();
        let mut left_out = 0_usize;
        loop {
            line.clear();
            let read = reader.read_until(b'\n', &mut line)?;
            if read == 0 || line.last() != Some(&b'\n') {
                break;
            }
            whole += read as u64;
            let json = &line[..line.len() - 1];
            match serde_json::from_slice::<Head>(json) {
                // Past the limits (a NATS that came and went without a moment when nothing
                // waited keeps lines it holds already), the rest stay on this bridge alone.
                Ok(_) if !waiting.has_room(json.len()) => {
                    left_out += 1;
                }
                Ok(head) => {
                    waiting.bytes += json.len();
                    (waiting.queue).push_back(Outgoing::history(
                        head.envelope.id,
                        Bytes::copy_from_slice(json),
                    ));
                }
                Err(e) => {
                    tracing::warn!(error = %e, file = %path.display(), "federation: a line of the messages waiting for NATS cannot be read; left out")
                }
            }
        }
        drop(reader);
        if file.seek(std::io::SeekFrom::End(0))? != whole {
            file.set_len(whole)?;
        }
        if left_out > 0 {
            tracing::warn!(
                left_out,
                "federation: more waits for NATS than is kept; the newest are not shared"
            );
        }
        waiting.count();
        if !waiting.queue.is_empty() {
            tracing::info!(
                count = waiting.queue.len(),
                "federation: messages kept while NATS was away wait to be shared"
            );
        }
        Ok(Arc::new(Unshared {
            waiting: Mutex::new(waiting),
            file: Some(Mutex::new(file)),
        }))
    }

    fn waiting(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock()
    }

    /// Keeps `outgoing` to share once NATS is back: in the file first, when there is one
    /// (off the async threads), then in the queue.
    pub async fn keep(self: &Arc<Self>, outgoing: Outgoing) {
        if self.file.is_none() {
            return self.keep_now(outgoing);
        }
        let this = self.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || this.keep_now(outgoing)).await {
            tracing::error!(error = %e, "federation: keeping a message for NATS failed");
        }
    }

    fn keep_now(&self, outgoing: Outgoing) {
        let size = outgoing.payload.len();
        // The file's lock is held until the message is queued, so that `shared` cannot
        // empty the file of a line whose message is not in the queue yet.
        let mut file = self.file.as_ref().map(|f| f.lock());
        if !self.waiting().has_room(size) {
            tracing::warn!(message_id = %outgoing.id, "federation: too much waits for NATS; this message stays on this bridge alone");
            return;
        }
        if let Some(file) = file.as_mut() {
            let mut line = Vec::with_capacity(size + 1);
            line.extend_from_slice(&outgoing.payload);
            line.push(b'\n');
            if let Err(e) = append_line(file, &line) {
                // It still waits in memory: shared unless the bridge stops first.
                tracing::error!(error = %e, message_id = %outgoing.id, "federation: cannot write a message waiting for NATS to its file");
            }
        }
        let mut waiting = self.waiting();
        waiting.bytes += size;
        waiting.queue.push_back(outgoing);
        waiting.count();
    }

    /// Everything that waits, taken to be shared: each is `shared` or `put_back` later.
    pub fn take_all(&self) -> Vec<Outgoing> {
        let mut waiting = self.waiting();
        waiting.bytes = 0;
        let all: Vec<Outgoing> = waiting.queue.drain(..).collect();
        waiting.sharing += all.len();
        all
    }

    /// Takes back, at the front, what a refused publish carried.
    pub fn put_back(&self, refused: Vec<Outgoing>) {
        let mut waiting = self.waiting();
        waiting.sharing = waiting.sharing.saturating_sub(refused.len());
        for outgoing in refused.into_iter().rev() {
            waiting.bytes += outgoing.payload.len();
            waiting.queue.push_front(outgoing);
        }
    }

    /// JetStream holds `count` of the messages taken; once it holds all, the file is
    /// emptied.
    pub fn shared(self: &Arc<Self>, count: usize) {
        let done = {
            let mut waiting = self.waiting();
            waiting.sharing = waiting.sharing.saturating_sub(count);
            waiting.count();
            waiting.is_settled()
        };
        if done && self.file.is_some() {
            let this = self.clone();
            tokio::task::spawn_blocking(move || this.empty_file());
        }
    }

    fn empty_file(&self) {
        let Some(file) = &self.file else { return };
        let file = file.lock();
        if self.waiting().is_settled()
            && let Err(e) = file.set_len(0).and_then(|()| file.sync_data())
        {
            tracing::warn!(error = %e, "federation: cannot empty the file of messages waiting for NATS");
        }
    }
}

/// Appends `line` and syncs it; on a failure, takes back what part of it was written, so
/// that the next line starts on a line of its own.
fn append_line(file: &mut File, line: &[u8]) -> std::io::Result<()> {
    let end = file.metadata()?.len();
    let written = file.write_all(line).and_then(|()| file.sync_data());
    if written.is_err() {
        let _ = file.set_len(end);
    }
    written
}

/// As much of a waiting message as names it.
#[derive(Deserialize)]
struct Head {
    envelope: HeadId,
}

#[derive(Deserialize)]
struct HeadId {
    id: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(id: &str) -> Outgoing {
        Outgoing::history(
            id.into(),
            format!(r#"{{"envelope":{{"id":"{id}"}},"history":true}}"#).into(),
        )
    }

    fn ids(all: &[Outgoing]) -> Vec<&str> {
        all.iter().map(|o| o.id.as_str()).collect()
    }

    #[tokio::test]
    async fn what_waits_is_read_back_by_the_next_run_until_it_is_shared() {
        let dir = tempfile::tempdir().unwrap();
        let first = Unshared::open(dir.path()).unwrap();
        first.keep(history("m1")).await;
        first.keep(history("m2")).await;
        drop(first);

        let second = Unshared::open(dir.path()).unwrap();
        let taken = second.take_all();
        assert_eq!(ids(&taken), ["m1", "m2"]);
        second.put_back(taken);
        let taken = second.take_all();
        second.shared(taken.len());
        // Emptied off the async threads: the next run finds nothing, once it is.
        let path = dir.path().join(FILE_NAME);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::metadata(&path).unwrap().len() != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the file was not emptied"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(Unshared::open(dir.path()).unwrap().take_all().is_empty());
    }

    #[tokio::test]
    async fn a_line_cut_short_is_dropped_and_the_next_starts_on_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        std::fs::write(&path, "{\"envelope\":{\"id\":\"m1\"}}\n{\"envelope\":{\"i").unwrap();
        let unshared = Unshared::open(dir.path()).unwrap();
        unshared.keep(history("m2")).await;
        drop(unshared);
        let again = Unshared::open(dir.path()).unwrap();
        assert_eq!(ids(&again.take_all()), ["m1", "m2"]);
    }

    #[tokio::test]
    async fn nothing_is_emptied_while_a_message_is_being_shared() {
        let dir = tempfile::tempdir().unwrap();
        let unshared = Unshared::open(dir.path()).unwrap();
        unshared.keep(history("m1")).await;
        unshared.keep(history("m2")).await;
        let taken = unshared.take_all();
        unshared.shared(1);
        unshared.empty_file();
        assert_ne!(
            std::fs::metadata(dir.path().join(FILE_NAME)).unwrap().len(),
            0
        );
        unshared.shared(taken.len() - 1);
        unshared.empty_file();
        assert_eq!(
            std::fs::metadata(dir.path().join(FILE_NAME)).unwrap().len(),
            0
        );
    }
}
