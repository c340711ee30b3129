use super::rounds::*;
use super::sqlite::*;
use super::writer::*;
use super::*;
use crate::core::MessageQuery;
use std::sync::atomic::Ordering;

/// An in-memory store with a table `t` of unique integers.
async fn store_with_table() -> Store {
    let store = Store::open(IN_MEMORY).await.unwrap();
    store
        .write(|c| Ok(c.execute_batch("CREATE TABLE t (v INTEGER PRIMARY KEY)")?))
        .await
        .unwrap();
    store
}

/// Keeps the writer busy until `release` is sent on, so that the writes queued
/// meanwhile go into one batch; the future finishes with the holding write.
async fn hold_writer(
    store: &Store,
) -> (
    std::sync::mpsc::Sender<()>,
    impl Future<Output = Result<(), StoreError>>,
) {
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (started, running) = oneshot::channel();
    let holding = store.write(move |_| {
        let _ = started.send(());
        let _ = held.recv();
        Ok(())
    });
    running.await.unwrap();
    (release, holding)
}

async fn rows_in_t(store: &Store) -> i64 {
    store
        .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))?))
        .await
        .unwrap()
}

/// The writes of one batch share a statement, prepared once, across savepoints and a
/// write that failed on a constraint; the batch commits whole.
#[tokio::test]
async fn a_batch_holds_each_statement_prepared_across_its_writes() {
    const INSERT: &str = "INSERT INTO t (v) VALUES (?1)";
    let store = store_with_table().await;
    let (release, holding) = hold_writer(&store).await;
    // Each write answers how many statements it had the batch prepare.
    let insert = |v: i64| {
        store.write_unguarded_in_batch(move |batch| {
            let held_before = batch.held.len();
            batch.statement(INSERT)?.execute([v])?;
            Ok(batch.held.len() - held_before)
        })
    };
    let first = insert(1);
    // A write in a savepoint of its own, between two that use the held statement.
    let guarded = store.write(|c| Ok(c.execute("INSERT INTO t (v) VALUES (10)", [])?));
    let writes = [insert(2), insert(1), insert(3)];
    release.send(()).unwrap();
    holding.await.unwrap();
    assert_eq!(first.await.unwrap(), 1);
    guarded.await.unwrap();
    let prepared: Vec<Option<usize>> = futures_util::future::join_all(writes)
        .await
        .into_iter()
        .map(Result::ok)
        .collect();
    assert_eq!(
        prepared,
        [Some(0), None, Some(0)],
        "the second 1 is a duplicate"
    );
    assert_eq!(rows_in_t(&store).await, 4);
}

/// A round can be added after the one written after it (`Store::add_unapplied`): a
/// resent id is still unapplied until the database holds both of its records.
#[test]
fn a_resent_id_is_unapplied_until_its_latest_record_is_applied() {
    let mut unapplied = Unapplied::default();
    unapplied.add("m".into(), 5);
    unapplied.add("m".into(), 3);
    unapplied.add("n".into(), 4);
    for applied in [3, 4] {
        assert!(
            unapplied.contains("m", applied),
            "applied through {applied}"
        );
    }
    assert!(unapplied.contains("n", 3) && !unapplied.contains("n", 4));
    assert!(!unapplied.contains("m", 5) && !unapplied.contains("x", 0));
}

/// Applied ids are swept out once the map has doubled since the last sweep, and never
/// an unapplied one.
#[test]
fn applied_ids_are_swept_once_the_map_has_doubled() {
    let mut unapplied = Unapplied::default();
    let floor = Unapplied::SWEPT_AT_LEAST as u64;
    let mut applied = 0;
    for number in 1..=10 * floor {
        unapplied.add(format!("m{number}").into(), number);
        // The writer keeps 100 records behind.
        applied = number.saturating_sub(100);
        unapplied.sweep_if_grown(applied);
        assert!(unapplied.by_id.len() <= 2 * Unapplied::SWEPT_AT_LEAST + 1);
    }
    for number in applied + 1..=10 * floor {
        assert!(unapplied.contains(&format!("m{number}"), applied));
    }
    assert!(!unapplied.by_id.contains_key("m1"), "swept");
}

