//! The Synapse endpoint over real sockets: a tonic client generated from synapse.proto for
//! every RPC, both streams, every transport mode (callbacks against a local HTTP receiver),
//! and the HTTP/JSON gateway with a plain HTTP client.

#[path = "../common/mod.rs"]
mod common;

mod agents;
mod gateway;
mod inbox;
mod messages;
mod support;
mod tasks;
