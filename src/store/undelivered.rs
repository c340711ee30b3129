//! The tables in which a bridge keeps the messages it had not done with
//! (`store::redelivery`): `undelivered`, each pending id with the agents it is pending for,
//! and `undelivered_after`, the newest message stored as they were kept and where a fleet's
//! stream is to be read again from.
//!
//! A keeping writes only the rows that changed since the last one this run committed
//! (`UndeliveredRows`): a slow reader holding thousands of messages keeps them pending for
//! as long, and rewriting every row each time would be work on the writer's thread, which
//! every stored message waits for, in proportion to the backlog rather than to what moved.

use foldhash::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::messages::{STORED, decodable};
use super::{Store, StoreError};
use crate::core::{LeftUndelivered, StoredMessage};

/// The pending messages as kept: each id, with the agents it is pending for (`None`: every
/// recipient that holds).
pub(crate) type PendingRows = HashMap<String, Option<Arc<[String]>>>;

/// The `undelivered` table as this run's last committed keeping left it, so that the next
/// writes only what changed. Used on the writer's thread only.
#[derive(Clone, Default)]
pub(crate) struct UndeliveredRows(Arc<Mutex<Rows>>);

#[derive(Default)]
struct Rows {
    rows: PendingRows,
    /// Whether `rows` is what the table holds: not before this run's first keeping
    /// committed (the table holds the last run's), nor from a keeping's write until its
    /// batch committed (a batch that fails undoes it).
    committed: bool,
}