/// With a journal a message is durable before the database has it, but no further
/// than `MAX_UNAPPLIED` messages ahead: then its sender waits for the database.
#[tokio::test]
async fn journaled_messages_wait_once_the_database_is_far_behind() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let (release, holding) = hold_writer(&store).await;
    let message = |i: usize| {
        let mut env = crate::core::Envelope::new("test", "a", crate::core::Kind::Chat);
        env.id = format!("m{i}");
        env
    };
    for i in 0..MAX_UNAPPLIED {
        store.insert_message(&message(i)).await.unwrap();
    }
    assert!(
        store.has_message("m0").await.unwrap(),
        "acknowledged, so found"
    );
    let mut over = std::pin::pin!(store.insert_message(&message(MAX_UNAPPLIED)));
    let waited = tokio::time::timeout(std::time::Duration::from_millis(50), over.as_mut()).await;
    assert!(
        waited.is_err(),
        "the writer is held: the message waits for it"
    );
    release.send(()).unwrap();
    holding.await.unwrap();
    over.await.unwrap();
    let all = store
        .messages(MessageQuery {
            limit: MAX_UNAPPLIED + 10,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), MAX_UNAPPLIED + 1);
    store.close().await;
}

/// A sender over the limit waits only until the database is back within it, not for
/// its own message; and hears `Closed` if the writer stops first.
#[tokio::test]
async fn a_sender_over_the_limit_waits_for_the_backlog_to_shrink() {
    let backlog = Backlog::default();
    backlog.start_after(10);
    use futures_util::FutureExt;
    let mut reached = Box::pin(backlog.reached(12));
    assert!((&mut reached).now_or_never().is_none());
    backlog.applied_through(11);
    assert!((&mut reached).now_or_never().is_none(), "11 is not yet 12");
    backlog.applied_through(12);
    assert!(reached.await.is_ok());

    let mut stranded = Box::pin(backlog.reached(20));
    assert!((&mut stranded).now_or_never().is_none());
    backlog.stop();
    assert!(matches!(stranded.await, Err(StoreError::Closed)));
}

#[tokio::test]
async fn a_failing_write_does_not_undo_its_batch_neighbours() {
    let store = store_with_table().await;
    let mut writes = Vec::new();
    for v in [1, 2, 1, 3] {
        let s = store.clone();
        writes.push(tokio::spawn(async move {
            s.write(move |c| Ok(c.execute("INSERT INTO t (v) VALUES (?1)", [v])?))
                .await
        }));
    }
    let results: Vec<bool> = futures_util::future::join_all(writes)
        .await
        .into_iter()
        .map(|r| r.unwrap().is_ok())
        .collect();
    assert_eq!(results.iter().filter(|ok| !**ok).count(), 1);
    assert_eq!(rows_in_t(&store).await, 3);
}

#[tokio::test]
async fn a_failing_unguarded_write_leaves_its_batch_whole() {
    let store = store_with_table().await;
    let (release, holding) = hold_writer(&store).await;
    let writes: Vec<_> = [1, 2, 1, 3]
        .into_iter()
        .map(|v| {
            store.write_unguarded(move |c| Ok(c.execute("INSERT INTO t (v) VALUES (?1)", [v])?))
        })
        .collect();
    release.send(()).unwrap();
    holding.await.unwrap();
    let results: Vec<bool> = futures_util::future::join_all(writes)
        .await
        .into_iter()
        .map(|r| r.is_ok())
        .collect();
    assert_eq!(results, [true, true, false, true]);
    assert_eq!(rows_in_t(&store).await, 3);
}

