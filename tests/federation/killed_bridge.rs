//! A bridge killed with SIGKILL: what it acknowledged reaches its recipients, through another
//! bridge or through it back, once and in order.

use std::time::{Duration, Instant};

use crate::common::fleet::{Fleet, QUICK, federation_section};
use crate::common::grid::{QUIET_AT_MOST, numbered, read_until_got};
use crate::common::peers::{Peer, Proto, What};
use crate::common::process::BridgeProcess;
use crate::common::skynet::{SkynetHttp, SkynetWs};
use crate::common::{self, WAIT, eventually_within};
use crate::support::{
    assert_once_in_order, grid_note, grid_request, read_rest, send_steadily, send_steadily_padded,
    spawn_bridge, spawn_member, wait_held,
};

/// A program that left a bridge which is then killed, and that connects to another
/// before the fleet takes the killed one for gone, gets what was sent to it in between,
/// before what is sent to it once connected: nobody kept that (the killed bridge was
/// to); the bridge it moved to, finding no one to hand its mail over, waits until it
/// takes the killed one for gone and keeps it from what that one missed.
#[tokio::test]
async fn a_program_that_left_a_bridge_killed_just_after_gets_what_that_bridge_missed() {
    use common::grid::{GridHttp, GridWs};
    let fleet = Fleet::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_member(&fleet, dir.path(), "b1").await;
    let (socket, _) = GridWs::connect(process.addr("grid"), "leaver", None).await;
    fleet.wait_known(0, "leaver").await;
    drop(socket);
    wait_held(&fleet, 0, "leaver", Some("b1"), false).await;
    process.kill_9();
    GridHttp::new(fleet.nets[0].grid)
        .send(&grid_request("between", "poster", "leaver"))
        .await;
    let mut moved = GridWs::quiet(fleet.nets[0].grid, "leaver", None).await;
    wait_held(&fleet, 0, "leaver", None, true).await;
    GridHttp::new(fleet.nets[0].grid)
        .send(&grid_request("after", "poster", "leaver"))
        .await;
    assert_eq!(moved.next_message().await["id"], "between");
    assert_eq!(moved.next_message().await["id"], "after");
    fleet.shutdown().await;
}

/// The sender's bridge killed with SIGKILL while messages are in flight: every message
/// its sender saw acknowledged (Skynet's echo) reaches the recipient on the other bridge,
/// and none twice.
#[tokio::test]
async fn what_a_killed_bridge_acknowledged_reaches_its_recipients_once() {
    let fleet = Fleet::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_member(&fleet, dir.path(), "b1").await;
    let mut receiver = fleet.nets[0].peer(Proto::Grid).await;

    let http = SkynetHttp::new(process.addr("skynet"));
    let card = http.agent("sky").await;
    let (mut sky, _) = SkynetWs::join(process.addr("skynet"), &card).await;
    fleet.wait_known(0, "sky").await;
    let members = http.get("/api/members").await.1;
    let executor = members
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == receiver.name.as_str())
        .expect("b1's Skynet lists the Grid program on b0")["id"]
        .clone();

    const WINDOW: usize = 16;
    let mut acknowledged = Vec::new();
    let send_window = async |sky: &mut SkynetWs, first: usize| {
        for n in first..first + WINDOW {
            let message = serde_json::json!({
                "id": format!("m{n}"), "type": "chat", "payload": { "text": format!("m{n}") },
                "mentions": [executor],
            });
            sky.action("send", message).await;
        }
    };
    for round in 0..8 {
        send_window(&mut sky, round * WINDOW).await;
        for _ in 0..WINDOW {
            let echo = sky.next_message().await;
            acknowledged.push(echo["id"].as_str().unwrap().to_owned());
        }
    }
    // A window in flight as the bridge dies: each of these may or may not have been taken.
    send_window(&mut sky, 8 * WINDOW).await;
    process.kill_9();

    let mut seen = each_arrives_once(&mut receiver, &acknowledged).await;
    while let Ok(message) =
        tokio::time::timeout(Duration::from_millis(700), receiver.next(What::Chat)).await
    {
        assert!(
            seen.insert(message.text.clone()),
            "{} arrived twice",
            message.text
        );
    }
    fleet.shutdown().await;
}

/// A Tracker member's bridge killed with SIGKILL while the member posts to the lobby:
/// every message that bridge answered 201 is in the lobby as the other bridge lists it,
/// once, and reaches the Skynet agent it mentions there, once.
#[tokio::test]
async fn what_a_killed_bridge_acknowledged_to_a_tracker_member_is_in_the_fleets_chat_once() {
    use crate::common::tracker::{TrackerHttp, TrackerWs};
    use serde_json::json;
    let fleet = Fleet::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_member(&fleet, dir.path(), "b1").await;
    let mut sky = fleet.nets[0].peer(Proto::Skynet).await;
    let (_coder, ok) = TrackerWs::auth_subscribed(process.addr("tracker"), "tb-coder").await;
    let lobby = ok["lobby_chat_id"].as_str().unwrap().to_owned();
    fleet.wait_known(0, "coder").await;

    let poster = TrackerHttp::new(process.addr("tracker"), "tb-coder");
    eventually_within("b1 knows the Skynet agent", WAIT, async || {
        poster.get(&format!("/members/{}", sky.name)).await.0 == 200
    })
    .await;
    let (acked_tx, mut acked_rx) = tokio::sync::mpsc::unbounded_channel();
    let posting = tokio::spawn(async move {
        for n in 0.. {
            let body = json!({ "chat_id": lobby, "content": format!("@sky m{n}") });
            match poster.try_post("/messages", body).await {
                Some((201, _)) => acked_tx.send(format!("@sky m{n}")).unwrap(),
                _ => break,
            }
        }
    });
    let mut acked = Vec::new();
    while acked.len() < 40 {
        acked.push(acked_rx.recv().await.expect("the member posts"));
    }
    process.kill_9();
    posting.await.unwrap();
    while let Ok(more) = acked_rx.try_recv() {
        acked.push(more);
    }

    let lobby = ok["lobby_chat_id"].as_str().unwrap();
    let listed = async || {
        let http = TrackerHttp::new(fleet.nets[0].tracker, "tb-admin");
        let (_, listed) = (http.get(&format!("/messages?chat_id={lobby}&limit=1000"))).await;
        (listed.as_array().into_iter().flatten())
            .filter_map(|m| m["content"].as_str().map(str::to_owned))
            .collect::<Vec<String>>()
    };
    let mut on_b0 = Vec::new();
    eventually_within("b0 lists every message b1 acknowledged", WAIT, async || {
        on_b0 = listed().await;
        acked.iter().all(|said| on_b0.contains(said))
    })
    .await;
    for said in &acked {
        let times = on_b0.iter().filter(|m| *m == said).count();
        assert_eq!(times, 1, "{said} listed {times} times: {on_b0:?}");
    }
    each_arrives_once(&mut sky, &acked).await;
    fleet.shutdown().await;
}

