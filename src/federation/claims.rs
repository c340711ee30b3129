//! Names claimed fleet-wide, through a KV bucket of the fleet: a registration creates its
//! name's key (JetStream's create fails if the key exists), so of two bridges registering
//! one name at once, exactly one wins. A name whose holder's bridge is gone (no heartbeat
//! in the bridges bucket) is taken over with a revision check, which is as linearisable —
//! unless it is a lasting registration's (a shared record outlives its bridge), which only
//! the same agent takes. An agent connecting through another bridge moves its name there
//! while it is not online where it was (`Claiming`). While NATS is away, names are claimed
//! in this bridge's directory alone, and in the bucket once it is back
//! (`FleetClaims::settle_claimed_alone`); a claim NATS does not answer in time is refused.

use std::sync::Arc;

use async_nats::jetstream::kv::{CreateErrorKind, Operation};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, Ready, lost_race};
use super::wire::{Card, agent_key, known_protocol};
use crate::core::{
    AgentInfo, BRIDGE_PROTOCOL, ClaimFuture, Claiming, Directory, NameClaims, NameTaken, Role,
};

/// Who holds a name, as its key in the names bucket says.
#[derive(Debug, Serialize, Deserialize)]
struct Claim {
    bridge: String,
    protocol: String,
    role: Role,
    /// The agent's id in its protocol (absent in claims made before it was kept).
    #[serde(default)]
    native_id: Option<String>,
    /// A registration the fleet keeps: the name stays its own after its bridge is gone.
    #[serde(default)]
    lasting: bool,
}

impl Claim {
    /// Whether the name is held for the agent `info` describes.
    fn is_for(&self, info: &AgentInfo) -> bool {
        self.protocol == info.protocol && self.native_id.as_deref() == Some(&info.native_id)
    }

    /// The key's value claiming `agent`'s name for `bridge`.
    fn value(agent: &AgentInfo, bridge: &str, lasting: bool) -> bytes::Bytes {
        let claim = Claim {
            bridge: bridge.to_owned(),
            protocol: agent.protocol.to_owned(),
            role: agent.role,
            native_id: Some(agent.native_id.clone()),
            lasting,
        };
        bytes::Bytes::from(serde_json::to_vec(&claim).unwrap_or_default())
    }

    /// The refusal of a claim on `name`, naming this holder.
    fn taken(self, name: &str) -> NameTaken {
        NameTaken {
            name: name.to_owned(),
            holder_protocol: known_protocol(&self.protocol).unwrap_or(BRIDGE_PROTOCOL),
            holder_role: match self.role {
                Role::Agent => "agent",
                Role::Human => "human",
            },
            holder_bridge: Some(self.bridge),
        }
    }
}

/// How long a contended or unanswered claim is tried before it is refused: longer than a
/// NATS stream takes to elect a leader once its old one is gone (election timeouts run up
/// to 9 s), so that a claim made while a NATS server fails over waits rather than fails.
const SETTLE_WITHIN: std::time::Duration = std::time::Duration::from_secs(12);
/// The pause before a claim is tried again after NATS did not answer or refused it.
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_millis(100);
/// The pause before a claim that lost a race is read again: a replica that answered with an
/// older revision has usually caught up by then.
const REREAD_AFTER: std::time::Duration = std::time::Duration::from_millis(20);

pub struct FleetClaims {
    pub link: Arc<NatsLink>,
    /// Names whose release is being tried again, each with the id of the release that
    /// tries it and the agent it releases: a name claimed again meanwhile leaves this map,
    /// and its pending release gives up rather than free the new claim (it starts again if
    /// that claim fails); a later release of the name takes over.
    pub releasing: Arc<dashmap::DashMap<String, (u64, AgentInfo)>>,
    /// Names claimed in this bridge's directory alone, while NATS was away or before the
    /// fleet's buckets were set up: claimed in the names bucket once NATS is back
    /// (`settle_claimed_alone`), unless released meanwhile.
    pub claimed_alone: dashmap::DashMap<String, (AgentInfo, Claiming)>,
    /// This bridge's directory: a name it holds again is not released (`release`).
    pub directory: Arc<Directory>,
}

