//! Tasks submitted through `TaskService` as records a fleet shares (`core::SharedRecords`):
//! `GetTask`, `ListTasks` and `StreamTaskStatus` answer alike through every bridge, and a
//! task follows its assignee's progress and result whichever bridge they reach.
//!
//! A change reads the fleet's record, makes the change on what it read, and writes it back
//! at that revision, again when another write came first: every bridge's hub sees a
//! progress message and makes its change, and after the first write the others find
//! nothing left to change, so one bridge writes it — and only that one sends what the
//! change sends (the assignment, the cancellation, the submitter's callback). Every bridge
//! applies each revision to its own tables and tells its own `StreamTaskStatus` watchers.
//! An `external_task_id` is claimed fleet-wide by a record of its own. A task's files are
//! the fleet's files (`synapse-task-files/<id>/<position>`, each its description, a line
//! break, then its bytes), taken by the bridge that gives the task to an agent. A bridge
//! alone keeps its tasks in its own tables only.

use std::sync::Arc;

use tonic::Status;

use super::Synapse;
use super::agents::{internal, not_recorded};
use super::db::{FileRow, TaskRow, Update};
use crate::core::{Expect, RecordChange, RecordError, Tried, sink, unless_lost, until_not_lost};
use crate::store::StoreError;

/// The table of tasks in the fleet's records, keyed by task id.
const TASKS: &str = "synapse-tasks";
/// The table of external task ids in use, each naming its task.
const EXTERNAL_IDS: &str = "synapse-task-external-ids";

/// Follows the fleet's tasks, when there is a fleet.
pub fn follow(synapse: &Arc<Synapse>) {
    if let Some(records) = synapse.core.records() {
        records.follow(TASKS, sink(synapse, "synapse task", apply_change));
    }
}

async fn apply_change(synapse: Arc<Synapse>, change: RecordChange) -> Result<(), StoreError> {
    // Tasks are never removed.
    let Some(value) = change.value else {
        return Ok(());
    };
    synapse.apply_task(decode(&value)?, change.revision).await
}

fn encode(task: &TaskRow) -> bytes::Bytes {
    serde_json::to_vec(task).expect("a task encodes").into()
}

fn decode(value: &[u8]) -> Result<TaskRow, StoreError> {
    serde_json::from_slice(value).map_err(|e| StoreError::Corrupt(format!("a shared task: {e}")))
}

/// The fleet's name of file `position` of task `id`.
fn file_name(id: &str, position: usize) -> String {
    format!("synapse-task-files/{id}/{position}")
}

/// A file as the fleet keeps it: its description as JSON, a line break, its bytes.
fn encode_file(file: &FileRow) -> bytes::Bytes {
    let mut bytes = serde_json::to_vec(file).expect("a file's description encodes");
    bytes.push(b'\n');
    bytes.extend_from_slice(&file.data);
    bytes.into()
}

fn decode_file(bytes: &[u8]) -> Result<FileRow, StoreError> {
    let corrupt = |why: String| StoreError::Corrupt(format!("a shared task file: {why}"));
    let split =
        (bytes.iter().position(|&b| b == b'\n')).ok_or_else(|| corrupt("no line".into()))?;
    let mut file: FileRow =
        serde_json::from_slice(&bytes[..split]).map_err(|e| corrupt(e.to_string()))?;
    file.data = bytes[split + 1..].to_vec();
    Ok(file)
}

