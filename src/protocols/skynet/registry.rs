//! Registered Skynet agents and humans: created over HTTP, kept in the store, claimed in
//! the bridge's directory so their names are unique across every protocol. In a fleet a
//! registration is one of the fleet's shared records (`records`), so that an agent
//! registered through one bridge may join through any.

use std::sync::Arc;

use dashmap::DashMap;
use rusqlite::params;
use serde_json::{Map, Value, json};

use super::PROTOCOL;
use crate::core::{AgentInfo, Core, Expect, NameTaken, RecordChange, RecordError, Role, Status};
use crate::protocols::record_json::{decode, encode};
use crate::shared::arrival_order::ArrivalOrder;
use crate::store::{Migration, Store, StoreError};

static MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: "
        CREATE TABLE skynet_agents (
            id         TEXT PRIMARY KEY,
            name       TEXT NOT NULL UNIQUE,
            type       TEXT NOT NULL,
            role       TEXT,
            persona    TEXT,
            created_at INTEGER NOT NULL
        );
        CREATE TABLE skynet_humans (
            id         TEXT PRIMARY KEY,
            name       TEXT NOT NULL UNIQUE,
            created_at INTEGER NOT NULL
        );
    ",
}];

/// A registered agent (with its card's persistent fields) or human.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Profile {
    pub id: String,
    pub name: String,
    /// The card `type`; `None` for humans.
    pub agent_type: Option<String>,
    pub role: Option<String>,
    pub persona: Option<String>,
    pub created_at: i64,
}

impl Profile {
    pub fn is_human(&self) -> bool {
        self.agent_type.is_none()
    }

    /// The AgentCard (agents) or HumanProfile (humans) as the HTTP API returns it.
    pub fn to_json(&self, status: &str) -> Value {
        let mut out = Map::new();
        out.insert("id".into(), json!(self.id));
        out.insert("name".into(), json!(self.name));
        if let Some(agent_type) = &self.agent_type {
            out.insert("type".into(), json!(agent_type));
            if let Some(role) = &self.role {
                out.insert("role".into(), json!(role));
            }
            if let Some(persona) = &self.persona {
                out.insert("persona".into(), json!(persona));
            }
            out.insert("createdAt".into(), json!(self.created_at));
            out.insert("status".into(), json!(status));
        } else {
            out.insert("createdAt".into(), json!(self.created_at));
        }
        Value::Object(out)
    }

    pub fn directory_entry(&self) -> AgentInfo {
        let mut info = AgentInfo::new(&self.name, PROTOCOL, &self.id);
        info.role = if self.is_human() {
            Role::Human
        } else {
            Role::Agent
        };
        info.agent_type = Some(self.agent_type.clone().unwrap_or_else(|| "human".into()));
        info.description = self.role.clone();
        info.created_at = self.created_at;
        info
    }
}

