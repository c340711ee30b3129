use super::row::Text;
use super::*;
use crate::core::{Audience, Envelope, Kind};
use crate::store::IN_MEMORY;

/// The database in `dir` as a build that knew migrations up to `version` left it:
/// those run and recorded, as `Store::migrate` does.
fn migrated_through(dir: &std::path::Path, version: u32) -> Connection {
    let conn = Connection::open(dir.join(crate::store::DB_FILE)).unwrap();
    conn.execute_batch(
        "CREATE TABLE schema_migrations (component TEXT NOT NULL, version INTEGER NOT NULL,
            applied_at INTEGER NOT NULL, PRIMARY KEY (component, version)) WITHOUT ROWID;",
    )
    .unwrap();
    for step in MIGRATIONS.iter().filter(|step| step.version <= version) {
        conn.execute_batch(step.sql).unwrap();
        conn.execute(
            "INSERT INTO schema_migrations VALUES ('core', ?1, 0)",
            [step.version],
        )
        .unwrap();
    }
    conn
}

fn chat(from: &str, ts: i64, mentions: &[&str]) -> Envelope {
    let mut env = Envelope::new("test", from, Kind::Chat);
    env.timestamp = ts;
    env.mentions = mentions.iter().map(|s| s.to_string()).collect();
    env
}

/// A database made by the first release (version 1 without `task_id`) is brought up
/// to date and takes task messages.
#[tokio::test]
async fn a_first_release_database_is_migrated() {
    // Released migrations are never edited; later changes are new versions.
    assert!(!MIGRATIONS[0].sql.contains("task_id") && !MIGRATIONS[0].sql.contains("private"));
    let dir = tempfile::tempdir().unwrap();
    drop(migrated_through(dir.path(), 1));
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let mut assign = Envelope::new("test", "a", Kind::TaskAssign);
    assign.task = Some(Box::new(crate::core::TaskInfo {
        id: "t-1".into(),
        ..Default::default()
    }));
    store.insert_message(&assign).await.unwrap();
    let stored = store.message(&assign.id).await.unwrap().unwrap();
    assert_eq!(stored.envelope.task.unwrap().id, "t-1");
    store.close().await;
}

