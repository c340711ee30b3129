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
    /// The file as TOML, its variables put in: a reload compares it key by key with what
    /// runs.
    pub source: Source,
}

/// A config file's TOML (`Config::source`); its `Debug` shows its sections' keys only, as
/// values may be secrets.
#[derive(Clone, Default, PartialEq)]
pub struct Source(pub toml::Table);

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = |v: &toml::Value| -> Vec<String> {
            v.as_table()
                .map(|t| t.keys().cloned().collect())
                .unwrap_or_default()
        };
        f.debug_map()
            .entries(self.0.iter().map(|(section, v)| (section, keys(v))))
            .finish()
    }
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
            source: Source::default(),
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

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeConfig {
    /// Where the SQLite store lives; `":memory:"` keeps nothing on disk. A relative path is
    /// taken from the directory of the config file.
    pub data_dir: String,
    /// `text` or `json`; the `--log-format` flag overrides it.
    pub log_format: Option<LogFormat>,
    /// Which log lines are written, as `RUST_LOG` says it (`info`, `agentbridge=debug`);
    /// unset, `RUST_LOG` decides, and `info` without it.
    pub log_level: Option<String>,
}

impl Default for BridgeConfig {
    fn default() -> Self {
        BridgeConfig {
            data_dir: "./data".into(),
            log_format: None,
            log_level: None,
        }
    }
}

impl BridgeConfig {
    /// The log filter to run with: `log_level`, else `RUST_LOG`, else `info`.
    pub fn log_filter(&self) -> String {
        (self.log_level.clone())
            .or_else(|| std::env::var("RUST_LOG").ok())
            .unwrap_or_else(|| "info".into())
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// `[admin]`: the operations listener (`/metrics`, `/healthz`, `/readyz`, and for
/// operators the console, reload and trace).
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default, try_from = "AdminSection")]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// The bearer token everything but `/healthz`, `/readyz` and `/metrics` asks for; none
    /// on a loopback address leaves it open to the host's own users.
    pub token: Option<String>,
}

impl std::fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "…"))
            .finish()
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
            token: None,
        }
    }
}

/// `[admin]` as written, before it is checked.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct AdminSection {
    listen: SocketAddr,
    token: Option<String>,
}

impl Default for AdminSection {
    fn default() -> Self {
        let AdminConfig { listen, token } = AdminConfig::default();
        AdminSection { listen, token }
    }
}

impl TryFrom<AdminSection> for AdminConfig {
    type Error = String;

    /// Reading every message and changing the running bridge is for operators: off the
    /// host's own addresses, only with a token.
    fn try_from(section: AdminSection) -> Result<AdminConfig, String> {
        let token = section.token.filter(|t| !t.is_empty());
        if token.is_none() && !section.listen.ip().is_loopback() {
            return Err(format!(
                "listen = \"{}\" is not a loopback address: set admin.token (a bearer token) to open the admin listener beyond this host",
                section.listen
            ));
        }
        Ok(AdminConfig {
            listen: section.listen,
            token,
        })
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

    /// Parses config text; `file` names it in errors. `${NAME}` is the environment
    /// variable `NAME` (`$${` is a literal `${`), so that secrets can come from the
    /// environment rather than the file.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        let text = interpolate(text, file)?;
        let mut config = toml::from_str::<Config>(&text).map_err(|e| locate(&text, file, &e))?;
        config.source = Source(toml::from_str(&text).map_err(|e| locate(&text, file, &e))?);
        Ok(config)
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

/// Where in a TOML line the scanner of `interpolate` is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum InToml {
    Bare,
    Basic,
    Literal,
    MultiBasic,
    MultiLiteral,
}

/// `text` with each `${NAME}` replaced by the environment variable `NAME`; one that is not
/// set is refused at its line. Inside a `"…"` string the value is escaped as TOML wants it
/// (a `"` or `\` in a secret stays itself), and comments are left as written.
fn interpolate(text: &str, file: &str) -> Result<String, ConfigError> {
    if !text.contains("${") {
        return Ok(text.to_owned());
    }
    let mut out = String::with_capacity(text.len());
    let mut state = InToml::Bare;
    for (index, line) in text.split_inclusive('\n').enumerate() {
        let mut rest = line;
        while let Some(c) = rest.chars().next() {
            let starts = |s: &str| rest.starts_with(s);
            let (next, taken) = match (state, c) {
                (InToml::Bare, '#') => (InToml::Bare, rest.len()),
                (InToml::Bare, '"') if starts(r#"""""#) => (InToml::MultiBasic, 3),
                (InToml::Bare, '\'') if starts("'''") => (InToml::MultiLiteral, 3),
                (InToml::Bare, '"') => (InToml::Basic, 1),
                (InToml::Bare, '\'') => (InToml::Literal, 1),
                (InToml::Basic | InToml::MultiBasic, '\\') => (state, 2),
                (InToml::Basic, '"') | (InToml::Literal, '\'') => (InToml::Bare, 1),
                (InToml::MultiBasic, '"') if starts(r#"""""#) => (InToml::Bare, 3),
                (InToml::MultiLiteral, '\'') if starts("'''") => (InToml::Bare, 3),
                (_, '$') if starts("$${") => {
                    out.push_str("${");
                    rest = &rest[3..];
                    continue;
                }
                (_, '$') if starts("${") => {
                    let (value, after) = variable(&rest[2..], file, index + 1)?;
                    match state {
                        InToml::Basic | InToml::MultiBasic => escape_basic(&mut out, &value),
                        _ => out.push_str(&value),
                    }
                    rest = after;
                    continue;
                }
                _ => (state, c.len_utf8()),
            };
            state = next;
            rest = push(&mut out, rest, taken);
        }
        // A one-line string ends with its line (TOML refuses it unclosed).
        if matches!(state, InToml::Basic | InToml::Literal) {
            state = InToml::Bare;
        }
    }
    Ok(out)
}

/// The value of the variable named at the start of `open` (after `${`), and what follows
/// its `}`.
fn variable<'a>(open: &'a str, file: &str, line: usize) -> Result<(String, &'a str), ConfigError> {
    let refused = |message: String| ConfigError::Invalid {
        file: file.to_owned(),
        line,
        key: format!("${{{}}}", open.split('}').next().unwrap_or_default()),
        message,
    };
    let Some(end) = open.find('}') else {
        return Err(refused(
            "a `${` with no `}`: write `$${` for a literal one".into(),
        ));
    };
    let name = &open[..end];
    let valid = (name.chars().next()).is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        return Err(refused(format!(
            "`{name}` is not an environment variable's name"
        )));
    }
    let value = std::env::var(name)
        .map_err(|_| refused(format!("the environment variable {name} is not set")))?;
    Ok((value, &open[end + 1..]))
}

/// Copies up to `n` bytes of `rest` (whole characters) to `out`; what follows.
fn push<'a>(out: &mut String, rest: &'a str, n: usize) -> &'a str {
    let n = (1..=n.min(rest.len()))
        .rev()
        .find(|&i| rest.is_char_boundary(i))
        .unwrap_or(rest.len());
    out.push_str(&rest[..n]);
    &rest[n..]
}

