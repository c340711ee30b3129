//! How messages leave the bridge for Synapse agents that are not reading a stream: a
//! callback (the message POSTed as proto3 JSON to the agent's callback URL, its token as
//! bearer, retried with backoff) or the polling inbox. A callback that keeps failing is
//! counted and its message kept in the inbox, so nothing accepted is lost.

use std::sync::{Arc, Weak};

use std::time::Duration;

use dashmap::DashMap;
use parking_lot::Mutex;
use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tonic::Status;

use super::agents::internal;
use super::proto::{SynapseMessage, TransportMode};
use super::shared_inbox::Keeping;
use super::{Config, PROTOCOL, Synapse, translate};
use crate::core::{Delivery, OfflineSink, Outstanding, Revision, TakenMail};
use crate::telemetry;

/// Where one message for an agent goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Its open stream.
    Stream,
    Callback {
        url: String,
        token: Option<String>,
    },
    Inbox,
}

/// A message POSTed to a callback URL; `fallback` is the agent whose inbox keeps it when
/// every attempt fails. A message routed here keeps its delivery's hold (`Outstanding`)
/// until it is posted or kept.
pub struct Callback {
    pub url: String,
    pub token: Option<String>,
    pub message: SynapseMessage,
    pub fallback: Option<String>,
    pub outstanding: Option<Outstanding>,
}

/// What the inbox writer does, one job at a time in the order asked.
enum InboxJob {
    /// Keep a message for an agent (boxed: a message is far larger than a barrier), and
    /// the hold of its delivery until it is kept (`Outstanding`).
    Keep(String, Box<SynapseMessage>, Keeping, Option<Outstanding>),
    /// Answered once everything asked before it is written: a barrier for readers.
    Flush(oneshot::Sender<()>),
}

type Receivers = (
    mpsc::UnboundedReceiver<Callback>,
    mpsc::UnboundedReceiver<InboxJob>,
);

pub struct Outbound {
    callbacks: mpsc::UnboundedSender<Callback>,
    inbox: mpsc::UnboundedSender<InboxJob>,
    receivers: Mutex<Option<Receivers>>,
    http: reqwest::Client,
    attempts: u32,
    backoff: Duration,
}

impl Outbound {
    pub fn new(config: &Config) -> Self {
        // HTTPS callbacks use rustls with the ring provider (pure Rust and C, no cmake);
        // installing it twice (several bridges in one process) is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let (callbacks, callback_rx) = mpsc::unbounded_channel();
        let (inbox, inbox_rx) = mpsc::unbounded_channel();
        Outbound {
            callbacks,
            inbox,
            receivers: Mutex::new(Some((callback_rx, inbox_rx))),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .expect("the HTTP client builds"),
            attempts: config.callback_attempts.max(1),
            backoff: Duration::from_millis(config.callback_backoff_ms),
        }
    }