/// A version-4 database (`seq` with AUTOINCREMENT) keeps its messages and their
/// recipients through the table's rebuild; numbering goes on after the last message,
/// and recipients still belong to a stored message.
#[tokio::test]
async fn messages_keep_their_numbers_and_recipients_through_the_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    let mut old = Vec::new();
    {
        let conn = migrated_through(dir.path(), 4);
        conn.execute_batch("PRAGMA foreign_keys = ON;").unwrap();
        for (ts, mentions) in [(1, ["b"]), (2, ["c"]), (3, ["b"])] {
            let mut env = chat("a", ts, &mentions);
            // Every column the rebuild copies holds something other than its default.
            if ts == 2 {
                env.id = "not-a-uuid".into();
                env.audience = Audience::Private;
                env.reply_to = Some("m0".into());
                env.correlation_id = Some("root".into());
                env.thread = Some("room".into());
                env.task = Some(Box::new(crate::core::TaskInfo {
                    id: "t-1".into(),
                    ..Default::default()
                }));
            }
            if ts == 3 {
                env.audience = Audience::Everyone;
            }
            let record = record(&env).unwrap();
            Row::decode(&record)
                .unwrap()
                .insert(&mut Batch::new(&conn, None))
                .unwrap();
            old.push(env);
        }
    }
    type Columns = (String, String, i64, String, String, Option<String>);
    let columns = |conn: &Connection| -> rusqlite::Result<Vec<Columns>> {
        conn.prepare("SELECT id, uuid, ts, sender, kind, reply_to FROM messages ORDER BY seq")?
            .query_map([], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                ))
            })?
            .collect()
    };
    let more = |conn: &Connection| -> rusqlite::Result<Vec<String>> {
        conn.prepare(
            "SELECT concat_ws('|', correlation_id, thread, everyone, origin, body, private, task_id)
             FROM messages ORDER BY seq",
        )?
        .query_map([], |r| r.get(0))?
        .collect()
    };
    let before = {
        let conn = Connection::open(dir.path().join(crate::store::DB_FILE)).unwrap();
        (columns(&conn).unwrap(), more(&conn).unwrap())
    };
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let after = store
        .read(move |conn| Ok((columns(conn)?, more(conn)?)))
        .await
        .unwrap();
    assert_eq!(after, before, "every column of every message is kept");
    let newer = chat("a", 4, &["b"]);
    store.insert_message(&newer).await.unwrap();

    let for_b = store
        .messages(MessageQuery {
            recipients: Some(vec!["b".into()]),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    let seen: Vec<(i64, &str)> = for_b
        .iter()
        .map(|m| (m.seq, m.envelope.id.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            (1, old[0].id.as_str()),
            (3, old[2].id.as_str()),
            (4, newer.id.as_str())
        ]
    );
    let (schema, indexes): (String, String) = store
        .read(|conn| {
            Ok(conn.query_row(
                "SELECT group_concat(sql, ';'),
                        (SELECT group_concat(name, ',') FROM (SELECT name FROM sqlite_schema
                          WHERE type = 'index' AND tbl_name = 'messages' AND sql IS NOT NULL
                          ORDER BY name))
                 FROM sqlite_schema WHERE name LIKE 'message%'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?)
        })
        .await
        .unwrap();
    assert_eq!(
        indexes,
        "messages_by_correlation,messages_by_reply,messages_by_task,messages_by_thread,messages_by_time,messages_by_uuid,messages_with_a_task"
    );
    assert!(
        !schema.contains("AUTOINCREMENT") && !schema.contains("_v5") && !schema.contains("_v8"),
        "{schema}"
    );
    // Version 8 built the recipients anew, without their reference.
    assert!(!schema.contains("REFERENCES"), "{schema}");
    store.close().await;
}

/// The stored messages that name `name`.
async fn addressed_to(store: &Store, name: &str) -> Vec<StoredMessage> {
    store
        .messages(MessageQuery {
            recipients: Some(vec![name.into()]),
            limit: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
}

/// With a database file, a message is acknowledged from the journal, before the
/// writer puts it in the database; every read after the acknowledgement sees it.
#[tokio::test]
async fn what_the_journal_acknowledged_is_read_back_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let sent: Vec<Envelope> = (1..=200).map(|ts| chat("a", ts, &["b"])).collect();
    let writes: Vec<_> = sent.iter().map(|env| store.insert_message(env)).collect();
    for write in writes {
        write.await.unwrap();
    }
    let last = &sent[199].id;
    assert!(store.has_message(last).await.unwrap());
    assert_eq!(
        store.message(last).await.unwrap().unwrap().envelope.id,
        *last
    );
    assert_eq!(addressed_to(&store, "b").await.len(), 200);
    store.close().await;
    let applied: i64 = Connection::open(dir.path().join(crate::store::DB_FILE))
        .unwrap()
        .query_row(APPLIED, [], |r| r.get(0))
        .unwrap();
    assert_eq!(applied, 200, "one record per message, numbered from 1");
}

/// Callers on several threads at once: whoever finds no round being written writes
/// the others' records too; every message is acknowledged, stored once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_senders_share_the_journal_s_writes() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let senders: Vec<_> = (0..8)
        .map(|sender| {
            let store = store.clone();
            tokio::spawn(async move {
                for i in 0..200 {
                    let env = chat(&format!("s{sender}"), i, &["b"]);
                    store.insert_message(&env).await.unwrap();
                }
            })
        })
        .collect();
    for sender in senders {
        sender.await.unwrap();
    }
    let all = store
        .messages(MessageQuery {
            limit: 5000,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), 1600);
    let in_order = all
        .iter()
        .filter(|m| m.envelope.from == "s3")
        .map(|m| m.envelope.timestamp)
        .collect::<Vec<_>>();
    assert_eq!(in_order, (0..200).collect::<Vec<_>>());
    store.close().await;
    let applied: i64 = Connection::open(dir.path().join(crate::store::DB_FILE))
        .unwrap()
        .query_row(APPLIED, [], |r| r.get(0))
        .unwrap();
    assert_eq!(applied, 1600);
}

/// Rounds the store's journal has taken so far.
fn journal_rounds(store: &Store) -> u64 {
    store.lock_journal().as_ref().unwrap().journal.rounds
}

/// What a task queues before it yields (a connection reading the frames its socket had
/// ready) is written in one round, by a task of the journal's own, which also takes
/// what comes while it writes.
#[tokio::test]
async fn messages_queued_in_one_turn_share_one_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let rounds = || journal_rounds(&store);
    let before = rounds();
    let envelopes: Vec<_> = (0..10).map(|i| chat("a", i, &["b"])).collect();
    let queued: Vec<_> = envelopes
        .iter()
        .map(|env| store.insert_message(env))
        .collect();
    assert_eq!(
        rounds(),
        before,
        "nothing is written before this task yields"
    );
    for written in futures_util::future::join_all(queued).await {
        written.unwrap();
    }
    assert_eq!(rounds(), before + 1);
    let all = store
        .messages(MessageQuery {
            limit: 20,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), 10);
    store.close().await;
}

/// A round whose task never runs (its runtime shut down first) is written as the task
/// is dropped: its sender hears it is stored, and the journal takes new rounds after it.
#[test]
fn a_round_whose_task_is_dropped_unrun_is_written_all_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let outer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = outer
        .block_on(Store::open(dir.path().to_str().unwrap()))
        .unwrap();
    let first = chat("a", 1, &["b"]);
    let inner = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // Queued on `inner`, whose round task is still unrun when it is dropped.
    let written = {
        let _entered = inner.enter();
        store.insert_message(&first)
    };
    drop(inner);
    outer.block_on(written).unwrap();
    outer
        .block_on(store.insert_message(&chat("a", 2, &["b"])))
        .unwrap();
    let stored = outer
        .block_on(store.messages(MessageQuery {
            limit: 10,
            ..Default::default()
        }))
        .unwrap();
    assert_eq!(stored.len(), 2);
    outer.block_on(store.close());
}

