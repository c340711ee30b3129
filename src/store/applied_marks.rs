//! What an endpoint's hub applied, marked by message id (`core::AppliedMarks`): a bridge
//! stopped or killed while its hub was behind the messages it accepted applies the rest
//! when it starts again. A message whose mark the kill lost (it is queued after the
//! apply, not awaited) is applied twice.

use rusqlite::OptionalExtension;

use super::messages::{STORED, decodable};
use super::{Store, StoreError};
use crate::core::{CatchUp, StoredMessage};

impl Store {
    /// Marks message `id` applied by `consumer`, queued at the call. With `prune`, only its
    /// newest that many marks are kept.
    pub fn mark_applied(
        &self,
        consumer: &'static str,
        id: &str,
        prune: Option<usize>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        let id = id.to_owned();
        // Unguarded: only the insert can fail on its data, and it ignores a conflict.
        self.write_unguarded(move |conn| {
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

    /// Where `consumer` catches up: after the message it last caught up to, or the
    /// `at_most`th newest task message if that is later, through the newest message now.
    /// A consumer that never caught up has nothing to catch up on: it cannot tell what it
    /// applied before it kept marks.
    pub async fn catch_up_window(
        &self,
        consumer: &'static str,
        at_most: usize,
    ) -> Result<CatchUp, StoreError> {
        self.read_messages(move |conn| {
            let through: i64 =
                conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM messages", [], |r| {
                    r.get(0)
                })?;
            let floor: Option<i64> = conn
                .query_row(
                    "SELECT seq FROM applied_floor WHERE consumer = ?1",
                    [consumer],
                    |r| r.get(0),
                )
                .optional()?;
            let oldest: i64 = conn.query_row(
                "SELECT COALESCE(MIN(seq), 1) - 1 FROM (SELECT seq FROM messages
                 WHERE task_id IS NOT NULL ORDER BY seq DESC LIMIT ?1)",
                [at_most as i64],
                |r| r.get(0),
            )?;
            let after = floor.map_or(through, |floor| floor.max(oldest));
            Ok(CatchUp { after, through })
        })
        .await
    }

    /// The first `page` task messages of `window` that `consumer` has not marked applied,
    /// in the order stored.
    pub async fn unapplied_tasks(
        &self,
        consumer: &'static str,
        window: CatchUp,
        page: usize,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        self.read_messages(move |conn| {
            let sql = format!(
                "SELECT {STORED} FROM messages m INDEXED BY messages_with_a_task
                 WHERE m.task_id IS NOT NULL AND m.seq > ?1 AND m.seq <= ?2
                   AND NOT EXISTS (SELECT 1 FROM applied_marks a
                                   WHERE a.consumer = ?3 AND a.id = m.id)
                 ORDER BY m.seq LIMIT ?4"
            );
            let mut statement = conn.prepare_cached(&sql)?;
            let arguments = rusqlite::params![window.after, window.through, consumer, page as i64];
            decodable(&mut statement, arguments)
        })
        .await
    }

    /// `consumer` applied, or passed over, every message up to `through`: its next catch-up
    /// starts after it, and its marks so far go. The ids they marked.
    pub fn caught_up(
        &self,
        consumer: &'static str,
        through: i64,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send + 'static {
        self.write(move |conn| {
            conn.prepare_cached(
                "INSERT INTO applied_floor (consumer, seq) VALUES (?1, ?2)
                 ON CONFLICT (consumer) DO UPDATE SET seq = MAX(seq, excluded.seq)",
            )?
            .execute(rusqlite::params![consumer, through])?;
            let mut deleted =
                conn.prepare_cached("DELETE FROM applied_marks WHERE consumer = ?1 RETURNING id")?;
            let ids = deleted.query_map([consumer], |r| r.get(0))?;
            Ok(ids.collect::<Result<_, _>>()?)
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

    async fn unapplied(store: &Store, consumer: &'static str, at_most: usize) -> Vec<String> {
        let mut window = store.catch_up_window(consumer, at_most).await.unwrap();
        let mut ids = Vec::new();
        loop {
            let page = store.unapplied_tasks(consumer, window, 2).await.unwrap();
            let Some(last) = page.last() else { break };
            window.after = last.seq;
            ids.extend(page.into_iter().map(|m| m.envelope.id));
        }
        ids
    }

    async fn caught_up(store: &Store, consumer: &'static str) {
        let window = store.catch_up_window(consumer, 100).await.unwrap();
        store.caught_up(consumer, window.through).await.unwrap();
    }

    /// Caught up, a consumer hears which messages it had marked.
    #[tokio::test]
    async fn catching_up_gives_back_the_marked_ids() {
        let store = Store::open(IN_MEMORY).await.unwrap();
        store.mark_applied("hub", "m1", None).await.unwrap();
        store.mark_applied("other", "m2", None).await.unwrap();
        assert_eq!(store.caught_up("hub", 0).await.unwrap(), ["m1"]);
        assert!(store.caught_up("hub", 0).await.unwrap().is_empty());
    }

    /// A consumer that never caught up has nothing to catch up on; after that, it is given
    /// back, page by page and in the order stored, the task messages it did not mark, the
    /// newest `at_most` at most. Chats are not task messages.
    #[tokio::test]
    async fn a_consumer_gets_back_the_task_messages_it_did_not_mark() {
        let store = Store::open(IN_MEMORY).await.unwrap();
        store.insert_message(&task_message("m0")).await.unwrap();
        assert!(unapplied(&store, "hub", 100).await.is_empty());
        caught_up(&store, "hub").await;
        for id in ["m1", "m2", "m3", "m4", "m5"] {
            store.insert_message(&task_message(id)).await.unwrap();
        }
        let chat = Envelope::new("test", "a", Kind::Chat);
        store.insert_message(&chat).await.unwrap();
        store.mark_applied("hub", "m2", None).await.unwrap();
        assert_eq!(
            unapplied(&store, "hub", 100).await,
            ["m1", "m3", "m4", "m5"]
        );
        assert_eq!(unapplied(&store, "hub", 3).await, ["m3", "m4", "m5"]);
        assert!(unapplied(&store, "other", 100).await.is_empty());

        caught_up(&store, "hub").await;
        assert!(unapplied(&store, "hub", 100).await.is_empty());
        store.insert_message(&task_message("m6")).await.unwrap();
        assert_eq!(unapplied(&store, "hub", 100).await, ["m6"]);
        store.mark_applied("hub", "m6", None).await.unwrap();
        assert!(unapplied(&store, "hub", 100).await.is_empty());
    }

    /// Pruned, a consumer keeps its newest marks.
    #[tokio::test]
    async fn pruning_keeps_the_newest_marks() {
        let store = Store::open(IN_MEMORY).await.unwrap();
        caught_up(&store, "hub").await;
        for id in ["m1", "m2", "m3", "m4"] {
            store.insert_message(&task_message(id)).await.unwrap();
            store.mark_applied("hub", id, None).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        store.mark_applied("hub", "m4", Some(2)).await.unwrap();
        assert_eq!(unapplied(&store, "hub", 100).await, ["m1", "m2"]);
    }
}
