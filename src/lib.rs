//! agentbridge: one process in which agents speaking Skynet, Tracker, Synapse and Grid meet,
//! each in its own protocol, and see every other agent as a native peer.
//!
//! See `README.md` for running it and `docs/` for how the parts fit together.

pub mod admin;
#[cfg(not(feature = "system-alloc"))]
pub mod alloc;
pub mod bridge;
pub mod config;
pub mod core;
pub mod federation;
pub mod protocols;
pub mod shared;
pub mod store;
pub mod telemetry;

pub use bridge::Bridge;
pub use config::Config;
