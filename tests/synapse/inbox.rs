//! The polling inbox: what an agent away or a stream that ended left is kept, in order,
//! until it is fetched or a stream takes it.

use agentbridge::protocols::synapse::proto::{SendMessageRequest, SynapseMessage};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request};

use crate::common;
use crate::common::synapse::{Stream, chat, clients, send, text_of, with_meta};
use crate::support::{World, world, world_with};

#[tokio::test]
async fn polling_keeps_messages_in_order_until_fetched_even_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    {
        let bridge = common::start_bridge_in(data, "").await;
        let mut c = clients(bridge.addr("synapse").unwrap()).await;
        let mut poller = c
            .messages
            .receive_callback(with_meta(
                (),
                &[
                    ("x-synapse-agent-id", "poller"),
                    ("x-synapse-transport", "polling"),
                ],
            ))
            .await
            .unwrap()
            .into_inner();
        while poller.next().await.is_some() {}
        let mut sender = c
            .messages
            .receive_callback(with_meta((), &[("x-synapse-agent-id", "sender")]))
            .await
            .unwrap()
            .into_inner();
        while sender.next().await.is_some() {}
        for i in 1..=3 {
            send(&mut c, chat("sender", "poller", &format!("m{i}")))
                .await
                .unwrap();
        }
        // Let the inbox writer finish before stopping.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        bridge.shutdown().await;
    }
    let bridge = common::start_bridge_in(data, "").await;
    let mut w = World {
        c: clients(bridge.addr("synapse").unwrap()).await,
        http: common::http(),
        addr: bridge.addr("synapse").unwrap(),
        bridge,
    };
    let got: Vec<String> = w.poll("poller").await.iter().map(text_of).collect();
    assert_eq!(got, ["m1", "m2", "m3"]);
    assert!(w.poll("poller").await.is_empty());
    let err =
        w.c.messages
            .receive_callback(Request::new(()))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    w.bridge.shutdown().await;
}

/// `ReceiveCallback` right after `SendMessage` returns sees the message: the poll waits
/// for the inbox writer to catch up with everything accepted before it.
#[tokio::test]
async fn a_poll_sees_every_message_accepted_before_it() {
    let mut w = world().await;
    w.register("inbox", &[("x-synapse-transport", "polling")])
        .await;
    w.register("beta", &[]).await;
    for round in 0..20 {
        let sends = (0..10).map(|i| {
            let mut client = w.c.messages.clone();
            async move {
                client
                    .send_message(Request::new(SendMessageRequest {
                        message: Some(chat("beta", "inbox", &format!("r{round} m{i}"))),
                    }))
                    .await
                    .unwrap()
            }
        });
        futures_util::future::join_all(sends).await;
        assert_eq!(w.poll("inbox").await.len(), 10, "round {round}");
    }
    w.bridge.shutdown().await;
}

/// What waited in an agent's inbox while it was away arrives, in order, on the stream it
/// opens, and leaves the inbox.
#[tokio::test]
async fn messages_kept_while_offline_arrive_in_order_when_the_stream_opens() {
    let mut w = world().await;
    w.register("sleeper", &[]).await;
    w.register("beta", &[]).await;
    for i in 1..=3 {
        send(&mut w.c, chat("beta", "sleeper", &format!("m{i}")))
            .await
            .unwrap();
    }
    let mut stream = Stream::open(w.addr, "sleeper").await;
    for i in 1..=3 {
        assert_eq!(text_of(&stream.next().await), format!("m{i}"));
    }
    send(&mut w.c, chat("beta", "sleeper", "m4")).await.unwrap();
    assert_eq!(text_of(&stream.next().await), "m4");
    assert!(w.poll("sleeper").await.is_empty(), "delivered, so gone");
    w.bridge.shutdown().await;
}

/// The number a test message carries at the start of its text.
fn seq_of(msg: &SynapseMessage) -> usize {
    text_of(msg)
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a numbered message")
}

/// A stream of `agent` on a narrow channel, `total` messages from "beta" sent to it.
async fn flooded_stream(w: &mut World, agent: &str, total: usize) -> Stream {
    w.register("beta", &[]).await;
    let narrow = common::synapse::narrow_channel(w.addr).await;
    let stream = Stream::open_on(narrow, agent).await;
    flood(w, agent, total).await;
    stream
}

/// Sends `total` numbered messages of about 8 KiB, more than a stream on a narrow channel
/// that is not read can take in (HTTP/2 window, output buffer), so some wait at the bridge.
async fn flood(w: &mut World, to: &str, total: usize) {
    let pad = "x".repeat(8 * 1024);
    for i in 0..total {
        send(&mut w.c, chat("beta", to, &format!("{i} {pad}")))
            .await
            .unwrap();
    }
}

/// A stream that ends (the client closes its side) leaves nothing behind: what it did not
/// write yet goes back to the agent's inbox.
#[tokio::test]
async fn deliveries_queued_for_an_ending_stream_go_back_to_the_inbox() {
    let mut w = world().await;
    let total = 300;
    let Stream { out, mut inbound } = flooded_stream(&mut w, "closing", total).await;
    // The client is done sending: the bridge ends the stream.
    drop(out);
    let mut seen = Vec::new();
    while let Some(msg) = tokio::time::timeout(common::WAIT, inbound.next())
        .await
        .expect("the stream ends within the wait")
    {
        seen.push(seq_of(&msg.unwrap()));
    }
    seen.extend(w.poll("closing").await.iter().map(seq_of));
    assert_eq!(seen, (0..total).collect::<Vec<_>>());
    w.bridge.shutdown().await;
}