#[tokio::test]
async fn an_unguarded_write_failing_otherwise_fails_its_whole_batch() {
    let store = store_with_table().await;
    let (release, holding) = hold_writer(&store).await;
    let before = store.write(|c| Ok(c.execute("INSERT INTO t (v) VALUES (1)", [])?));
    let failing = store.write_unguarded(|c| {
        c.execute("INSERT INTO t (v) VALUES (2)", [])?;
        Err::<(), _>(StoreError::Corrupt("half done".into()))
    });
    let after = store.write(|c| Ok(c.execute("INSERT INTO t (v) VALUES (3)", [])?));
    release.send(()).unwrap();
    holding.await.unwrap();
    assert!(failing.await.is_err());
    assert!(
        before.await.is_err() && after.await.is_err(),
        "the batch failed whole"
    );
    assert_eq!(rows_in_t(&store).await, 0);
    // The store goes on.
    store
        .write(|c| Ok(c.execute("INSERT INTO t (v) VALUES (4)", [])?))
        .await
        .unwrap();
    assert_eq!(rows_in_t(&store).await, 1);
}

/// Small journal rounds are joined while both fill less than a statement's rows;
/// other jobs, full rounds and rounds after a full one stay apart.
#[test]
fn the_writer_joins_small_rounds() {
    let round = |rows: usize, last: u64| -> Box<dyn Job> {
        Box::new(JournaledRound {
            records: vec![rows as u8; rows],
            rows,
            last,
        })
    };
    let mut batch = vec![round(1, 1)];
    assert!(join_round(&mut batch, &mut *round(2, 3)));
    let joined = batch[0].as_round().unwrap();
    assert_eq!(
        (joined.records.as_slice(), joined.rows, joined.last),
        (&[1, 2, 2][..], 3, 3)
    );
    assert!(
        !join_round(&mut batch, &mut *round(messages::ROWS_PER_STATEMENT, 19)),
        "a full round is not copied"
    );
    assert!(join_round(&mut batch, &mut *round(14, 17)));
    assert_eq!(batch[0].journaled_up_to(), Some(17));
    assert!(
        !join_round(&mut batch, &mut *round(1, 18)),
        "the first is full"
    );
    let (reply, _) = tokio::sync::oneshot::channel::<Result<(), StoreError>>();
    let mut other: Box<dyn Job> = Box::new(WriteJob::new(
        |_: &mut Batch<'_>| Ok(()),
        false,
        reply,
        None,
    ));
    let mut batch = vec![round(1, 1)];
    assert!(!join_round(&mut batch, &mut *other));
    let mut batch = vec![other];
    assert!(!join_round(&mut batch, &mut *round(1, 1)));
}

#[test]
fn the_writer_keeps_up_while_its_backlog_is_short() {
    let backlog = Backlog::default();
    backlog.start_after(100);
    assert!(backlog.keeping_up());
    backlog
        .journaled
        .store(100 + KEEPING_UP as u64, Ordering::Release);
    assert!(!backlog.keeping_up());
    backlog.applied.store(101, Ordering::Release);
    assert!(backlog.keeping_up());
}

/// A new database is made with `PAGE_BYTES` pages; one made before keeps its own.
#[tokio::test]
async fn new_databases_get_large_pages_and_old_ones_keep_theirs() {
    let page_size = |store: Store| async move {
        let bytes: i64 = store
            .read(|c| Ok(c.pragma_query_value(None, "page_size", |r| r.get(0))?))
            .await
            .unwrap();
        store.close().await;
        bytes
    };
    let new = tempfile::tempdir().unwrap();
    let store = Store::open(new.path().to_str().unwrap()).await.unwrap();
    assert_eq!(page_size(store).await, i64::from(PAGE_BYTES));

    let old = tempfile::tempdir().unwrap();
    Connection::open(old.path().join(DB_FILE))
        .unwrap()
        .execute_batch("PRAGMA page_size = 4096; CREATE TABLE t (v INTEGER);")
        .unwrap();
    let store = Store::open(old.path().to_str().unwrap()).await.unwrap();
    assert_eq!(page_size(store).await, 4096);
}

