//! Reading `bridge.toml` again while running (SIGHUP, `POST /admin/reload`). The file goes
//! through the same validation as at start; a file that fails it changes nothing. Then
//! each section is compared key by key with what runs: a key that can change without
//! dropping a connection changes in place — through the code that applied it at start —
//! and any other (where something listens, the data directory, the fleet) is reported as
//! taking a restart and left as it was.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use toml::{Table, Value};

use crate::admin::{ReloadReport, Token};
use crate::config::Config;
use crate::core::Core;
use crate::protocols::endpoint::Reloader;
use crate::shared::listener::SharedLimits;
use crate::telemetry;

/// Sets the log filter (`RUST_LOG`'s syntax); what the command line installed.
pub type LogLevelHook = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The keys of the bridge's own sections that change while it runs (`*`: all of them).
fn own_reloadable(section: &str) -> Option<&'static [&'static str]> {
    Some(match section {
        "bridge" => &["log_level"],
        "admin" => &["token"],
        "routing" => &["*"],
        // The read budget is one semaphore every socket holds permits of.
        "limits" => &[
            "header_read_timeout_ms",
            "idle_timeout_ms",
            "body_read_timeout_ms",
            "drain_timeout_ms",
        ],
        "federation" => &[],
        _ => return None,
    })
}

/// What a running bridge changes when its config is read again.
pub struct Live {
    pub path: Option<PathBuf>,
    /// The config's TOML as it runs: what the file said at start, with every change a
    /// reload applied since.
    pub running: Mutex<Table>,
    pub core: Arc<Core>,
    pub token: Token,
    /// Whether the admin listener, if any, is on a loopback address (its address changes
    /// only at a restart).
    pub admin_on_loopback: bool,
    pub limits: SharedLimits,
    pub log_level: Option<LogLevelHook>,
    /// Each running endpoint, set once they have started.
    pub endpoints: OnceLock<Vec<(&'static str, Reloader)>>,
    /// One reload at a time.
    pub reloading: tokio::sync::Mutex<()>,
}

impl Live {
    pub async fn reload(&self) -> ReloadReport {
        let _one = self.reloading.lock().await;
        let Some(path) = &self.path else {
            return refused("the bridge was started without a config file to read again".into());
        };
        let config = match Config::load(path) {
            Ok(config) => config,
            Err(e) => return refused(e.to_string()),
        };
        let running = self.running.lock().clone();
        let mut report = ReloadReport::default();
        let mut applied = running.clone();
        let sections: Vec<&String> = (running.keys().chain(config.source.0.keys()))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for section in sections {
            let (old, new) = (running.get(section), config.source.0.get(section));
            if old == new {
                continue;
            }
            let reloadable = match own_reloadable(section) {
                Some(keys) => keys,
                // An endpoint's section, in both files: the keys its endpoint takes again.
                None if old.is_some() && new.is_some() => (config.endpoints.iter())
                    .find(|s| s.protocol() == section.as_str())
                    .map_or(&[][..], |s| s.reloadable()),
                None => {
                    report.needs_restart.push(format!(
                        "[{section}] (an endpoint starts or stops at a restart)"
                    ));
                    continue;
                }
            };
            let mut changed = Vec::new();
            for key in changed_keys(old, new) {
                if reloadable.contains(&"*") || reloadable.contains(&key.as_str()) {
                    changed.push(key);
                } else {
                    report.needs_restart.push(format!("{section}.{key}"));
                }
            }
            if changed.is_empty() {
                continue;
            }
            match self.apply(section, &config).await {
                Ok(()) => {
                    for key in changed {
                        set_key(&mut applied, section, &key, new);
                        report.changed.push(format!("{section}.{key}"));
                    }
                }
                Err(e) => report.needs_restart.push(format!("{section}: {e}")),
            }
        }
        *self.running.lock() = applied;
        telemetry::config_reloaded(true);
        tracing::info!(changed = ?report.changed, needs_restart = ?report.needs_restart, "config reloaded");
        report
    }

