//! A stored message's `body` column: its envelope without the fields the row keeps in
//! columns of their own.
//!
//! The id, sender, time, reply link, correlation id, thread and origin protocol are
//! columns, for the queries that filter on them; written into the JSON again they were a
//! sixth of every row and of the work of encoding it. Reading a message back takes them
//! from the columns. Bodies written by earlier versions hold the whole envelope: the same
//! values, passed over.

use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::core::{Attachment, Audience, Envelope, Kind, Origin, Priority, TaskInfo};
use crate::shared::json_writer::ObjectWriter;

/// What a message's row holds in columns of its own, read back with its body.
pub(super) struct Columns {
    pub id: String,
    pub ts: i64,
    pub sender: String,
    pub reply_to: Option<String>,
    pub correlation_id: Option<String>,
    pub thread: Option<String>,
    pub origin: String,
}

impl Columns {
    /// The columns from `row`, starting at column `first`: `id, ts, sender, reply_to,
    /// correlation_id, thread, origin`, in that order.
    pub fn read(row: &rusqlite::Row<'_>, first: usize) -> rusqlite::Result<Columns> {
        Ok(Columns {
            id: row.get(first)?,
            ts: row.get(first + 1)?,
            sender: row.get(first + 2)?,
            reply_to: row.get(first + 3)?,
            correlation_id: row.get(first + 4)?,
            thread: row.get(first + 5)?,
            origin: row.get(first + 6)?,
        })
    }
}

/// About how many bytes `encode` appends for `env`: its text and origin frame, and room for
/// the rest. The caller sizes the buffer with it, so that the text is not copied again as
/// the buffer grows (three times for a short chat).
pub(super) fn size_hint(env: &Envelope) -> usize {
    256 + env.bulk_len()
}