/// Closing the store writes the records still waiting for their round's task, and
/// their senders hear they are stored.
#[tokio::test]
async fn closing_writes_what_waits_for_a_round() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().to_str().unwrap();
    let store = Store::open(data_dir).await.unwrap();
    let env = chat("a", 1, &["b"]);
    // This task has not yielded: the round's task has not run.
    let written = store.insert_message(&env);
    store.close().await;
    written.await.unwrap();
    let store = Store::open(data_dir).await.unwrap();
    assert!(store.message(&env.id).await.unwrap().is_some());
    store.close().await;
}

/// While a round is being written (by `close`, beside the round's task), no second
/// round starts: two at once would append side by side and could hand their rows to
/// the writer out of order.
#[tokio::test]
async fn no_round_starts_while_another_is_being_written() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let rounds = || journal_rounds(&store);
    let before = rounds();
    store.lock_journal().as_mut().unwrap().in_flight = true;
    let written = tokio::spawn({
        let store = store.clone();
        let env = chat("a", 1, &["b"]);
        async move { store.insert_message(&env).await }
    });
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        rounds(),
        before,
        "the task left the row for the round in flight"
    );
    // That round over, the row is written when the store closes.
    store.lock_journal().as_mut().unwrap().in_flight = false;
    store.close().await;
    written.await.unwrap().unwrap();
}

