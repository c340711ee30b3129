//! The generated Synapse types and services, and the descriptor set they came from.

#![allow(clippy::all, missing_docs)]

tonic::include_proto!("synapse");

/// The compiled descriptor set of proto/synapse.proto and everything it imports.
pub const DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/synapse_descriptor.bin"));