/// How often names claimed while NATS was away are looked at, to claim them once it is back.
const SETTLE_ALONE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The id of the next background release (`FleetClaims::releasing`).
static NEXT_RELEASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl FleetClaims {
    /// Claims the name for this bridge, as `how` allows.
    ///
    /// `rewrite`: a key this bridge holds already is written again, to describe `info`. A
    /// release of the name pending here reads the key before it deletes it, so its revision
    /// check then fails rather than free this claim; and a claim made here alone while NATS
    /// was away replaces what the key said of an agent before it.
    async fn claim_in(
        &self,
        ready: &Ready,
        info: &AgentInfo,
        how: Claiming,
        rewrite: bool,
    ) -> Result<(), NameTaken> {
        let key = agent_key(&info.name);
        let claim = |lasting: bool| Claim::value(info, &self.link.bridge_id, lasting);
        // A registration's claim lasts; so does one an agent the fleet registered moves.
        let fresh = claim(how != Claiming::Held);
        let deadline = tokio::time::Instant::now() + SETTLE_WITHIN;
        while tokio::time::Instant::now() < deadline {
            match ready.names.create(&key, fresh.clone()).await {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == CreateErrorKind::AlreadyExists || lost_race(&e) => {}
                Err(e) => {
                    // A bucket just made may have no leader yet: asked again, not decided
                    // here alone, so that a name never has two holders.
                    tracing::debug!(error = %e, name = %info.name, "federation: claiming a name again");
                    tokio::time::sleep(RETRY_AFTER).await;
                    continue;
                }
            }
            let Ok(Some(entry)) = ready.names.entry(&key).await else {
                tokio::time::sleep(RETRY_AFTER).await;
                continue;
            };
            let (value, lasting) = match serde_json::from_slice::<Claim>(&entry.value) {
                Ok(held) if held.bridge == self.link.bridge_id && !rewrite => return Ok(()),
                Ok(held) if held.bridge == self.link.bridge_id => {
                    let lasting = how != Claiming::Held || (held.is_for(info) && held.lasting);
                    (claim(lasting), lasting)
                }
                Ok(held) => {
                    let same = held.is_for(info);
                    // Not known while NATS does not answer (a stream electing its leader):
                    // asked again rather than decided, as for the claim itself.
                    let Some(heartbeat_kept) = self.is_alive(ready, &held.bridge).await else {
                        tokio::time::sleep(RETRY_AFTER).await;
                        continue;
                    };
                    // The same agent moving from a bridge this one has taken for gone (no
                    // heartbeat for a TTL, its agents shown offline) is let through at
                    // once, not refused until the bucket forgets the heartbeat — unless
                    // this bridge was itself away lately, and took the others for gone
                    // for not hearing them.
                    let moving_from_gone = same
                        && how != Claiming::Registration
                        && self.directory.is_gone(&held.bridge)
                        && self.link.connected_for_a_ttl();
                    let alive = heartbeat_kept && !moving_from_gone;
                    // Only the same agent's move or hold asks where it is online.
                    let online = match same && alive && how != Claiming::Registration {
                        false => false,
                        true => match self.online_at(ready, info, &held.bridge).await {
                            Some(online) => online,
                            None => {
                                tokio::time::sleep(RETRY_AFTER).await;
                                continue;
                            }
                        },
                    };
                    let takes = match how {
                        // The same agent takes its name from a bridge it is not online
                        // through (it moved); another only from a gone bridge.
                        Claiming::Move => same && !(alive && online),
                        Claiming::Held if same => !(alive && online),
                        Claiming::Held | Claiming::Registration => {
                            !alive && (same || !held.lasting)
                        }
                    };
                    if !takes {
                        return Err(held.taken(&info.name));
                    }
                    // A registration moved or taken over by its own agent stays lasting.
                    let lasting = how != Claiming::Held || (same && held.lasting);
                    (claim(lasting), lasting)
                }
                // Not one of ours.
                Err(_) => (fresh.clone(), how != Claiming::Held),
            };
            match ready.names.update(&key, value, entry.revision).await {
                Ok(_) => return Ok(()),
                // Read again: another bridge wrote first, or the replica read was behind.
                Err(e) if lost_race(&e) => {
                    tokio::time::sleep(REREAD_AFTER).await;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, name = %info.name, lasting, "federation: taking a name over again");
                    tokio::time::sleep(RETRY_AFTER).await;
                    continue;
                }
            }
        }
        Err(NameTaken::unsettled(&info.name))
    }

    /// Whether the fleet's card of `info`'s agent shows it online through `bridge`, with a
    /// connection open there (one waiting out a grace period with none may move); `None`
    /// when NATS did not answer.
    async fn online_at(&self, ready: &Ready, info: &AgentInfo, bridge: &str) -> Option<bool> {
        match ready.agents.get(agent_key(&info.name)).await {
            Ok(Some(value)) => Some(
                serde_json::from_slice::<Card>(&value)
                    .is_ok_and(|card| card.online && card.connected && card.bridge == bridge),
            ),
            Ok(None) => Some(false),
            Err(_) => None,
        }
    }

    /// Whether `bridge` has a heartbeat in the bridges bucket (which forgets one a few
    /// TTLs old): a bridge that has just stopped keeps its names a little longer, rather
    /// than a name ever having two holders. `None` when NATS did not answer.
    async fn is_alive(&self, ready: &Ready, bridge: &str) -> Option<bool> {
        match ready.bridges.get(bridge).await {
            Ok(heartbeat) => Some(heartbeat.is_some()),
            Err(_) => None,
        }
    }
}