/// A bridge killed after its journal acknowledged messages and before they reached the
/// database: at the next start they are put in, those the database already holds are
/// not put in again, and the journal starts anew after them.
#[tokio::test]
async fn start_up_puts_in_what_only_the_journal_holds() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().to_str().unwrap();
    let mut first = chat("a", 1, &["b"]);
    first.text = Some("as stored".into());
    let store = Store::open(data_dir).await.unwrap();
    store.insert_message(&first).await.unwrap();
    store.close().await;

    // What the killed bridge's journal held: the first message again (record 1, which
    // the database has), then two it never put in.
    let journal_dir = dir.path().join(crate::store::journal::DIR);
    for segment in crate::store::journal::segments(&journal_dir).unwrap() {
        std::fs::remove_file(segment).unwrap();
    }
    let mut again = first.clone();
    again.text = Some("rewritten".into());
    let later = [chat("a", 2, &["b"]), chat("a", 3, &["c"])];
    let mut journal = crate::store::journal::Journal::create(&journal_dir, 1).unwrap();
    for env in std::iter::once(&again).chain(&later) {
        let record = record(env).unwrap();
        journal.record(|buf| buf.extend_from_slice(&record));
    }
    journal.write().unwrap();
    drop(journal);

    let store = Store::open(data_dir).await.unwrap();
    let stored = store.message(&first.id).await.unwrap().unwrap();
    assert_eq!(stored.envelope.text.as_deref(), Some("as stored"));
    for env in &later {
        assert!(store.has_message(&env.id).await.unwrap(), "{}", env.id);
    }
    assert_eq!(addressed_to(&store, "c").await.len(), 1);
    let segments = crate::store::journal::segments(&journal_dir).unwrap();
    assert_eq!(segments.len(), 1, "{segments:?}");
    assert!(
        segments[0].ends_with("00000000000000000004.log"),
        "{segments:?}"
    );
    store.close().await;
}

/// The journal stays bounded: a closed segment goes once a checkpoint has synced its
/// records into the database (not at their commit, which a power loss could take back).
#[tokio::test]
async fn closed_segments_go_once_a_checkpoint_has_synced_them() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let journal_dir = dir.path().join(crate::store::journal::DIR);
    let filler = "x".repeat(64 * 1024);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut n = 0;
    // A segment holds 256 of these (16 MiB). Past three segments' worth, then until those
    // three are gone: the oldest left starts past them. (How many later ones are still
    // waiting for a checkpoint depends on how far the writer outruns it: a release build
    // writes fast enough that there are always several.)
    let first_record = |segment: &std::path::PathBuf| -> u64 {
        let stem = segment.file_stem().and_then(|s| s.to_str());
        stem.and_then(|s| s.parse().ok()).unwrap_or(0)
    };
    loop {
        let mut env = chat("a", n, &["b"]);
        env.text = Some(filler.clone());
        store.insert_message(&env).await.unwrap();
        n += 1;
        let segments = crate::store::journal::segments(&journal_dir).unwrap();
        if n > 800
            && segments
                .first()
                .is_some_and(|oldest| first_record(oldest) >= 768)
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "closed segments stay: {segments:?}"
        );
    }
    store.close().await;
}

/// A store in `dir` holding one message, from "a" to "b", whose stored body is damaged:
/// the message, sent again, replaces it and fails on the data.
async fn with_a_damaged_message(dir: &std::path::Path) -> (Store, Envelope) {
    let store = Store::open(dir.to_str().unwrap()).await.unwrap();
    let message = chat("a", 1, &["b"]);
    store.insert_message(&message).await.unwrap();
    let id = message.id.clone();
    store
        .write(move |conn| {
            conn.execute("UPDATE messages SET body = '{' WHERE id = ?1", [id])?;
            Ok(())
        })
        .await
        .unwrap();
    (store, message)
}

/// A journaled message the database refuses for what it holds (here: it replaces a
/// message whose stored body is damaged) is left out, and holds up none after it.
#[tokio::test]
async fn a_journaled_message_the_database_refuses_holds_up_no_other() {
    let dir = tempfile::tempdir().unwrap();
    let (store, first) = with_a_damaged_message(dir.path()).await;
    store.insert_message(&first).await.unwrap();
    let next = chat("a", 2, &["b"]);
    store.insert_message(&next).await.unwrap();
    let stored = store.message(&next.id).await.unwrap();
    assert!(stored.is_some(), "the message after it is stored");
    assert!(
        store.message(&first.id).await.is_err(),
        "the damaged row was not replaced"
    );
    store.close().await;
}