/// Reads `receiver`'s chats until each of `texts` came, none twice; the texts read.
async fn each_arrives_once(
    receiver: &mut Peer,
    texts: &[String],
) -> std::collections::HashSet<String> {
    let mut seen = std::collections::HashSet::new();
    let mut missing: std::collections::HashSet<&String> = texts.iter().collect();
    while !missing.is_empty() {
        let message = receiver.next(What::Chat).await;
        missing.remove(&message.text);
        assert!(seen.insert(message.text), "a chat arrived twice: {seen:?}");
    }
    seen
}

/// A program that leaves its bridge while a sender on another bridge sends to it steadily,
/// its bridge killed just after, and which connects again through a third gets every
/// message once, in the order sent: what its socket had not sent (kept before the fleet
/// hears it left), what its bridge kept for it and what that bridge missed, then what
/// comes live. (A program still connected when its bridge is killed may get twice what
/// it was written after the last acknowledgement, so is not asked for each once: see
/// `a_program_whose_bridge_is_killed_as_it_reads_gets_every_message_through_another`.)
#[tokio::test]
async fn a_program_that_left_a_bridge_killed_just_after_gets_its_messages_once_in_order() {
    use common::grid::GridWs;
    let fleet = Fleet::start(2).await;
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_member(&fleet, dir.path(), "b2").await;
    let socket = GridWs::quiet(process.addr("grid"), "survivor", None).await;
    for i in 0..2 {
        fleet.wait_known(i, "survivor").await;
    }
    const TOTAL: usize = 1500;
    let sender = GridWs::quiet(fleet.nets[0].grid, "steady", None).await;
    let pause = Duration::from_millis(20);
    let sending = send_steadily(sender, "steady", "survivor", TOTAL, pause);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let read = socket.close_reading().await;
    let mut got: Vec<usize> = read.iter().filter_map(numbered).collect();
    // Killed once the fleet has heard the program left.
    wait_held(&fleet, 1, "survivor", Some("b2"), false).await;
    process.kill_9();
    let mut socket = GridWs::connect_once_free(fleet.nets[1].grid, "survivor").await;
    let _sender = sending.await.unwrap();
    read_rest(
        &mut socket,
        (fleet.nets[1].grid, "survivor"),
        &mut got,
        TOTAL,
    )
    .await;
    assert_once_in_order(&got, TOTAL);
    fleet.shutdown().await;
}

/// A program connected to a bridge `kill -9`ed as messages flow to it gets every message
/// through another bridge, those the killed bridge had taken in and not yet written to its
/// socket too: the program reads slowly (a narrow socket, unread), so they wait in the
/// bridge's mailbox. What it was written and the fleet could not know of may come twice.
/// (Order is not asserted: the bridge it reconnects to waits for its own share of what the
/// bridges still here keep from the killed one's stretch, not for the other's; see
/// docs/federation.md, *Not yet done*.)
#[tokio::test]
async fn a_program_whose_bridge_is_killed_as_it_reads_gets_every_message_through_another() {
    use common::grid::GridWs;
    let SlowReader {
        fleet,
        dir: _dir,
        process,
        socket,
        ..
    } = SlowReader::on_a_third_bridge().await;
    // 16 KB each, so that the socket's buffers fill and the rest waits at the bridge.
    const TOTAL: usize = 600;
    let sender = GridWs::quiet(fleet.nets[0].grid, "steady", None).await;
    let pause = Duration::from_millis(20);
    let sending = send_steadily_padded(sender, "steady", "stayer", TOTAL, pause, 16 << 10);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut got = read_past_the_kill(process, socket).await;
    let mut socket = GridWs::connect_once_free(fleet.nets[1].grid, "stayer").await;
    let _sender = sending.await.unwrap();
    read_rest(&mut socket, (fleet.nets[1].grid, "stayer"), &mut got, TOTAL).await;
    let missing: Vec<usize> = (0..TOTAL).filter(|n| !got.contains(n)).collect();
    assert!(missing.is_empty(), "missing {missing:?}");
    fleet.shutdown().await;
}

/// A bridge `kill -9`ed and started again before the fleet takes it for gone reads again
/// what it had taken from the stream and not acknowledged: what waited in the mailbox of a
/// program reading slowly reaches the program when it reconnects there, ahead of what came
/// after. (What it had been written may come twice.)
#[tokio::test]
async fn a_program_on_a_bridge_killed_and_back_at_once_gets_what_waited_for_it_there() {
    use common::grid::GridWs;
    let SlowReader {
        fleet,
        dir,
        section,
        process,
        socket,
    } = SlowReader::on_a_patient_fleet().await;
    const TOTAL: usize = 600;
    let sender = GridWs::quiet(fleet.nets[0].grid, "steady", None).await;
    let pause = Duration::from_millis(20);
    let sending = send_steadily_padded(sender, "steady", "stayer", TOTAL, pause, 16 << 10);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut got = read_past_the_kill(process, socket).await;
    let process = spawn_bridge(dir.path(), "b1", &section).await;
    let mut socket = GridWs::connect_once_free(process.addr("grid"), "stayer").await;
    let _sender = sending.await.unwrap();
    read_rest(
        &mut socket,
        (process.addr("grid"), "stayer"),
        &mut got,
        TOTAL,
    )
    .await;
    let firsts: Vec<usize> = {
        let mut seen = std::collections::HashSet::new();
        got.iter().copied().filter(|n| seen.insert(*n)).collect()
    };
    assert_once_in_order(&firsts, TOTAL);
    // The killed run's last heartbeat, read as the new run starts, is not another bridge
    // under its id (`id_clash`): many heartbeats later, the bridge is still ready.
    let readyz = format!("http://{}/readyz", process.addr("admin"));
    let said = common::http().get(&readyz).send().await.unwrap();
    assert_eq!(said.text().await.unwrap(), "ready\n");
    drop(process);
    fleet.shutdown().await;
}

