//! The store as the core's message log (`core::MessageLog`).

use crate::core::{
    AppliedMarks, CatchUp, Envelope, Link, LogError, LogFuture, MessageLog, MessageQuery,
    StoredMessage, TaskRequest,
};

use super::{Store, StoreError};

impl From<StoreError> for LogError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Closed => LogError::Closed,
            other => LogError::Failed(Box::new(other)),
        }
    }
}

impl From<LogError> for StoreError {
    fn from(e: LogError) -> Self {
        match e {
            LogError::Closed => StoreError::Closed,
            LogError::Failed(e) => StoreError::Log(e),
            LogError::Refused(reason) => StoreError::Log(reason.into()),
        }
    }
}

/// `fut`'s error as the log's.
fn logged<'a, T>(fut: impl Future<Output = Result<T, StoreError>> + Send + 'a) -> LogFuture<'a, T> {
    Box::pin(async move { fut.await.map_err(LogError::from) })
}

impl MessageLog for Store {
    fn append(&self, env: &Envelope) -> LogFuture<'static, ()> {
        logged(self.insert_message(env))
    }

    fn read(&self, query: MessageQuery) -> LogFuture<'_, Vec<StoredMessage>> {
        logged(self.messages(query))
    }

    fn read_ids(&self, ids: Vec<String>) -> LogFuture<'_, Vec<StoredMessage>> {
        logged(self.messages_by_id(ids))
    }

    fn get(&self, id: &str) -> LogFuture<'_, Option<StoredMessage>> {
        let id = id.to_owned();
        logged(async move { self.message(&id).await })
    }

    fn replies(&self, id: &str) -> LogFuture<'_, Vec<StoredMessage>> {
        let id = id.to_owned();
        logged(async move { Store::replies(self, &id).await })
    }

    fn contains(&self, id: &str) -> LogFuture<'_, bool> {
        let id = id.to_owned();
        logged(async move { self.has_message(&id).await })
    }

    fn link(&self, id: &str) -> LogFuture<'_, Option<Link>> {
        let id = id.to_owned();
        logged(async move { Store::link(self, &id).await })
    }

    fn task_request(&self, task_id: &str) -> LogFuture<'_, Option<TaskRequest>> {
        let task_id = task_id.to_owned();
        logged(async move { Store::task_request(self, &task_id).await })
    }

    fn id_by_uuid(&self, uuid: &str) -> LogFuture<'_, Option<String>> {
        let uuid = uuid.to_owned();
        logged(async move { self.message_id_by_uuid(&uuid).await })
    }
}

impl AppliedMarks for Store {
    fn mark_applied(
        &self,
        consumer: &'static str,
        id: &str,
        prune: Option<usize>,
    ) -> LogFuture<'static, ()> {
        logged(Store::mark_applied(self, consumer, id, prune))
    }

    fn catch_up_window(&self, consumer: &'static str, at_most: usize) -> LogFuture<'_, CatchUp> {
        logged(Store::catch_up_window(self, consumer, at_most))
    }

    fn unapplied_tasks(
        &self,
        consumer: &'static str,
        window: CatchUp,
        page: usize,
    ) -> LogFuture<'_, Vec<StoredMessage>> {
        logged(Store::unapplied_tasks(self, consumer, window, page))
    }

    fn caught_up(&self, consumer: &'static str, through: i64) -> LogFuture<'static, Vec<String>> {
        logged(Store::caught_up(self, consumer, through))
    }
}

#[cfg(test)]
mod tests {
    //! The core's conversation links over the store as its log.

    use std::sync::Arc;

    use crate::core::{AddressedOnly, AgentInfo, Core, Envelope, Kind, RoutingConfig, uuid_form};
    use crate::store::{IN_MEMORY, Store};

