//! Bridges federated over a real NATS cluster with JetStream, on loopback: agents on
//! different bridges meet as on one bridge, and what the fleet promises holds when a
//! bridge or a NATS server goes.

#[path = "../common/mod.rs"]
mod common;

mod credentials;
mod killed_bridge;
mod mail;
mod metrics;
mod nats_faults;
mod presence;
mod records;
mod routes;
mod support;

/// The translation contract's matrix with A and B on two bridges (`common::matrix`).
mod matrix {
    use crate::common::matrix::{self, Placement};
    use crate::common::peers::Proto;

    crate::matrix_cells!(Placement::TwoBridges);
}