/// A program connected to a bridge `kill -9`ed gets, through another bridge, what that
/// bridge accepted for it itself and had not yet written to its socket: messages from an
/// agent on the same bridge, which it routed as it accepted them, not from the stream. The
/// program reads slowly (a narrow socket, unread), so they wait in the bridge's mailbox.
/// What it was written and the fleet could not know of may come twice.
#[tokio::test]
async fn a_program_whose_bridge_is_killed_as_it_reads_gets_what_that_bridge_accepted_for_it() {
    let SlowReader {
        fleet,
        dir: _dir,
        process,
        socket,
        ..
    } = SlowReader::on_a_third_bridge().await;
    let sending = SentUntilKilled::start(process.addr("grid"), "stayer").await;
    let mut got = read_past_the_kill(process, socket).await;
    let accepted = sending.accepted().await;
    read_rest_of((fleet.nets[1].grid, "stayer"), &mut got, &accepted).await;
    fleet.shutdown().await;
}

/// As `a_program_whose_bridge_is_killed_as_it_reads_gets_what_that_bridge_accepted_for_it`,
/// the bridge started again before the fleet takes it for gone: it routes again what its
/// killed run accepted and perhaps did not write, and the program gets it there — before
/// what its sender, going on through the restarted bridge at once, sent it after.
#[tokio::test]
async fn a_program_on_a_bridge_killed_and_back_at_once_gets_what_it_accepted_before_what_came_after()
 {
    use common::grid::{GridHttp, GridWs};
    let SlowReader {
        fleet,
        dir,
        section,
        process,
        socket,
    } = SlowReader::on_a_patient_fleet().await;
    let sending = SentUntilKilled::start(process.addr("grid"), "stayer").await;
    let mut got = read_past_the_kill(process, socket).await;
    let accepted = sending.accepted().await;
    let before_restart = got.len();
    let process = spawn_bridge(dir.path(), "b1", &section).await;
    let at = (process.addr("grid"), "stayer");
    let mut socket = GridWs::connect_once_free(at.0, "stayer").await;
    const AFTER: usize = 1_000_000;
    let http = GridHttp::new(at.0);
    for n in AFTER..AFTER + 20 {
        let id = format!("m{n}");
        assert!(
            http.try_send(&grid_note(&id, "neighbour", "stayer", "after"))
                .await
        );
    }
    let wanted = (accepted.iter().copied())
        .chain(AFTER..AFTER + 20)
        .collect();
    read_until_got(&mut socket, at, &mut got, &wanted).await;
    let since = &got[before_restart..];
    let first_after = since.iter().position(|&n| n >= AFTER);
    let late: Vec<usize> = (since[first_after.unwrap_or(since.len())..].iter())
        .copied()
        .filter(|&n| n < AFTER && !got[..before_restart].contains(&n))
        .collect();
    assert!(
        late.is_empty(),
        "accepted before the kill, came after later ones: {late:?}"
    );
    let missing: Vec<usize> = (wanted.iter().copied())
        .filter(|n| !got.contains(n))
        .collect();
    assert!(missing.is_empty(), "missing {missing:?}");
    drop(process);
    fleet.shutdown().await;
}

/// A program reading more slowly than a batch's acknowledgement waits for (`WRITTEN_WITHIN`,
/// 5 s) loses nothing when its bridge is `kill -9`ed: the batches acknowledged before they
/// were written are carried in the bridge's heartbeat, and the other bridges read the
/// stream again from there — what the bridge accepted itself and what came through the
/// stream alike. (What it was written may come twice.)
#[tokio::test]
async fn a_program_further_behind_than_acknowledgements_wait_gets_everything_through_another() {
    let SlowReader {
        fleet,
        dir: _dir,
        process,
        socket,
        ..
    } = SlowReader::on_a_third_bridge().await;
    let through = [process.addr("grid"), fleet.nets[0].grid];
    let accepted = sent_and_left_unwritten(&fleet, "b2", &through, "stayer").await;
    let mut got = read_past_the_kill(process, socket).await;
    read_rest_of((fleet.nets[1].grid, "stayer"), &mut got, &accepted).await;
    fleet.shutdown().await;
}

/// As `a_program_further_behind_than_acknowledgements_wait_gets_everything_through_another`,
/// the bridge started again before the fleet takes it for gone: it reads the stream again
/// from where its killed run's heartbeat said the deliveries not written began.
#[tokio::test]
async fn a_program_further_behind_than_acknowledgements_wait_gets_everything_from_its_bridge_back()
{
    let SlowReader {
        fleet,
        dir,
        section,
        process,
        socket,
    } = SlowReader::on_a_patient_fleet().await;
    let through = [process.addr("grid"), fleet.nets[0].grid];
    let accepted = sent_and_left_unwritten(&fleet, "b1", &through, "stayer").await;
    let mut got = read_past_the_kill(process, socket).await;
    let process = spawn_bridge(dir.path(), "b1", &section).await;
    read_rest_of((process.addr("grid"), "stayer"), &mut got, &accepted).await;
    drop(process);
    fleet.shutdown().await;
}