impl NameClaims for FleetClaims {
    fn claim<'a>(&'a self, info: &'a AgentInfo, how: Claiming) -> ClaimFuture<'a> {
        Box::pin(async move {
            let released = self
                .releasing
                .remove(&info.name)
                .map(|(_, (_, agent))| agent);
            // A server failing over is waited out, rather than the name claimed alone.
            let claimed = match self.link.ready_after_failover().await {
                Some(ready) => self.claim_in(&ready, info, how, released.is_some()).await,
                // Claimed here alone (the key, if still this bridge's, stays so), and in
                // the fleet once NATS is back.
                None => {
                    (self.claimed_alone).insert(info.name.clone(), (info.clone(), how));
                    Ok(())
                }
            };
            // Refused or unsettled: the name is not this claim's, and the release it
            // stopped goes on.
            if claimed.is_err()
                && let Some(agent) = released
            {
                self.release(&agent);
            }
            claimed
        })
    }

    fn give_up<'a>(
        &'a self,
        agent: &'a AgentInfo,
    ) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
        Box::pin(async move {
            // Tried for as long as a claim waits, while the next claim of the name waits
            // for it; with NATS away (claims are this bridge's alone then), or past that,
            // the release goes on in the background.
            let deadline = tokio::time::Instant::now() + SETTLE_WITHIN;
            while let Some(ready) = self.link.ready()
                && tokio::time::Instant::now() < deadline
            {
                if release_once(&ready, &self.link.bridge_id, agent, || true)
                    .await
                    .is_ok()
                {
                    return;
                }
                tokio::time::sleep(RETRY_AFTER).await;
            }
            self.release(agent);
        })
    }

    fn hand_over<'a>(
        &'a self,
        holder: &'a AgentInfo,
        loser: &'a AgentInfo,
    ) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
        Box::pin(async move {
            // Claimed here alone (NATS was away): not to be claimed once NATS is back, and
            // no key of it to hand over.
            if !self.forget_claimed_alone(loser) {
                self.hand_key_over(holder, loser).await
            }
        })
    }

    /// Gives the name up in the background, again until NATS takes it (a release lost while
    /// NATS is away would leave a lasting claim held for good).
    fn release(&self, agent: &AgentInfo) {
        self.claimed_alone.remove(&agent.name);
        let (link, agent) = (self.link.clone(), agent.clone());
        let (releasing, directory) = (self.releasing.clone(), self.directory.clone());
        let id = NEXT_RELEASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        releasing.insert(agent.name.clone(), (id, agent.clone()));
        tokio::spawn(async move {
            let mut wait = RETRY_AFTER;
            // Until it lands, or the name is claimed again (and so is not to be freed), or
            // released again (by a task of its own), or held here again: a claim that ran
            // as its agent was unregistered registered it after, and relies on the key.
            let wanted = || {
                releasing.get(&agent.name).is_some_and(|r| r.0 == id)
                    && (directory.get(&agent.name)).is_none_or(|a| a.bridge.is_some())
            };
            while wanted() {
                if let Some(ready) = link.ready() {
                    match release_once(&ready, &link.bridge_id, &agent, wanted).await {
                        Ok(()) => {
                            releasing.remove_if(&agent.name, |_, r| r.0 == id);
                            return;
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, name = %agent.name, "federation: releasing a name again shortly")
                        }
                    }
                }
                // While NATS is away, tried again as soon as it is back.
                if link.is_connected() {
                    tokio::time::sleep(wait).await;
                } else {
                    let _ = link.reconnected(std::time::Instant::now() + wait).await;
                }
                wait = (wait * 2).min(RELEASE_RETRY_MAX);
            }
            releasing.remove_if(&agent.name, |_, r| r.0 == id);
        });
    }
}

