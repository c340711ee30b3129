//! `bridge.toml`: which endpoints run, where they listen, and the limits they keep.
//!
//! Each endpoint owns the type of its own section; this file only assembles them. A section
//! that is absent leaves its endpoint off. Unknown keys and bad values are refused with the
//! file, line and key named.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::core::RoutingConfig;
use crate::protocols;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub bridge: BridgeConfig,
    pub admin: Option<AdminConfig>,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub limits: protocols::Limits,
    pub skynet: Option<protocols::skynet::Config>,
    pub tracker: Option<protocols::tracker::Config>,
    pub synapse: Option<protocols::synapse::Config>,
    pub grid: Option<protocols::grid::Config>,
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
        if let Some(grid) = &mut config.grid {
            for pad in &mut grid.scratchpad.0 {
                if pad.is_relative() {
                    *pad = base.join(&*pad);
                }
            }
        }
        Ok(config)
    }

    /// Parses config text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        toml::from_str::<Config>(text).map_err(|e| locate(text, file, &e))
    }

    /// Every listener this config would open, as (endpoint, role, address).
    pub fn listeners(&self) -> Vec<(&'static str, &'static str, SocketAddr)> {
        let mut out = Vec::new();
        if let Some(admin) = &self.admin {
            out.push(("admin", "http: /metrics /healthz /readyz", admin.listen));
        }
        out.extend(protocols::listeners(self));
        out
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
        assert!(config.skynet.is_some());
    }

    #[test]
    fn absent_sections_leave_endpoints_off() {
        let config = Config::parse("", "bridge.toml").unwrap();
        assert!(config.skynet.is_none() && config.admin.is_none());
        assert_eq!(config.bridge.data_dir, "./data");
        assert_eq!(config.routing.mailbox_capacity.get(), 1024);
    }

    #[test]
    fn sections_given_bare_take_their_defaults() {
        let config = Config::parse("[admin]\n[synapse]\n", "bridge.toml").unwrap();
        assert_eq!(config.admin.unwrap().listen.to_string(), "127.0.0.1:9464");
        let synapse = config.synapse.unwrap();
        assert_eq!(synapse.listeners(), [("grpc+http", synapse.listen)]);
        let config = Config::parse(
            "[synapse]\ngrpc_listen = \"127.0.0.1:7001\"\nhttp_listen = \"127.0.0.1:7002\"\n",
            "bridge.toml",
        )
        .unwrap();
        let roles: Vec<_> = (config.synapse.unwrap().listeners().into_iter())
            .map(|(role, addr)| (role, addr.port()))
            .collect();
        assert_eq!(roles, [("grpc", 7001), ("http", 7002)]);
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
