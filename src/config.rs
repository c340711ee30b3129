//! `bridge.toml`: which endpoints run, where they listen, and the limits they keep.
//!
//! The bridge's own sections are here; each endpoint owns the type of its section, which
//! the registry reads (`protocols::registry::read_section`). A section that is absent
//! leaves its endpoint off. Unknown keys and bad values are refused with the file, line and
//! key named.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};

use crate::core::RoutingConfig;
use crate::federation::FederationConfig;
use crate::protocols::endpoint::{Endpoint, Section};
use crate::protocols::registry;
use crate::shared::listener::Limits;

#[derive(Debug)]
pub struct Config {
    pub bridge: BridgeConfig,
    pub admin: Option<AdminConfig>,
    pub routing: RoutingConfig,
    pub limits: Limits,
    /// Joins the bridge to a fleet over NATS; without it the bridge stands alone.
    pub federation: Option<FederationConfig>,
    /// The sections of the endpoints that run, in the registry's order (the order they
    /// start in).
    pub endpoints: Vec<Box<dyn Section>>,
}

/// The bridge's own sections.
const OWN_SECTIONS: [&str; 5] = ["bridge", "admin", "routing", "limits", "federation"];

/// Every section name, for the "expected one of" of an unknown one.
static SECTIONS: LazyLock<&'static [&'static str]> = LazyLock::new(|| {
    let all: Vec<&'static str> = OWN_SECTIONS
        .iter()
        .chain(registry::PROTOCOLS)
        .copied()
        .collect();
    Vec::leak(all)
});

enum Key {
    Bridge,
    Admin,
    Routing,
    Limits,
    Federation,
    Endpoint(&'static str),
}

/// Reads a top-level key inside the deserializer, so that an unknown one is refused where
/// TOML can say where it is.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Key, D::Error> {
        deserializer.deserialize_identifier(self)
    }
}

impl Visitor<'_> for KeySeed {
    type Value = Key;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a section name")
    }

    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Key, E> {
        Ok(match key {
            "bridge" => Key::Bridge,
            "admin" => Key::Admin,
            "routing" => Key::Routing,
            "limits" => Key::Limits,
            "federation" => Key::Federation,
            other => match registry::PROTOCOLS.iter().find(|p| **p == other) {
                Some(protocol) => Key::Endpoint(protocol),
                None => return Err(E::unknown_field(other, &SECTIONS)),
            },
        })
    }
}

impl<'de> Deserialize<'de> for Config {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Config, D::Error> {
        deserializer.deserialize_map(ConfigVisitor)
    }
}

struct ConfigVisitor;

impl<'de> Visitor<'de> for ConfigVisitor {
    type Value = Config;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("bridge.toml's sections")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Config, A::Error> {
        use serde::de::Error;
        let mut config = Config {
            bridge: BridgeConfig::default(),
            admin: None,
            routing: RoutingConfig::default(),
            limits: Limits::default(),
            federation: None,
            endpoints: Vec::new(),
        };
        while let Some(key) = map.next_key_seed(KeySeed)? {
            match key {
                Key::Bridge => config.bridge = map.next_value()?,
                Key::Admin => config.admin = Some(map.next_value()?),
                Key::Routing => config.routing = map.next_value()?,
                Key::Limits => config.limits = map.next_value()?,
                Key::Federation => config.federation = Some(map.next_value()?),
                Key::Endpoint(protocol) => {
                    if config.endpoints.iter().any(|s| s.protocol() == protocol) {
                        return Err(A::Error::duplicate_field(protocol));
                    }
                    let section = registry::read_section(protocol, &mut map)
                        .expect("a registered protocol has a section")?;
                    config.endpoints.push(section);
                }
            }
        }
        config
            .endpoints
            .sort_by_key(|s| (registry::PROTOCOLS.iter()).position(|p| *p == s.protocol()));
        Ok(config)
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeConfig {
    /// Where the SQLite store lives; `":memory:"` keeps nothing on disk. A relative path is
    /// taken from the directory of the config file.
    pub data_dir: String,
    /// `text` or `json`; the `--log-format` flag overrides it.
    pub log_format: Option<LogFormat>,
}

impl Default for BridgeConfig {
    fn default() -> Self {
        BridgeConfig {
            data_dir: "./data".into(),
            log_format: None,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// `[admin]`: the operations listener (`/metrics`, `/healthz`, `/readyz`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: SocketAddr,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
        }
    }
}

/// A config that could not be read or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}:{line}: {key}: {message}")]
    Invalid {
        file: String,
        line: usize,
        key: String,
        message: String,
    },
}

impl Config {
    /// Reads and validates the config file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut config = Config::parse(&text, &path.display().to_string())?;
        let base = path.parent().unwrap_or(Path::new("."));
        config.bridge.data_dir = resolve_data_dir(base, &config.bridge.data_dir);
        for section in &mut config.endpoints {
            section.resolve_paths(base);
        }
        if let Some(federation) = &mut config.federation {
            federation.resolve_paths(base);
        }
        Ok(config)
    }

