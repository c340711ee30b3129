//! Every core migration of the message log, in order. A migration, once released, is
//! never edited: a new step is added instead.

use super::super::Migration;

pub(in crate::store) static MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sql: "
        CREATE TABLE messages (
            seq            INTEGER PRIMARY KEY AUTOINCREMENT,
            id             TEXT NOT NULL UNIQUE,
            -- The id as a UUID: itself when it is one, else its UUIDv5 (`derived_uuid`), for
            -- protocols whose ids must be UUIDs; looked up to map a reply back.
            uuid           TEXT NOT NULL,
            ts             INTEGER NOT NULL,
            sender         TEXT NOT NULL,
            kind           TEXT NOT NULL,
            reply_to       TEXT,
            correlation_id TEXT,
            thread         TEXT,
            everyone       INTEGER NOT NULL DEFAULT 0,
            origin         TEXT NOT NULL,
            body           TEXT NOT NULL
        );
        CREATE INDEX messages_by_time ON messages (ts, seq);
        CREATE INDEX messages_by_uuid ON messages (uuid);
        CREATE INDEX messages_by_reply ON messages (reply_to);
        CREATE INDEX messages_by_thread ON messages (thread, ts);
        -- Who a message names (its `to` and `mentions`), for per-recipient replay.
        CREATE TABLE message_recipients (
            name TEXT NOT NULL,
            seq  INTEGER NOT NULL REFERENCES messages (seq) ON DELETE CASCADE,
            PRIMARY KEY (name, seq)
        ) WITHOUT ROWID;
        CREATE INDEX message_recipients_by_seq ON message_recipients (seq);
    ",
    },
    Migration {
        version: 2,
        // Messages only their named recipients may see (`Audience::Private`): kept out of
        // public histories.
        sql: "ALTER TABLE messages ADD COLUMN private INTEGER NOT NULL DEFAULT 0;",
    },
    Migration {
        version: 3,
        // The task a task message is about. Most messages have no reply, thread or task,
        // and an id that is its own UUID form: indexing only the rows that have one saves
        // four b-tree inserts per message. `x = ?` lookups use these partial indexes.
        // (Version 1 is as first released; databases made by builds that had `task_id`
        // and its full index in version 1 ran an earlier form of this step, to the same
        // schema.)
        sql: "
        ALTER TABLE messages ADD COLUMN task_id TEXT;
        DROP INDEX messages_by_uuid;
        DROP INDEX messages_by_reply;
        DROP INDEX messages_by_thread;
        CREATE INDEX messages_by_uuid ON messages (uuid) WHERE uuid <> id;
        CREATE INDEX messages_by_reply ON messages (reply_to) WHERE reply_to IS NOT NULL;
        CREATE INDEX messages_by_thread ON messages (thread, ts) WHERE thread IS NOT NULL;
        CREATE INDEX messages_by_task ON messages (task_id, kind) WHERE task_id IS NOT NULL;
    ",
    },
    Migration {
        version: 4,
        // Recipients are found by name (their primary key); a message's own rows are only
        // looked for when it is replaced, by the names its stored body lists. An index by
        // `seq` cost a b-tree insert per recipient of every message. (Messages are never
        // deleted; a retention job that deletes them would want it back, for the cascade.)
        sql: "DROP INDEX IF EXISTS message_recipients_by_seq;",
    },
    Migration {
        version: 5,
        // `seq` without AUTOINCREMENT: that keyword made every insert scan and rewrite
        // `sqlite_sequence` (3 % of a relayed message's cost). Messages are never deleted,
        // so the largest rowid plus one is the same number AUTOINCREMENT gave. SQLite can
        // only drop the keyword by building the table anew. Migrations run inside a
        // transaction, where foreign keys cannot be switched off, so the recipients (whose
        // rows would cascade away with the old table) are moved to a new table first, and
        // each table is renamed into place (a rename carries the reference along).
        sql: "
        CREATE TABLE messages_v5 (
            seq            INTEGER PRIMARY KEY,
            id             TEXT NOT NULL UNIQUE,
            uuid           TEXT NOT NULL,
            ts             INTEGER NOT NULL,
            sender         TEXT NOT NULL,
            kind           TEXT NOT NULL,
            reply_to       TEXT,
            correlation_id TEXT,
            thread         TEXT,
            everyone       INTEGER NOT NULL DEFAULT 0,
            origin         TEXT NOT NULL,
            body           TEXT NOT NULL,
            private        INTEGER NOT NULL DEFAULT 0,
            task_id        TEXT
        );
        INSERT INTO messages_v5 (seq, id, uuid, ts, sender, kind, reply_to, correlation_id,
                thread, everyone, origin, body, private, task_id)
            SELECT seq, id, uuid, ts, sender, kind, reply_to, correlation_id,
                thread, everyone, origin, body, private, task_id
            FROM messages;
        CREATE TABLE message_recipients_v5 (
            name TEXT NOT NULL,
            seq  INTEGER NOT NULL REFERENCES messages_v5 (seq) ON DELETE CASCADE,
            PRIMARY KEY (name, seq)
        ) WITHOUT ROWID;
        INSERT INTO message_recipients_v5 (name, seq) SELECT name, seq FROM message_recipients;
        DROP TABLE message_recipients;
        DROP TABLE messages;
        ALTER TABLE messages_v5 RENAME TO messages;
        ALTER TABLE message_recipients_v5 RENAME TO message_recipients;
        CREATE INDEX messages_by_time ON messages (ts, seq);
        CREATE INDEX messages_by_uuid ON messages (uuid) WHERE uuid <> id;
        CREATE INDEX messages_by_reply ON messages (reply_to) WHERE reply_to IS NOT NULL;
        CREATE INDEX messages_by_thread ON messages (thread, ts) WHERE thread IS NOT NULL;
        CREATE INDEX messages_by_task ON messages (task_id, kind) WHERE task_id IS NOT NULL;
        DELETE FROM sqlite_sequence WHERE name = 'messages';
    ",
    },
    Migration {
        version: 6,
        // No schema change: bodies stop repeating what the row has columns for
        // (message_body.rs). Builds from now on refuse a database migrated further than
        // they know (`Store::migrate`); the ones before this version would read such
        // bodies as corrupt.
        sql: "",
    },
    Migration {
        version: 7,
        // The last journal record the database holds (journal.rs): start-up puts in the
        // ones after it.
        sql: "
        CREATE TABLE journal (applied INTEGER NOT NULL);
        INSERT INTO journal (applied) VALUES (0);
    ",
    },
    Migration {
        version: 8,
        // Recipients without a foreign key: checking it looked up the message of every
        // recipient row inserted (1.6k of the 27.8k instructions the schema costs a
        // message). The writer inserts a message's recipients right after the message,
        // with the `seq` that insert gave, and messages are never deleted, so the check
        // never found anything and the cascade never ran. (A retention job that deletes
        // messages must delete their recipients itself, and would want migration 4's index
        // by `seq` back.) SQLite drops a reference only by building the table anew.
        sql: "
        CREATE TABLE message_recipients_v8 (
            name TEXT NOT NULL,
            seq  INTEGER NOT NULL,
            PRIMARY KEY (name, seq)
        ) WITHOUT ROWID;
        INSERT INTO message_recipients_v8 (name, seq) SELECT name, seq FROM message_recipients;
        DROP TABLE message_recipients;
        ALTER TABLE message_recipients_v8 RENAME TO message_recipients;
    ",
    },
    Migration {
        version: 9,
        // `uuid` is '' when the id is its own UUID form, as the bridge's and most clients'
        // ids are: the column repeated 36 bytes of every row (6 % of a relayed chat's row,
        // all of it written to the log and again to the database). Rows stored before keep
        // `uuid = id`; the index leaves out both kinds, and holds only derived UUIDs.
        sql: "
        DROP INDEX messages_by_uuid;
        CREATE INDEX messages_by_uuid ON messages (uuid) WHERE uuid <> id AND uuid <> '';
    ",
    },
    Migration {
        version: 10,
        // A conversation's messages, for `agentbridge trace` and the console; only the
        // messages that belong to one (a reply, or a request's follow-ups) are in it.
        sql: "CREATE INDEX messages_by_correlation ON messages (correlation_id)
              WHERE correlation_id IS NOT NULL;",
    },
    Migration {
        version: 11,
        // Derived UUIDs indexed by the stretch of 16,384 messages theirs falls in (`seq >>
        // 14`, `UUID_STRETCH_BITS`), then by UUID. A derived UUID is random: indexed by
        // itself, each went to a page anywhere in the index, so a round of writes made
        // dirty, and the commit and the checkpoint wrote, nearly every page of it (6 KB a
        // message more than a message whose id is a UUID, and growing with the log). Now a
        // round's entries go to the pages of one stretch.
        sql: "
        DROP INDEX messages_by_uuid;
        CREATE INDEX messages_by_uuid ON messages (seq >> 14, uuid) WHERE uuid <> id AND uuid <> '';
    ",
    },
    Migration {
        version: 12,
        // What an endpoint's hub applied (`Store::mark_applied`), so that after a restart it
        // applies what it had been routed and had not (`Store::unapplied_tasks`), and the
        // message it last caught up to (`applied_floor`). Task messages by order stored,
        // indexed only where a message has a task.
        sql: "
        CREATE TABLE applied_marks (
            consumer TEXT NOT NULL,
            id       TEXT NOT NULL,
            at       INTEGER NOT NULL,
            PRIMARY KEY (consumer, id)
        ) WITHOUT ROWID;
        CREATE INDEX applied_marks_by_time ON applied_marks (consumer, at);
        CREATE TABLE applied_floor (
            consumer TEXT PRIMARY KEY,
            seq      INTEGER NOT NULL
        ) WITHOUT ROWID;
        CREATE INDEX messages_with_a_task ON messages (seq) WHERE task_id IS NOT NULL;
    ",
    },
    Migration {
        version: 13,
        // A bridge alone's messages not yet done with (`store::redelivery`): those whose ids
        // `undelivered` holds, and every message after `undelivered_after`, are routed again to
        // the recipients that hold as the bridge starts. From the first start on: what was
        // stored before cannot be told done with or not.
        sql: "
        CREATE TABLE undelivered (id TEXT PRIMARY KEY) WITHOUT ROWID;
        CREATE TABLE undelivered_after (seq INTEGER NOT NULL);
        INSERT INTO undelivered_after (seq) SELECT COALESCE(MAX(seq), 0) FROM messages;
    ",
    },
    Migration {
        version: 14,
        // In a fleet, where the stream of messages is to be read again from for what the
        // bridge acknowledged before it was written (`LeftUndelivered::unwritten_from`),
        // kept with the ids: the heartbeat that carries it is deleted as the bridge stops.
        sql: "
        ALTER TABLE undelivered_after ADD COLUMN unwritten_from INTEGER;
    ",
    },
    Migration {
        version: 15,
        // With each id, the agents whose recipients had not been written it or kept it as
        // mail, as a JSON array (`HoldersOf::holders`): it is routed again to those only. NULL
        // where the bridge could not tell, routed again to every recipient that holds.
        sql: "
        ALTER TABLE undelivered ADD COLUMN holders TEXT;
    ",
    },
];