    /// Applies `section` of `config` (its reloadable keys) to the running bridge.
    async fn apply(&self, section: &str, config: &Config) -> Result<(), String> {
        match section {
            "bridge" => {
                let Some(set) = &self.log_level else {
                    return Err("the log level is set by whoever runs the bridge here".into());
                };
                set(&config.bridge.log_filter())
            }
            "admin" => {
                let token = config.admin.as_ref().and_then(|a| a.token.clone());
                // The listener keeps its address until a restart: one beyond this host
                // keeps a token, whatever the new file says of the address.
                if token.is_none() && !self.admin_on_loopback {
                    return Err("the admin listener runs on an address beyond this host \
                                until a restart, and keeps its token until then"
                        .into());
                }
                self.token.set(token);
                Ok(())
            }
            "routing" => {
                self.core.reconfigure_routing(&config.routing);
                Ok(())
            }
            "limits" => {
                let read_budget_bytes = self.limits.load().read_budget_bytes;
                self.limits.set(crate::shared::listener::Limits {
                    read_budget_bytes,
                    ..config.limits.clone()
                });
                Ok(())
            }
            protocol => {
                let endpoints = self.endpoints.get().map(Vec::as_slice).unwrap_or_default();
                let reloader = (endpoints.iter())
                    .find(|(name, _)| *name == protocol)
                    .map(|(_, reloader)| reloader);
                let section = (config.endpoints.iter()).find(|s| s.protocol() == protocol);
                match (reloader, section) {
                    (Some(reloader), Some(section)) => reloader.reload(section.as_ref()).await,
                    _ => Err("not running".into()),
                }
            }
        }
    }
}

fn refused(error: String) -> ReloadReport {
    telemetry::config_reloaded(false);
    tracing::warn!(%error, "config not reloaded: the running config stays");
    ReloadReport {
        error: Some(error),
        ..ReloadReport::default()
    }
}

/// The keys of a section whose values differ between `old` and `new` (absent counts as a
/// value: a key removed goes back to its default).
fn changed_keys(old: Option<&Value>, new: Option<&Value>) -> Vec<String> {
    let table = |v: Option<&Value>| v.and_then(Value::as_table).cloned().unwrap_or_default();
    let (old, new) = (table(old), table(new));
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    (keys.into_iter())
        .filter(|key| old.get(*key) != new.get(*key))
        .cloned()
        .collect()
}

/// Sets `section.key` in `running` to what `new` (the section as read) has, or removes it.
fn set_key(running: &mut Table, section: &str, key: &str, new: Option<&Value>) {
    let value = new
        .and_then(Value::as_table)
        .and_then(|t| t.get(key))
        .cloned();
    let entry = (running.entry(section.to_owned())).or_insert_with(|| Value::Table(Table::new()));
    if let Some(table) = entry.as_table_mut() {
        match value {
            Some(value) => {
                table.insert(key.to_owned(), value);
            }
            None => {
                table.remove(key);
            }
        }
    }
}

impl crate::admin::Reload for Live {
    fn reload(&self) -> std::pin::Pin<Box<dyn Future<Output = ReloadReport> + Send + '_>> {
        Box::pin(Live::reload(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_keys_are_those_whose_values_differ() {
        let old: Value = toml::from_str::<Table>("a = 1\nb = 2\nc = 3")
            .unwrap()
            .into();
        let new: Value = toml::from_str::<Table>("a = 1\nb = 5\nd = 4")
            .unwrap()
            .into();
        assert_eq!(changed_keys(Some(&old), Some(&new)), ["b", "c", "d"]);
        assert!(changed_keys(None, None).is_empty());
    }

    #[test]
    fn a_key_applied_is_set_as_read() {
        let mut running: Table = toml::from_str("[s]\na = 1\nb = 2").unwrap();
        let new: Value = toml::from_str::<Table>("a = 3").unwrap().into();
        set_key(&mut running, "s", "a", Some(&new));
        set_key(&mut running, "s", "b", Some(&new));
        assert_eq!(running["s"].as_table().unwrap().len(), 1);
        assert_eq!(running["s"]["a"].as_integer(), Some(3));
    }
}
