//! The translation contract's matrix: every ordered pair of protocols (A, B) × {a chat
//! with a mention; a task assigned → progress → result; a reply chain A→B→A→B; a message
//! to an unknown recipient}, with both agents on one bridge or on two bridges of a fleet.
//! `matrix_cells!` makes each cell its own test, `<a>_to_<b>::<scenario>`.

use super::fleet::Fleet;
use super::peers::{Net, Peer, Proto, What, now_ms};

/// Where the two agents of a cell connect.
#[derive(Clone, Copy, Debug)]
pub enum Placement {
    OneBridge,
    /// A on one bridge, B on another, federated over NATS.
    TwoBridges,
}

/// The bridges a cell runs on.
pub enum Bridges {
    One(Net),
    Fleet(Fleet),
}

impl Bridges {
    pub async fn shutdown(self) {
        match self {
            Bridges::One(net) => net.bridge.shutdown().await,
            Bridges::Fleet(fleet) => fleet.shutdown().await,
        }
    }
}

/// Connects B first, so A's protocol already lists it.
pub async fn pair(place: Placement, a: Proto, b: Proto) -> (Bridges, Peer, Peer) {
    match place {
        Placement::OneBridge => {
            let net = Net::start().await;
            let pb = net.peer(b).await;
            let pa = net.peer(a).await;
            (Bridges::One(net), pa, pb)
        }
        Placement::TwoBridges => {
            let fleet = Fleet::start(2).await;
            let pb = fleet.nets[1].peer(b).await;
            fleet.wait_known(0, &pb.name).await;
            let pa = fleet.nets[0].peer(a).await;
            fleet.wait_known(1, &pa.name).await;
            (Bridges::Fleet(fleet), pa, pb)
        }
    }
}

/// How far a timestamp a protocol shows may be from the test's clock: the bridge runs
/// on the same machine, so only second-granular formats and scheduling separate them.
const CLOCK_TOLERANCE_MS: i64 = 5_000;

fn assert_recent(peer: &Peer, ts: Option<i64>, what: &str) {
    let ts = ts.unwrap_or_else(|| panic!("{:?} shows no timestamp on {what}", peer.proto));
    let skew = (now_ms() - ts).abs();
    assert!(
        skew < CLOCK_TOLERANCE_MS,
        "{:?}: {what} timestamp {ts} is {skew} ms off",
        peer.proto
    );
}

pub async fn chat_with_a_mention(place: Placement, a: Proto, b: Proto) {
    let (net, mut pa, mut pb) = pair(place, a, b).await;
    let text = format!("@{} please review, from {}", b.agent(), a.agent());
    let sent = pa.chat(b.agent(), &text, None).await;
    let seen = pb.next(What::Chat).await;
    assert_eq!(seen.id, sent, "{a:?}→{b:?}: the id is kept: {}", seen.raw);
    assert_eq!(seen.from, a.agent(), "{}", seen.raw);
    assert_eq!(seen.text, text, "{}", seen.raw);
    assert_eq!(seen.reply_to, None, "{}", seen.raw);
    assert_recent(&pb, seen.timestamp, "a chat");
    net.shutdown().await;
}

pub async fn task_assigned_progress_result(place: Placement, a: Proto, b: Proto) {
    let (net, mut pa, mut pb) = pair(place, a, b).await;
    let (task_id, assignment_id) = pa.assign(b.agent(), "Write the parser").await;
    let task = pb.next_assignment().await;
    assert_eq!(
        task.task_id, task_id,
        "{a:?}→{b:?}: the same task id on both sides"
    );
    assert_eq!(task.from, a.agent());
    if let Some(id) = &assignment_id
        && b != Proto::Tracker
    {
        assert_eq!(&task.message_id, id, "the assignment keeps its id");
    }

    pb.progress(&task, "halfway there").await;
    let progress = pa.next(What::TaskProgress).await;
    assert_eq!(
        progress.task_id.as_deref(),
        Some(task_id.as_str()),
        "{}",
        progress.raw
    );
    assert_recent(&pa, progress.timestamp, "progress");
    if let Some(id) = &assignment_id {
        assert_eq!(
            progress.reply_to.as_ref(),
            Some(id),
            "progress answers the assignment: {}",
            progress.raw
        );
    }
    if a != Proto::Tracker {
        // A Tracker task event names the task's author; everyone else names the sender.
        assert_eq!(progress.from, b.agent(), "{}", progress.raw);
    }

    pb.complete(&task, "parser written").await;
    let done = pa.next(What::TaskDone).await;
    assert_eq!(
        done.task_id.as_deref(),
        Some(task_id.as_str()),
        "{}",
        done.raw
    );
    if let Some(id) = &assignment_id {
        assert_eq!(
            done.reply_to.as_ref(),
            Some(id),
            "the result answers the assignment: {}",
            done.raw
        );
    }
    if a != Proto::Tracker {
        assert_eq!(done.from, b.agent());
        assert_eq!(done.text, "parser written", "{}", done.raw);
    }
    net.shutdown().await;
}

