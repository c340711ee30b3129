//! The bridge's connection to NATS, and the stream and buckets it uses, made once
//! JetStream answers. A bridge starts whether NATS is up or not: until the link is ready
//! (and whenever the client is disconnected) it is degraded, and says why on `/readyz`.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use arc_swap::ArcSwapOption;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::context::ConsumerInfoErrorKind;
use async_nats::jetstream::{self, kv, object_store, stream};
use async_nats::{ClientError, ConnectOptions, Event};
use tokio_util::sync::CancellationToken;

use super::config::FederationConfig;
use super::id_clash::Clash;
use super::routed::Routed;
use super::unwritten::{Carrier, PutUnderWay, StoreFloor, UnwrittenFloor};
use super::wire::{Card, Heartbeat, Names, agent_key};
use crate::admin::Readiness;
use crate::telemetry;

/// How long the bridge lets JetStream keep a message id to drop a second publish of it.
/// Ids are checked again when a message is applied, so this bounds only the work.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(600);

/// Messages delivered to a bridge and not yet acknowledged, at most. A batch is
/// acknowledged once what it routed here was written (`written::WRITTEN_WITHIN` at most, and
/// `unwritten::CARRIED_WITHIN` more for a heartbeat to carry it), so this is how far
/// applying runs ahead of a recipient that reads slowly before it waits.
const MAX_ACK_PENDING: i64 = 16_384;

/// How often a wait for the client to reconnect looks at its state without an event.
const RECHECK_AFTER: Duration = Duration::from_millis(100);

/// What the bridge uses once JetStream is set up.
pub struct Ready {
    pub js: jetstream::Context,
    pub agents: kv::Store,
    pub bridges: kv::Store,
    /// Each bridge's floors record (`UnwrittenFloor`), which nobody watches.
    pub floors: kv::Store,
    /// Which bridge holds each name (`claims`).
    pub names: kv::Store,
    /// The records endpoints share (`records`).
    pub records: kv::Store,
    /// The files endpoints share (`records`).
    pub files: object_store::ObjectStore,
    /// Where this bridge's deliveries not yet written begin, which its heartbeats carry.
    pub unwritten: Arc<UnwrittenFloor>,
}

pub struct NatsLink {
    pub client: async_nats::Client,
    pub names: Names,
    pub bridge_id: String,
    /// This run of the bridge, unique to its process (`wire::RUN_HEADER`).
    pub run_id: String,
    /// Numbers this run's puts of its floors (`UnwrittenFloor`).
    puts: Arc<std::sync::atomic::AtomicU64>,
    ready: ArcSwapOption<Ready>,
    readiness: Readiness,
    /// Since when the client has been disconnected. A server failing over is ridden out
    /// (messages wait for the client to reconnect); past `grace` NATS is unreachable.
    disconnected_since: parking_lot::Mutex<Option<Instant>>,
    /// When the client last connected again after being disconnected.
    back_since: parking_lot::Mutex<Option<Instant>>,
    /// How long a bridge goes unheard before the fleet takes it for gone.
    presence_ttl: Duration,
    /// Why the client's last try to connect failed, while it is not connected (shown by
    /// `/readyz`: an authorization violation is the operator's to mend).
    connect_failed: parking_lot::Mutex<Option<String>>,
    /// Another run putting heartbeats under this bridge's id (`id_clash`), while it does.
    id_taken_by: parking_lot::Mutex<Option<String>>,
    /// Held while `update_readiness` works out and sets what it says.
    updating_readiness: parking_lot::Mutex<()>,
    grace: Duration,
    /// Changed whenever the client connects (`reconnected`, `connected_after`).
    connections: tokio::sync::watch::Sender<()>,
    /// Where this bridge has routed the stream up to (`apply`).
    pub routed: Routed,
}