impl Store {
    /// A bridge alone starts: the newest message stored before it accepts any, where what
    /// it routes again ends. When nothing was kept (it ran in a fleet, which reads that
    /// from its stream instead), a later start routes again what is stored after it.
    pub(super) fn start_redelivery(
        &self,
    ) -> impl Future<Output = Result<i64, StoreError>> + Send + 'static {
        // On the writer's thread, after every message `open` put in from the journal.
        self.write(|conn| {
            let newest: i64 =
                conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM messages", [], |r| {
                    r.get(0)
                })?;
            conn.execute(
                "INSERT INTO undelivered_after (seq) SELECT ?1
                 WHERE NOT EXISTS (SELECT 1 FROM undelivered_after)",
                [newest],
            )?;
            Ok(newest)
        })
    }

    /// What the last run kept of the messages it had not done with (`keep_undelivered`).
    pub(super) fn left_undelivered(
        &self,
    ) -> impl Future<Output = Result<LeftUndelivered, StoreError>> + Send + 'static {
        // On the writer's thread, after every message `open` put in from the journal.
        self.write(|conn| {
            let mut ids = conn.prepare("SELECT id, holders FROM undelivered")?;
            let pending = ids.query_map([], |r| {
                let (id, holders): (String, Option<String>) = (r.get(0)?, r.get(1)?);
                // Unreadable, it is pending for every recipient that holds.
                let named = holders.and_then(|named| {
                    serde_json::from_str::<Vec<String>>(&named)
                        .inspect_err(|e| tracing::warn!(error = %e, message_id = %id, "store: unreadable agents a message was pending for"))
                        .ok()
                });
                Ok((id, named.map(Arc::from)))
            });
            let pending = pending?.collect::<Result<_, _>>()?;
            let (kept_through, unwritten_from): (Option<i64>, Option<i64>) = conn.query_row(
                "SELECT MAX(seq), MIN(unwritten_from) FROM undelivered_after",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            let unwritten_from = unwritten_from.and_then(|from| u64::try_from(from).ok());
            Ok(LeftUndelivered::new(pending, kept_through).with_unwritten_from(unwritten_from))
        })
    }

    /// Keeps the ids `pending` gives, each with the agents it is pending for where known,
    /// read on the writer's thread as the write runs, and the newest message the database
    /// then holds, or `through` if older: every message it holds up to that one that is
    /// not done with is among them, since a message is pending from before its append.
    /// Writes what changed since what `rows` last committed, or every row when that is
    /// less (or not known).
    pub(crate) fn keep_undelivered(
        &self,
        rows: &UndeliveredRows,
        pending: impl FnOnce() -> PendingRows + Send + 'static,
        through: i64,
        unwritten_from: Option<u64>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        let unwritten_from = unwritten_from.and_then(|from| i64::try_from(from).ok());
        let (written, committed) = (rows.clone(), rows.clone());
        let keep = move |conn: &rusqlite::Connection| {
            let mut kept = written.0.lock();
            let now = pending();
            // The rows gone and those new or pending for other agents, unless writing every
            // row is less (most of a short list, under load and prompt readers, is new).
            let changes = (kept.committed)
                .then(|| {
                    let gone: Vec<&String> = (kept.rows.keys())
                        .filter(|id| !now.contains_key(*id))
                        .collect();
                    let changed: Vec<(&String, &Option<Arc<[String]>>)> = (now.iter())
                        .filter(|(id, named)| kept.rows.get(*id) != Some(named))
                        .collect();
                    (gone, changed)
                })
                .filter(|(gone, changed)| gone.len() + changed.len() <= now.len());
            let mut put = conn.prepare_cached(
                "INSERT OR REPLACE INTO undelivered (id, holders) VALUES (?1, ?2)",
            )?;
            let mut put = |id: &String, named: &Option<Arc<[String]>>| {
                let holders = named
                    .as_ref()
                    .and_then(|n| serde_json::to_string(&**n).ok());
                put.execute(rusqlite::params![id, holders]).map(drop)
            };
            match changes {
                Some((gone, changed)) => {
                    let mut delete =
                        conn.prepare_cached("DELETE FROM undelivered WHERE id = ?1")?;
                    for id in gone {
                        delete.execute([id])?;
                    }
                    for (id, named) in changed {
                        put(id, named)?;
                    }
                }
                None => {
                    conn.execute("DELETE FROM undelivered", [])?;
                    for (id, named) in &now {
                        put(id, named)?;
                    }
                }
            }
            conn.execute("DELETE FROM undelivered_after", [])?;
            conn.execute(
                "INSERT INTO undelivered_after (seq, unwritten_from)
                 SELECT MIN(COALESCE(MAX(seq), 0), ?1), ?2 FROM messages",
                rusqlite::params![through, unwritten_from],
            )?;
            // Known again once its batch commits.
            *kept = Rows {
                rows: now,
                committed: false,
            };
            Ok(())
        };
        self.write_then(keep, move |_| {
            (committed.0.lock()).committed = true;
        })
    }

    /// The first `page` messages after `after`, up to `through`, that were kept pending or
    /// stored after the newest message kept with them, in the order stored.
    pub async fn undelivered(
        &self,
        after: i64,
        through: i64,
        page: usize,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        self.read_messages(move |conn| {
            let sql = format!(
                "SELECT {STORED} FROM messages m WHERE m.seq IN (
                     SELECT seq FROM messages
                     WHERE id IN (SELECT id FROM undelivered) AND seq > ?1 AND seq <= ?2
                     UNION
                     SELECT seq FROM messages
                     WHERE seq > MAX(?1, (SELECT COALESCE(MAX(seq), 9223372036854775807)
                                          FROM undelivered_after))
                       AND seq <= ?2
                     ORDER BY seq LIMIT ?3)
                 ORDER BY m.seq"
            );
            let mut statement = conn.prepare_cached(&sql)?;
            let arguments = rusqlite::params![after, through, page as i64];
            decodable(&mut statement, arguments)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::UndeliveredRows;
    use crate::store::{IN_MEMORY, Store};

    type Pending<'a> = &'a [(&'a str, Option<&'a [&'a str]>)];

    async fn keep(store: &Store, rows: &UndeliveredRows, pending: Pending<'_>) {
        let pending: super::PendingRows = (owned(pending).into_iter())
            .map(|(id, named)| (id, named.map(Arc::from)))
            .collect();
        (store.keep_undelivered(rows, move || pending, i64::MAX, None))
            .await
            .unwrap();
    }

    async fn kept(store: &Store) -> Vec<(String, Option<Vec<String>>)> {
        let left = store.left_undelivered().await.unwrap();
        let mut kept: Vec<_> = (left.pending.iter())
            .map(|(id, named)| (id.clone(), named.as_ref().map(|n| n.to_vec())))
            .collect();
        kept.sort();
        kept
    }

    fn owned(pending: Pending<'_>) -> Vec<(String, Option<Vec<String>>)> {
        (pending.iter())
            .map(|(id, named)| {
                let named = named.map(|n| n.iter().map(|a| a.to_string()).collect());
                (id.to_string(), named)
            })
            .collect()
    }

    /// After each keeping the table holds just what it gave, whether it wrote the rows that
    /// changed or all of them: ids added, gone, and pending for other agents; and a new
    /// run's first keeping writes over every row of the last run's.
    #[tokio::test]
    async fn the_table_holds_what_each_keeping_gave() {
        let store = Store::open(IN_MEMORY).await.unwrap();
        let last_run = UndeliveredRows::default();
        keep(&store, &last_run, &[("m0", None), ("m1", Some(&["ann"]))]).await;
        let rows = UndeliveredRows::default();
        let keepings: [Pending; 5] = [
            &[("m1", Some(&["bob"])), ("m2", None)],
            &[
                ("m1", Some(&["bob"])),
                ("m2", Some(&["ann", "bob"])),
                ("m3", None),
            ],
            &[
                ("m1", Some(&["bob"])),
                ("m2", Some(&["ann", "bob"])),
                ("m4", None),
            ],
            &[("m4", Some(&["cy"]))],
            &[],
        ];
        for pending in keepings {
            keep(&store, &rows, pending).await;
            assert_eq!(kept(&store).await, owned(pending));
        }
    }

    /// Keepings queued together, which may run in one batch, leave the table as the last
    /// gave it, and the next keeping writes what changed from there.
    #[tokio::test]
    async fn keepings_queued_together_leave_the_last_ones_rows() {
        let (store, rows) = (
            Store::open(IN_MEMORY).await.unwrap(),
            UndeliveredRows::default(),
        );
        keep(&store, &rows, &[("m0", None), ("m1", None)]).await;
        let second: Pending = &[("m1", Some(&["ann"])), ("m2", None)];
        let third: Pending = &[("m1", None), ("m3", None), ("m4", None)];
        tokio::join!(keep(&store, &rows, second), keep(&store, &rows, third));
        assert_eq!(kept(&store).await, owned(third));
        let fourth: Pending = &[("m1", None), ("m3", None), ("m4", Some(&["bob"]))];
        keep(&store, &rows, fourth).await;
        assert_eq!(kept(&store).await, owned(fourth));
    }
}