/// Queued in one turn, messages are one journal round, put in the database many to a
/// statement (`chunks`): ids repeated within the round and ids stored before replace
/// the stored message, in order, as they would one at a time.
#[tokio::test]
async fn a_round_s_repeated_ids_replace_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let mut old = chat("a", 1, &["c"]);
    old.id = "old".into();
    store.insert_message(&old).await.unwrap();
    let rounds = journal_rounds(&store);
    let mut round: Vec<_> = (0..40).map(|i| chat("a", 10 + i, &["b"])).collect();
    round[3].id = "twice".into();
    round[3].mentions = vec!["c".into()];
    // In the same statement of sixteen rows as the first.
    round[10].id = "twice".into();
    round[10].text = Some("second".into());
    round[10].mentions = vec!["d".into()];
    round[33].id = "old".into();
    round[33].text = Some("resent".into());
    let written: Vec<_> = round.iter().map(|env| store.insert_message(env)).collect();
    for outcome in futures_util::future::join_all(written).await {
        outcome.unwrap();
    }
    assert_eq!(journal_rounds(&store), rounds + 1, "one round");

    let all = store
        .messages(MessageQuery {
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), 39, "40 sent, one id twice; `old` replaced");
    let text = |id: &str| {
        let found = all.iter().find(|m| m.envelope.id == id).unwrap();
        found.envelope.text.clone()
    };
    assert_eq!(text("twice").as_deref(), Some("second"));
    assert_eq!(text("old").as_deref(), Some("resent"));
    // A replaced message keeps its number and takes its replacement's time.
    let once: Vec<_> = all
        .iter()
        .filter(|m| !["old", "twice"].contains(&m.envelope.id.as_str()))
        .collect();
    assert!(
        once.windows(2).all(|w| w[0].seq < w[1].seq),
        "numbered in the order sent"
    );
    assert_eq!(addressed_to(&store, "b").await.len(), 38, "all but `twice`");
    assert!(
        addressed_to(&store, "c").await.is_empty(),
        "`twice` and `old` no longer name c"
    );
    let for_d = addressed_to(&store, "d").await;
    assert_eq!(for_d.len(), 1);
    assert_eq!(for_d[0].envelope.id, "twice");
    store.close().await;
}

/// A row that fails among the rows of one statement is left out alone: the others of
/// its round go in, with their recipients once.
#[tokio::test]
async fn a_refused_row_among_many_holds_up_none_of_them() {
    let dir = tempfile::tempdir().unwrap();
    let (store, damaged) = with_a_damaged_message(dir.path()).await;
    let mut round: Vec<_> = (0..16).map(|i| chat("a", 10 + i, &["b"])).collect();
    round[5] = damaged.clone();
    let written: Vec<_> = round.iter().map(|env| store.insert_message(env)).collect();
    for outcome in futures_util::future::join_all(written).await {
        outcome.unwrap();
    }
    let for_b = store
        .messages(MessageQuery {
            recipients: Some(vec!["b".into()]),
            limit: 100,
            ..Default::default()
        })
        .await;
    assert!(for_b.is_err(), "the damaged row reads as damaged");
    for (at, env) in round.iter().enumerate().filter(|(at, _)| *at != 5) {
        let stored = store.message(&env.id).await.unwrap();
        assert!(stored.is_some(), "message {at} is stored");
    }
    let recipients: i64 = store
        .read(|conn| {
            Ok(conn.query_row(
                "SELECT count(*) FROM message_recipients WHERE name = 'b'",
                [],
                |r| r.get(0),
            )?)
        })
        .await
        .unwrap();
    assert_eq!(
        recipients, 16,
        "15 new messages and the damaged one, once each"
    );
    store.close().await;
}