/// As `a_program_further_behind_than_acknowledgements_wait_gets_everything_from_its_bridge_back`,
/// the bridge stopped cleanly, alone in its fleet: its stop deletes its heartbeat, and with
/// it the floor of what it acknowledged unwritten, and no other bridge heard it to keep its
/// program's mail. Its store kept that floor with what was pending, and it reads the stream
/// again from there as it starts.
#[tokio::test]
async fn a_program_further_behind_than_acknowledgements_wait_gets_everything_from_its_bridge_stopped_and_back()
 {
    let fleet = Fleet::start_timed(0, PATIENT).await;
    let section = federation_section(&fleet.nats, &fleet.prefix, "b1", PATIENT);
    let SlowReader {
        fleet,
        dir,
        section,
        mut process,
        socket,
    } = SlowReader::on(fleet, "b1", section).await;
    let through = [process.addr("grid")];
    let accepted = sent_and_left_unwritten(&fleet, "b1", &through, "stayer").await;
    process.signal(libc::SIGTERM);
    let mut socket = socket;
    let read = socket.read_until_closed().await;
    let mut got: Vec<usize> = read.iter().filter_map(numbered).collect();
    assert!(process.exited(WAIT).is_some(), "the bridge stops");
    let beat = fleet.bucket("bridges").await.get("b1").await;
    assert!(
        beat.expect("read").is_none(),
        "its stop deleted its heartbeat"
    );
    let process = spawn_bridge(dir.path(), "b1", &section).await;
    read_rest_of((process.addr("grid"), "stayer"), &mut got, &accepted).await;
    drop(process);
    fleet.shutdown().await;
}

/// As `a_program_further_behind_than_acknowledgements_wait_gets_everything_from_its_bridge_back`,
/// with a second program on the bridge that reads as it is sent to, while the notes for
/// the slow one wait. The restarted bridge reads its stretch again from where the slow
/// one's deliveries not written began, and routes again only what its killed run had not
/// done with: the prompt program, which had everything, gets nothing twice.
#[tokio::test]
async fn a_program_beside_one_further_behind_gets_each_message_once_from_its_bridge_back() {
    beside_one_further_behind_from_its_bridge_back("stayer").await;
}

/// As `a_program_beside_one_further_behind_gets_each_message_once_from_its_bridge_back`,
/// the slow program's notes broadcast, so that the prompt program is sent them too, and
/// reads them as they come: the restarted bridge routes each broadcast its killed run had
/// not written to the slow program again to that program only, and the prompt one gets
/// none of them twice.
#[tokio::test]
async fn a_program_beside_one_further_behind_gets_each_broadcast_once_from_its_bridge_back() {
    beside_one_further_behind_from_its_bridge_back("broadcast").await;
}

/// A slow program and a prompt one beside it on a bridge, the slow one's notes sent to
/// `slow_to`; the bridge killed and started again: the slow one gets everything, the prompt
/// one each of its notes once.
async fn beside_one_further_behind_from_its_bridge_back(slow_to: &'static str) {
    let SlowReader {
        fleet,
        dir,
        section,
        process,
        socket,
    } = SlowReader::on_a_patient_fleet().await;
    let mut beside = PromptBeside::sent_to(&fleet, "b1", &process, slow_to).await;
    // What was done with in the last 200 ms before a kill is routed again (the bridge keeps
    // what is pending that often: `store::redelivery`): killed well after the prompt
    // program read its last note.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut got = read_past_the_kill(process, socket).await;
    let mut got_by_prompt = beside.read_past_the_kill().await;
    let process = spawn_bridge(dir.path(), "b1", &section).await;
    read_rest_of((process.addr("grid"), "stayer"), &mut got, &beside.accepted).await;
    // Everything it is sent after the restart comes after what the restart routed again.
    let at = (process.addr("grid"), "prompt");
    PromptBeside::read_to_a_last_note(&fleet, at, &mut got_by_prompt).await;
    PromptBeside::assert_each_once(&got_by_prompt);
    drop(process);
    fleet.shutdown().await;
}

/// As `a_program_beside_one_further_behind_gets_each_message_once_from_its_bridge_back`,
/// the two programs reconnecting through another bridge once the fleet took theirs for
/// gone: the others keep again, from the stretch the killed bridge's heartbeat carried, only
/// what each recipient had not been written — the slow program's notes, not the prompt
/// one's, whether the killed bridge had acknowledged them or not. Killed once a heartbeat
/// told of everything the prompt program was sent (what was routed after the last
/// heartbeat would come again).
#[tokio::test]
async fn a_program_beside_one_further_behind_gets_each_message_once_through_another() {
    let SlowReader {
        fleet,
        dir: _dir,
        process,
        socket,
        ..
    } = SlowReader::on_a_third_bridge().await;
    let mut beside = PromptBeside::sent_to(&fleet, "b2", &process, "stayer").await;
    let js = fleet.jetstream().await;
    let stream = js.get_stream(fleet.stream_name());
    let stream = stream.await.expect("the fleet's stream");
    let sent = stream
        .get_info()
        .await
        .expect("its info")
        .state
        .last_sequence;
    // A heartbeat that tells of all that, naming the slow program's floor only.
    let bridges = fleet.bucket("bridges").await;
    let told = async || tells_of_all_behind_only(&bridges, "b2", sent, "stayer").await;
    let what = "a heartbeat naming the slow program only, past all that was sent";
    eventually_within(what, WAIT, told).await;
    let mut got = read_past_the_kill(process, socket).await;
    let mut got_by_prompt = beside.read_past_the_kill().await;
    let through = fleet.nets[1].grid;
    read_rest_of((through, "stayer"), &mut got, &beside.accepted).await;
    PromptBeside::read_to_a_last_note(&fleet, (through, "prompt"), &mut got_by_prompt).await;
    PromptBeside::assert_each_once(&got_by_prompt);
    fleet.shutdown().await;
}