impl Synapse {
    /// Keeps a new task and its files; `None` when its external id is taken. In a fleet,
    /// the files and the task are the fleet's first.
    pub(super) async fn insert_task(
        &self,
        task: TaskRow,
        files: Vec<FileRow>,
    ) -> Result<Option<TaskRow>, Status> {
        let Some(records) = self.core.records() else {
            return self.db.insert_task(task, files).await.map_err(internal);
        };
        if let Some(external) = &task.external_task_id {
            let claimed = records
                .write(
                    EXTERNAL_IDS,
                    external,
                    task.id.clone().into(),
                    Expect::Absent,
                )
                .await;
            match claimed {
                Ok(_) => {}
                Err(RecordError::Conflict) => return Ok(None),
                Err(e) => return Err(refused(e)),
            }
        }
        let written = async {
            for (position, file) in files.iter().enumerate() {
                (records
                    .put_file(&file_name(&task.id, position), encode_file(file))
                    .await)
                    .map_err(refused)?;
            }
            (records
                .write(TASKS, &task.id, encode(&task), Expect::Absent)
                .await)
                .map_err(refused)
        };
        let revision = match written.await {
            Ok(revision) => revision,
            Err(status) => {
                // The task was not made: its external id is free again.
                if let Some(external) = &task.external_task_id {
                    let _ = records.remove(EXTERNAL_IDS, external).await;
                }
                return Err(status);
            }
        };
        self.apply_task(task.clone(), revision)
            .await
            .map_err(internal)?;
        self.db
            .put_task_files(&task.id, files)
            .await
            .map_err(internal)?;
        Ok(Some(task))
    }

    /// Makes `change` to task `id` — in a fleet, to the fleet's record — and tells this
    /// bridge's watchers of a change. Only a real change is written.
    pub(super) async fn update_task<F>(&self, id: &str, change: F) -> Result<Update, Status>
    where
        F: Fn(&mut TaskRow) + Send + 'static,
    {
        let Some(records) = self.core.records() else {
            let told = self.told_watchers();
            return self
                .db
                .update_task(id, change, told)
                .await
                .map_err(internal);
        };
        let changed = until_not_lost::<_, Status, _, _>(|| async {
            let Some(record) = records.read(TASKS, id).await.map_err(refused)? else {
                return Ok(Tried::Done(Update::Missing));
            };
            let Some(value) = record.value else {
                return Ok(Tried::Done(Update::Missing));
            };
            let before = decode(&value).map_err(internal)?;
            let mut after = before.clone();
            change(&mut after);
            if after == before {
                return Ok(Tried::Done(Update::Unchanged(before)));
            }
            after.updated_at = crate::core::now_ms();
            let written = records
                .write(TASKS, id, encode(&after), Expect::At(record.revision))
                .await;
            let Some(revision) = unless_lost(written).map_err(refused)? else {
                return Ok(Tried::Lost);
            };
            self.apply_task(after.clone(), revision)
                .await
                .map_err(internal)?;
            Ok(Tried::Done(Update::Changed(after)))
        })
        .await?;
        changed.ok_or_else(|| refused(RecordError::Conflict))
    }

    /// Task `id`'s files, in the order they were given: this bridge's, or the fleet's
    /// (then kept here) for a task submitted through another bridge.
    pub(super) async fn task_files(&self, id: &str) -> Result<Vec<FileRow>, Status> {
        let here = self.db.task_files(id).await.map_err(internal)?;
        let Some(records) = self.core.records() else {
            return Ok(here);
        };
        if !here.is_empty() {
            return Ok(here);
        }
        let mut files = Vec::new();
        while let Some(bytes) =
            (records.file(&file_name(id, files.len())).await).map_err(refused)?
        {
            files.push(decode_file(&bytes).map_err(internal)?);
        }
        (self.db.put_task_files(id, files.clone()).await).map_err(internal)?;
        Ok(files)
    }

    /// Keeps a revision of a fleet's task here, and tells this bridge's watchers when it
    /// is news here.
    async fn apply_task(&self, task: TaskRow, revision: u64) -> Result<(), StoreError> {
        let told = self.told_watchers();
        if self.db.apply_task(task.clone(), revision, told).await? {
            self.tasks.insert(task.id.clone());
        }
        Ok(())
    }
}

/// A change the fleet's records did not take, as gRPC says it.
fn refused(e: RecordError) -> Status {
    not_recorded("task", e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_goes_into_the_fleet_and_back() {
        let file = FileRow {
            field_name: "doc".into(),
            filename: "a\nb.txt".into(),
            mime_type: "text/plain".into(),
            data: b"line one\nline two\n".to_vec(),
        };
        assert_eq!(decode_file(&encode_file(&file)).unwrap(), file);
    }
}