    /// Starts the inbox writer and the callback dispatcher.
    pub fn start(&self, synapse: &Arc<Synapse>) -> Vec<JoinHandle<()>> {
        let Some((mut callbacks, mut inbox)) = self.receivers.lock().take() else {
            return Vec::new();
        };
        // One writer keeps each agent's inbox in arrival order.
        let keeper = Arc::downgrade(synapse);
        let stop = synapse.shutdown.clone();
        let inbox_writer = tokio::spawn(async move {
            loop {
                // At shutdown, what is already waiting is still kept.
                let job = tokio::select! {
                    biased;
                    next = inbox.recv() => match next { Some(next) => next, None => break },
                    _ = stop.cancelled() => match inbox.try_recv() {
                        Ok(next) => next,
                        Err(_) => break,
                    },
                };
                match job {
                    InboxJob::Keep(agent, message, keeping, _held) => {
                        let Some(synapse) = keeper.upgrade() else {
                            break;
                        };
                        if let Err(e) = synapse.keep_in_inbox(&agent, &message, keeping).await {
                            tracing::error!(error = %e, agent, "synapse: cannot keep a message for polling");
                        }
                    }
                    InboxJob::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
        });
        // One worker per callback URL: each destination gets its messages in order, and a
        // slow or failing one does not hold back the others.
        let http = self.http.clone();
        let (attempts, backoff) = (self.attempts, self.backoff);
        let inbox_tx = self.inbox.clone();
        let shutdown = synapse.shutdown.clone();
        let dispatcher = tokio::spawn(async move {
            let workers: DashMap<String, mpsc::UnboundedSender<Callback>> = DashMap::new();
            loop {
                let job = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    job = callbacks.recv() => match job { Some(job) => job, None => break },
                };
                let url = job.url.clone();
                let worker = workers.entry(url).or_insert_with(|| {
                    let (tx, mut rx) = mpsc::unbounded_channel::<Callback>();
                    let (http, inbox_tx, shutdown) =
                        (http.clone(), inbox_tx.clone(), shutdown.clone());
                    tokio::spawn(async move {
                        loop {
                            let job = tokio::select! {
                                _ = shutdown.cancelled() => break,
                                job = rx.recv() => match job { Some(job) => job, None => break },
                            };
                            post_with_retries(&http, job, attempts, backoff, &inbox_tx).await;
                        }
                    });
                    tx
                });
                let _ = worker.send(job);
            }
        });
        vec![inbox_writer, dispatcher]
    }

    pub fn callback(&self, job: Callback) {
        let _ = self.callbacks.send(job);
    }

    /// Keeps `message` in `agent`'s inbox, after what was kept before it; `outstanding`
    /// is held until it is.
    pub fn keep(
        &self,
        agent: &str,
        message: SynapseMessage,
        keeping: Keeping,
        outstanding: Option<Outstanding>,
    ) {
        let job = InboxJob::Keep(agent.to_owned(), Box::new(message), keeping, outstanding);
        let _ = self.inbox.send(job);
    }

    /// Waits until every message kept before this call is in the store, so that a reader
    /// of the inbox sees everything the bridge accepted before it read.
    pub async fn flush(&self) {
        let (done, written) = oneshot::channel();
        if self.inbox.send(InboxJob::Flush(done)).is_ok() {
            // An error means the writer stopped (shutdown): nothing more will be written.
            let _ = written.await;
        }
    }
}

async fn post_with_retries(
    http: &reqwest::Client,
    job: Callback,
    attempts: u32,
    backoff: Duration,
    inbox: &mpsc::UnboundedSender<InboxJob>,
) {
    let body = match translate::callback_body(&job.message) {
        Ok(body) => body,
        Err(e) => {
            // Only a message the bridge built itself can get here (Synapse input is
            // checked on the way in); it waits in the inbox, where it is kept whole.
            tracing::error!(url = %job.url, error = %e, "synapse: cannot write a callback body");
            telemetry::callback_failed(PROTOCOL, "unencodable");
            keep_instead(job, inbox);
            return;
        }
    };
    let mut wait = backoff;
    for attempt in 1..=attempts {
        let mut request = http.post(&job.url).json(&body);
        if let Some(token) = &job.token {
            request = request.bearer_auth(token);
        }
        match request.send().await {
            Ok(response) if response.status().is_success() => return,
            Ok(response) => {
                tracing::warn!(url = %job.url, status = %response.status(), attempt, "synapse: callback refused");
            }
            Err(e) => {
                tracing::warn!(url = %job.url, error = %e, attempt, "synapse: callback failed")
            }
        }
        if attempt < attempts {
            telemetry::callback_failed(PROTOCOL, "retry");
            tokio::time::sleep(wait).await;
            wait = wait.saturating_mul(2);
        }
    }
    telemetry::callback_failed(PROTOCOL, "gave_up");
    keep_instead(job, inbox);
}

/// Keeps a callback that could not be posted in its fallback agent's inbox, if it has one,
/// its hold with it.
fn keep_instead(job: Callback, inbox: &mpsc::UnboundedSender<InboxJob>) {
    if let Some(agent) = job.fallback {
        let message = Box::new(job.message);
        let _ = inbox.send(InboxJob::Keep(
            agent,
            message,
            Keeping::New,
            job.outstanding,
        ));
    }
}

/// A message taken from an inbox.
pub struct FromInbox {
    pub message: SynapseMessage,
    /// The revision of the fleet's record it was taken at; none for one this bridge kept
    /// alone.
    pub taken_at: Option<Revision>,
}

impl Synapse {
    /// Takes every message kept for `agent`, oldest first, including any accepted but not
    /// yet written when this was called.
    pub async fn take_inbox(&self, agent: &str) -> Result<TakenMail<FromInbox>, Status> {
        self.outbound.flush().await;
        let kept = self.take_inbox_rows(agent).await.map_err(internal)?;
        let taken = (kept.taken.iter())
            .filter_map(|row| {
                let message = SynapseMessage::decode(row.message.as_slice()).ok()?;
                let taken_at = row.fleet_revision;
                Some(FromInbox { message, taken_at })
            })
            .collect();
        Ok(TakenMail {
            taken,
            retake: kept.retake,
        })
    }

    /// Where a message for `agent` goes, given whether the caller holds its open stream.
    pub fn route_for(&self, agent: &str, from_stream: bool) -> Route {
        let (mode, url, token) = self.reach(agent);
        let callback = |url: Option<String>| match url {
            Some(url) => Route::Callback {
                url,
                token: token.clone(),
            },
            None => Route::Inbox,
        };
        match mode {
            TransportMode::Callback => callback(url),
            TransportMode::Polling => Route::Inbox,
            _ if from_stream => Route::Stream,
            _ => callback(url),
        }
    }

    /// Sends `message` to `agent` by `route` (other than its stream); a callback keeps
    /// `outstanding` until it is posted.
    pub fn send_by(
        &self,
        agent: &str,
        route: Route,
        message: SynapseMessage,
        outstanding: Option<Outstanding>,
    ) {
        match route {
            Route::Stream => {}
            Route::Callback { url, token } => self.outbound.callback(Callback {
                url,
                token,
                message,
                fallback: Some(agent.to_owned()),
                outstanding,
            }),
            Route::Inbox => self
                .outbound
                .keep(agent, message, Keeping::New, outstanding),
        }
    }
}

/// The router's way to Synapse agents with no open stream.
pub struct Sink(pub Weak<Synapse>);

impl OfflineSink for Sink {
    fn deliver(&self, agent: &str, delivery: &Arc<Delivery>) {
        let Some(synapse) = self.0.upgrade() else {
            return;
        };
        // The bridge itself reads its messages through the hub, not an inbox.
        if agent == crate::core::BRIDGE_AGENT {
            return;
        }
        let Some(message) = synapse.encode(delivery) else {
            return;
        };
        // The mail of an agent whose bridge is gone from the fleet goes to its inbox, which
        // the fleet shares: every bridge still here keeps it, once between them, where a
        // callback would be posted by each.
        let route = match synapse.core.directory.held_elsewhere(agent) {
            true => Route::Inbox,
            false => synapse.route_for(agent, false),
        };
        synapse.send_by(agent, route, message, delivery.held());
        delivery.written_to(PROTOCOL);
    }

    fn flush(&self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            if let Some(synapse) = self.0.upgrade() {
                synapse.outbound.flush().await;
            }
        })
    }
}
