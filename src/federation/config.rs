//! `[federation]`: the NATS cluster a bridge joins, who it is in the fleet, and how it
//! tells the others it is alive.

use std::path::PathBuf;

use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FederationConfig {
    /// The NATS servers of one cluster with JetStream; the client fails over between them.
    /// A list, or one string of URLs separated by commas, as `NATS_URL` takes them.
    #[serde(deserialize_with = "servers")]
    pub nats: Vec<String>,
    /// This bridge's name in the fleet, unique in it; by default the host name, each
    /// character a bridge id does not take ('.' of a dotted name) made '-'.
    pub bridge_id: String,
    /// Replicas of the stream and buckets the bridge creates (1 for a single NATS server).
    pub replicas: usize,
    /// The prefix of every subject, stream and bucket: fleets sharing a NATS account
    /// stay apart by it.
    pub prefix: String,
    /// How often the bridge tells the fleet it is alive.
    pub heartbeat_ms: u64,
    /// How long after its last heartbeat a bridge's agents are shown offline.
    pub presence_ttl_ms: u64,
    /// How long a message waits for JetStream to acknowledge it before the sender is told
    /// it could not be accepted.
    pub publish_timeout_ms: u64,
    /// NATS credentials: a `.creds` file, a token, or a user and password. Each key also
    /// takes the name the `nats` CLI's contexts or nats-server's `tls` block give it.
    #[serde(alias = "creds")]
    pub creds_file: Option<PathBuf>,
    pub token: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    /// TLS: the CA that signed the servers' certificates, and a client certificate.
    #[serde(alias = "ca", alias = "ca_file")]
    pub tls_ca: Option<PathBuf>,
    #[serde(alias = "cert", alias = "cert_file")]
    pub tls_cert: Option<PathBuf>,
    #[serde(alias = "key", alias = "key_file")]
    pub tls_key: Option<PathBuf>,
}

impl Default for FederationConfig {
    fn default() -> Self {
        FederationConfig {
            nats: vec!["nats://127.0.0.1:4222".into()],
            bridge_id: bridge_id_of(&host_name()),
            replicas: 3,
            prefix: "agentbridge".into(),
            heartbeat_ms: 1_000,
            presence_ttl_ms: 5_000,
            publish_timeout_ms: 5_000,
            creds_file: None,
            token: None,
            user: None,
            password: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
        }
    }
}

impl FederationConfig {
    /// Makes relative paths relative to the config file's directory.
    pub fn resolve_paths(&mut self, base: &std::path::Path) {
        for path in [
            &mut self.creds_file,
            &mut self.tls_ca,
            &mut self.tls_cert,
            &mut self.tls_key,
        ]
        .into_iter()
        .flatten()
        {
            if path.is_relative() {
                *path = base.join(&*path);
            }
        }
    }
}

/// `nats`: a list of URLs, or one string of them separated by commas.
fn servers<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Servers {
        Many(Vec<String>),
        One(String),
    }
    Ok(match Servers::deserialize(de)? {
        Servers::Many(urls) => urls,
        Servers::One(urls) => (urls.split(','))
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(str::to_owned)
            .collect(),
    })
}

/// A host name as a bridge id, which subjects, keys and the consumer's name take whole:
/// letters, digits, '-' and '_'; any other character (the dots of a fully qualified name)
/// becomes '-'. Two hosts whose names differ only there get one id: give them each their
/// own `bridge_id` (a fleet tells two bridges of one id, `id_clash`).
fn bridge_id_of(host: &str) -> String {
    let id: String = (host.chars())
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' => c,
            _ => '-',
        })
        .collect();
    if id.is_empty() {
        "bridge".to_owned()
    } else {
        id
    }
}

/// The host's name (a pod's name under Kubernetes), or "bridge" when it has none.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer it is given.
    let done = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..len]) {
        Ok(name) if done == 0 && !name.is_empty() => name.to_owned(),
        _ => "bridge".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dotted_host_name_is_a_bridge_id_with_dashes() {
        assert_eq!(bridge_id_of("pod-a"), "pod-a");
        assert_eq!(bridge_id_of("node1.example.com"), "node1-example-com");
        assert_eq!(bridge_id_of("höst"), "h-st");
        assert_eq!(bridge_id_of(""), "bridge");
        assert!(super::super::wire::is_token(
            &FederationConfig::default().bridge_id
        ));
    }

    #[test]
    fn credentials_and_tls_take_the_names_nats_clients_give_them() {
        let config: FederationConfig = toml::from_str(
            "creds = 'a.creds'\nuser = 'u'\nca_file = 'ca.pem'\ncert = 'c.pem'\nkey_file = 'k.pem'\n",
        )
        .unwrap();
        assert_eq!(config.creds_file, Some(PathBuf::from("a.creds")));
        assert_eq!(config.user.as_deref(), Some("u"));
        assert_eq!(config.tls_ca, Some(PathBuf::from("ca.pem")));
        assert_eq!(config.tls_cert, Some(PathBuf::from("c.pem")));
        assert_eq!(config.tls_key, Some(PathBuf::from("k.pem")));
        assert!(toml::from_str::<FederationConfig>("tls_cafile = 'x'").is_err());
    }

    #[test]
    fn the_servers_are_a_list_or_one_string_of_urls() {
        let nats = |toml: &str| toml::from_str::<FederationConfig>(toml).map(|c| c.nats);
        let both = vec!["nats://a:4222".to_owned(), "nats://b:4222".to_owned()];
        assert_eq!(
            nats("nats = ['nats://a:4222', 'nats://b:4222']").unwrap(),
            both
        );
        assert_eq!(nats("nats = 'nats://a:4222, nats://b:4222'").unwrap(), both);
        assert_eq!(nats("nats = 'nats://a:4222'").unwrap(), &both[..1]);
        assert!(nats("nats = 4222").is_err());
    }
}
