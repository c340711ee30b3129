//! Memory per idle connection: the bridge runs in a child process; N agents connect and
//! stay idle (Skynet: registered and joined; Tracker: created and authenticated; Grid: a
//! program's socket; Synapse: a `StreamMessages` stream on its own connection), and the
//! child's resident set is read before and after. `WARM` connections are made first and
//! not counted, so one-time allocations (thread pools, caches) do not flatter or blame them.

use std::time::Duration;

use futures_util::StreamExt;
use indicatif::ProgressBar;
use serde::Serialize;

use super::agents::{self, Error, Proto};
use super::server::{Server, rss_kib};

const WARM: usize = 100;
/// Connections being set up at once.
const PARALLEL: usize = 32;

#[derive(Debug, Serialize)]
pub struct IdleReport {
    pub protocol: Proto,
    pub connections: usize,
    pub rss_before_kib: u64,
    pub rss_after_kib: u64,
    pub kib_per_connection: f64,
}

pub async fn measure(
    proto: Proto,
    connections: usize,
    progress: &ProgressBar,
) -> Result<IdleReport, Error> {
    let server = Server::start(false, true, 1024, "replay", "").await?;
    let run = &uuid::Uuid::new_v4().simple().to_string()[..6];
    let names: Vec<String> = (0..WARM + connections.max(1))
        .map(|i| format!("idle{run}-{i}"))
        .collect();
    let (warm, counted) = names.split_at(WARM);
    let mut open = Vec::with_capacity(names.len());
    open.extend(connect_all(&server, proto, warm, progress).await?);
    settle().await;
    let (before, _) = rss_kib(server.pid).ok_or("cannot read the bridge's memory")?;
    open.extend(connect_all(&server, proto, counted, progress).await?);
    settle().await;
    let (after, _) = rss_kib(server.pid).ok_or("cannot read the bridge's memory")?;
    for connection in open {
        connection.abort();
    }
    server.stop().await;
    Ok(IdleReport {
        protocol: proto,
        connections: counted.len(),
        rss_before_kib: before,
        rss_after_kib: after,
        kib_per_connection: after.saturating_sub(before) as f64 / counted.len() as f64,
    })
}

async fn connect_all(
    server: &Server,
    proto: Proto,
    names: &[String],
    progress: &ProgressBar,
) -> Result<Vec<tokio::task::JoinHandle<()>>, Error> {
    let endpoints = &server.endpoints;
    futures_util::stream::iter(names)
        .map(|name| async move {
            // A WebSocket, or a Synapse `StreamMessages` stream on a connection of its own.
            let mut connection = agents::receiver(endpoints, proto, name).await?;
            progress.inc(1);
            // An idle client still reads what it is sent (others' presence), as real ones do.
            Ok(tokio::spawn(async move {
                while connection.next().await.is_some() {}
            }))
        })
        .buffer_unordered(PARALLEL)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// Lets the bridge finish what connecting started (presence fan-out, store writes).
/// Long enough for the bridge's metrics upkeep (every 5 s) to fold the histogram samples
/// that setting up the connections took, and for jemalloc to return the pages they held:
/// those are the set-up's, not what an idle connection keeps.
async fn settle() {
    tokio::time::sleep(Duration::from_secs(7)).await;
}