    #[tokio::test]
    async fn replies_inherit_the_conversation_root() {
        let store = Arc::new(Store::open(IN_MEMORY).await.unwrap());
        let core = Core::new(store.clone(), store, &RoutingConfig::default());
        let first = Envelope::new("test", "a", Kind::Chat);
        let first_id = first.id.clone();
        core.publish(first).await.unwrap();

        let mut second = Envelope::new("test", "b", Kind::Chat);
        second.reply_to = Some(first_id.clone());
        let second = core.publish(second).await.unwrap();
        assert_eq!(
            second.envelope.correlation_id.as_deref(),
            Some(first_id.as_str())
        );

        let mut third = Envelope::new("test", "a", Kind::Chat);
        third.reply_to = Some(second.envelope.id.clone());
        let third = core.publish(third).await.unwrap();
        assert_eq!(
            third.envelope.correlation_id.as_deref(),
            Some(first_id.as_str())
        );
    }

    #[tokio::test]
    async fn derived_ids_map_back_to_stored_messages() {
        let store = Arc::new(Store::open(IN_MEMORY).await.unwrap());
        let core = Core::new(store.clone(), store, &RoutingConfig::default());
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.id = "msg-abc".into();
        core.publish(env).await.unwrap();
        let derived = uuid_form("msg-abc");
        assert!(uuid::Uuid::parse_str(&derived).is_ok());
        assert_eq!(core.original_id(&derived).await, "msg-abc");
        let uuid = uuid::Uuid::new_v4().to_string();
        assert_eq!(uuid_form(&uuid), uuid);
        // Other spellings of a UUID come out in the one form.
        assert_eq!(uuid_form(&uuid.to_uppercase()), uuid);
        assert_eq!(uuid_form(&uuid.replace('-', "")), uuid);
        assert_eq!(core.original_id("unknown").await, "unknown");
    }

    /// A message whose write failed was not accepted, so it is not among those the core
    /// has seen lately: its sender's retry, here or through another bridge of a fleet, is
    /// not passed over as a repeat. One seen before stays seen when a retry of it fails.
    #[tokio::test]
    async fn a_message_whose_write_failed_is_not_taken_for_one_seen() {
        let store = Arc::new(Store::open(IN_MEMORY).await.unwrap());
        let core = Core::new(store.clone(), store.clone(), &RoutingConfig::default());
        let accepted = Envelope::new("test", "a", Kind::Chat);
        core.publish(accepted.clone()).await.unwrap();
        assert!(core.recently_seen(&accepted.id));
        // Every write of a message fails from here on.
        let broken = store.write(|conn| {
            conn.execute_batch("ALTER TABLE messages RENAME TO elsewhere")?;
            Ok(())
        });
        broken.await.unwrap();

        let refused = Envelope::new("test", "a", Kind::Chat);
        assert!(core.publish(refused.clone()).await.is_err());
        assert!(
            !core.recently_seen(&refused.id),
            "a refused message is not seen"
        );
        assert!(core.publish(accepted.clone()).await.is_err());
        assert!(
            core.recently_seen(&accepted.id),
            "a refused retry forgets nothing"
        );
    }

    /// A publish whose caller is dropped before its message is durable (an HTTP client
    /// that went away) routes it all the same, once it is.
    #[tokio::test]
    async fn a_publish_dropped_before_its_write_is_durable_is_routed_all_the_same() {
        use futures_util::FutureExt;
        let store = Arc::new(Store::open(IN_MEMORY).await.unwrap());
        let core = Core::new(store.clone(), store.clone(), &RoutingConfig::default());
        core.directory
            .register(AgentInfo::new("b", "test", "b"))
            .unwrap();
        let mailbox = core.router.mailbox("test");
        let _b = core
            .router
            .attach("b", mailbox.clone(), Arc::new(AddressedOnly));
        // The writer waits until told, so the message's write cannot be durable before its
        // caller is dropped.
        let (go_on, held) = std::sync::mpsc::channel::<()>();
        let holding = store.write(move |_| {
            let _ = held.recv();
            Ok(())
        });
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.to = vec!["b".into()];
        let id = env.id.clone();
        let staged = core.stage(env).await;
        let dropped = core.publish_staged(staged).now_or_never();
        assert!(
            dropped.is_none(),
            "the write is not durable while the writer waits"
        );
        go_on.send(()).unwrap();
        holding.await.unwrap();
        let routed = tokio::time::timeout(std::time::Duration::from_secs(10), mailbox.recv());
        let routed = routed.await.expect("routed within the wait").expect("open");
        assert_eq!(routed.envelope.id, id);
    }
}