pub async fn three_hop_reply_chain(place: Placement, a: Proto, b: Proto) {
    let (net, mut pa, mut pb) = pair(place, a, b).await;
    let m1 = pa.chat(b.agent(), "one", None).await;
    let s1 = pb.next(What::Chat).await;
    assert_eq!(s1.id, m1);

    let m2 = pb.chat(a.agent(), "two", Some(&s1.id)).await;
    let s2 = pa.next(What::Chat).await;
    assert_eq!((s2.id.as_str(), s2.text.as_str()), (m2.as_str(), "two"));
    assert_eq!(
        s2.reply_to.as_ref(),
        Some(&m1),
        "{a:?} gets its own id back: {}",
        s2.raw
    );

    let m3 = pa.chat(b.agent(), "three", Some(&s2.id)).await;
    let s3 = pb.next(What::Chat).await;
    assert_eq!(
        s3.reply_to.as_ref(),
        Some(&m2),
        "{b:?} gets its own id back: {}",
        s3.raw
    );

    pb.chat(a.agent(), "four", Some(&s3.id)).await;
    let s4 = pa.next(What::Chat).await;
    assert_eq!(s4.text, "four");
    assert_eq!(s4.reply_to.as_ref(), Some(&m3), "{}", s4.raw);
    assert_eq!(s4.from, b.agent());
    net.shutdown().await;
}

pub async fn unknown_recipient_is_an_error_in_the_senders_protocol(
    place: Placement,
    a: Proto,
    b: Proto,
) {
    let (net, mut pa, mut pb) = pair(place, a, b).await;
    let ghost = format!("ghost-of-{}", b.agent());
    let error = pa.chat_to_unknown(&ghost).await;
    assert!(
        error.contains(&ghost),
        "{a:?}: the error names the recipient: {error}"
    );
    // B's next message is the next real one: nothing of the refused one reached it.
    let sent = pa.chat(b.agent(), "the real one", None).await;
    let seen = pb.next(What::Chat).await;
    assert_eq!((seen.id, seen.text.as_str()), (sent, "the real one"));
    net.shutdown().await;
}

/// One test per scenario for every ordered pair, with the agents placed by `$place`, and
/// the check that the pairs are the registry's.
#[macro_export]
macro_rules! matrix_cells {
    ($place:expr) => {
        $crate::matrix_cells! { @cells $place;
            skynet_to_tracker: Skynet => Tracker;
            skynet_to_synapse: Skynet => Synapse;
            skynet_to_grid: Skynet => Grid;
            tracker_to_skynet: Tracker => Skynet;
            tracker_to_synapse: Tracker => Synapse;
            tracker_to_grid: Tracker => Grid;
            synapse_to_skynet: Synapse => Skynet;
            synapse_to_tracker: Synapse => Tracker;
            synapse_to_grid: Synapse => Grid;
            grid_to_skynet: Grid => Skynet;
            grid_to_tracker: Grid => Tracker;
            grid_to_synapse: Grid => Synapse;
        }
    };
    (@cells $place:expr; $($name:ident: $a:ident => $b:ident;)*) => {
        /// The ordered pairs the matrix has a cell for.
        const CELLS: &[(Proto, Proto)] = &[$((Proto::$a, Proto::$b)),*];
        $(
        mod $name {
            use super::*;

            #[tokio::test]
            async fn chat_with_a_mention() {
                matrix::chat_with_a_mention($place, Proto::$a, Proto::$b).await;
            }

            #[tokio::test]
            async fn task_assigned_progress_result() {
                matrix::task_assigned_progress_result($place, Proto::$a, Proto::$b).await;
            }

            #[tokio::test]
            async fn three_hop_reply_chain() {
                matrix::three_hop_reply_chain($place, Proto::$a, Proto::$b).await;
            }

            #[tokio::test]
            async fn unknown_recipient_is_an_error_in_the_senders_protocol() {
                matrix::unknown_recipient_is_an_error_in_the_senders_protocol(
                    $place,
                    Proto::$a,
                    Proto::$b,
                )
                .await;
            }
        }
        )*

        /// A protocol added to the registry fails this until it has a test peer and a cell
        /// for each pair it makes.
        #[test]
        fn the_matrix_has_a_cell_for_every_ordered_pair_of_the_registry() {
            use agentbridge::protocols::registry::PROTOCOLS;
            let registered: Vec<Proto> = PROTOCOLS.iter().map(|name| Proto::named(name)).collect();
            assert_eq!(registered, Proto::ALL, "tests/common/peers.rs: Proto::ALL");
            let mut pairs = Vec::new();
            for &a in &registered {
                for &b in registered.iter().filter(|&&b| b != a) {
                    pairs.push((a, b));
                }
            }
            let mut cells = CELLS.to_vec();
            let key = |(a, b): &(Proto, Proto)| (a.name(), b.name());
            pairs.sort_by_key(key);
            cells.sort_by_key(key);
            assert_eq!(cells, pairs);
        }
    };
}