/// `value` as the inside of a TOML basic string.
fn escape_basic(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
}

/// Turns a TOML error into "file:line: key: message", finding the key from the error's
/// position: the `key =` on that line, inside the nearest `[section]` above it.
fn locate(text: &str, file: &str, err: &toml::de::Error) -> ConfigError {
    let message = err.message().trim().to_owned();
    let offset = err.span().map(|s| s.start).unwrap_or(0).min(text.len());
    let line_index = text[..offset].matches('\n').count();
    let lines: Vec<&str> = text.lines().collect();
    let this_line = lines.get(line_index).copied().unwrap_or("");

    // The section header on the error's line (a section refused whole), or above it.
    let section = std::iter::once(&this_line)
        .chain(lines[..line_index.min(lines.len())].iter().rev())
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
    fn environment_variables_are_put_in_and_a_missing_one_is_named() {
        // SAFETY (set_var): this test alone uses this variable.
        unsafe { std::env::set_var("AGENTBRIDGE_TEST_TOKEN", "s3cret") };
        let config = Config::parse(
            "[admin]\nlisten = \"0.0.0.0:9464\"\ntoken = \"${AGENTBRIDGE_TEST_TOKEN}\"\n",
            "bridge.toml",
        )
        .unwrap();
        assert_eq!(config.admin.unwrap().token.as_deref(), Some("s3cret"));
        let err = error("[admin]\n\ntoken = \"${AGENTBRIDGE_TEST_UNSET}\"\n");
        assert!(
            err.starts_with("bridge.toml:3: ${AGENTBRIDGE_TEST_UNSET}: the environment variable"),
            "{err}"
        );
        let config = Config::parse(
            "[tracker]\nlisten = \"127.0.0.1:0\"\ndefault_project = \"$${x}\"\n",
            "b.toml",
        );
        assert!(config.is_ok());
        // A secret with a quote and a backslash stays itself; comments are left alone.
        // SAFETY (set_var): this test alone uses this variable.
        unsafe { std::env::set_var("AGENTBRIDGE_TEST_ODD", r#"a"b\c"#) };
        let config = Config::parse(
            "[admin] # see ${NOT_SET}\ntoken = \"${AGENTBRIDGE_TEST_ODD}\" # ${NOT_SET}\n",
            "bridge.toml",
        )
        .unwrap();
        assert_eq!(config.admin.unwrap().token.as_deref(), Some(r#"a"b\c"#));
    }

    #[test]
    fn an_admin_listener_off_the_host_needs_a_token() {
        let err = error("[bridge]\n[admin]\nlisten = \"0.0.0.0:9464\"\n");
        assert!(err.starts_with("bridge.toml:2: admin:"), "{err}");
        assert!(err.contains("admin.token"), "{err}");
        let config = Config::parse("[admin]\nlisten = \"[::1]:9464\"\n", "bridge.toml").unwrap();
        assert!(config.admin.unwrap().token.is_none());
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
