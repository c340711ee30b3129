//! A NATS cluster that asks its clients who they are: bridges given a user and password
//! join it as one fleet; a bridge given the wrong password stays out and says why.

use crate::common::fleet::{Fleet, QUICK, start_member};
use crate::common::nats::Cluster;
use crate::common::peers::{Proto, What};
use crate::common::{self, eventually};

/// Two users: the bridges', and one for clients that give no credentials (the cluster's
/// own checks): a bridge whose credentials were not sent would be let in too, so the test
/// asks the server which user each bridge connected as.
const AUTHORIZATION: &str = "authorization {\n  users = [\n    { user: \"bridge\", password: \"s3cret\" }\n    { user: \"anyone\", password: \"unguessed\" }\n  ]\n}\nno_auth_user: \"anyone\"\n";

#[tokio::test]
async fn bridges_join_a_cluster_that_asks_for_a_user_and_password() {
    let cluster = Cluster::start_with(1, AUTHORIZATION).await;
    let nats = cluster.toml_list();
    let as_bridge = format!("{QUICK}user = \"bridge\"\npassword = \"s3cret\"\n");
    let fleet = Fleet::start_on(&nats, 2, &as_bridge).await;
    // Connected as the user given, not let in as anyone.
    let connections = cluster.connections(0).await;
    for bridge in ["agentbridge b0", "agentbridge b1"] {
        let users: Vec<&serde_json::Value> = (connections.iter())
            .filter(|c| c["name"] == bridge)
            .map(|c| &c["authorized_user"])
            .collect();
        assert_eq!(users, ["bridge"], "{bridge}: {connections:?}");
    }
    let mut receiver = fleet.nets[1].peer(Proto::Tracker).await;
    fleet.wait_known(0, &receiver.name).await;
    let mut sender = fleet.nets[0].peer(Proto::Skynet).await;
    sender
        .chat(&receiver.name, "@coder who goes there", None)
        .await;
    assert_eq!(
        receiver.next(What::Chat).await.text,
        "@coder who goes there"
    );

    // The wrong password: NATS refuses the bridge, which says so in `/readyz` (starting
    // while its doors wait for the stream, then degraded) and serves its own agents.
    let wrong = format!("{QUICK}user = \"bridge\"\npassword = \"wrong\"\n");
    let outsider = start_member(&nats, &fleet.prefix, "b2", ":memory:", &wrong).await;
    eventually(
        "the outsider tells why it is not in the fleet",
        async || {
            let (_, readyz) = common::admin_get(&outsider.bridge, "/readyz").await;
            readyz.contains("NATS unreachable (authorization violation)")
        },
    )
    .await;
    let mut local = outsider.peer(Proto::Grid).await;
    let mut neighbour = outsider.peer(Proto::Grid).await;
    neighbour.chat(&local.name, "still here", None).await;
    assert_eq!(local.next(What::Chat).await.text, "still here");
    outsider.bridge.shutdown().await;
    fleet.shutdown().await;
}