/// The table of registrations in the fleet's records, keyed by the agent's or human's id.
pub const PROFILES: &str = "skynet-profiles";

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(transparent)]
    Taken(#[from] NameTaken),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The fleet's records did not take the change.
    #[error(transparent)]
    Fleet(#[from] RecordError),
}

pub struct Registry {
    core: Arc<Core>,
    store: Store,
    by_id: DashMap<String, Profile>,
    /// The order profiles came to this bridge, for `list`.
    order: ArrivalOrder,
}

impl Registry {
    /// Loads every registered agent and human and claims their names.
    pub async fn load(core: Arc<Core>, store: Store) -> Result<Registry, StoreError> {
        store.migrate("skynet", MIGRATIONS).await?;
        let profiles = store
            .read(|conn| {
                let mut out = Vec::new();
                let mut agents = conn.prepare(
                    "SELECT id, name, type, role, persona, created_at FROM skynet_agents ORDER BY rowid",
                )?;
                for row in agents.query_map([], |r| {
                    Ok(Profile {
                        id: r.get(0)?,
                        name: r.get(1)?,
                        agent_type: Some(r.get(2)?),
                        role: r.get(3)?,
                        persona: r.get(4)?,
                        created_at: r.get(5)?,
                    })
                })? {
                    out.push(row?);
                }
                let mut humans = conn.prepare("SELECT id, name, created_at FROM skynet_humans ORDER BY rowid")?;
                for row in humans.query_map([], |r| {
                    Ok(Profile {
                        id: r.get(0)?,
                        name: r.get(1)?,
                        agent_type: None,
                        role: None,
                        persona: None,
                        created_at: r.get(2)?,
                    })
                })? {
                    out.push(row?);
                }
                Ok(out)
            })
            .await?;
        let registry = Registry {
            core,
            store,
            by_id: DashMap::new(),
            order: ArrivalOrder::default(),
        };
        for profile in profiles {
            if let Err(e) = (registry.core.directory).register_known(profile.directory_entry()) {
                tracing::warn!(error = %e, "skynet: a registered name is held elsewhere; it stays unreachable");
                continue;
            }
            registry.list_here(profile);
        }
        Ok(registry)
    }

    /// Registers an agent (`agent_type` set) or a human (`None`).
    pub async fn create(
        self: &Arc<Self>,
        name: &str,
        agent_type: Option<&str>,
        role: Option<&str>,
        persona: Option<&str>,
    ) -> Result<Profile, RegisterError> {
        let profile = Profile {
            id: uuid::Uuid::new_v4().to_string(),
            name: name.to_owned(),
            agent_type: agent_type.map(str::to_owned),
            role: role.map(str::to_owned),
            persona: persona.map(str::to_owned),
            created_at: crate::core::now_ms(),
        };
        // Claim the name first: two racing registrations cannot both win.
        self.core
            .register_for_fleet(profile.directory_entry())
            .await?;
        // Claimed, the registration runs to its end even if its client goes: dropped before
        // its record is written or refused, it would leave the name claimed with no record.
        let registry = self.clone();
        let recorded = self
            .core
            .to_the_end
            .run(async move { registry.record(profile).await });
        recorded
            .await
            .unwrap_or(Err(RegisterError::Store(StoreError::Closed)))
    }

    /// Writes the record of `profile`, whose name is claimed, and keeps it here; the name
    /// is given up if either is refused.
    async fn record(&self, profile: Profile) -> Result<Profile, RegisterError> {
        let fleet = self.core.records();
        if let Some(fleet) = fleet {
            let written = fleet
                .write(PROFILES, &profile.id, encode(&profile), Expect::Absent)
                .await;
            if let Err(e) = written {
                self.core.unregister(&profile.name, PROTOCOL);
                return Err(e.into());
            }
        }
        if let Err(e) = self.keep(&profile).await {
            // Not registered after all: the fleet's record goes too.
            if let Some(fleet) = fleet
                && let Err(e) = fleet.remove(PROFILES, &profile.id).await
            {
                tracing::warn!(error = %e, "skynet: a registration not kept here stays in the fleet's records");
            }
            self.core.unregister(&profile.name, PROTOCOL);
            return Err(e.into());
        }
        Ok(profile)
    }

    /// Stores `profile` and lists it (again: the fleet's record of it may come first).
    /// Another registration with its name is refused by the table (`name` is unique).
    async fn keep(&self, profile: &Profile) -> Result<(), StoreError> {
        let row = profile.clone();
        self.store
            .write(move |conn| {
                match &row.agent_type {
                    Some(agent_type) => conn.execute(
                        "INSERT INTO skynet_agents (id, name, type, role, persona, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                         ON CONFLICT (id) DO UPDATE SET name = ?2, type = ?3, role = ?4, persona = ?5, created_at = ?6",
                        params![row.id, row.name, agent_type, row.role, row.persona, row.created_at],
                    )?,
                    None => conn.execute(
                        "INSERT INTO skynet_humans (id, name, created_at) VALUES (?1, ?2, ?3)
                         ON CONFLICT (id) DO UPDATE SET name = ?2, created_at = ?3",
                        params![row.id, row.name, row.created_at],
                    )?,
                };
                Ok(())
            })
            .await?;
        self.list_here(profile.clone());
        Ok(())
    }

    /// Lists `profile`, in its place if it was listed before.
    fn list_here(&self, profile: Profile) {
        self.order.arrived(&profile.id);
        self.by_id.insert(profile.id.clone(), profile);
    }

    /// A change the fleet made to its registrations (through this bridge or another).
    pub async fn apply(&self, change: RecordChange) -> Result<(), StoreError> {
        match change.value {
            Some(value) => self.apply_profile(decode(&value)?).await,
            None => self.forget(&change.key).await.map(drop),
        }
    }

    /// A registration: kept and listed here, its name in this bridge's directory unless
    /// an agent online through another bridge has it (the fleet claimed the name when it
    /// was registered).
    async fn apply_profile(&self, profile: Profile) -> Result<(), StoreError> {
        if self.by_id.get(&profile.id).is_some_and(|p| *p == profile) {
            return Ok(());
        }
        // A registration of this bridge's from before it was one of a fleet keeps its name.
        if (self.by_id.iter()).any(|p| p.name == profile.name && p.id != profile.id) {
            tracing::warn!(name = %profile.name, "skynet: a fleet registration's name is registered here as another");
            return Ok(());
        }
        if let Err(e) = self.core.directory.register(profile.directory_entry()) {
            tracing::debug!(reason = %e, "skynet: a fleet registration's name is held here by another");
        }
        self.keep(&profile).await
    }

    /// Removes a registration by id: from the fleet's records first, when there is a
    /// fleet.
    pub async fn delete(&self, id: &str) -> Result<Option<Profile>, RegisterError> {
        if !self.by_id.contains_key(id) {
            return Ok(None);
        }
        if let Some(fleet) = self.core.records() {
            fleet.remove(PROFILES, id).await?;
        }
        Ok(self.forget(id).await?)
    }

    async fn forget(&self, id: &str) -> Result<Option<Profile>, StoreError> {
        let Some(profile) = self.by_id.get(id).map(|p| p.clone()) else {
            return Ok(None);
        };
        let row_id = profile.id.clone();
        let human = profile.is_human();
        self.store
            .write(move |conn| {
                let table = if human {
                    "skynet_humans"
                } else {
                    "skynet_agents"
                };
                conn.execute(&format!("DELETE FROM {table} WHERE id = ?1"), [row_id])?;
                Ok(())
            })
            .await?;
        self.by_id.remove(id);
        self.order.forget(id);
        let held_here = (self.core.directory.get(&profile.name))
            .is_some_and(|a| a.protocol == PROTOCOL && a.native_id == profile.id);
        if held_here {
            self.core.unregister(&profile.name, PROTOCOL);
        }
        Ok(Some(profile))
    }

    pub fn by_id(&self, id: &str) -> Option<Profile> {
        self.by_id.get(id).map(|p| p.clone())
    }

    /// By id, or else by name — as Skynet's `GET /api/agents/:id` looks agents up.
    pub fn by_id_or_name(&self, key: &str, human: bool) -> Option<Profile> {
        if let Some(p) = self.by_id(key).filter(|p| p.is_human() == human) {
            return Some(p);
        }
        let id = self
            .core
            .directory
            .get(key)
            .filter(|a| a.protocol == PROTOCOL)?
            .native_id;
        self.by_id(&id).filter(|p| p.is_human() == human)
    }

    /// Every agent (or every human), oldest first.
    pub fn list(&self, humans: bool) -> Vec<Profile> {
        let mut all: Vec<((i64, u64), Profile)> = (self.by_id.iter())
            .filter(|p| p.is_human() == humans)
            .map(|p| ((p.created_at, self.order.place(&p.id)), p.clone()))
            .collect();
        all.sort_by_key(|(created, _)| *created);
        all.into_iter().map(|(_, profile)| profile).collect()
    }
}

/// Skynet's status vocabulary → the bridge's.
pub fn status_from_skynet(status: &str) -> Status {
    match status {
        "idle" => Status::Idle,
        "busy" => Status::Busy,
        "offline" => Status::Offline,
        "error" => Status::Error,
        _ => Status::Online,
    }
}

/// The bridge's status vocabulary → Skynet's (`idle | busy | offline | error`).
pub fn status_to_skynet(status: Status) -> &'static str {
    match status {
        Status::Online | Status::Idle => "idle",
        Status::Busy => "busy",
        Status::Offline => "offline",
        Status::Error => "error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::RoutingConfig;
    use crate::store::IN_MEMORY;

    #[tokio::test]
    async fn profiles_created_in_one_millisecond_are_listed_in_the_order_made() {
        let store = Store::open(IN_MEMORY).await.unwrap();
        let log = Arc::new(store.clone());
        let core = Core::new(log.clone(), log, &RoutingConfig::default());
        let names = |registry: &Registry| -> Vec<String> {
            (registry.list(false).into_iter()).map(|p| p.name).collect()
        };
        let registry = Registry::load(core.clone(), store.clone()).await.unwrap();
        for (id, name) in [("3", "carol"), ("1", "alice"), ("2", "bob")] {
            let profile = Profile {
                id: id.into(),
                name: name.into(),
                agent_type: Some("worker".into()),
                role: None,
                persona: None,
                created_at: 1,
            };
            registry.keep(&profile).await.unwrap();
        }
        assert_eq!(names(&registry), ["carol", "alice", "bob"]);
        // A restart keeps the order.
        drop(registry);
        let reloaded = Registry::load(
            Core::new(
                Arc::new(store.clone()),
                Arc::new(store.clone()),
                &RoutingConfig::default(),
            ),
            store,
        )
        .await
        .unwrap();
        assert_eq!(names(&reloaded), ["carol", "alice", "bob"]);
    }
}
