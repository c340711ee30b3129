//! The NATS baseline: when `nats-server` is installed, the same load through its WebSocket
//! listener (subject `lg.<receiver>`, plain-text NATS protocol inside WebSocket frames).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::agents::{self, Error, Receiver, Sender};

/// A running `nats-server`, stopped when dropped.
pub struct NatsServer {
    child: Child,
    _dir: tempfile::TempDir,
    pub ws_url: String,
}

impl NatsServer {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `nats-server` is on the PATH.
pub fn installed() -> bool {
    Command::new("nats-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts `nats-server` with a WebSocket listener on loopback and waits until it accepts.
pub async fn start() -> Result<NatsServer, Error> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (port, ws_port) = (
        free_port().map_err(|e| e.to_string())?,
        free_port().map_err(|e| e.to_string())?,
    );
    let conf = dir.path().join("nats.conf");
    std::fs::write(
        &conf,
        format!(
            "listen: \"127.0.0.1:{port}\"\nmax_payload: 8MB\nwebsocket {{\n  listen: \"127.0.0.1:{ws_port}\"\n  no_tls: true\n  compression: false\n}}\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    let child = Command::new("nats-server")
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start nats-server: {e}"))?;
    let server = NatsServer {
        child,
        _dir: dir,
        ws_url: format!("ws://127.0.0.1:{ws_port}"),
    };
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(("127.0.0.1", ws_port))
            .await
            .is_ok()
        {
            return Ok(server);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("nats-server did not open its WebSocket port".into())
}

const CONNECT: &str = "CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":false}\r\n";

/// A subscriber to `lg.<name>`, subscribed when this returns (the server's PONG follows
/// the SUB, in order).
pub async fn receiver(url: &str, name: &str) -> Result<Receiver, Error> {
    let mut conn = agents::plain::duplex(url).await?;
    conn.send(&format!("{CONNECT}SUB lg.{name} 1\r\nPING\r\n"))
        .await?;
    conn.wait_for("PONG").await?;
    Ok(conn.into_receiver())
}

/// A publisher to `lg.<receiver>`.
pub async fn sender(url: &str, receiver: &str) -> Result<Sender, Error> {
    let subject = format!("lg.{receiver}");
    let mut first = true;
    agents::plain::sender(url, move |_, text| {
        let publish = format!("PUB {subject} {}\r\n{text}\r\n", text.len());
        if std::mem::take(&mut first) {
            format!("{CONNECT}{publish}")
        } else {
            publish
        }
    })
    .await
}