/// A prompt program beside a slow one, on a bridge whose heartbeats are seconds apart,
/// killed after it was written notes its heartbeat never told of: the slow program holds
/// back the bridge's acknowledgements, so those notes are past both its acknowledgement
/// floor and its last heartbeat. Its floors record, put within `RECORD_EVERY`, told of
/// them; the others go by it, the later put, and send the prompt program none of them
/// again through another bridge, while the slow program gets what it was not written.
/// All of it before the slow program's first note not written is `WRITTEN_WITHIN` (5 s)
/// old: the wait for a late batch to be carried puts a heartbeat at once.
#[tokio::test]
async fn a_prompt_program_is_sent_nothing_again_that_the_floors_record_told_of() {
    const OBSERVING: &str =
        "heartbeat_ms = 200\npresence_ttl_ms = 8000\npublish_timeout_ms = 2000\n";
    const SLOW_BEATS: &str =
        "heartbeat_ms = 6000\npresence_ttl_ms = 8000\npublish_timeout_ms = 2000\n";
    // Its name is free once the bucket forgot its last heartbeat, two TTLs on.
    const FREE_WITHIN: Duration = Duration::from_secs(30);
    const PROMPT_NOTES: std::ops::Range<usize> = 1_000..1_020;
    const LAST: usize = 9_999;
    let fleet = Fleet::start_timed(2, OBSERVING).await;
    let dir = tempfile::tempdir().unwrap();
    let section = federation_section(&fleet.nats, &fleet.prefix, "b2", SLOW_BEATS);
    let process = spawn_bridge(dir.path(), "b2", &section).await;
    let at = process.addr("grid");
    let slow = common::grid::GridWs::quiet_narrow(at, "stayer").await;
    let mut prompt = common::grid::GridWs::quiet(at, "prompt", None).await;
    for i in 0..fleet.nets.len() {
        fleet.wait_known(i, "stayer").await;
        fleet.wait_known(i, "prompt").await;
    }
    let (bridges, floors) = (fleet.bucket("bridges").await, fleet.bucket("floors").await);
    // Just after a heartbeat: the next is seconds away.
    let put_before = floors_of(&bridges, "b2").await["put"].as_u64();
    let beat = async || floors_of(&bridges, "b2").await["put"].as_u64() > put_before;
    eventually_within("a heartbeat of b2", WAIT, beat).await;
    // Some 5 MB for the slow program, more than its socket's buffers take: the bridge
    // holds back acknowledgements (up to `WRITTEN_WITHIN`) for what it cannot write.
    let b0 = common::grid::GridHttp::new(fleet.nets[0].grid);
    let b0 = &b0;
    let send_all = async |notes: &[usize], to: &str, text: &str| {
        let sending = notes.chunks(5).map(|notes| async move {
            for &n in notes {
                let note = grid_note(&format!("m{n}"), "neighbour", to, text);
                assert!(b0.try_send(&note).await, "note {n} accepted");
            }
        });
        futures_util::future::join_all(sending).await;
    };
    let slow_notes: Vec<usize> = (0..25).collect();
    send_all(&slow_notes, "stayer", &"x".repeat(200 << 10)).await;
    send_all(&PROMPT_NOTES.collect::<Vec<_>>(), "prompt", "hello").await;
    let mut got = Vec::new();
    let wanted = PROMPT_NOTES.collect();
    read_until_got(&mut prompt, (at, "prompt"), &mut got, &wanted).await;
    let js = fleet.jetstream().await;
    let stream = js.get_stream(fleet.stream_name());
    let mut stream = stream.await.expect("the fleet's stream");
    let sent = stream.info().await.expect("its info").state.last_sequence;
    let told = async |bucket| tells_of_all_behind_only(bucket, "b2", sent, "stayer").await;
    let what = "a floors record naming the slow program only, past all that was sent";
    eventually_within(what, WAIT, async || told(&floors).await).await;
    assert!(
        !told(&bridges).await,
        "the heartbeat told of it all too: the bridge took too long to be written this"
    );
    got.extend(read_past_the_kill(process, prompt).await);
    let through = fleet.nets[1].grid;
    let mut slow = slow;
    let read = slow.read_until_closed().await;
    let mut stayer_got: Vec<usize> = read.iter().filter_map(numbered).collect();
    let at = (through, "stayer");
    read_rest_of_within(at, &mut stayer_got, &slow_notes, FREE_WITHIN).await;
    let connect = common::grid::GridWs::connect_once_free_within;
    let mut prompt = connect(through, "prompt", FREE_WITHIN).await;
    let last = grid_note(&format!("m{LAST}"), "neighbour", "prompt", "the last");
    assert!(b0.try_send(&last).await);
    read_until_got(&mut prompt, (through, "prompt"), &mut got, &[LAST].into()).await;
    let twice = common::grid::got_twice(&got);
    assert!(twice.is_empty(), "the prompt program got {twice:?} twice");
    fleet.shutdown().await;
}

/// A second program, `prompt`, on the slow reader's bridge, reading as it is sent to: 200
/// numbered notes (from 1,000) sent to it through that bridge and the fleet's first in
/// turn, beside the slow one's (`sent_and_left_unwritten`).
struct PromptBeside {
    /// The numbers of the notes sent to the slow program.
    accepted: Vec<usize>,
    /// What the prompt program read, and its socket.
    got: Vec<usize>,
    socket: common::grid::GridWs,
}

impl PromptBeside {
    const NOTES: std::ops::Range<usize> = 1_000..1_200;
    /// The note sent once the programs reconnected, read last.
    const LAST: usize = 9_999;

