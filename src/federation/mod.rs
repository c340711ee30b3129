//! Federation: the bridges of a fleet behave as one, over NATS JetStream.
//!
//! Every message a bridge accepts goes to one stream of record (`fleet_log`); every other
//! bridge applies it in the stream's order into its own store and routes it to the agents
//! it holds (`apply`). Presence changes carry the agent's card, so every bridge knows every
//! agent and which bridge holds it; heartbeats tell which bridges are alive (`presence`).
//! `docs/federation.md` has the subjects, the guarantees and what it costs.

mod acks;
mod apply;
mod bucket_watch;
mod cards;
mod claims;
mod clashes;
mod config;
mod doors;
mod fleet_log;
mod floors_record;
mod handover;
mod held_cards;
mod id_clash;
mod link;
mod missed_mail;
mod own_deliveries;
mod presence;
mod publisher;
mod record_positions;
mod records;
mod routed;
mod stretch;
mod unshared;
mod unsure;
mod unwritten;
mod wire;
mod written;

use std::path::Path;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::FederationConfig;

use crate::admin::Readiness;
use crate::core::{Core, LeftUndelivered, MessageLog, UnwrittenFrom};
use fleet_log::FleetLog;
use link::NatsLink;
use publisher::Publisher;
use unshared::Unshared;

/// A bridge's membership of the fleet, between connecting and starting its tasks.
pub struct Federation {
    config: FederationConfig,
    link: Arc<NatsLink>,
    log: Arc<FleetLog>,
    local: Arc<dyn MessageLog>,
    /// What the last run of this bridge had not done with: a stretch of the stream read
    /// again as it starts is not routed again where it had.
    left_undelivered: Arc<LeftUndelivered>,
    publisher: Publisher,
    cards: Arc<cards::CardKeeper>,
    own: Arc<own_deliveries::OwnDeliveries>,
    /// Whether the bridge's store keeps the floor its heartbeats carry (`kept_by_store`).
    kept_by_store: std::sync::atomic::AtomicBool,
}

/// The floor a bridge's heartbeats carry, as its store keeps it.
struct StoreKeeps(Arc<NatsLink>);

impl UnwrittenFrom for StoreKeeps {
    fn now(&self) -> Option<u64> {
        (self.0.set_up()).and_then(|ready| ready.unwritten.floor_now())
    }

    fn kept(&self, floor: Option<u64>) {
        if let Some(ready) = self.0.set_up() {
            ready.unwritten.store_kept(floor);
        }
    }

    fn wanted(&self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            match self.0.set_up() {
                Some(ready) => ready.unwritten.store_wanted().await,
                // No batch waits before the fleet is set up.
                None => std::future::pending().await,
            }
        })
    }
}

impl Federation {
    /// Starts connecting to NATS (the bridge starts degraded if it cannot) and makes the
    /// fleet's log over `local`, whose last run left `left_undelivered`. What waits for
    /// NATS is kept in `data_dir` (in memory without one).
    pub async fn connect(
        config: &FederationConfig,
        local: Arc<dyn MessageLog>,
        left_undelivered: Arc<LeftUndelivered>,
        data_dir: Option<&Path>,
        readiness: Readiness,
    ) -> Result<Federation, String> {
        for (key, value) in [("bridge_id", &config.bridge_id), ("prefix", &config.prefix)] {
            if !wire::is_token(value) {
                return Err(format!(
                    "federation.{key} {value:?}: use letters, digits, '-' and '_' only"
                ));
            }
        }
        if config.nats.is_empty() {
            return Err("federation.nats: name at least one NATS server".into());
        }
        let unshared = match data_dir {
            Some(dir) => Unshared::open(dir).map_err(|e| {
                format!("cannot read what waits for NATS in {}: {e}", dir.display())
            })?,
            None => Unshared::in_memory(),
        };
        let link = NatsLink::connect(config, readiness).await?;
        let timeout = std::time::Duration::from_millis(config.publish_timeout_ms);
        let cards = Arc::<cards::CardKeeper>::default();
        let own = Arc::<own_deliveries::OwnDeliveries>::default();
        let (log, publisher) = FleetLog::new(
            local.clone(),
            link.clone(),
            unshared,
            cards.clone(),
            own.clone(),
            timeout,
            config.replicas,
        );
        Ok(Federation {
            config: config.clone(),
            link,
            log,
            local,
            left_undelivered,
            publisher,
            cards,
            own,
            kept_by_store: Default::default(),
        })
    }