/// An agent with two streams open is sent every message on each. What the newer one holds
/// when it ends is not kept for the agent again: its older stream was sent all of it.
#[tokio::test]
async fn what_a_newer_stream_leaves_undelivered_is_not_kept_while_an_older_one_has_it() {
    let mut w = world().await;
    assert_eq!(newer_streams_leftovers(&mut w).await, 0);
    w.bridge.shutdown().await;
}

/// As above, but the older stream's mailbox drops messages when full (`drop_oldest`): it
/// may not have them all, so what the newer one holds is kept.
#[tokio::test]
async fn what_a_newer_stream_leaves_undelivered_is_kept_when_the_older_one_may_drop() {
    let mut w = world_with("[routing]\nwhen_full = \"drop_oldest\"").await;
    assert!(newer_streams_leftovers(&mut w).await > 0);
    w.bridge.shutdown().await;
}

/// Opens two streams of one agent, floods it, reads everything on the older, lets the
/// bridge end the newer with messages still at the bridge: how many are then kept in the
/// agent's inbox.
async fn newer_streams_leftovers(w: &mut World) -> usize {
    let total = 300;
    let mut older = Stream::open(w.addr, "twin").await;
    let Stream { out, mut inbound } = flooded_stream(w, "twin", total).await;
    for i in 0..total {
        assert_eq!(seq_of(&older.next().await), i);
    }
    // The newer stream's client is done sending: the bridge ends that stream, with what
    // the client has not taken in still at the bridge.
    drop(out);
    let mut read = 0;
    while let Some(msg) = tokio::time::timeout(common::WAIT, inbound.next())
        .await
        .expect("the stream ends within the wait")
    {
        msg.unwrap();
        read += 1;
    }
    assert!(read < total, "the newer stream was sent everything: {read}");
    w.poll("twin").await.len()
}

/// A client that goes away (cancels the call) mid-stream: what the bridge still held for
/// it is kept in its inbox, in order, up to the last message.
#[tokio::test]
async fn deliveries_held_for_a_vanished_client_are_kept() {
    let mut w = world().await;
    let total = 300;
    let Stream { out, mut inbound } = flooded_stream(&mut w, "gone", total).await;
    let mut read = Vec::new();
    for _ in 0..5 {
        let msg = tokio::time::timeout(common::WAIT, inbound.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        read.push(seq_of(&msg));
    }
    assert_eq!(read, [0, 1, 2, 3, 4]);
    drop(inbound);
    drop(out);
    // The bridge notices the cancel on its own time.
    let kept = poll_through(&mut w, "gone", total - 1).await;
    // What was in flight on the connection is gone with it; the rest is kept, in order.
    let first = *kept.first().expect("something was kept");
    assert!(first > 4, "{kept:?}");
    assert_eq!(kept, (first..total).collect::<Vec<_>>());
    w.bridge.shutdown().await;
}

/// A stream whose mailbox overflows under `when_full = "disconnect"` is ended, and what
/// its mailbox held, the message that overflowed it and those after go to the agent's
/// inbox: nothing is lost.
#[tokio::test]
async fn a_stream_disconnected_for_overflow_leaves_its_messages_in_the_inbox() {
    let mut w = world_with("[routing]\nmailbox_capacity = 8\nwhen_full = \"disconnect\"").await;
    let total = 300;
    let Stream { out, mut inbound } = flooded_stream(&mut w, "slow", total).await;
    // The bridge ends the stream; what the client can still read, it reads.
    let mut seen = Vec::new();
    while let Some(Ok(msg)) = tokio::time::timeout(common::WAIT, inbound.next())
        .await
        .expect("the stream ends within the wait")
    {
        seen.push(seq_of(&msg));
    }
    drop(out);
    // Everything, the message that overflowed the mailbox included, in order.
    seen.extend(poll_through(&mut w, "slow", total - 1).await);
    assert_eq!(seen, (0..total).collect::<Vec<_>>());
    w.bridge.shutdown().await;
}

/// A stream that names its agent by its first message, whose client leaves while the bridge
/// is still sending what waited in the agent's inbox: that first message is stored and
/// delivered all the same.
#[tokio::test]
async fn the_message_a_stream_opens_with_is_kept_when_its_client_leaves_during_the_backlog() {
    use agentbridge::protocols::synapse::proto::synapse_message_service_client::SynapseMessageServiceClient;

    let mut w = world().await;
    w.register("leaver", &[]).await;
    w.register("peer", &[("x-synapse-transport", "polling")])
        .await;
    w.register("beta", &[]).await;
    // More than a narrow channel that is not read takes in: the backlog send waits.
    flood(&mut w, "leaver", 300).await;
    let narrow = common::synapse::narrow_channel(w.addr).await;
    let (out, rx) = mpsc::channel(4);
    out.send(chat("leaver", "peer", "said on the way out"))
        .await
        .unwrap();
    let inbound = SynapseMessageServiceClient::new(narrow)
        .stream_messages(Request::new(ReceiverStream::new(rx)))
        .await
        .unwrap()
        .into_inner();
    // Nothing is read; the client leaves while its backlog is being sent.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    drop(inbound);
    drop(out);
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        let polled = w.poll("peer").await;
        if polled.iter().any(|m| text_of(m) == "said on the way out") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stream's first message never reached its receiver"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    w.bridge.shutdown().await;
}

/// Polls `agent`'s inbox until message `last` is in it; the numbers polled, in order.
async fn poll_through(w: &mut World, agent: &str, last: usize) -> Vec<usize> {
    let mut kept = Vec::new();
    for _ in 0..500 {
        kept.extend(w.poll(agent).await.iter().map(seq_of));
        if kept.last() == Some(&last) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    kept
}