    /// The slow program's notes are sent to `slow_to`: `stayer`, or `broadcast`, which the
    /// prompt program is sent too.
    async fn sent_to(
        fleet: &Fleet,
        id: &str,
        process: &BridgeProcess,
        slow_to: &'static str,
    ) -> PromptBeside {
        let at = (process.addr("grid"), "prompt");
        let mut socket = common::grid::GridWs::quiet(at.0, at.1, None).await;
        for i in 0..fleet.nets.len() {
            fleet.wait_known(i, "prompt").await;
        }
        let through = [process.addr("grid"), fleet.nets[0].grid];
        // Sent beside the slow program's notes through both bridges.
        let sending_to_prompt = async {
            let clients = through.map(common::grid::GridHttp::new);
            for n in Self::NOTES {
                let note = grid_note(&format!("m{n}"), "neighbour", "prompt", "hello");
                assert!(clients[n % 2].try_send(&note).await, "note {n} accepted");
            }
        };
        // A broadcast prompt program reads the slow one's notes as they come too.
        let slow_ones = (slow_to == "broadcast").then_some(0..LEFT_UNWRITTEN);
        let wanted = Self::NOTES.chain(slow_ones.into_iter().flatten());
        let (mut got, wanted) = (Vec::new(), wanted.collect());
        let reading = read_until_got(&mut socket, at, &mut got, &wanted);
        let (accepted, (), ()) = tokio::join!(
            sent_and_left_unwritten(fleet, id, &through, slow_to),
            sending_to_prompt,
            reading,
        );
        PromptBeside {
            accepted,
            got,
            socket,
        }
    }

    /// What the prompt program read, up to what its bridge wrote it before it was killed.
    async fn read_past_the_kill(&mut self) -> Vec<usize> {
        let read = self.socket.read_until_closed().await;
        self.got.extend(read.iter().filter_map(numbered));
        std::mem::take(&mut self.got)
    }

    /// Reconnects the prompt program at `at`, sends it a last note through the fleet's
    /// first bridge, and reads until it came.
    async fn read_to_a_last_note(
        fleet: &Fleet,
        at: (std::net::SocketAddr, &str),
        got: &mut Vec<usize>,
    ) {
        let mut prompt = common::grid::GridWs::connect_once_free(at.0, at.1).await;
        let last = grid_note(
            &format!("m{}", Self::LAST),
            "neighbour",
            "prompt",
            "the last",
        );
        assert!(
            common::grid::GridHttp::new(fleet.nets[0].grid)
                .try_send(&last)
                .await
        );
        read_until_got(&mut prompt, at, got, &[Self::LAST].into()).await;
    }

    /// The prompt program got each of its notes, and no message twice.
    fn assert_each_once(got: &[usize]) {
        let twice = common::grid::got_twice(got);
        let missing: Vec<usize> = (Self::NOTES).filter(|n| !got.contains(n)).collect();
        assert!(missing.is_empty(), "the prompt program missed {missing:?}");
        assert!(twice.is_empty(), "the prompt program got {twice:?} twice");
    }
}

/// How many notes `sent_and_left_unwritten` sends: numbered from 0.
const LEFT_UNWRITTEN: usize = 300;

/// Sends `to`, a program reading slowly on the bridge `id` of `fleet` (or `broadcast`:
/// every program), more numbered notes of 16 KiB than its socket's buffers hold, eight at
/// a time, through the Grid endpoints `through` in turn; waits until that bridge's
/// heartbeat carries a late batch and its consumer acknowledged past it. The numbers sent
/// (each must be accepted).
async fn sent_and_left_unwritten(
    fleet: &Fleet,
    id: &str,
    through: &[std::net::SocketAddr],
    to: &'static str,
) -> Vec<usize> {
    const NOTES: usize = LEFT_UNWRITTEN;
    const SENDERS: usize = 8;
    let pad = "x".repeat(16 << 10);
    let numbers: Vec<usize> = (0..NOTES).collect();
    let sending = numbers.chunks(NOTES.div_ceil(SENDERS)).map(|numbers| {
        let clients: Vec<_> = (through.iter().copied())
            .map(common::grid::GridHttp::new)
            .collect();
        let pad = &pad;
        async move {
            for &n in numbers {
                let id = format!("m{n}");
                let note = grid_note(&id, "neighbour", to, &format!("{id}{pad}"));
                let http = &clients[n % clients.len()];
                assert!(http.try_send(&note).await, "note {n} accepted");
            }
        }
    });
    // Some 5 MB through two bridges beside the rest of the suite: a bound, not a speed.
    let sent = futures_util::future::join_all(sending);
    tokio::time::timeout(WAIT * 6, sent)
        .await
        .expect("notes accepted within the wait");
    // A late batch carried in the bridge's heartbeat, and acknowledged: what waits for the
    // program is past the consumer's acknowledgement floor.
    let bridges = fleet.bucket("bridges").await;
    let js = fleet.jetstream().await;
    let stream = js.get_stream(fleet.stream_name());
    let stream = stream.await.expect("the fleet's stream");
    let carried_and_acknowledged = async || {
        let Some(from) = floors_of(&bridges, id).await["unwritten_from"].as_u64() else {
            return false;
        };
        let info = stream.consumer_info(format!("bridge-{id}")).await;
        info.is_ok_and(|info| info.ack_floor.stream_sequence >= from)
    };
    let what = "a late batch carried in the heartbeat and acknowledged";
    eventually_within(what, WAIT * 2, carried_and_acknowledged).await;
    numbers
}

