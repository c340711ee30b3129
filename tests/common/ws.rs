//! The WebSocket connection under every protocol's test client: each read is bounded by
//! `WAIT`, so a silent bridge fails the test instead of hanging it. The clients decode the
//! text (JSON, YAML) as their protocol does.

use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::WAIT;

pub struct TestSocket {
    stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

impl TestSocket {
    pub async fn connect(url: &str) -> Self {
        let (stream, _) = tokio_tungstenite::connect_async(url)
            .await
            .expect("websocket connects");
        TestSocket { stream }
    }

    pub async fn send_text(&mut self, text: impl Into<String>) {
        self.stream
            .send(Message::Text(text.into().into()))
            .await
            .expect("send");
    }

    /// The next text frame; a close, an error or a silent wait fails the test.
    pub async fn next_text(&mut self) -> String {
        loop {
            let frame = tokio::time::timeout(WAIT, self.stream.next())
                .await
                .expect("a frame within the wait")
                .expect("the socket is open")
                .expect("a valid frame");
            match frame {
                Message::Text(text) => return text.as_str().to_owned(),
                Message::Close(close) => panic!("socket closed: {close:?}"),
                _ => continue,
            }
        }
    }

    /// Waits for the server to close the socket and returns the close frame.
    pub async fn closed(&mut self) -> Option<CloseFrame> {
        loop {
            let frame = tokio::time::timeout(WAIT, self.stream.next())
                .await
                .expect("the close within the wait");
            match frame {
                Some(Ok(Message::Close(close))) => return close,
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return None,
            }
        }
    }

    pub async fn close(mut self) {
        let _ = self.stream.close(None).await;
    }
}