impl FleetClaims {
    /// Claims in the names bucket, once NATS is back, the names this bridge claimed in its
    /// directory alone meanwhile; until `shutdown`. A name another bridge claimed meanwhile
    /// is held by both until their cards meet, which settles it on one (`clashes`). One
    /// released while its claim was being made is released again.
    pub async fn settle_claimed_alone(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(SETTLE_ALONE_EVERY) => {}
            }
            if self.claimed_alone.is_empty() {
                continue;
            }
            let Some(ready) = self.link.ready() else {
                continue;
            };
            let alone: Vec<(AgentInfo, Claiming)> = (self.claimed_alone.iter())
                .map(|e| e.value().clone())
                .collect();
            for (info, how) in alone {
                let claimed = self.claim_in(&ready, &info, how, true).await;
                let still = |e: &(AgentInfo, Claiming)| e.0 == info;
                // Gone from the set: released meanwhile (a name claimed here again alone
                // for another agent is settled next).
                let released = !self.claimed_alone.contains_key(&info.name);
                // Given up to another bridge's agent meanwhile (`clashes`): the key is
                // that agent's, not to be released.
                let given_up =
                    (self.directory.get(&info.name)).filter(AgentInfo::is_online_elsewhere);
                match (claimed, given_up) {
                    (Ok(()), Some(holder)) => self.hand_key_over(&holder, &info).await,
                    (Ok(()), None) if released => self.release(&info),
                    (Ok(()), None) => {
                        drop(self.claimed_alone.remove_if(&info.name, |_, e| still(e)))
                    }
                    // NATS did not answer in time: tried again shortly.
                    (Err(taken), _) if taken.holder_protocol == BRIDGE_PROTOCOL => {}
                    (Err(taken), _) => {
                        tracing::info!(name = %info.name, holder = %taken, "federation: a name registered here while NATS was away is held by another bridge too; their cards settle it");
                        self.claimed_alone.remove_if(&info.name, |_, e| still(e));
                    }
                }
            }
        }
    }

    /// Writes the key of `holder`'s name (held by another bridge's agent, `holder.bridge`)
    /// as that bridge's, if it still holds this bridge's claim for `loser`: this bridge
    /// gave the name up to `holder` (`clashes`), and its own claim, made while cut off,
    /// may have landed last; or a move of `holder` here did not complete. A lasting claim
    /// of the same agent stays lasting. Tried for as long as a claim waits.
    pub async fn hand_key_over(&self, holder: &AgentInfo, loser: &AgentInfo) {
        let Some(bridge) = holder.bridge.clone() else {
            return;
        };
        let key = agent_key(&holder.name);
        let deadline = tokio::time::Instant::now() + SETTLE_WITHIN;
        while tokio::time::Instant::now() < deadline {
            let Some(ready) = self.link.ready() else {
                tokio::time::sleep(RETRY_AFTER).await;
                continue;
            };
            let entry = match ready.names.entry(&key).await {
                Ok(Some(entry)) if entry.operation == Operation::Put => entry,
                Ok(_) => return,
                Err(_) => {
                    tokio::time::sleep(RETRY_AFTER).await;
                    continue;
                }
            };
            let Ok(held) = serde_json::from_slice::<Claim>(&entry.value) else {
                return;
            };
            let losers = held.bridge == self.link.bridge_id
                && (held.is_for(loser) || held.native_id.is_none());
            if !losers {
                return;
            }
            let lasting = held.lasting && held.is_for(holder);
            let value = Claim::value(holder, &bridge, lasting);
            match ready.names.update(&key, value, entry.revision).await {
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(error = %e, name = %holder.name, "federation: handing a name's key over again");
                    tokio::time::sleep(REREAD_AFTER).await;
                }
            }
        }
    }

    /// Forgets that `info`'s name was claimed here alone: the fleet settled it on another
    /// bridge's agent (`clashes`), or its move here did not complete, and it is not to be
    /// claimed once NATS is back. Whether it was.
    pub fn forget_claimed_alone(&self, info: &AgentInfo) -> bool {
        (self.claimed_alone)
            .remove_if(&info.name, |_, (alone, _)| alone.is_same_agent(info))
            .is_some()
    }
}

/// The longest wait between two tries of a release.
const RELEASE_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// Deletes `agent`'s name claim if `bridge` holds it, or it is `agent`'s lasting claim;
/// `Ok` also when there is nothing of ours to release, or it is no longer `wanted` once
/// the key is read. A claim of the name here stops wanting it before it writes the key,
/// and writes a key this bridge holds again (`claim_in`): the revision read here is then
/// behind, and the delete refused.
async fn release_once(
    ready: &Ready,
    bridge: &str,
    agent: &AgentInfo,
    wanted: impl Fn() -> bool,
) -> Result<(), String> {
    let key = agent_key(&agent.name);
    let Some(entry) = ready.names.entry(&key).await.map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let ours = serde_json::from_slice::<Claim>(&entry.value)
        .is_ok_and(|c| c.bridge == bridge || (c.lasting && c.is_for(agent)));
    if !ours || entry.operation != Operation::Put || !wanted() {
        return Ok(());
    }
    match (ready.names)
        .delete_expect_revision(&key, Some(entry.revision))
        .await
    {
        Ok(()) => Ok(()),
        // Changed meanwhile: read again.
        Err(e) if lost_race(&e) => Err("the claim changed".into()),
        Err(e) => Err(e.to_string()),
    }
}
