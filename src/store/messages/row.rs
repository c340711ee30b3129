//! A message's row: its journal record, written on the caller's thread (`record`), and
//! the columns read back from it where it lies in the journal's round (`Row`).

use rusqlite::Connection;

use super::super::journal::fields::{self, Fields};
use super::super::message_body;
use super::StoreError;
use crate::core::{Audience, Envelope, Kind};

/// The columns of a message's row, as `Row::values` gives them.
pub(super) const COLUMNS: &str = "id, uuid, ts, sender, kind, reply_to, correlation_id, thread, task_id, \
                       everyone, origin, body, private";
pub(super) const COLUMN_COUNT: usize = 13;

/// A message's journal record: its row's columns and its addressees, written on the
/// caller's thread. The writer reads them back where they lie in the round written to the
/// journal (`Row::decode`), rather than from owned texts built per message to carry them
/// across.
pub(in crate::store) fn record(env: &Envelope) -> Result<Vec<u8>, StoreError> {
    // The columns and addressees take well under 256 bytes for most messages.
    let mut buf = Vec::with_capacity(256 + message_body::size_hint(env));
    let mut encoded = uuid::Uuid::encode_buffer();
    fields::put_str(&mut buf, &env.id);
    let uuid = crate::core::message_uuid(&env.id)
        .hyphenated()
        .encode_lower(&mut encoded);
    // The `uuid` column: '' for an id that is its own UUID form (migration 9; rows stored
    // before hold the id again), else the UUID form.
    fields::put_str(&mut buf, if *uuid == *env.id { "" } else { uuid });
    fields::put_u64(&mut buf, env.timestamp as u64);
    fields::put_str(&mut buf, &env.from);
    fields::put_str(&mut buf, env.kind.as_str());
    fields::put_opt(&mut buf, env.reply_to.as_deref());
    fields::put_opt(&mut buf, env.correlation_id.as_deref());
    fields::put_opt(&mut buf, env.thread.as_deref());
    let task_id = env.task.as_ref().map(|t| t.id.as_str());
    fields::put_opt(&mut buf, task_id.filter(|id| !id.is_empty()));
    // Presence is broadcast too, but it is not a message *for* everyone.
    let everyone = env.audience == Audience::Everyone && !env.kind.is_presence();
    let private = env.audience == Audience::Private;
    fields::put_u64(&mut buf, u64::from(everyone) | (u64::from(private) << 1));
    fields::put_str(&mut buf, &env.origin.protocol);
    fields::put_with(&mut buf, |buf| message_body::encode(env, buf))
        .map_err(|e| StoreError::Corrupt(format!("cannot encode message: {e}")))?;
    let count = fields::put_u64_later(&mut buf);
    let mut recipients = 0;
    for name in env.addressees() {
        fields::put_str(&mut buf, name);
        recipients += 1;
    }
    fields::set_u64(&mut buf, count, recipients);
    Ok(buf)
}

/// The columns of one message, read from its journal record (`record`).
pub(in crate::store) struct Row<'r> {
    pub(super) id: Text<'r>,
    pub(super) uuid: Text<'r>,
    pub(super) ts: i64,
    pub(super) sender: Text<'r>,
    pub(super) kind: Kind,
    pub(super) reply_to: Option<Text<'r>>,
    pub(super) correlation_id: Option<Text<'r>>,
    pub(super) thread: Option<Text<'r>>,
    pub(super) task_id: Option<Text<'r>>,
    pub(super) everyone: bool,
    pub(super) private: bool,
    pub(super) origin: Text<'r>,
    pub(super) body: Text<'r>,
    /// The addressees' names, each a text field.
    pub(super) recipients: Fields<'r>,
}

/// A text of a journal record, bound as it lies there. It is not checked for UTF-8 (about
/// 700 instructions a message): `record` wrote it from a `&str`, and a record damaged on
/// disk fails its CRC before it is read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Text<'r>(pub(super) &'r [u8]);

impl rusqlite::ToSql for Text<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(ValueRef::Text(self.0)))
    }
}

/// Stored by its name (`Kind::as_str`).
impl rusqlite::ToSql for Kind {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        self.as_str().to_sql()
    }
}

impl std::fmt::Display for Text<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&String::from_utf8_lossy(self.0))
    }
}

impl<'r> Row<'r> {
    /// The row a journal record's payload holds; `None` when it is not one `record` wrote.
    pub(in crate::store) fn decode(payload: &'r [u8]) -> Option<Row<'r>> {
        let mut f = Fields(payload);
        let id = Text(f.bytes()?);
        let uuid = Text(f.bytes()?);
        let ts = f.u64()? as i64;
        let sender = Text(f.bytes()?);
        let kind = Kind::from_name(f.str()?)?;
        let mut opt = || Some(f.opt_bytes()?.map(Text));
        let (reply_to, correlation_id, thread, task_id) = (opt()?, opt()?, opt()?, opt()?);
        let flags = f.u64()?;
        let (origin, body) = (Text(f.bytes()?), Text(f.bytes()?));
        let count = f.u64()?;
        let recipients = f;
        // Every name is read once here, so that writing the row finds none amiss.
        for _ in 0..count {
            f.bytes()?;
        }
        f.is_empty().then_some(Row {
            id,
            uuid,
            ts,
            sender,
            kind,
            reply_to,
            correlation_id,
            thread,
            task_id,
            everyone: flags & 1 != 0,
            private: flags & 2 != 0,
            origin,
            body,
            recipients,
        })
    }

    pub(super) fn recipients(&self) -> impl Iterator<Item = Text<'r>> {
        let mut names = self.recipients;
        std::iter::from_fn(move || names.bytes().map(Text))
    }

    /// The row's columns, in `COLUMNS` order.
    pub(super) fn values(&self) -> [&dyn rusqlite::ToSql; COLUMN_COUNT] {
        [
            &self.id,
            &self.uuid,
            &self.ts,
            &self.sender,
            &self.kind,
            &self.reply_to,
            &self.correlation_id,
            &self.thread,
            &self.task_id,
            &self.everyone,
            &self.origin,
            &self.body,
            &self.private,
        ]
    }

    /// Replaces the stored message with this row's id (a client resending): the stored
    /// message is overwritten, with whom it names; its sequence number.
    pub(super) fn replace(&self, conn: &Connection) -> Result<i64, StoreError> {
        // Its recipients' rows are found by the names its stored body lists (`to` and
        // `mentions`, which `Envelope::addressees` draws on), before the body is
        // overwritten.
        conn.prepare_cached(
            "DELETE FROM message_recipients
             WHERE seq = (SELECT seq FROM messages WHERE id = ?1)
               AND name IN (
                   SELECT j.value FROM messages m, json_each(m.body, '$.to') j WHERE m.id = ?1
                   UNION
                   SELECT j.value FROM messages m, json_each(m.body, '$.mentions') j WHERE m.id = ?1)",
        )?
        .execute([self.id])?;
        let seq = conn
            .prepare_cached(
                "UPDATE messages SET uuid = ?2, ts = ?3, sender = ?4, kind = ?5, reply_to = ?6,
                    correlation_id = ?7, thread = ?8, task_id = ?9, everyone = ?10,
                    origin = ?11, body = ?12, private = ?13
                 WHERE id = ?1 RETURNING seq",
            )?
            .query_row(&self.values()[..], |r| r.get(0))?;
        Ok(seq)
    }
}
