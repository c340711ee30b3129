//! What an endpoint's hub applied, marked by message id: a bridge stopped or killed while
//! its hub was behind the messages it accepted applies the rest when it starts again, and
//! nothing twice (`core::MessageLog::unapplied_tasks`).

use super::messages::{STORED, decode, stored};
use super::{Store, StoreError};
use crate::core::Unapplied;

impl Store {
    /// Marks message `id` applied by `consumer`, queued at the call. With `prune`, only its
    /// newest `keep` marks are kept.
    pub fn mark_applied(
        &self,
        consumer: &'static str,
        id: &str,
        prune: Option<usize>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        let id = id.to_owned();
        self.write(move |conn| {
            conn.prepare_cached(
                "INSERT OR IGNORE INTO applied_marks (consumer, id, at) VALUES (?1, ?2, ?3)",
            )?
            .execute(rusqlite::params![consumer, id, crate::core::now_ms()])?;
            if let Some(keep) = prune {
                conn.prepare_cached(
                    "DELETE FROM applied_marks WHERE consumer = ?1 AND at < (
                        SELECT at FROM applied_marks WHERE consumer = ?1
                        ORDER BY at DESC LIMIT 1 OFFSET ?2)",
                )?
                // The `keep`th newest mark's time; marks made in the same millisecond stay.
                .execute(rusqlite::params![consumer, keep.saturating_sub(1) as i64])?;
            }
            Ok(())
        })
    }

    /// Of the newest `limit` task messages stored after `consumer` last caught up, those it
    /// has not marked applied, in the order stored; and the newest message stored.
    pub async fn unapplied_tasks(
        &self,
        consumer: &'static str,
        limit: usize,
    ) -> Result<Unapplied, StoreError> {
        self.read_messages(move |conn| {
            let floor: i64 = conn.query_row(
                "SELECT COALESCE(
                    (SELECT seq FROM applied_floor WHERE consumer = ?1),
                    (SELECT seq FROM applied_floor WHERE consumer = ''),
                    0)",
                [consumer],
                |r| r.get(0),
            )?;
            let through: i64 =
                conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM messages", [], |r| {
                    r.get(0)
                })?;
            let sql = format!(
                "SELECT {STORED} FROM messages m
                 WHERE m.seq IN (SELECT seq FROM messages
                                 WHERE task_id IS NOT NULL AND seq > ?1
                                 ORDER BY seq DESC LIMIT ?3)
                   AND NOT EXISTS (SELECT 1 FROM applied_marks a
                                   WHERE a.consumer = ?2 AND a.id = m.id)
                 ORDER BY m.seq"
            );
            let mut statement = conn.prepare_cached(&sql)?;
            let rows =
                statement.query_map(rusqlite::params![floor, consumer, limit as i64], stored)?;
            let mut messages = Vec::new();
            for row in rows {
                match decode(row?) {
                    Ok(message) => messages.push(message),
                    Err(e) => tracing::error!(error = %e, "a stored message cannot be decoded"),
                }
            }
            Ok(Unapplied { messages, through })
        })
        .await
    }

    /// `consumer` applied, or passed over, every message up to `through`: its next catch-up
    /// starts after it, and its marks so far are of no more use.
    pub fn caught_up(
        &self,
        consumer: &'static str,
        through: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        self.write(move |conn| {
            conn.prepare_cached(
                "INSERT INTO applied_floor (consumer, seq) VALUES (?1, ?2)
                 ON CONFLICT (consumer) DO UPDATE SET seq = MAX(seq, excluded.seq)",
            )?
            .execute(rusqlite::params![consumer, through])?;
            conn.prepare_cached("DELETE FROM applied_marks WHERE consumer = ?1")?
                .execute([consumer])?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::core::{Envelope, Kind, TaskInfo};
    use crate::store::{IN_MEMORY, Store};

    fn task_message(id: &str) -> Envelope {
        let mut env = Envelope::new("test", "a", Kind::TaskUpdate);
        env.id = id.to_owned();
        env.task = Some(Box::new(TaskInfo {
            id: "t1".into(),
            ..Default::default()
        }));
        env
    }

    async fn unapplied(store: &Store, consumer: &'static str) -> Vec<String> {
        let unapplied = store.unapplied_tasks(consumer, 100).await.unwrap();
        (unapplied.messages.into_iter())
            .map(|m| m.envelope.id)
            .collect()
    }

    /// A consumer is given back the task messages it did not mark, in the order stored,
    /// and none from before it last caught up; chats are not task messages.
    #[tokio::test]
    async fn a_consumer_gets_back_the_task_messages_it_did_not_mark() {
        let store = Store::open(IN_MEMORY).await.unwrap();
        for id in ["m1", "m2", "m3"] {
            store.insert_message(&task_message(id)).await.unwrap();
        }
        store
            .insert_message(&Envelope::new("test", "a", Kind::Chat))
            .await
            .unwrap();
        store.mark_applied("hub", "m2", None).await.unwrap();
        assert_eq!(unapplied(&store, "hub").await, ["m1", "m3"]);
        assert_eq!(unapplied(&store, "other").await, ["m1", "m2", "m3"]);

        let through = store.unapplied_tasks("hub", 100).await.unwrap().through;
        store.caught_up("hub", through).await.unwrap();
        assert!(unapplied(&store, "hub").await.is_empty());
        store.insert_message(&task_message("m4")).await.unwrap();
        assert_eq!(unapplied(&store, "hub").await, ["m4"]);
        store.mark_applied("hub", "m4", None).await.unwrap();
        assert!(unapplied(&store, "hub").await.is_empty());
    }

    /// Pruned, a consumer keeps its newest marks.
    #[tokio::test]
    async fn pruning_keeps_the_newest_marks() {
        let store = Store::open(IN_MEMORY).await.unwrap();
        for id in ["m1", "m2", "m3", "m4"] {
            store.insert_message(&task_message(id)).await.unwrap();
            store.mark_applied("hub", id, None).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        store.mark_applied("hub", "m4", Some(2)).await.unwrap();
        assert_eq!(unapplied(&store, "hub").await, ["m1", "m2"]);
    }
}
