//! Server-side mention enrichment, exactly as Skynet's workspace server does it: for chat
//! messages whose text contains `@`, every registered member whose `@name` occurs in the
//! lower-cased text (a plain substring test) is added, then `__all__` for `@all`.

use std::sync::Arc;

use super::wire::MENTION_ALL;
use crate::shared::at_names;
use crate::shared::each_once::push_once;

/// The members a chat may mention, in the order they are tried: `(card id, name)`, their
/// `@name`s lower-cased and indexed once rather than for every chat.
pub type Candidates = at_names::Needles<String>;

/// Enriches a message's mentions (`ids`, the client's, each once) in place, from `text`, a
/// chat's `payload.text`. `candidates` are in the order they are tried: registered
/// agents, then humans, then agents of other protocols. (A message whose mentions come
/// to nothing is written without the field: `SentMessage::to_json`.)
pub fn enrich(
    ids: &mut Vec<String>,
    text: Option<&str>,
    sender_id: &str,
    candidates: impl FnOnce() -> Arc<Candidates>,
) {
    let Some(text) = text.filter(|t| at_names::has_at(t)) else {
        return;
    };
    let lower = text.to_lowercase();
    // Only a text with an `@` pays for the member list.
    let candidates = candidates();
    // A plain substring test: a name counts whatever follows it.
    let mut seen = foldhash::HashSet::default();
    for id in candidates.found_in(&lower, |_| true) {
        if id != sender_id {
            push_once(ids, &mut seen, id.clone());
        }
    }
    if !ids.iter().any(|id| id == MENTION_ALL) && lower.contains("@all") {
        ids.push(MENTION_ALL.to_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::skynet::wire::{ClientFrame, parse_client_frame};
    use serde_json::{Value, json};

    fn enriched(msg: Value, sender: &str) -> Option<Value> {
        let frame = json!({ "action": "send", "data": msg }).to_string();
        let Ok(ClientFrame::Send(mut msg)) = parse_client_frame(&frame) else {
            panic!("a send: {frame}");
        };
        let members = [("id-alice", "Alice"), ("id-bob", "bob"), ("id-al", "al")];
        msg.enrich_mentions(sender, || {
            Arc::new(Candidates::new(
                members.map(|(id, name)| (id.to_owned(), name)),
            ))
        });
        msg.stamp("card");
        let written: Value = serde_json::from_str(&msg.to_json()).unwrap();
        written.get("mentions").cloned()
    }

    #[test]
    fn names_are_found_case_insensitively_as_substrings() {
        let m = enriched(
            json!({"type":"chat","payload":{"text":"hey **@ALICE** and @bobby"}}),
            "x",
        );
        // "@alice" also contains "@al": a plain substring test, as Skynet does it.
        assert_eq!(m, Some(json!(["id-alice", "id-bob", "id-al"])));
    }

    #[test]
    fn a_name_after_any_at_sign_counts_even_inside_a_word() {
        // As a substring test would find them: after the second of two `@`s, and
        // inside an address.
        let m = enriched(
            json!({"type":"chat","payload":{"text":"mail x@BOB.org, cc @@Al"}}),
            "x",
        );
        assert_eq!(m, Some(json!(["id-bob", "id-al"])));
    }

    #[test]
    fn client_mentions_are_kept_first_without_duplicates() {
        let m = enriched(
            json!({"type":"chat","payload":{"text":"@bob"},"mentions":["id-bob","id-zed","id-bob"]}),
            "x",
        );
        assert_eq!(m, Some(json!(["id-bob", "id-zed"])));
    }

    #[test]
    fn the_sender_is_not_added_and_at_all_is() {
        let m = enriched(
            json!({"type":"chat","payload":{"text":"@bob @all"}}),
            "id-bob",
        );
        // "@all" also matches the member "al": substring semantics again.
        assert_eq!(m, Some(json!(["id-al", "__all__"])));
    }

    #[test]
    fn only_chat_with_at_signs_is_enriched_and_empty_stays_absent() {
        assert_eq!(
            enriched(json!({"type":"task.assign","payload":{"text":"@bob"}}), "x"),
            None
        );
        assert_eq!(
            enriched(json!({"type":"chat","payload":{"text":"bob"}}), "x"),
            None
        );
        assert_eq!(
            enriched(
                json!({"type":"chat","payload":{"text":"hi"},"mentions":[]}),
                "x"
            ),
            None
        );
    }
}