#[tokio::test]
async fn migrations_run_once_and_survive_reopen() {
    static STEPS: &[Migration] = &[
        Migration {
            version: 1,
            sql: "CREATE TABLE m (v INTEGER)",
        },
        Migration {
            version: 2,
            sql: "INSERT INTO m VALUES (42)",
        },
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap().to_owned();
    for _ in 0..2 {
        let store = Store::open(&path).await.unwrap();
        store.migrate("test", STEPS).await.unwrap();
        let rows: i64 = store
            .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM m", [], |r| r.get(0))?))
            .await
            .unwrap();
        assert_eq!(rows, 1);
        store.close().await;
    }
}

/// A build that knows fewer steps than were applied (an older build on a newer
/// database) is refused rather than left to misread what it finds.
#[tokio::test]
async fn a_database_migrated_further_than_this_build_knows_is_refused() {
    static ALL: &[Migration] = &[
        Migration {
            version: 1,
            sql: "CREATE TABLE m (v INTEGER)",
        },
        Migration {
            version: 2,
            sql: "",
        },
    ];
    let store = Store::open(IN_MEMORY).await.unwrap();
    store.migrate("test", ALL).await.unwrap();
    let err = store.migrate("test", &ALL[..1]).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::TooNew {
                found: 2,
                known: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("newer agentbridge"), "{err}");
}

#[tokio::test]
async fn an_unusable_data_dir_is_named_in_the_error() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let bad = file.path().join("sub");
    let err = match Store::open(bad.to_str().unwrap()).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("opened a data dir under a file"),
    };
    assert!(err.contains(bad.to_str().unwrap()), "{err}");
}

#[tokio::test]
async fn closed_store_refuses_work() {
    let store = Store::open(IN_MEMORY).await.unwrap();
    store.close().await;
    assert!(matches!(
        store.write(|_| Ok(())).await,
        Err(StoreError::Closed)
    ));
}

#[tokio::test]
async fn a_failure_of_the_moment_is_worth_applying_again_and_a_broken_constraint_is_not() {
    use crate::core::ApplyError;
    let store = store_with_table().await;
    let insert = |v: i64| {
        store.write(move |c| {
            c.execute("INSERT INTO t (v) VALUES (?1)", [v])?;
            Ok(())
        })
    };
    insert(1).await.unwrap();
    let twice = insert(1).await.unwrap_err();
    assert!(!twice.worth_trying_again(), "{twice}");
    let full = StoreError::Sqlite(rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
        None,
    ));
    assert!(full.worth_trying_again());
    assert!(!StoreError::Corrupt("not a record".into()).worth_trying_again());
}

/// What `write_then` is told comes in the order the writes committed, once they did: a
/// write that failed tells nothing.
#[tokio::test]
async fn writes_are_told_of_their_commit_in_commit_order() {
    let store = store_with_table().await;
    let told = Arc::new(Mutex::new(Vec::new()));
    let (release, holding) = hold_writer(&store).await;
    let write = |v: i64| {
        let told = told.clone();
        store.write_then(
            move |c| Ok(c.execute("INSERT INTO t (v) VALUES (?1)", [v]).map(|_| v)?),
            move |v: &i64| told.lock().push(*v),
        )
    };
    // One batch, with a duplicate that fails in its savepoint.
    let writes: Vec<_> = [3, 1, 2, 1, 5].into_iter().map(write).collect();
    assert!(told.lock().is_empty(), "nothing is told before it commits");
    release.send(()).unwrap();
    holding.await.unwrap();
    let answered: Vec<bool> = (futures_util::future::join_all(writes).await.iter())
        .map(Result::is_ok)
        .collect();
    assert_eq!(answered, [true, true, true, false, true]);
    assert_eq!(*told.lock(), [3, 1, 2, 5]);
}
