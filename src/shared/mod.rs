//! Building blocks the layers share, none of which knows a protocol: the WebSocket and
//! HTTP serving every endpoint uses (with the limits a public listener keeps), the JSON
//! and text helpers of the hot path, and small data structures.

pub mod arrival_order;
pub mod at_names;
pub mod body_budget;
pub mod budget;
pub mod clock;
pub mod deep_json;
pub mod each_once;
pub mod gate;
pub mod http_refusals;
pub mod json_writer;
pub mod latch;
pub mod listener;
pub mod pace;
pub mod raw_object;
pub mod text;
pub mod to_the_end;
pub mod websocket;
