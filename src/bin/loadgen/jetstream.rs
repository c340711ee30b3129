//! The JetStream baseline: the load published to a file-backed stream of the run's NATS
//! cluster and consumed from it, at the same window, the way a fleet's bridges use
//! JetStream — each publish carries a `Nats-Msg-Id` and its acknowledgement is awaited;
//! each receiver pulls through a consumer of its own subject and acknowledges in batches
//! (`AckPolicy::All`). What a federated path costs beyond this is the bridges'.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use tokio::sync::mpsc;

use super::agents::{self, Error, FrameSink, Receiver, Sender};
use super::nats::Cluster;

/// A stream of the run's own, `LOADGEN_<run>` on subjects `lgjs.<run>.>`.
pub struct Baseline {
    js: jetstream::Context,
    stream: stream::Stream,
    subjects: String,
}

/// A consumer acknowledges at least this often (and whenever it has caught up).
const ACK_EVERY: u64 = 64;

impl Baseline {
    pub async fn set_up(cluster: &Cluster, run: &str) -> Result<Baseline, Error> {
        let client = async_nats::connect(cluster.urls.as_slice())
            .await
            .map_err(|e| format!("cannot connect to NATS: {e}"))?;
        let js = jetstream::new(client);
        let subjects = format!("lgjs.{run}");
        let stream = js
            .create_stream(stream::Config {
                name: format!("LOADGEN_{run}"),
                subjects: vec![format!("{subjects}.>")],
                num_replicas: cluster.replicas(),
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("cannot create the baseline's stream: {e}"))?;
        Ok(Baseline {
            js,
            stream,
            subjects,
        })
    }

    /// Deletes the stream: the next run starts on an empty store.
    pub async fn remove(self) {
        let name = self.stream.cached_info().config.name.clone();
        let _ = self.js.delete_stream(name).await;
    }

    /// A pull consumer of `name`'s subject.
    pub async fn receiver(&self, name: &str) -> Result<Receiver, Error> {
        let consumer = self
            .stream
            .create_consumer(pull::Config {
                filter_subject: format!("{}.{name}", self.subjects),
                ack_policy: AckPolicy::All,
                ack_wait: Duration::from_secs(30),
                max_ack_pending: 10_000,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("cannot create a consumer: {e}"))?;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| format!("cannot consume: {e}"))?;
        let frames = messages.filter_map(|message| async move {
            let message = message.ok()?;
            let due = message.info().map_or(true, |i| {
                i.pending == 0 || i.consumer_sequence % ACK_EVERY == 0
            });
            if due {
                let _ = message.ack().await;
            }
            Some(message.payload.clone())
        });
        Ok(Receiver::Frames(frames.boxed()))
    }

    /// A publisher to `receiver`'s subject, of Skynet-sized frames.
    pub fn sender(&self, receiver: &str, client_ids: bool) -> Sender {
        let (acks, mut pending) = mpsc::unbounded_channel::<PublishAckFuture>();
        // The acknowledgements, awaited in order off the sending path: the window, not
        // each publish's round trip, paces the sender, as a bridge's publisher does.
        tokio::spawn(async move {
            let mut failed = 0u64;
            while let Some(ack) = pending.recv().await {
                if let Err(e) = ack.await {
                    failed += 1;
                    if failed == 1 {
                        eprintln!("loadgen: a JetStream publish was not acknowledged: {e}");
                    }
                }
            }
        });
        let subject = format!("{}.{receiver}", self.subjects);
        let sink = Publisher {
            js: self.js.clone(),
            subject: subject.clone(),
            acks,
        };
        Sender::over(Box::new(sink), move |_, text| {
            agents::skynet_frame(client_ids, text)
        })
    }
}

struct Publisher {
    js: jetstream::Context,
    subject: String,
    acks: mpsc::UnboundedSender<PublishAckFuture>,
}

impl FrameSink for Publisher {
    fn send(&mut self, seq: u64, frame: String) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            let publish = PublishMessage::build()
                .payload(frame.into())
                .message_id(format!("{}-{seq}", self.subject));
            let ack = (self.js.send_publish(self.subject.clone(), publish).await)
                .map_err(|e| format!("publish: {e}"))?;
            self.acks
                .send(ack)
                .map_err(|_| "the acknowledgements' task is gone".into())
        })
    }
}
