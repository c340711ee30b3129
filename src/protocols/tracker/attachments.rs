//! Attachments in a fleet: the bytes of an uploaded file go to the fleet's files
//! (`SharedRecords::put_file`, `tracker-attachments/<id>`) and its description to a record
//! (`tracker-attachments.<id>`); every bridge keeps the description, so it lists the file
//! with its message or task, and fetches the bytes from the fleet the first time the file
//! is downloaded through it (then keeps them). A bridge alone keeps both in its tables.

use std::sync::Arc;

use super::Tracker;
use super::db::AttachmentRow;
use super::records::{decode, encode};
use super::tasks::WriteError;
use crate::core::{Expect, RecordChange, RecordError, sink};
use crate::store::StoreError;

/// The table of attachments' descriptions in the fleet's records, keyed by attachment id.
const ATTACHMENTS: &str = "tracker-attachments";

/// The fleet's name of the bytes of attachment `id`.
fn file_name(id: &str) -> String {
    format!("tracker-attachments/{id}")
}

async fn apply_change(tracker: Arc<Tracker>, change: RecordChange) -> Result<(), StoreError> {
    // Attachments are never removed.
    let Some(value) = change.value else {
        return Ok(());
    };
    tracker.db.apply_attachment(decode(&value)?).await
}

impl Tracker {
    /// Follows the fleet's attachments, when there is a fleet.
    pub(super) fn follow_attachments(self: &Arc<Self>) {
        if let Some(records) = self.core.records() {
            records.follow(ATTACHMENTS, sink(self, "tracker attachment", apply_change));
        }
    }

    /// Keeps an uploaded file: in a fleet, its bytes and its description are the fleet's
    /// first.
    pub async fn keep_attachment(
        &self,
        row: AttachmentRow,
        data: Vec<u8>,
    ) -> Result<AttachmentRow, WriteError> {
        if let Some(records) = self.core.records() {
            records
                .put_file(&file_name(&row.id), data.clone().into())
                .await?;
            records
                .write(ATTACHMENTS, &row.id, encode(&row), Expect::Absent)
                .await?;
        }
        Ok(self.db.insert_attachment(row, data).await?)
    }

    /// An attachment's description and bytes; in a fleet, bytes not kept here yet are
    /// fetched from the fleet's files (and kept).
    pub async fn attachment(
        &self,
        id: &str,
    ) -> Result<Option<(AttachmentRow, Vec<u8>)>, WriteError> {
        let Some((row, data)) = self.db.attachment(id).await? else {
            return Ok(None);
        };
        let (Some(records), true) = (self.core.records(), (data.len() as i64) < row.size) else {
            return Ok(Some((row, data)));
        };
        let fetched = records.file(&file_name(id)).await?;
        let data = fetched.ok_or_else(|| {
            RecordError::Unavailable(format!("the fleet has no bytes of attachment {id}"))
        })?;
        self.db.keep_attachment_data(id, data.to_vec()).await?;
        Ok(Some((row, data.to_vec())))
    }
}