/// Appends the body to store for `env` to `body` (sized with `size_hint`).
pub(super) fn encode(env: &Envelope, body: &mut Vec<u8>) -> serde_json::Result<()> {
    // Every field is named, so that one added to `Envelope` does not build until it is
    // stored, in the body or in a column.
    let Envelope {
        id: _,
        from: _,
        to,
        mentions,
        audience,
        echo,
        kind,
        reply_to: _,
        correlation_id: _,
        thread: _,
        task,
        text,
        data,
        attachments,
        timestamp: _,
        priority,
        ttl_secs,
        origin,
    } = env;
    // Fields at their default are left out, as most messages leave them. Names and forms are
    // `Envelope`'s own serde form, which `BodyIn` reads.
    let mut body = ObjectWriter::start(body);
    if !to.is_empty() {
        body.strings("to", to);
    }
    if !mentions.is_empty() {
        body.strings("mentions", mentions);
    }
    if !audience.is_addressed() {
        body.serialized("audience", audience)?;
    }
    if *echo {
        body.raw("echo", "true");
    }
    body.serialized("kind", kind)?;
    if let Some(task) = task {
        body.serialized("task", task)?;
    }
    if let Some(text) = text {
        body.string("text", text);
    }
    if let Some(data) = data {
        body.serialized("data", data)?;
    }
    if !attachments.is_empty() {
        body.serialized("attachments", attachments)?;
    }
    if !priority.is_normal() {
        body.serialized("priority", priority)?;
    }
    if let Some(ttl_secs) = ttl_secs {
        body.serialized("ttl_secs", ttl_secs)?;
    }
    // The frame's text as it is: it is JSON (the endpoint wrote it, or read it as JSON),
    // and making it a `RawValue` to have serde write it would read it through again.
    let origin_field = body.key("origin");
    origin_field.push(b'{');
    if let Some(native) = origin.native_json() {
        origin_field.extend_from_slice(br#""native":"#);
        origin_field.extend_from_slice(native.as_bytes());
    }
    origin_field.push(b'}');
    body.end();
    Ok(())
}

/// The envelope stored as `columns` and `body`.
pub(super) fn decode(columns: Columns, body: &str) -> serde_json::Result<Envelope> {
    let BodyIn {
        to,
        mentions,
        audience,
        echo,
        kind,
        task,
        text,
        data,
        attachments,
        priority,
        ttl_secs,
        origin,
    } = crate::shared::deep_json::from_own_str(body)?;
    Ok(Envelope {
        id: columns.id,
        from: columns.sender,
        to,
        mentions,
        audience,
        echo,
        kind,
        reply_to: columns.reply_to,
        correlation_id: columns.correlation_id,
        thread: columns.thread,
        task,
        text,
        data,
        attachments,
        timestamp: columns.ts,
        priority,
        ttl_secs,
        // Kept as text: a peer of the same protocol is sent it as it is.
        origin: match origin.native {
            Some(native) => {
                Origin::from_native_json(columns.origin, Box::<str>::from(native).into())
            }
            None => Origin::new(columns.origin, None),
        },
    })
}

// Field names and defaults as `Envelope`'s own serde form, which older bodies are in.

#[derive(Deserialize)]
struct BodyIn {
    #[serde(default)]
    to: Vec<String>,
    #[serde(default)]
    mentions: Vec<String>,
    #[serde(default)]
    audience: Audience,
    #[serde(default)]
    echo: bool,
    kind: Kind,
    #[serde(default)]
    task: Option<Box<TaskInfo>>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    data: Option<Value>,
    #[serde(default)]
    attachments: Vec<Attachment>,
    #[serde(default)]
    priority: Priority,
    #[serde(default)]
    ttl_secs: Option<u64>,
    #[serde(default)]
    origin: OriginIn,
}

#[derive(Default, Deserialize)]
struct OriginIn {
    #[serde(default)]
    native: Option<Box<RawValue>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::TaskState;
    use serde_json::json;

    /// An envelope with every field away from its default.
    fn full() -> Envelope {
        let mut env = Envelope::new("test", "alice", Kind::TaskAssign);
        env.to = vec!["bob".into()];
        env.mentions = vec!["carol".into()];
        env.audience = Audience::Group("crew".into());
        env.echo = true;
        env.reply_to = Some("m-0".into());
        env.correlation_id = Some("c-1".into());
        env.thread = Some("room".into());
        env.task = Some(Box::new(TaskInfo {
            id: "t-1".into(),
            state: Some(TaskState::Assigned),
            ..Default::default()
        }));
        env.text = Some("say \"hi\"".into());
        env.data = Some(json!({ "k": [1, 2] }));
        env.attachments = vec![Attachment {
            name: "a.txt".into(),
            mime_type: "text/plain".into(),
            size: 2,
            data: "aGk=".into(),
        }];
        env.priority = Priority::High;
        env.ttl_secs = Some(60);
        env.origin
            .set_native(Some(json!({ "type": "chat", "text": "hi" })));
        env
    }

    fn columns(env: &Envelope) -> Columns {
        Columns {
            id: env.id.clone(),
            ts: env.timestamp,
            sender: env.from.clone(),
            reply_to: env.reply_to.clone(),
            correlation_id: env.correlation_id.clone(),
            thread: env.thread.clone(),
            origin: env.origin.protocol.clone(),
        }
    }

    fn encoded(env: &Envelope) -> String {
        let mut body = Vec::new();
        encode(env, &mut body).unwrap();
        String::from_utf8(body).unwrap()
    }

    #[test]
    fn every_field_comes_back_from_the_columns_and_the_body() {
        let env = full();
        let body = encoded(&env);
        let json: Value = serde_json::from_str(&body).unwrap();
        // `Envelope`'s serde names of the fields the row keeps in columns.
        let columns_named = [
            "id",
            "from",
            "timestamp",
            "reply_to",
            "correlation_id",
            "thread",
        ];
        for column in columns_named {
            assert!(json.get(column).is_none(), "{column} in {body}");
        }
        assert_eq!(
            json["origin"],
            json!({ "native": { "type": "chat", "text": "hi" } })
        );
        assert_eq!(decode(columns(&env), &body).unwrap(), env);
        // The rest is the envelope's own serde form, field for field.
        let mut whole = serde_json::to_value(&env).unwrap();
        let whole = whole.as_object_mut().unwrap();
        for column in columns_named.into_iter().chain(["origin"]) {
            whole.remove(column);
        }
        let mut json = json.as_object().unwrap().clone();
        json.remove("origin");
        assert_eq!(json, *whole);
        // And in the order the fields were always written in.
        assert_eq!(
            body,
            r#"{"to":["bob"],"mentions":["carol"],"audience":{"type":"group","id":"crew"},"echo":true,"kind":"task_assign","task":{"id":"t-1","state":"assigned"},"text":"say \"hi\"","data":{"k":[1,2]},"attachments":[{"name":"a.txt","mime_type":"text/plain","size":2,"data":"aGk="}],"priority":"high","ttl_secs":60,"origin":{"native":{"text":"hi","type":"chat"}}}"#
        );

        let plain = Envelope::new("test", "alice", Kind::Chat);
        let body = encoded(&plain);
        assert_eq!(body, r#"{"kind":"chat","origin":{}}"#);
        assert_eq!(decode(columns(&plain), &body).unwrap(), plain);
    }

    /// Older versions stored the whole envelope in its own serde form.
    #[test]
    fn a_body_holding_the_whole_envelope_reads_back() {
        let env = full();
        let old = serde_json::to_string(&env).unwrap();
        assert_eq!(decode(columns(&env), &old).unwrap(), env);
    }
}