    /// Parses config text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        toml::from_str::<Config>(text).map_err(|e| locate(text, file, &e))
    }

    /// Every listener this config would open, as (endpoint, what it serves, address).
    pub fn listeners(&self) -> Vec<(&'static str, &'static str, SocketAddr)> {
        let mut out = Vec::new();
        if let Some(admin) = &self.admin {
            out.push(("admin", "http: /metrics /healthz /readyz", admin.listen));
        }
        for section in &self.endpoints {
            for listening in section.listeners() {
                out.push((section.protocol(), listening.serves, listening.addr));
            }
        }
        out
    }

    /// Endpoint `E`'s section, when it runs.
    pub fn endpoint<E: Endpoint>(&self) -> Option<&E::Config> {
        (self.endpoints.iter())
            .find(|s| s.protocol() == E::NAME)
            .and_then(|s| s.as_any().downcast_ref::<E::Config>())
    }
}

fn resolve_data_dir(base: &Path, data_dir: &str) -> String {
    if data_dir == crate::store::IN_MEMORY || Path::new(data_dir).is_absolute() {
        return data_dir.to_owned();
    }
    let joined = base.join(data_dir);
    joined.display().to_string()
}

/// Turns a TOML error into "file:line: key: message", finding the key from the error's
/// position: the `key =` on that line, inside the nearest `[section]` above it.
fn locate(text: &str, file: &str, err: &toml::de::Error) -> ConfigError {
    let message = err.message().trim().to_owned();
    let offset = err.span().map(|s| s.start).unwrap_or(0).min(text.len());
    let line_index = text[..offset].matches('\n').count();
    let lines: Vec<&str> = text.lines().collect();
    let this_line = lines.get(line_index).copied().unwrap_or("");

    let section = lines[..line_index.min(lines.len())]
        .iter()
        .rev()
        .chain(std::iter::once(&this_line))
        .find_map(|l| {
            let l = l.trim();
            (l.starts_with('[') && l.ends_with(']'))
                .then(|| l.trim_matches(|c| c == '[' || c == ']').trim().to_owned())
        });
    let key_here = this_line
        .split_once('=')
        .map(|(k, _)| k.trim().trim_matches('"').to_owned())
        .filter(|k| !k.is_empty() && !k.starts_with('['));
    // "unknown field `x`" and "missing field `x`" name the key themselves.
    let named = message
        .split('`')
        .nth(1)
        .filter(|_| message.starts_with("unknown field") || message.starts_with("missing field"))
        .map(str::to_owned);
    let key = match (section, named.or(key_here)) {
        (Some(s), Some(k)) if !this_line.trim().starts_with('[') || k != s => format!("{s}.{k}"),
        (Some(s), _) => s,
        (None, Some(k)) => k,
        (None, None) => "(top level)".to_owned(),
    };
    ConfigError::Invalid {
        file: file.to_owned(),
        line: line_index + 1,
        key,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(text: &str) -> String {
        Config::parse(text, "bridge.toml").unwrap_err().to_string()
    }

    #[test]
    fn the_bundled_config_is_valid() {
        let text = include_str!("../bridge.toml");
        let config = Config::parse(text, "bridge.toml").unwrap();
        assert!(config.admin.is_some());
        assert_eq!(config.endpoints.len(), registry::PROTOCOLS.len());
    }

    #[test]
    fn absent_sections_leave_endpoints_off() {
        let config = Config::parse("", "bridge.toml").unwrap();
        assert!(config.endpoints.is_empty() && config.admin.is_none());
        assert_eq!(config.bridge.data_dir, "./data");
        assert_eq!(config.routing.mailbox_capacity.get(), 1024);
    }

    #[test]
    fn sections_given_bare_take_their_defaults() {
        let config = Config::parse("[admin]\n[routing]\n", "bridge.toml").unwrap();
        assert_eq!(config.admin.unwrap().listen.to_string(), "127.0.0.1:9464");
        assert_eq!(config.routing.mailbox_capacity.get(), 1024);
    }

    #[test]
    fn unknown_keys_are_named_with_their_line() {
        let err =
            error("[bridge]\ndata_dir = \"x\"\n\n[skynet]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n");
        assert!(
            err.starts_with("bridge.toml:6: skynet.lisen: unknown field"),
            "{err}"
        );
    }

    #[test]
    fn unknown_sections_are_refused() {
        let err = error("[bridge]\n[nonsense]\nx = 1\n");
        assert!(err.starts_with("bridge.toml:2:"), "{err}");
        assert!(err.contains("nonsense"), "{err}");
    }

    #[test]
    fn bad_values_are_named_with_their_line() {
        let err = error("[skynet]\nlisten = \"not an address\"\n");
        assert!(err.starts_with("bridge.toml:2: skynet.listen:"), "{err}");
        let err = error("[routing]\nmailbox_capacity = 0\n");
        assert!(
            err.starts_with("bridge.toml:2: routing.mailbox_capacity:"),
            "{err}"
        );
        let err = error("[routing]\nwhen_full = \"explode\"\n");
        assert!(
            err.starts_with("bridge.toml:2: routing.when_full:"),
            "{err}"
        );
        assert!(err.contains("drop_oldest"), "{err}");
    }

    #[test]
    fn relative_data_dirs_follow_the_config_file() {
        assert_eq!(
            resolve_data_dir(Path::new("/etc/agentbridge"), "./data"),
            "/etc/agentbridge/./data"
        );
        assert_eq!(
            resolve_data_dir(Path::new("/x"), "/var/lib/ab"),
            "/var/lib/ab"
        );
        assert_eq!(resolve_data_dir(Path::new("/x"), ":memory:"), ":memory:");
    }
}