#[test]
fn a_row_comes_back_from_its_journal_record() {
    let mut env = chat("a", 5, &["b", "c"]);
    env.reply_to = Some("m0".into());
    env.thread = Some("room".into());
    env.audience = Audience::Private;
    let mut buf = record(&env).unwrap();
    let back = Row::decode(&buf).unwrap();
    assert_eq!(back.id, Text(env.id.as_bytes()));
    assert_eq!(back.uuid, Text(b""), "the id is its own UUID form");
    assert_eq!(
        (back.ts, back.sender, back.kind),
        (5, Text(b"a"), Kind::Chat)
    );
    assert_eq!(
        (back.reply_to, back.thread),
        (Some(Text(b"m0")), Some(Text(b"room")))
    );
    assert_eq!((back.correlation_id, back.task_id), (None, None));
    assert_eq!(back.origin, Text(b"test"));
    let body: serde_json::Value = serde_json::from_slice(back.body.0).unwrap();
    assert_eq!(body["mentions"], serde_json::json!(["b", "c"]));
    assert!(back.private && !back.everyone);
    assert_eq!(
        back.recipients().collect::<Vec<_>>(),
        [Text(b"b"), Text(b"c")]
    );
    assert!(Row::decode(&buf[..buf.len() - 1]).is_none());
    buf.push(0);
    assert!(Row::decode(&buf).is_none(), "trailing bytes");
}

