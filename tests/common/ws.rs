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
    /// How long a read waits: `WAIT`, unless the test expects a slower bridge.
    wait: std::time::Duration,
}

impl TestSocket {
    pub async fn connect(url: &str) -> Self {
        let (stream, _) = tokio_tungstenite::connect_async(url)
            .await
            .expect("websocket connects");
        TestSocket { stream, wait: WAIT }
    }

    /// Lets each read wait up to `wait` from now on (a test that rides out a failover).
    pub fn wait_up_to(&mut self, wait: std::time::Duration) {
        self.wait = wait;
    }

    /// Connects with a small kernel receive buffer, so that a client that stops reading
    /// soon stops the bridge writing to it (and its messages wait at the bridge).
    pub async fn connect_narrow(url: &str) -> Self {
        let addr: std::net::SocketAddr = url
            .trim_start_matches("ws://")
            .split('/')
            .next()
            .and_then(|a| a.parse().ok())
            .expect("a ws://ip:port/ URL");
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let tcp = socket.connect(addr).await.expect("tcp connects");
        let (stream, _) = tokio_tungstenite::client_async(url, MaybeTlsStream::Plain(tcp))
            .await
            .expect("websocket connects");
        TestSocket { stream, wait: WAIT }
    }

    pub async fn send_text(&mut self, text: impl Into<String>) {
        self.stream
            .send(Message::Text(text.into().into()))
            .await
            .expect("send");
    }

    /// Sends any message, a raw frame included (say, a text frame that is not UTF-8).
    pub async fn send_message(&mut self, message: Message) {
        self.stream.send(message).await.expect("send");
    }

    /// The next text frame; a close, an error or a silent wait fails the test.
    pub async fn next_text(&mut self) -> String {
        loop {
            let frame = tokio::time::timeout(self.wait, self.stream.next())
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

    /// The next text frame, or the close frame if the server closes the socket first; an
    /// error or a silent wait fails the test.
    pub async fn next_text_or_close(&mut self) -> Result<String, Option<CloseFrame>> {
        loop {
            let frame = tokio::time::timeout(self.wait, self.stream.next())
                .await
                .expect("a frame within the wait");
            match frame {
                Some(Ok(Message::Text(text))) => return Ok(text.as_str().to_owned()),
                Some(Ok(Message::Close(close))) => return Err(close),
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Err(None),
            }
        }
    }

    /// Waits for the server to close the socket and returns the close frame.
    pub async fn closed(&mut self) -> Option<CloseFrame> {
        loop {
            let frame = tokio::time::timeout(self.wait, self.stream.next())
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

    /// Closes the socket and reads what the bridge sent before it saw the close: the text
    /// frames up to its own close.
    pub async fn close_reading(mut self) -> Vec<String> {
        self.stream.close(None).await.expect("the close is sent");
        let mut texts = Vec::new();
        loop {
            let frame = tokio::time::timeout(self.wait, self.stream.next())
                .await
                .expect("the close within the wait");
            match frame {
                Some(Ok(Message::Text(text))) => texts.push(text.as_str().to_owned()),
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return texts,
            }
        }
    }
}

/// A WebSocket client written byte by byte, for what a well-behaved client library will
/// not send: half a frame, then nothing.
pub struct RawSocket {
    pub tcp: TcpStream,
}

impl RawSocket {
    /// Opens `path` on `addr` and completes the handshake.
    pub async fn connect(addr: std::net::SocketAddr, path: &str) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tcp = TcpStream::connect(addr).await.expect("tcp connects");
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        );
        tcp.write_all(request.as_bytes()).await.unwrap();
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            let n = tokio::time::timeout(WAIT, tcp.read(&mut byte))
                .await
                .expect("the handshake's answer within the wait")
                .unwrap();
            assert_eq!(n, 1, "the server closed during the handshake");
            head.push(byte[0]);
        }
        assert!(
            head.starts_with(b"HTTP/1.1 101"),
            "{}",
            String::from_utf8_lossy(&head)
        );
        RawSocket { tcp }
    }

    /// The header of a masked client frame (mask 0) carrying `len` payload bytes.
    pub fn frame_header(opcode: u8, fin: bool, len: usize) -> Vec<u8> {
        let mut out = vec![(u8::from(fin) << 7) | opcode];
        match len {
            n if n < 126 => out.push(0x80 | n as u8),
            n if n <= 0xFFFF => {
                out.push(0x80 | 126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                out.push(0x80 | 127);
                out.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        out.extend_from_slice(&[0, 0, 0, 0]);
        out
    }

    pub async fn write(&mut self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt;
        self.tcp.write_all(bytes).await.expect("write");
    }
}