    /// The log the core appends to.
    pub fn log(&self) -> Arc<dyn MessageLog> {
        self.log.clone()
    }

    /// Where the fleet's stream is to be read again from now, for what this bridge
    /// acknowledged before it was written (the floor its heartbeats carry): for its store
    /// to keep (`LeftUndelivered::unwritten_from`), as the heartbeat is deleted when it
    /// stops and forgotten two TTLs after it was killed. Asked before `start`, and only
    /// for a store that keeps it: a batch acknowledged unwritten then waits until the store
    /// kept its floor too.
    pub fn kept_by_store(&self) -> Arc<dyn UnwrittenFrom> {
        (self.kept_by_store).store(true, std::sync::atomic::Ordering::Relaxed);
        Arc::new(StoreKeeps(self.link.clone()))
    }

    /// Runs the fleet's tasks for `core` until `shutdown`.
    pub fn start(self, core: Arc<Core>, shutdown: CancellationToken) -> Vec<JoinHandle<()>> {
        self.log.set_directory(core.directory.clone());
        core.directory.set_bridge_id(&self.link.bridge_id);
        let claims = Arc::new(claims::FleetClaims {
            link: self.link.clone(),
            releasing: Arc::default(),
            claimed_alone: Default::default(),
            directory: core.directory.clone(),
        });
        core.set_claims(claims.clone());
        let settler = tokio::spawn(claims.clone().settle_claimed_alone(shutdown.clone()));
        let positions = Arc::<record_positions::RecordPositions>::default();
        core.set_records(Arc::new(records::FleetRecords {
            link: self.link.clone(),
            shutdown: shutdown.clone(),
            positions: positions.clone(),
            leaderless_since: Default::default(),
        }));
        let publisher = tokio::spawn(self.publisher.run(shutdown.clone()));
        let sharer = tokio::spawn(self.log.clone().share_when_back(shutdown.clone()));
        let Federation {
            config,
            link,
            local,
            left_undelivered,
            cards,
            own,
            kept_by_store,
            ..
        } = self;
        let kept_by_store = kept_by_store.into_inner();
        // A card says whether a connection of its agent is open (`clashes`): put again as
        // that changes for an agent online here (a join or leave puts its own).
        let (keeper, directory) = (cards.clone(), core.directory.clone());
        (core.router).on_connections_changed(Arc::new(move |name: &str| {
            if (directory.get(name)).is_some_and(|a| a.is_online_here()) {
                keeper.keep(name);
            }
        }));
        let card_keeper = cards
            .clone()
            .run(link.clone(), core.clone(), shutdown.clone());
        let card_keeper = tokio::spawn(card_keeper);
        let doors = doors::open_once_caught_up(link.clone(), shutdown.clone());
        let doors = tokio::spawn(doors);
        let fleet = tokio::spawn(async move {
            let left_here = left_undelivered.unwritten_from;
            let set_up = link.set_up_when_possible(&config, left_here, kept_by_store, &shutdown);
            let Some(ready) = set_up.await else {
                return;
            };
            let applier = apply::Applier {
                link: link.clone(),
                core: core.clone(),
                local,
                left_undelivered,
                own,
                delivered_before: Default::default(),
                redelivered_through: Default::default(),
            };
            let handover = handover::serve(link.clone(), core.clone(), positions, shutdown.clone());
            let record = floors_record::keep_put(link.clone(), ready.clone(), shutdown.clone());
            let presence = presence::Presence::new(link, core, &config, cards, claims);
            tokio::join!(
                applier.run(ready.clone(), shutdown.clone()),
                presence.run(ready, shutdown.clone()),
                handover,
                record,
            );
        });
        vec![publisher, sharer, card_keeper, settler, doors, fleet]
    }
}