/// A message is found by its UUID form whether its id is one (stored with `uuid`
/// empty), is one in capitals, or is not one; and so is a message stored before
/// migration 9, its `uuid` the id again. The index holds only the derived forms, and finds
/// them in any stretch of messages (`UUID_STRETCH_BITS`).
#[tokio::test]
async fn a_message_is_found_by_its_uuid_form() {
    let dir = tempfile::tempdir().unwrap();
    let before_9 = chat("a", 1, &[]);
    {
        let conn = migrated_through(dir.path(), 8);
        // As a build before migration 9 stored it.
        let record = record(&before_9).unwrap();
        let mut row = Row::decode(&record).unwrap();
        row.uuid = row.id;
        row.insert(&mut Batch::new(&conn, None)).unwrap();
    }
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let own = chat("a", 2, &[]);
    let mut derived = chat("a", 3, &[]);
    derived.id = "msg-1".into();
    let mut capitals = chat("a", 4, &[]);
    capitals.id = crate::core::uuid_form("msg-2").to_uppercase();
    for env in [&own, &derived, &capitals] {
        store.insert_message(env).await.unwrap();
    }
    // Queued behind the journaled messages: once it is done, the database holds them.
    store.write(|_| Ok(())).await.unwrap();
    // A message as far on as the third stretch after the first.
    let mut far = chat("a", 5, &[]);
    far.id = "msg-far".into();
    store.insert_message(&far).await.unwrap();
    store
        .write(|c| {
            let moved = c.execute(
                "UPDATE messages SET seq = ?1 WHERE id = 'msg-far'",
                [3_i64 << super::UUID_STRETCH_BITS],
            )?;
            assert_eq!(moved, 1);
            Ok(())
        })
        .await
        .unwrap();
    let column = |sql: &'static str| {
        store.read(move |c| {
            let mut stmt = c.prepare(sql)?;
            let values = stmt.query_map([], |r| r.get(0))?;
            Ok(values.collect::<rusqlite::Result<Vec<String>>>()?)
        })
    };
    let form = crate::core::uuid_form;
    let stored = column("SELECT uuid FROM messages ORDER BY seq")
        .await
        .unwrap();
    let indexed = [form("msg-1"), form(&capitals.id), form("msg-far")];
    assert_eq!(
        stored[..],
        [&[before_9.id.clone(), "".into()], &indexed[..]].concat()
    );
    let in_index = column(
        "SELECT uuid FROM messages INDEXED BY messages_by_uuid
         WHERE uuid <> id AND uuid <> '' ORDER BY seq",
    );
    assert_eq!(in_index.await.unwrap(), indexed);
    for env in [&before_9, &own, &derived, &capitals, &far] {
        let found = store.message_id_by_uuid(&form(&env.id)).await.unwrap();
        assert_eq!(found.as_deref(), Some(env.id.as_str()));
    }
    let unknown = form("msg-4");
    assert_eq!(store.message_id_by_uuid(&unknown).await.unwrap(), None);
    assert_eq!(store.message_id_by_uuid("msg-1").await.unwrap(), None);
    // The stretch's width is written three times: the index, the query, the constant.
    let width = format!("seq >> {}", super::UUID_STRETCH_BITS);
    let index = migrations::MIGRATIONS
        .iter()
        .find(|m| m.version == 11)
        .unwrap();
    assert!(index.sql.contains(&width) && BY_DERIVED_UUID.contains(&width));
    let plan = store
        .read(|c| {
            let mut stmt = c.prepare(&format!("EXPLAIN QUERY PLAN {BY_DERIVED_UUID}"))?;
            let steps = stmt.query_map(rusqlite::params![0, ""], |r| r.get::<_, String>(3))?;
            Ok(steps.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
        .unwrap();
    assert!(
        plan.iter()
            .any(|step| step.contains("INDEX messages_by_uuid")),
        "{plan:?}"
    );
    store.close().await;
}

#[tokio::test]
async fn history_is_chronological_and_paginates_by_time() {
    let store = Store::open(IN_MEMORY).await.unwrap();
    for ts in 1..=5 {
        store
            .insert_message(&chat("a", ts * 10, &[]))
            .await
            .unwrap();
    }
    let page = store
        .messages(MessageQuery {
            limit: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    let times: Vec<i64> = page.iter().map(|m| m.envelope.timestamp).collect();
    assert_eq!(times, [40, 50]);
    let older = store
        .messages(MessageQuery {
            limit: 10,
            before: Some(40),
            ..Default::default()
        })
        .await
        .unwrap();
    let times: Vec<i64> = older.iter().map(|m| m.envelope.timestamp).collect();
    assert_eq!(times, [10, 20, 30]);
}

#[tokio::test]
async fn recipient_queries_include_everyone_messages() {
    let store = Store::open(IN_MEMORY).await.unwrap();
    store.insert_message(&chat("a", 1, &["b"])).await.unwrap();
    store.insert_message(&chat("a", 2, &["c"])).await.unwrap();
    let mut all = chat("a", 3, &[]);
    all.audience = Audience::Everyone;
    store.insert_message(&all).await.unwrap();
    let for_b = store
        .messages(MessageQuery {
            recipients: Some(vec!["b".into()]),
            or_everyone: true,
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    let times: Vec<i64> = for_b.iter().map(|m| m.envelope.timestamp).collect();
    assert_eq!(times, [1, 3]);
}

#[tokio::test]
async fn same_id_replaces_and_replies_are_indexed() {
    let store = Store::open(IN_MEMORY).await.unwrap();
    let mut first = chat("a", 1, &["b"]);
    first.id = "m1".into();
    first.to = vec!["d".into()];
    store.insert_message(&first).await.unwrap();
    first.text = Some("edited".into());
    first.mentions = vec!["c".into()];
    first.to.clear();
    store.insert_message(&first).await.unwrap();
    let mut reply = chat("b", 2, &[]);
    reply.reply_to = Some("m1".into());
    reply.correlation_id = Some("root".into());
    store.insert_message(&reply).await.unwrap();

    let stored = store.message("m1").await.unwrap().unwrap();
    assert_eq!(stored.envelope.text.as_deref(), Some("edited"));
    assert!(store.has_message("m1").await.unwrap());
    assert!(!store.has_message("m2").await.unwrap());
    let for_b = store
        .messages(MessageQuery {
            recipients: Some(vec!["b".into()]),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        for_b.is_empty(),
        "old recipients are replaced with the message"
    );
    for (name, count) in [("c", 1), ("d", 0)] {
        let seen = store
            .messages(MessageQuery {
                recipients: Some(vec![name.into()]),
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(seen.len(), count, "{name}");
    }
    let replies = store.replies("m1").await.unwrap();
    assert_eq!(replies.len(), 1);
    let link = store.link(&reply.id).await.unwrap().unwrap();
    assert_eq!((link.root.as_str(), link.from.as_str()), ("root", "b"));
    assert_eq!(store.link("m1").await.unwrap().unwrap().root, "m1");
}
