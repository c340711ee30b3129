//! Posting and reading Tracker chat messages. Both the REST `POST /messages` and the
//! WebSocket `chat.send` come here; a message becomes an envelope in the core's log (its
//! `thread` is the chat, or the task for a task comment) and crosses to other protocols
//! from there.

use std::sync::Arc;

use super::Tracker;
use super::db::TaskRow;
use super::translate::{self, Authored, Translator, message_out};
use super::wire::{AuthorType, MessageOut};
use crate::core::{Envelope, LogError, Staged, new_message_id, now_ms};
use crate::core::{MessageQuery, StoredMessage};
use crate::protocols::endpoint::{Decoded, Translation};
use crate::shared::at_names;
use crate::shared::clock::iso8601;
use crate::shared::each_once::{each_once, push_once};

/// The agents a chat may `@mention`, oldest first, each labelled with its own name.
pub type MentionNames = at_names::Needles<String>;

/// Which of `names` `text` mentions, in their order: a whole name after an `@`.
fn mentions_in(names: &MentionNames, text: &str) -> Vec<String> {
    let name_ends = |after: &str| {
        after
            .chars()
            .next()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '-' || c == '_'))
    };
    names
        .found_in(&text.to_lowercase(), name_ends)
        .cloned()
        .collect()
}

/// A message as a Tracker member posts it.
pub struct NewMessage {
    pub author_slug: String,
    pub author_type: AuthorType,
    pub chat_id: Option<String>,
    pub task_id: Option<String>,
    pub content: String,
    pub mentions: Vec<String>,
    pub reply_to: Option<String>,
}

/// A staged message's answer, and what is left to do once it is stored.
pub struct Posted {
    out: MessageOut,
    /// A comment on a task another protocol asked for: the task and the comment.
    tell_requester: Option<(String, String)>,
}

/// Why a message was not posted.
#[derive(Debug)]
pub enum PostError {
    /// The chat or task it names does not exist; the text names which.
    NotFound(String),
    /// A mention names nobody the bridge knows.
    UnknownMention(String),
    /// More mentions than `max_mentions`: (how many, the limit).
    TooManyMentions(usize, usize),
    Store(crate::store::StoreError),
    /// The message log would not take it now; the text says why (the fleet's log is
    /// unreachable).
    Refused(String),
}

impl From<LogError> for PostError {
    fn from(e: LogError) -> Self {
        match e {
            LogError::Refused(reason) => PostError::Refused(reason),
            other => PostError::Store(other.into()),
        }
    }
}

impl Tracker {
    /// Posts a message; a comment on a task another protocol asked for is also sent to the
    /// task's requester as progress.
    pub async fn post_message(&self, new: NewMessage) -> Result<MessageOut, PostError> {
        self.post(new, true).await
    }

    /// Posts a message without telling a task's requester (the caller already did).
    pub async fn post_comment_quietly(&self, new: NewMessage) -> Result<MessageOut, PostError> {
        self.post(new, false).await
    }

    /// Stages, then delivers once durable. Its callers are REST writes, which run to
    /// their end even if their client goes (`shared::to_the_end::WritesToTheEnd`), so a
    /// message staged is not left stored and never delivered.
    async fn post(&self, new: NewMessage, notify_requester: bool) -> Result<MessageOut, PostError> {
        let (staged, post) = self.stage_post(new, notify_requester).await?;
        let env = staged.durable().await?;
        Ok(self.posted(env, post).await)
    }

    /// The first half of posting, for a connection that keeps reading while its earlier
    /// messages are written: checks the message and queues its store write (in call
    /// order). Once the write is durable, `posted` delivers it.
    pub async fn stage_post(
        &self,
        new: NewMessage,
        notify_requester: bool,
    ) -> Result<(Staged, Posted), PostError> {
        // Bounded before any mention is looked up, and again once the text's are in.
        let max = self.config.max_mentions;
        if new.mentions.len() > max {
            return Err(PostError::TooManyMentions(new.mentions.len(), max));
        }
        let (thread, task) = self
            .place(new.chat_id.as_deref(), new.task_id.as_deref())
            .await?;
        let mut mentions = each_once(new.mentions);
        // An explicit mention is a recipient: one nobody holds is refused, not dropped.
        if let Some(unknown) = mentions.iter().find(|m| !self.core.directory.contains(m)) {
            return Err(PostError::UnknownMention(unknown.clone()));
        }
        let mut seen = foldhash::HashSet::default();
        for name in self.mentioned_in(&new.content) {
            push_once(&mut mentions, &mut seen, name);
        }
        if mentions.len() > max {
            return Err(PostError::TooManyMentions(mentions.len(), max));
        }
        let reply_to = match &new.reply_to {
            Some(id) => Some(self.core.original_id(id).await),
            None => None,
        };
        let created = now_ms();
        let out = MessageOut {
            // Time-ordered (UUIDv7): each new id lands at the end of the log's id index.
            // A random (v4) id would land on a page of its own, and every message would
            // rewrite one more page of the index into the WAL and the database.
            id: new_message_id(),
            chat_id: if task.is_some() {
                None
            } else {
                new.chat_id.clone()
            },
            task_id: task.as_ref().map(|t| t.id.clone()),
            author_type: new.author_type,
            author_slug: new.author_slug.clone(),
            content: new.content.clone(),
            mentions,
            created_at: iso8601(created),
            reply_to: new.reply_to.clone(),
            attachments: Vec::new(),
        };
        let authored = Authored {
            message: &out,
            thread,
            reply_to,
            timestamp: created,
        };
        let Ok(Decoded { envelope: env, .. }) = Translator::decode(self, authored);
        let staged = self.core.stage(env).await;
        // A comment on a task another protocol asked for is news for the requester.
        let tell_requester = task
            .filter(|task| task.requester.is_some() && notify_requester)
            .map(|task| (task.id, new.content));
        Ok((
            staged,
            Posted {
                out,
                tell_requester,
            },
        ))
    }

