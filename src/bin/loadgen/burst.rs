//! `loadgen burst`: a burst several times a recipient's mailbox, sent to a reader that
//! reads slower than the sender sends, over a socket with a small receive buffer (so the
//! messages it has not read wait at the bridge, not in the kernel). Each message is either
//! delivered or the reader is told it was dropped, in its protocol: what the run checks is
//! that delivered + told-about = sent, under the bridge's `when_full` policy.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::agents::{self, Error, Proto};
use super::marker;
use super::server::Server;

/// What the burst measured.
#[derive(Debug, Serialize)]
pub struct BurstReport {
    pub path: String,
    pub when_full: String,
    pub mailbox_capacity: usize,
    pub sent: u64,
    pub delivered: u64,
    /// Messages the reader was told were dropped.
    pub told: u64,
    /// Neither delivered nor told of.
    pub lost: u64,
    /// The sender's and the reader's rates, messages a second.
    pub send_rate: f64,
    pub read_rate: f64,
    pub seconds: f64,
}

/// The words of the bridge's drop notice after its count (`websocket::dropped_text`).
const DROPPED: &[u8] = b" message(s) for this connection were dropped";

/// Messages dropped that `frame` tells of.
fn told_in(frame: &[u8]) -> u64 {
    let Some(at) = memchr::memmem::find(frame, DROPPED) else {
        return 0;
    };
    let digits = frame[..at]
        .iter()
        .rev()
        .take_while(|b| b.is_ascii_digit())
        .count();
    std::str::from_utf8(&frame[at - digits..at])
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

pub struct Burst {
    pub from: Proto,
    pub to: Proto,
    pub capacity: usize,
    pub when_full: String,
    /// The burst's size, in mailboxes.
    pub factor: usize,
    /// The sender's pace, messages a second; 0 sends the burst as fast as it can.
    pub rate: f64,
    /// The reader's pace, messages a second.
    pub read_rate: f64,
    pub payload: usize,
}

pub async fn run(burst: &Burst) -> Result<BurstReport, Error> {
    let server = Server::start(false, true, burst.capacity, &burst.when_full, "").await?;
    let run_id = &uuid::Uuid::new_v4().simple().to_string()[..6];
    let (sender_name, receiver_name) = (format!("b{run_id}-s"), format!("b{run_id}-r"));
    agents::set_receive_buffer(4096);
    let mut receiver = agents::receiver(&server.endpoints, burst.to, &receiver_name).await;
    agents::set_receive_buffer(0);
    let mut sender = agents::sender(agents::Pairing {
        endpoints: &server.endpoints,
        from: burst.from,
        to: burst.to,
        sender: sender_name,
        receiver: receiver_name,
        client_ids: false,
    })
    .await?;
    let receiver = receiver.as_mut().map_err(|e| e.clone())?;
    let total = (burst.capacity * burst.factor) as u64;
    let started = Instant::now();
    let send_gap = (burst.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / burst.rate));
    let read_gap = Duration::from_secs_f64(1.0 / burst.read_rate);
    let sending = async {
        for seq in 0..total {
            if let Some(gap) = send_gap {
                tokio::time::sleep_until((started + gap * seq as u32).into()).await;
            }
            sender.send(seq, &marker::text(seq, burst.payload)).await?;
        }
        Ok::<Duration, Error>(started.elapsed())
    };
    let reading = async {
        let (mut delivered, mut told, mut reads) = (0u64, 0u64, 0u32);
        while delivered + told < total {
            tokio::time::sleep_until((started + read_gap * reads).into()).await;
            reads += 1;
            let next = tokio::time::timeout(Duration::from_secs(10), receiver.next()).await;
            let Ok(Some(frame)) = next else { break };
            marker::scan(&frame, |_, _| delivered += 1);
            told += told_in(&frame);
        }
        (delivered, told)
    };
    let (sending, (delivered, told)) = tokio::join!(sending, reading);
    let send_seconds = sending?.as_secs_f64();
    let sent = total;
    let seconds = started.elapsed().as_secs_f64();
    server.stop().await;
    Ok(BurstReport {
        path: format!("{}→{}", burst.from.name(), burst.to.name()),
        when_full: burst.when_full.clone(),
        mailbox_capacity: burst.capacity,
        sent,
        delivered,
        told,
        lost: sent.saturating_sub(delivered + told),
        send_rate: sent as f64 / send_seconds.max(1e-9),
        read_rate: (delivered + told) as f64 / seconds.max(1e-9),
        seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_of_a_drop_notice_is_read() {
        let frame = br#"{"event":"error","data":{"message":"1204 message(s) for this connection were dropped: it did not"}}"#;
        assert_eq!(told_in(frame), 1204);
        assert_eq!(told_in(b"@@lg:1:2@@"), 0);
    }
}
