//! The bridge and clients a test works with, and the task helpers more than one module
//! uses.

use std::net::SocketAddr;

use agentbridge::Bridge;
use agentbridge::protocols::synapse::proto::{
    SubmitTaskRequest, SynapseMessage, TaskStatus, TaskStatusStreamRequest, TaskStatusUpdate,
};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Request;

use crate::common::synapse::{Clients, clients, with_meta};
use crate::common::{self, start_bridge};

pub(crate) struct World {
    pub(crate) bridge: Bridge,
    pub(crate) addr: SocketAddr,
    pub(crate) c: Clients,
    pub(crate) http: reqwest::Client,
}

pub(crate) async fn world() -> World {
    world_with("").await
}

pub(crate) async fn world_with(extra: &str) -> World {
    let bridge = start_bridge(extra).await;
    let addr = bridge.addr("synapse").unwrap();
    World {
        c: clients(addr).await,
        http: common::http(),
        addr,
        bridge,
    }
}

impl World {
    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub(crate) async fn get(&self, path: &str) -> (u16, Value) {
        self.bodiless(reqwest::Method::GET, path).await
    }

    /// A request of `method` without a body: its status and JSON answer.
    pub(crate) async fn bodiless(&self, method: reqwest::Method, path: &str) -> (u16, Value) {
        let res = self
            .http
            .request(method, self.url(path))
            .send()
            .await
            .unwrap();
        (
            res.status().as_u16(),
            res.json().await.unwrap_or(Value::Null),
        )
    }

    pub(crate) async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let res = self
            .http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        (
            res.status().as_u16(),
            res.json().await.unwrap_or(Value::Null),
        )
    }

    pub(crate) async fn post_form(
        &self,
        path: &str,
        form: reqwest::multipart::Form,
    ) -> (u16, Value) {
        let res = self
            .http
            .post(self.url(path))
            .multipart(form)
            .send()
            .await
            .unwrap();
        (
            res.status().as_u16(),
            res.json().await.unwrap_or(Value::Null),
        )
    }

    /// Registers `agent` with its transport hints, by a harmless call.
    pub(crate) async fn register(&mut self, agent: &str, meta: &[(&'static str, &str)]) {
        let mut all = vec![("x-synapse-agent-id", agent)];
        all.extend_from_slice(meta);
        self.c
            .capabilities
            .get_capabilities(with_meta((), &[]))
            .await
            .unwrap();
        // Polling with identity registers the agent (and fetches nothing yet).
        let mut polled = self
            .c
            .messages
            .receive_callback(with_meta((), &all))
            .await
            .unwrap()
            .into_inner();
        while polled.next().await.is_some() {}
    }

    pub(crate) async fn poll(&mut self, agent: &str) -> Vec<SynapseMessage> {
        let mut stream = self
            .c
            .messages
            .receive_callback(with_meta((), &[("x-synapse-agent-id", agent)]))
            .await
            .unwrap()
            .into_inner();
        let mut out = Vec::new();
        while let Some(msg) = stream.next().await {
            out.push(msg.unwrap());
        }
        out
    }
}

/// Waits for the next update on a `StreamTaskStatus` stream.
pub(crate) async fn next_update(
    watching: &mut tonic::Streaming<TaskStatusUpdate>,
) -> TaskStatusUpdate {
    tokio::time::timeout(common::WAIT, watching.next())
        .await
        .expect("an update within the wait")
        .expect("the watch is open")
        .expect("an update, not an error")
}

/// Opens `StreamTaskStatus` subscribed to `ids`; returns the sender (kept open) and stream.
pub(crate) async fn watch(
    w: &mut World,
    ids: &[&str],
) -> (
    mpsc::Sender<TaskStatusStreamRequest>,
    tonic::Streaming<TaskStatusUpdate>,
) {
    let (tx, rx) = mpsc::channel(8);
    for id in ids {
        tx.send(TaskStatusStreamRequest {
            task_id: (*id).to_owned(),
            subscribe: true,
        })
        .await
        .unwrap();
    }
    let watching =
        w.c.tasks
            .stream_task_status(Request::new(ReceiverStream::new(rx)))
            .await
            .unwrap()
            .into_inner();
    (tx, watching)
}

pub(crate) async fn submit_type(w: &mut World, task_type: &str) -> String {
    let submitted =
        w.c.tasks
            .submit_task(Request::new(SubmitTaskRequest {
                task_type: task_type.into(),
                payload: Some(prost_types::Any {
                    type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
                    value: prost::Message::encode_to_vec(&format!("a {task_type} job")),
                }),
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner();
    assert!(submitted.success);
    assert_eq!(submitted.status, TaskStatus::Received as i32);
    submitted.task_id
}