/// A bridge killed under load can leave its consumer holding as many deliveries as it
/// allows unacknowledged (`max_ack_pending`), and JetStream then delivers nothing more to it
/// until their `ack_wait` (30 s) runs out. Started again, the bridge reads them from the
/// stream and acknowledges them: a message sent to its program after the restart arrives
/// at once.
#[tokio::test]
async fn a_bridge_back_after_a_kill_that_left_its_consumer_full_is_delivered_to_at_once() {
    use async_nats::jetstream::consumer::PullConsumer;
    use common::grid::{GridHttp, GridWs};
    use futures_util::StreamExt;

    let fleet = Fleet::start_timed(1, PATIENT).await;
    let dir = tempfile::tempdir().unwrap();
    let section = federation_section(&fleet.nats, &fleet.prefix, "b1", PATIENT);
    let process = spawn_bridge(dir.path(), "b1", &section).await;
    let socket = GridWs::quiet(process.addr("grid"), "stayer", None).await;
    fleet.wait_known(0, "stayer").await;
    process.kill_9();
    drop(socket);

    // What the killed run had taken: every delivery the consumer allows, none acknowledged
    // (of empty batches, which route nothing).
    let js = fleet.jetstream().await;
    let stream_name = fleet.stream_name();
    let stream = js.get_stream(&stream_name).await.expect("the stream");
    let mut consumer: PullConsumer = stream.get_consumer("bridge-b1").await.expect("b1's");
    let most = consumer
        .info()
        .await
        .expect("its info")
        .config
        .max_ack_pending as usize;
    // Published a window at a time, each acknowledged: a stream takes in only so many
    // publishes at once.
    let subject = format!("{}.msg.gone", fleet.prefix);
    for _ in 0..most.div_ceil(1000) {
        let mut window = Vec::new();
        for _ in 0..1000 {
            window.push(
                js.publish(subject.clone(), "[]".into())
                    .await
                    .expect("sent"),
            );
        }
        for ack in window {
            ack.await.expect("stored");
        }
    }
    // Until the consumer holds as many as it may (what the killed run had left it counts).
    let deadline = Instant::now() + WAIT;
    loop {
        let pending = consumer.info().await.expect("its info").num_ack_pending;
        if pending >= most {
            break;
        }
        assert!(Instant::now() < deadline, "{pending} of {most} pending");
        let fetch = consumer.fetch().max_messages(most - pending);
        let mut batch = (fetch.expires(Duration::from_secs(1)).messages().await).expect("fetched");
        while let Some(delivery) = batch.next().await {
            delivery.expect("a delivery");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let process = spawn_bridge(dir.path(), "b1", &section).await;
    let mut socket = GridWs::connect_once_free(process.addr("grid"), "stayer").await;
    let http = GridHttp::new(fleet.nets[0].grid);
    assert!(
        http.try_send(&grid_note("m1", "neighbour", "stayer", "after"))
            .await
    );
    // Within `WAIT`: a third of `ack_wait`.
    assert_eq!(socket.next_message().await["id"], "m1");
    let pending = consumer.info().await.unwrap().num_ack_pending;
    assert!(
        pending < most,
        "{pending} deliveries to the killed run still pending"
    );
    drop(process);
    fleet.shutdown().await;
}

/// A Grid program, `stayer`, on a bridge in a process of its own, reading slowly (a narrow
/// socket, unread), known to every bridge of the fleet: what is sent to it waits at its
/// bridge once the socket's buffers are full.
struct SlowReader {
    fleet: Fleet,
    /// The bridge's data directory, and its federation section: to start it again.
    dir: tempfile::TempDir,
    section: String,
    process: BridgeProcess,
    socket: common::grid::GridWs,
}

impl SlowReader {
    /// On `b2`, the third bridge of a fleet whose other two are in this process.
    async fn on_a_third_bridge() -> SlowReader {
        let fleet = Fleet::start(2).await;
        let section = federation_section(&fleet.nats, &fleet.prefix, "b2", QUICK);
        SlowReader::on(fleet, "b2", section).await
    }

    /// On `b1`, the second bridge of a fleet whose presence TTL a restart fits in
    /// (`PATIENT`): the other never takes it for gone, so keeps nothing for its agents.
    async fn on_a_patient_fleet() -> SlowReader {
        let fleet = Fleet::start_timed(1, PATIENT).await;
        let section = federation_section(&fleet.nats, &fleet.prefix, "b1", PATIENT);
        SlowReader::on(fleet, "b1", section).await
    }

    async fn on(fleet: Fleet, id: &str, section: String) -> SlowReader {
        let dir = tempfile::tempdir().unwrap();
        let process = spawn_bridge(dir.path(), id, &section).await;
        let socket = common::grid::GridWs::quiet_narrow(process.addr("grid"), "stayer").await;
        for i in 0..fleet.nets.len() {
            fleet.wait_known(i, "stayer").await;
        }
        SlowReader {
            fleet,
            dir,
            section,
            process,
            socket,
        }
    }
}

/// The floors `bucket` (the fleet's `bridges` or `floors`) holds for `bridge`, as JSON
/// (`null` if none).
async fn floors_of(bucket: &async_nats::jetstream::kv::Store, bridge: &str) -> serde_json::Value {
    let value = bucket.get(bridge).await.ok().flatten();
    let value = value.and_then(|v| serde_json::from_slice::<serde_json::Value>(&v).ok());
    value.unwrap_or_default()
}

/// Whether the floors `bucket` holds for `bridge` tell of the stream up to `sent`, naming
/// `behind` alone as not yet written.
async fn tells_of_all_behind_only(
    bucket: &async_nats::jetstream::kv::Store,
    bridge: &str,
    sent: u64,
    behind: &str,
) -> bool {
    let floors = floors_of(bucket, bridge).await;
    let named = floors["unwritten_for"].as_object();
    let named: Vec<&String> = named.into_iter().flat_map(|named| named.keys()).collect();
    named == [behind] && floors["routed_through"].as_u64() >= Some(sent)
}

/// Kills `process` (`kill -9`) and reads what its bridge had written to `socket` before:
/// the numbers of the messages (`numbered`).
async fn read_past_the_kill(
    process: BridgeProcess,
    mut socket: common::grid::GridWs,
) -> Vec<usize> {
    process.kill_9();
    let read = socket.read_until_closed().await;
    read.iter().filter_map(numbered).collect()
}

/// A presence TTL a restart fits in: the fleet never takes the restarted bridge for gone,
/// so keeps nothing for its agents.
const PATIENT: &str = "heartbeat_ms = 200\npresence_ttl_ms = 30000\npublish_timeout_ms = 2000\n";

/// Numbered notes of 16 KiB sent through a bridge's Grid HTTP endpoint, `SENDERS` at a
/// time, each sender's next once its last was accepted, until the bridge stops answering.
/// Several at once so that the notes that wait at the bridge were accepted within
/// `WRITTEN_WITHIN` (5 s) of the kill, still unacknowledged: these tests are about what a
/// bridge had not acknowledged (those further behind: `sent_and_left_unwritten`).
struct SentUntilKilled {
    senders: Vec<tokio::task::JoinHandle<Vec<usize>>>,
}

impl SentUntilKilled {
    /// More than a narrow socket's buffers hold: the rest waits at the bridge.
    const BEFORE_THE_KILL: usize = 300;
    const SENDERS: usize = 8;

    /// Starts sending to `to` through the Grid endpoint at `grid`; returns once
    /// `BEFORE_THE_KILL` were accepted.
    async fn start(grid: std::net::SocketAddr, to: &'static str) -> SentUntilKilled {
        let (count, mut counted) = tokio::sync::watch::channel(0);
        let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let pad = std::sync::Arc::new("x".repeat(16 << 10));
        let senders = (0..Self::SENDERS)
            .map(|_| {
                let http = common::grid::GridHttp::new(grid);
                let (count, next, pad) = (count.clone(), next.clone(), pad.clone());
                tokio::spawn(async move {
                    let mut accepted = Vec::new();
                    loop {
                        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let id = format!("m{n}");
                        let note = grid_note(&id, "neighbour", to, &format!("{id}{pad}"));
                        if !http.try_send(&note).await {
                            return accepted;
                        }
                        accepted.push(n);
                        count.send_modify(|sent| *sent += 1);
                    }
                })
            })
            .collect();
        let enough = counted.wait_for(|n| *n >= Self::BEFORE_THE_KILL);
        // Some 5 MB through a bridge beside the rest of the suite on a busy machine: a
        // bound, not a speed.
        tokio::time::timeout(WAIT * 6, enough)
            .await
            .expect("notes accepted within the wait")
            .expect("the senders send on");
        SentUntilKilled { senders }
    }

    /// The numbers of the notes accepted, once the bridge stopped answering.
    async fn accepted(self) -> Vec<usize> {
        let mut accepted = Vec::new();
        for sender in self.senders {
            accepted.extend(sender.await.expect("a sender ends"));
        }
        accepted.sort_unstable();
        accepted
    }
}

/// Reads, on a socket the program opens at `at` (a bridge's Grid endpoint, the program's
/// name), until `got` holds every number `accepted` holds (`read_until_got`); it must.
async fn read_rest_of(at: (std::net::SocketAddr, &str), got: &mut Vec<usize>, accepted: &[usize]) {
    read_rest_of_within(at, got, accepted, WAIT).await;
}

/// As `read_rest_of`, waiting up to `wait` for the program's name to be free.
async fn read_rest_of_within(
    at: (std::net::SocketAddr, &str),
    got: &mut Vec<usize>,
    accepted: &[usize],
    wait: Duration,
) {
    let mut socket = common::grid::GridWs::connect_once_free_within(at.0, at.1, wait).await;
    read_until_got(&mut socket, at, got, &accepted.iter().copied().collect()).await;
    let missing: Vec<usize> = (accepted.iter().copied())
        .filter(|n| !got.contains(n))
        .collect();
    assert!(
        missing.is_empty(),
        "missing {missing:?} of {} accepted",
        accepted.len()
    );
}

/// As `a_program_whose_bridge_is_killed_as_it_reads_gets_every_message_through_another`,
/// for a Synapse agent reading a stream (slowly: a narrow channel, not read): what waited in the killed bridge's output queue and mailbox reaches the stream it
/// opens on another bridge, and so does what was sent after the kill. What HTTP/2 held
/// past the client's window is lost: a message is done once tonic takes it, and tonic
/// hands on what it took in writes of 32 KiB (four of these messages). (Order is not
/// asserted, as in the Grid test.)
#[tokio::test]
async fn a_synapse_agent_whose_bridge_is_killed_as_it_reads_gets_every_message_through_another() {
    use common::synapse::{Stream, chat, clients, narrow_channel, send, text_of};
    let fleet = Fleet::start(2).await;
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_member(&fleet, dir.path(), "b2").await;
    let narrow = narrow_channel(process.addr("synapse")).await;
    let mut stream = Stream::open_on(narrow, "stayer").await;
    for i in 0..2 {
        fleet.wait_known(i, "stayer").await;
    }
    const TOTAL: usize = 200;
    let pad = "x".repeat(8 * 1024);
    let mut sender = clients(fleet.nets[0].synapse).await;
    let mut send_from = async |numbers: std::ops::Range<usize>| {
        for n in numbers {
            let message = chat("writer", "stayer", &format!("{n} {pad}"));
            send(&mut sender, message).await.unwrap();
        }
    };
    send_from(0..TOTAL / 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    process.kill_9();
    let number = |m: &agentbridge::protocols::synapse::proto::SynapseMessage| {
        text_of(m)
            .split(' ')
            .next()
            .unwrap()
            .parse::<usize>()
            .unwrap()
    };
    let mut got: Vec<usize> = stream.read_until_ended().await.iter().map(number).collect();
    let read_before = got.len();
    send_from(TOTAL / 2..TOTAL).await;
    let mut next = Stream::open_once_free(fleet.nets[1].synapse, "stayer").await;
    let mut seen: std::collections::HashSet<usize> = got.iter().copied().collect();
    while seen.len() < TOTAL {
        // Once only what HTTP/2 may have held is missing, a short wait tells.
        let quiet = match TOTAL - seen.len() {
            0..=4 => Duration::from_secs(3),
            _ => QUIET_AT_MOST,
        };
        let Ok(Some(Ok(message))) =
            tokio::time::timeout(quiet, futures_util::StreamExt::next(&mut next.inbound)).await
        else {
            break;
        };
        seen.insert(number(&message));
        got.push(number(&message));
    }
    let in_http2: Vec<usize> = (0..TOTAL).filter(|n| !seen.contains(n)).collect();
    assert!(
        in_http2.len() <= 4
            && in_http2
                .iter()
                .all(|n| (read_before..read_before + 4).contains(n)),
        "missing {in_http2:?}, beyond one write after the {read_before} read before the kill"
    );
    fleet.shutdown().await;
}
