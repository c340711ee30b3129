//! Tracker members: who they are (cached from the store), how their tokens resolve, and
//! whether they are online — a member is online while at least one of its connections is
//! open and has not missed the heartbeat timeout.

use std::collections::HashMap;
use std::sync::Arc;

use dashmap::DashMap;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};

use super::db::MemberRow;
use super::wire::HeartbeatStatus;

/// Tokens are stored as the hex of their SHA-256; the token itself is never kept.
pub fn hash_token(token: &str) -> String {
    crate::shared::text::hex(&token_digest(token))
}

/// A token's SHA-256, which a request's token is looked up by: its hex and that string
/// were a third of what authenticating a REST call cost.
fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The digest a stored `token_hash` is the hex of.
fn stored_digest(token_hash: &str) -> Option<[u8; 32]> {
    let mut digest = [0; 32];
    hex::decode_to_slice(token_hash, &mut digest).ok()?;
    Some(digest)
}

/// A fresh member token: `tb-` and 128 random bits.
pub fn new_token() -> String {
    format!("tb-{}", uuid::Uuid::new_v4().simple())
}

/// A presence change worth announcing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    CameOnline,
    WentOffline,
    /// Still online, now `busy`, `idle` or plain `online`.
    StatusChanged(HeartbeatStatus),
}

#[derive(Default)]
struct Presence {
    /// connection id → whether it is alive (heartbeating within the timeout).
    connections: HashMap<u64, bool>,
    status: HeartbeatStatus,
}

impl Presence {
    fn online(&self) -> bool {
        self.connections.values().any(|alive| *alive)
    }
}

#[derive(Default)]
pub struct Members {
    /// Shared rather than copied out: a REST call's caller is one, and a member's row is
    /// a dozen allocations.
    by_slug: DashMap<String, Arc<MemberRow>>,
    /// A token's SHA-256 → its member's slug.
    by_token: DashMap<[u8; 32], String>,
    presence: Mutex<HashMap<String, Presence>>,
}

impl Members {
    pub fn insert(&self, member: MemberRow) {
        // No guard of one map is held while the other is locked.
        let old = (self.by_slug.get(&member.slug)).and_then(|old| stored_digest(&old.token_hash));
        if let Some(digest) = old {
            self.by_token.remove(&digest);
        }
        match stored_digest(&member.token_hash) {
            Some(digest) => {
                self.by_token.insert(digest, member.slug.clone());
            }
            None => {
                tracing::error!(member = %member.slug, "tracker: a member's token hash is not a SHA-256; its token is not accepted");
            }
        }
        self.by_slug.insert(member.slug.clone(), Arc::new(member));
    }

    /// The member holding `token`; none for an empty one, whatever a config declared.
    pub fn by_token(&self, token: &str) -> Option<Arc<MemberRow>> {
        if token.is_empty() {
            return None;
        }
        let slug = self.by_token.get(&token_digest(token))?.clone();
        self.get(&slug)
    }

    pub fn get(&self, slug: &str) -> Option<Arc<MemberRow>> {
        self.by_slug.get(slug).map(|m| m.clone())
    }

    pub fn contains(&self, slug: &str) -> bool {
        self.by_slug.contains_key(slug)
    }

    /// Every member, oldest first.
    pub fn list(&self) -> Vec<MemberRow> {
        let mut all: Vec<MemberRow> = self.by_slug.iter().map(|m| (**m).clone()).collect();
        all.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.slug.cmp(&b.slug)));
        all
    }

    /// Applies `change` to the member's presence and reports whether it crossed between
    /// online and offline.
    fn transition(&self, slug: &str, change: impl FnOnce(&mut Presence)) -> Option<Transition> {
        let mut all = self.presence.lock();
        let presence = all.entry(slug.to_owned()).or_default();
        let (before, status_before) = (presence.online(), presence.status);
        change(presence);
        let (after, status) = (presence.online(), presence.status);
        if presence.connections.is_empty() {
            all.remove(slug);
        }
        match (before, after) {
            (false, true) => Some(Transition::CameOnline),
            (true, false) => Some(Transition::WentOffline),
            (true, true) if status != status_before => Some(Transition::StatusChanged(status)),
            _ => None,
        }
    }

    pub fn connected(&self, slug: &str, conn: u64) -> Option<Transition> {
        self.transition(slug, |p| {
            p.connections.insert(conn, true);
        })
    }

    pub fn heartbeat(&self, slug: &str, conn: u64, status: HeartbeatStatus) -> Option<Transition> {
        self.transition(slug, |p| {
            p.connections.insert(conn, true);
            p.status = status;
        })
    }

    pub fn timed_out(&self, slug: &str, conn: u64) -> Option<Transition> {
        self.transition(slug, |p| {
            if let Some(alive) = p.connections.get_mut(&conn) {
                *alive = false;
            }
        })
    }

    pub fn disconnected(&self, slug: &str, conn: u64) -> Option<Transition> {
        self.transition(slug, |p| {
            p.connections.remove(&conn);
        })
    }

    /// `online | busy | idle | offline`.
    pub fn status(&self, slug: &str) -> &'static str {
        match self.presence.lock().get(slug) {
            Some(p) if p.online() => p.status.as_str(),
            _ => "offline",
        }
    }

    pub fn is_online(&self, slug: &str) -> bool {
        self.presence.lock().get(slug).is_some_and(Presence::online)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_hash_and_look_like_tracker_tokens() {
        let token = new_token();
        assert!(token.starts_with("tb-") && token.len() == 35, "{token}");
        assert_eq!(hash_token("abc").len(), 64);
        assert_ne!(hash_token(&token), token);
    }

    #[test]
    fn online_while_any_connection_is_alive() {
        let members = Members::default();
        assert_eq!(members.connected("a", 1), Some(Transition::CameOnline));
        assert_eq!(members.connected("a", 2), None);
        assert_eq!(members.timed_out("a", 1), None);
        assert_eq!(members.timed_out("a", 2), Some(Transition::WentOffline));
        assert_eq!(members.status("a"), "offline");
        assert_eq!(
            members.heartbeat("a", 2, HeartbeatStatus::Busy),
            Some(Transition::CameOnline)
        );
        assert_eq!(members.status("a"), "busy");
        assert_eq!(members.disconnected("a", 1), None);
        assert_eq!(members.disconnected("a", 2), Some(Transition::WentOffline));
        assert!(!members.is_online("a"));
    }
}
