//! The `raw-relay` baseline: a minimal tokio-tungstenite server that forwards each text
//! frame from a sender to its receiver without parsing it. Clients connect to
//! `/?me=<name>` (receivers) or `/?me=<name>&to=<name>` (senders). Whatever agentbridge
//! does beyond this — decoding, routing, storing, encoding — is its cost over the machine.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::{SinkExt, StreamExt};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};

type Routes = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<Message>>>>;

/// Starts the relay on a loopback port; returns its address.
pub async fn start() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let routes: Routes = Arc::default();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = tcp.set_nodelay(true);
            tokio::spawn(serve(tcp, routes.clone()));
        }
    });
    Ok(addr)
}

#[allow(clippy::result_large_err)] // the handshake callback's signature is tungstenite's
async fn serve(tcp: tokio::net::TcpStream, routes: Routes) {
    let mut query = String::new();
    let callback = |request: &Request, response: Response| {
        query = request.uri().query().unwrap_or_default().to_owned();
        Ok(response)
    };
    let Ok(ws) = tokio_tungstenite::accept_hdr_async(tcp, callback).await else {
        return;
    };
    let param = |key: &str| {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .map(str::to_owned)
    };
    let (me, to) = (param("me").unwrap_or_default(), param("to"));
    let (mut sink, mut stream) = ws.split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Message>();
    routes.lock().insert(me, tx);
    tokio::spawn(async move {
        while let Some(frame) = rx.recv().await {
            if sink.send(frame).await.is_err() {
                break;
            }
        }
    });
    let mut peer: Option<mpsc::UnboundedSender<Message>> = None;
    while let Some(Ok(frame)) = stream.next().await {
        if !frame.is_text() {
            continue;
        }
        if peer.is_none()
            && let Some(to) = &to
        {
            peer = routes.lock().get(to).cloned();
        }
        if let Some(peer) = &peer {
            let _ = peer.send(frame);
        }
    }
}