    /// The second half of posting: routes the stored message and tells a task's requester.
    pub async fn posted(&self, env: Envelope, post: Posted) -> MessageOut {
        self.core.route(env);
        // Boxed: telling the requester (kilobytes of future) would size every posted
        // message's, which the connection boxes and so copies whole.
        if let Some((task_id, note)) = post.tell_requester
            && let Err(e) = Box::pin(self.note_task(&task_id, note)).await
        {
            tracing::error!(error = %e, "tracker: cannot report a task comment");
        }
        post.out
    }

    /// The thread of a chat or task, and the task for a task comment.
    async fn place(
        &self,
        chat_id: Option<&str>,
        task_id: Option<&str>,
    ) -> Result<(Option<String>, Option<TaskRow>), PostError> {
        if let Some(task_id) = task_id {
            let task = self
                .db
                .task(task_id)
                .await
                .map_err(PostError::Store)?
                .ok_or_else(|| PostError::NotFound(format!("Task {task_id} not found")))?;
            return Ok((Some(task.id.clone()), Some(task)));
        }
        let chat_id = chat_id.unwrap_or(&self.chats.lobby_chat_id);
        if chat_id == self.chats.lobby_chat_id {
            // The lobby is the conversation every protocol shares: no thread.
            return Ok((None, None));
        }
        if self.chats.project_of_chat(chat_id).is_some() {
            return Ok((Some(chat_id.to_owned()), None));
        }
        Err(PostError::NotFound(format!("Chat {chat_id} not found")))
    }

    /// Agents named as `@name` in text, against the whole directory (case-insensitive, and
    /// the name must end there: `@coder` does not mention `coder-2`), oldest first.
    pub fn mentioned_in(&self, text: &str) -> Vec<String> {
        if !at_names::has_at(text) {
            return Vec::new();
        }
        mentions_in(&self.mention_names(), text)
    }

    /// Every agent's lower-cased `@name`, oldest registration first; rebuilt only when the
    /// directory has changed, not for every message with an `@` in it.
    fn mention_names(&self) -> Arc<MentionNames> {
        self.mention_names.get(&self.core.directory, || {
            let mut agents = Vec::new();
            self.core
                .directory
                .for_each(|agent| agents.push((agent.created_at, agent.name.clone())));
            agents.sort();
            MentionNames::new(agents.into_iter().map(|(_, name)| (name.clone(), name)))
        })
    }

    /// The newest `limit` messages of a chat (or a task's comments), oldest first.
    pub async fn list_messages(
        &self,
        chat_id: Option<&str>,
        task_id: Option<&str>,
        limit: usize,
    ) -> Result<Vec<MessageOut>, PostError> {
        let (thread, _) = self.place(chat_id, task_id).await?;
        let query = MessageQuery {
            thread: Some(thread),
            kinds: Some(CHAT_KINDS.to_vec()),
            limit,
            ..Default::default()
        };
        let stored = self
            .core
            .log
            .read(query)
            .await
            .map_err(|e| PostError::Store(e.into()))?;
        self.render(stored).await
    }

    /// Messages that answer `id` (a Tracker message id, or the UUID shown for another's).
    pub async fn replies(&self, id: &str) -> Result<Option<Vec<MessageOut>>, PostError> {
        let original = self.core.original_id(id).await;
        if self
            .core
            .log
            .get(&original)
            .await
            .map_err(|e| PostError::Store(e.into()))?
            .is_none()
        {
            return Ok(None);
        }
        let stored = self
            .core
            .log
            .replies(&original)
            .await
            .map_err(|e| PostError::Store(e.into()))?;
        let chat: Vec<StoredMessage> = stored
            .into_iter()
            .filter(|m| translate::is_chat_like(&m.envelope))
            .collect();
        self.render(chat).await.map(Some)
    }

    /// Whether a stored message with this (Tracker-shown) id exists; its original id.
    pub async fn find_message(&self, id: &str) -> Result<Option<StoredMessage>, PostError> {
        let original = self.core.original_id(id).await;
        self.core
            .log
            .get(&original)
            .await
            .map_err(|e| PostError::Store(e.into()))
    }

    async fn render(&self, stored: Vec<StoredMessage>) -> Result<Vec<MessageOut>, PostError> {
        let mut out = Vec::with_capacity(stored.len());
        for message in stored {
            let mut rendered = message_out(&message.envelope, self);
            rendered.attachments = self
                .db
                .attachments(&rendered.id, false)
                .await
                .map_err(PostError::Store)?
                .iter()
                .map(|a| self.attachment_out(a))
                .collect();
            out.push(rendered);
        }
        Ok(out)
    }
}

/// Kinds listed as chat history (`Kind::as_str`).
const CHAT_KINDS: &[&str] = &[
    "chat",
    "custom",
    "context",
    "decision.request",
    "decision.response",
    "vote.initiate",
    "vote.submit",
    "vote.result",
    "error",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn mentioned(text: &str) -> Vec<String> {
        let names = ["coder", "coder-2", "Reviewer", "al"].map(|n| (n.to_owned(), n));
        mentions_in(&MentionNames::new(names), text)
    }

    #[test]
    fn a_mention_is_a_whole_name_in_any_case_in_directory_order() {
        assert_eq!(mentioned("@REVIEWER, then @coder."), ["coder", "Reviewer"]);
        assert_eq!(mentioned("ask @coder-2 and @coder_x"), ["coder-2"]);
        assert_eq!(mentioned("mail al@al"), ["al"]);
        assert!(mentioned("@alice @ coder").is_empty());
    }
}