impl NatsLink {
    /// Starts connecting to the cluster; returns at once, connected or not.
    pub async fn connect(
        config: &FederationConfig,
        readiness: Readiness,
    ) -> Result<Arc<NatsLink>, String> {
        install_crypto_provider();
        let (events, mut event_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut options = ConnectOptions::new()
            .name(format!("agentbridge {}", config.bridge_id))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(2))
            // The next server of the cluster at once; then back off, to at most 2 s.
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((attempts.saturating_sub(1) as u64 * 100).min(2_000))
            })
            .event_callback(move |event| {
                let events = events.clone();
                async move {
                    let _ = events.send(event);
                }
            });
        if let Some(creds) = &config.creds_file {
            options = options
                .credentials_file(creds)
                .await
                .map_err(|e| format!("federation.creds_file {}: {e}", creds.display()))?;
        }
        if let Some(token) = &config.token {
            options = options.token(token.clone());
        }
        if let (Some(user), Some(password)) = (&config.user, &config.password) {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(ca) = &config.tls_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        let client = async_nats::connect_with_options(&config.nats, options)
            .await
            .map_err(|e| format!("federation.nats: {e}"))?;
        readiness.set_degraded(Some("federation: connecting to NATS".into()));
        let link = Arc::new(NatsLink {
            client,
            names: Names::new(&config.prefix),
            bridge_id: config.bridge_id.clone(),
            run_id: uuid::Uuid::new_v4().to_string(),
            puts: Arc::default(),
            ready: ArcSwapOption::empty(),
            readiness,
            disconnected_since: parking_lot::Mutex::new(None),
            back_since: parking_lot::Mutex::new(None),
            presence_ttl: Duration::from_millis(config.presence_ttl_ms),
            connect_failed: parking_lot::Mutex::new(None),
            id_taken_by: parking_lot::Mutex::new(None),
            updating_readiness: parking_lot::Mutex::new(()),
            grace: Duration::from_millis(config.publish_timeout_ms),
            connections: tokio::sync::watch::Sender::new(()),
            routed: Routed::default(),
        });
        let watched = Arc::downgrade(&link);
        tokio::spawn(async move {
            while let Some(event) = event_rx.recv().await {
                let Some(link) = watched.upgrade() else { break };
                match event {
                    Event::Connected => {
                        tracing::info!("federation: connected to NATS");
                        if link.disconnected_since.lock().take().is_some() {
                            *link.back_since.lock() = Some(Instant::now());
                        }
                        *link.connect_failed.lock() = None;
                        link.update_readiness();
                        link.connections.send_replace(());
                    }
                    Event::Disconnected => {
                        tracing::warn!("federation: disconnected from NATS; reconnecting");
                        link.disconnected_since
                            .lock()
                            .get_or_insert_with(Instant::now);
                        link.update_readiness();
                    }
                    // A try to connect failed; told when its reason changes.
                    Event::ClientError(ClientError::Other(e)) if !link.is_connected() => {
                        let told = link.connect_failed.lock().replace(e.clone());
                        if told.as_ref() != Some(&e) {
                            tracing::warn!(error = %e, "federation: cannot connect to NATS; trying again");
                            link.update_readiness();
                        }
                    }
                    other => tracing::debug!(event = %other, "federation: NATS"),
                }
            }
        });
        Ok(link)
    }

    /// The stream and buckets, once set up, while the client is connected.
    pub fn ready(&self) -> Option<Arc<Ready>> {
        if !self.is_connected() {
            return None;
        }
        self.ready.load_full()
    }

    /// The stream and buckets once set up, connected or not (their calls wait for the
    /// client to reconnect, up to their timeouts).
    pub fn set_up(&self) -> Option<Arc<Ready>> {
        self.ready.load_full()
    }

    /// Whether a message for another bridge is refused at once: the stream was never set
    /// up, or the client has been disconnected for longer than a failover takes.
    pub fn unreachable(&self) -> bool {
        let away = *self.disconnected_since.lock();
        self.ready.load().is_none() || away.is_some_and(|since| since.elapsed() > self.grace)
    }

    /// Whether the client has been connected for a presence TTL or more (since it started,
    /// or since it last connected again): bridges this one took for gone while it was
    /// away have had their heartbeats' time to come back through its watch since.
    pub fn connected_for_a_ttl(&self) -> bool {
        self.is_connected()
            && self.disconnected_since.lock().is_none()
            && (self.back_since.lock()).is_none_or(|back| back.elapsed() >= self.presence_ttl)
    }

    /// Waits until the client is connected, or `deadline`; whether it is.
    pub async fn reconnected(&self, deadline: std::time::Instant) -> bool {
        let mut connected = self.connections.subscribe();
        loop {
            if self.is_connected() {
                return true;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            // Woken by the connection event; looked at again now and then regardless, as
            // the client sends its event before it shows itself connected.
            let _ = tokio::time::timeout(left.min(RECHECK_AFTER), connected.changed()).await;
        }
    }

    /// The stream and buckets once the client is connected: a server failing over is
    /// waited out (the client reconnects to another) for as long as a publish waits;
    /// none at once when NATS has been away longer than that (`unreachable`).
    pub async fn ready_after_failover(&self) -> Option<Arc<Ready>> {
        if let Some(ready) = self.ready() {
            return Some(ready);
        }
        let deadline = std::time::Instant::now() + self.publish_timeout();
        if self.unreachable() || !self.reconnected(deadline).await {
            return None;
        }
        self.ready()
    }

    /// The client's connection now, counted from its first: what was sent on an earlier
    /// one may have been lost with it, or its answer (`publisher`). The client counts a
    /// connection before it shows itself connected.
    pub fn connection(&self) -> u64 {
        let connects = &self.client.statistics().connects;
        connects.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Ends once the client has connected again since `connection`.
    pub async fn connected_after(&self, connection: u64) {
        let mut connected = self.connections.subscribe();
        // The sender lives as long as the link, which the caller holds.
        let _ = connected
            .wait_for(|()| self.connection() > connection)
            .await;
    }

    /// How long a publish waits for JetStream's answer (`publish_timeout_ms`).
    pub fn publish_timeout(&self) -> Duration {
        self.grace
    }

    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Lets clients in to the bridge's endpoints (`federation::doors`).
    pub fn open_doors(&self) {
        self.readiness.open_doors();
    }

    /// Ends once every endpoint of the bridge is listening.
    pub async fn endpoints_listening(&self) {
        self.readiness.listening().await
    }

    /// Another bridge runs under this one's id, or no longer does: logged, and said by
    /// `/readyz` meanwhile.
    pub fn tell_id_clash(&self, clash: Clash) {
        let other = match clash {
            Clash::Found(run) => {
                tracing::error!(
                    bridge_id = %self.bridge_id,
                    other_run = %run,
                    "federation: another bridge runs with this bridge_id; they share one place in the stream, and each takes messages meant for the other's agents: give each bridge its own bridge_id"
                );
                Some(run)
            }
            Clash::Over => {
                tracing::info!("federation: no other bridge runs with this bridge_id now");
                None
            }
        };
        *self.id_taken_by.lock() = other;
        self.update_readiness();
    }

    /// Works out what `/readyz` and the connected gauge say now. Called from the client's
    /// events and from presence: one at a time, so that an older answer never lands last.
    fn update_readiness(&self) {
        let _one_at_a_time = self.updating_readiness.lock();
        let nats = if !self.is_connected() {
            let why =
                (self.connect_failed.lock().as_ref()).map_or(String::new(), |e| format!(" ({e})"));
            Some(format!(
                "federation: NATS unreachable{why}; messages to other bridges are refused"
            ))
        } else if self.ready.load().is_none() {
            Some("federation: setting up JetStream".to_owned())
        } else {
            None
        };
        telemetry::federation_connected(nats.is_none());
        let taken = (self.id_taken_by.lock().is_some()).then(|| {
            format!(
                "federation: another bridge runs with bridge_id {:?}; give each bridge its own",
                self.bridge_id
            )
        });
        let reasons: Vec<String> = taken.into_iter().chain(nats).collect();
        self.readiness
            .set_degraded((!reasons.is_empty()).then(|| reasons.join("; ")));
    }

    /// Creates (or finds) the stream and buckets, retrying until JetStream answers or the
    /// bridge shuts down. `left_here` is the floor the last run's store kept
    /// (`LeftUndelivered::unwritten_from`), read again from if its heartbeat's is gone;
    /// `kept_by_store`, whether this run's store keeps it too.
    pub async fn set_up_when_possible(
        &self,
        config: &FederationConfig,
        left_here: Option<u64>,
        kept_by_store: bool,
        shutdown: &CancellationToken,
    ) -> Option<Arc<Ready>> {
        let mut delay = Duration::from_millis(100);
        loop {
            match self
                .try_set_up(config, left_here, kept_by_store, shutdown)
                .await
            {
                Ok(ready) => {
                    let ready = Arc::new(ready);
                    self.ready.store(Some(ready.clone()));
                    self.update_readiness();
                    tracing::info!(stream = %self.names.stream, "federation: JetStream set up");
                    return Some(ready);
                }
                Err(e) => tracing::warn!(error = %e, "federation: cannot set up JetStream yet"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    async fn try_set_up(
        &self,
        config: &FederationConfig,
        left_here: Option<u64>,
        kept_by_store: bool,
        shutdown: &CancellationToken,
    ) -> Result<Ready, async_nats::Error> {
        let js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_millis(config.publish_timeout_ms))
            .build(self.client.clone());
        let stream = js
            .get_or_create_stream(stream::Config {
                name: self.names.stream.clone(),
                subjects: vec![self.names.all_messages()],
                num_replicas: config.replicas,
                storage: stream::StorageType::File,
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await?;
        // Before the bridge is ready, so that nothing published once it is can pass it by.
        // A bridge new to the fleet starts from now; one that was here before resumes
        // after the last message it acknowledged. What its store kept of where to read
        // again from is a consumer's it no longer has (a stream or consumer made again, a
        // data directory moved to another fleet) when it has to make one.
        let (_, was_there) = durable_consumer(&stream, &self.bridge_id, DeliverPolicy::New).await?;
        let left_here = left_here.filter(|_| was_there);
        let replicas = config.replicas;
        let agents = bucket(
            &js,
            bucket_config(&self.names.agents, replicas, Duration::ZERO),
        )
        .await?;
        // A heartbeat two TTLs old says nothing: the bucket forgets it (and a name its
        // bridge held can be taken over, `claims`).
        let keep = Duration::from_millis(config.presence_ttl_ms * 2);
        let bridges = bucket(&js, bucket_config(&self.names.bridges, replicas, keep)).await?;
        let floors = bucket(&js, bucket_config(&self.names.floors, replicas, keep)).await?;
        let names = bucket(
            &js,
            bucket_config(&self.names.claims, replicas, Duration::ZERO),
        )
        .await?;
        // The records allow a message a TTL of its own, which the mark a take leaves has
        // (`records::TAKEN_REMEMBERED`); the markers `limit_markers` also sets are for
        // `max_age`, which is not set.
        let records = kv::Config {
            limit_markers: Some(Duration::from_secs(1)),
            ..bucket_config(&self.names.records, replicas, Duration::ZERO)
        };
        let records = bucket(&js, records).await?;
        allow_message_ttls(&js, &self.names.records).await?;
        let files = match js.get_object_store(&self.names.files).await {
            Ok(files) => files,
            Err(_) => {
                js.create_object_store(object_store::Config {
                    bucket: self.names.files.clone(),
                    num_replicas: replicas,
                    storage: stream::StorageType::File,
                    ..Default::default()
                })
                .await?
            }
        };
        // The first heartbeat before the bridge is ready: from then on the names it claims
        // are held by a bridge the others see alive. It carries on what the last run's
        // said of its deliveries not written (or its store kept, the heartbeat gone after
        // a clean stop or two TTLs), until this run has read again from there, and that
        // the last run's cards are to be put over (`Heartbeat::cards_coming`).
        let last_beat = bridges.get(&self.bridge_id).await?;
        let left_in_beat = last_beat.and_then(|value| Heartbeat::floor_in(&value));
        let left = left_in_beat.into_iter().chain(left_here).min();
        // The store holds what it kept last run until this run keeps its own.
        let store = match kept_by_store {
            true => StoreFloor::Kept(left_here),
            false => StoreFloor::NotKept,
        };
        let puts = self.puts.clone();
        let unwritten = Arc::new(UnwrittenFloor::new(left, shutdown.clone(), store, puts));
        put_heartbeat(self, &bridges, &unwritten, true).await?;
        Ok(Ready {
            js,
            agents,
            bridges,
            floors,
            names,
            records,
            files,
            unwritten,
        })
    }
}

/// `bridge`'s durable consumer of `stream`: made if there is none, delivering from
/// `start`; updated to today's settings if there is (a consumer an older version made
/// takes today's `max_ack_pending`), keeping where it was made to start, which the server
/// does not let change. With it, whether it was there before.
pub async fn durable_consumer(
    stream: &stream::Stream,
    bridge: &str,
    start: DeliverPolicy,
) -> Result<(PullConsumer, bool), async_nats::Error> {
    let name = Names::consumer_of(bridge);
    let (deliver_policy, was_there) = match stream.consumer_info(&name).await {
        Ok(info) => (info.config.deliver_policy, true),
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => (start, false),
        Err(e) => return Err(e.into()),
    };
    let config = pull::Config {
        durable_name: Some(name),
        deliver_policy,
        ack_policy: AckPolicy::All,
        ack_wait: Duration::from_secs(30),
        max_ack_pending: MAX_ACK_PENDING,
        ..Default::default()
    };
    Ok((stream.create_consumer(config).await?, was_there))
}

/// Puts this bridge's heartbeat in the bridges bucket: the floors of what it acknowledged
/// unwritten (`UnwrittenFloor`), and whether its cards are coming.
pub async fn put_heartbeat(
    link: &NatsLink,
    bridges: &kv::Store,
    unwritten: &UnwrittenFloor,
    cards_coming: bool,
) -> Result<(), async_nats::Error> {
    let put = unwritten.start_put(Carrier::Heartbeat);
    put_started(link, bridges, put, cards_coming).await
}

/// Puts the floors `put` carries in `bucket` (the bridges bucket, or the floors bucket for
/// the floors record), under this bridge's id.
pub async fn put_started(
    link: &NatsLink,
    bucket: &kv::Store,
    put: PutUnderWay<'_>,
    cards_coming: bool,
) -> Result<(), async_nats::Error> {
    let value = serde_json::to_vec(&Heartbeat {
        bridge: link.bridge_id.clone(),
        run: Some(link.run_id.clone()),
        put: put.number(),
        at: crate::core::now_ms(),
        unwritten_from: put.carries().from,
        unwritten_for: put.carries().by_agent.clone(),
        routed_through: (put.carries().by_agent.as_ref()).map(|_| put.carries().through),
        cards_coming,
    })?;
    bucket.put(&link.bridge_id, value.into()).await?;
    put.landed();
    Ok(())
}

/// Keeps `card` in the agents bucket, for bridges that start later (or missed the
/// presence change that carried it).
pub async fn put_card(agents: &kv::Store, card: &Card) -> Result<(), async_nats::Error> {
    let value = serde_json::to_vec(card)?;
    agents.put(agent_key(&card.name), value.into()).await?;
    Ok(())
}

/// Whether a KV write failed because another write came first. JetStream answers a failed
/// revision check with error 10071 or, from 2.11 on, 10164, and async-nats names only the
/// first `WrongLastRevision` (a create whose first try met the second reports it as
/// another error, with the answer as its source).
pub fn lost_race(e: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::ErrorCode;
    let mut cause = Some(e);
    while let Some(error) = cause {
        if let Some(update) = error.downcast_ref::<kv::UpdateError>()
            && update.kind() == kv::UpdateErrorKind::WrongLastRevision
        {
            return true;
        }
        cause = error.source();
    }
    matches!(
        answer_code(e),
        Some(
            ErrorCode::STREAM_WRONG_LAST_SEQUENCE | ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT
        )
    )
}

/// Whether a publish was refused because one with its `Nats-Msg-Id` is still being
/// replicated: a clustered stream's leader holds the id from the first proposal on, and
/// answers the first's sequence only once it is stored.
pub fn still_in_process(e: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::ErrorCode;
    answer_code(e) == Some(ErrorCode::STREAM_DUPLICATE_MESSAGE_CONFLICT)
}

/// The code of the JetStream answer behind `e`, if one is.
fn answer_code(e: &(dyn std::error::Error + 'static)) -> Option<async_nats::jetstream::ErrorCode> {
    let mut cause = Some(e);
    while let Some(error) = cause {
        if let Some(answer) = error.downcast_ref::<async_nats::jetstream::Error>() {
            return Some(answer.error_code());
        }
        cause = error.source();
    }
    None
}

/// Lets the stream behind KV bucket `bucket` give a message a TTL of its own, as the
/// records bucket's must for the marks takes leave: a bucket made before takes did not.
async fn allow_message_ttls(
    js: &jetstream::Context,
    bucket: &str,
) -> Result<(), async_nats::Error> {
    let mut stream = js.get_stream(format!("KV_{bucket}")).await?;
    let config = stream.info().await?.config.clone();
    if !config.allow_message_ttl {
        js.update_stream(stream::Config {
            allow_message_ttl: true,
            ..config
        })
        .await?;
    }
    Ok(())
}

/// The KV bucket `config` names, made as `config` says if it does not exist.
async fn bucket(
    js: &jetstream::Context,
    config: kv::Config,
) -> Result<kv::Store, async_nats::Error> {
    if let Ok(store) = js.get_key_value(&config.bucket).await {
        return Ok(store);
    }
    Ok(js.create_key_value(config).await?)
}

/// A bucket keeping one value per key, on file, with `replicas` copies; a value older than
/// `max_age` (unless zero) is forgotten.
fn bucket_config(name: &str, replicas: usize, max_age: Duration) -> kv::Config {
    kv::Config {
        bucket: name.to_owned(),
        history: 1,
        max_age,
        num_replicas: replicas,
        storage: stream::StorageType::File,
        ..Default::default()
    }
}

/// The rustls provider of every TLS connection the process makes: async-nats asks
/// rustls for the process default, which is ambiguous when more than one is built in.
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
