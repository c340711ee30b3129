//! How far this bridge is in each table of the fleet's records: the last revision it wrote
//! there, and the last its watch of the table applied. A bridge asked to hand over a moved
//! agent's mail answers with the first; the asking bridge waits on the second
//! (`handover`).

use dashmap::DashMap;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::core::Revision;

#[derive(Default)]
pub struct RecordPositions {
    written: DashMap<String, Revision>,
    applied: DashMap<String, watch::Sender<Revision>>,
}

impl RecordPositions {
    /// This bridge wrote `table` at `revision`.
    pub fn wrote(&self, table: &str, revision: Revision) {
        match self.written.get_mut(table) {
            Some(mut last) => *last = (*last).max(revision),
            None => {
                let mut last = self.written.entry(table.to_owned()).or_default();
                *last = (*last).max(revision);
            }
        }
    }

    /// The last revision this bridge wrote in `table`; 0 when it wrote none.
    pub fn written(&self, table: &str) -> Revision {
        self.written.get(table).map_or(0, |last| *last)
    }

    /// `table` is followed here: what its watch applies is kept from now on.
    pub fn follows(&self, table: &str) {
        (self.applied.entry(table.to_owned())).or_insert_with(|| watch::channel(0).0);
    }

    /// The watch of `table` applied its change at `revision`.
    pub fn applied(&self, table: &str, revision: Revision) {
        if let Some(applied) = self.applied.get(table) {
            applied.send_if_modified(|last| {
                let newer = revision > *last;
                *last = (*last).max(revision);
                newer
            });
        }
    }

    /// Waits until this bridge's watch of `table` has applied `revision`; false when
    /// `deadline` came first. A table not followed here has nothing to wait for.
    pub async fn applied_by(&self, table: &str, revision: Revision, deadline: Instant) -> bool {
        let Some(mut applied) = self.applied.get(table).map(|a| a.subscribe()) else {
            return true;
        };
        let reached = applied.wait_for(|&at| at >= revision);
        matches!(tokio::time::timeout_at(deadline, reached).await, Ok(Ok(_)))
    }
}
