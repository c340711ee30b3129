//! A connection's writes gathered until its socket is flushed, so that a burst of frames
//! leaves in one `send(2)`.
//!
//! tungstenite writes its buffer out whenever it holds more than its write buffer size, and
//! that buffer keeps the largest capacity it ever grew to for as long as the connection
//! lives. Kept small for the sake of idle connections (2 KiB), that buffer alone would
//! send a burst of deliveries a few frames at a time, a `send` every few messages.
//! Here a burst gathers in a buffer of its own, written out when the socket is flushed or
//! when it reaches [`GATHER_BYTES`], and let go once written: an idle connection holds
//! none of it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes gathered before they are written out without waiting for a flush. (A single
/// write of this size or more, when nothing is gathered, goes straight to the socket.)
pub const GATHER_BYTES: usize = 16 * 1024;

/// `inner` with its writes gathered until a flush; reads pass through.
pub struct Coalesced<S> {
    inner: S,
    gathered: Vec<u8>,
    /// How much of `gathered` the socket has taken.
    sent: usize,
}

impl<S> Coalesced<S> {
    pub fn new(inner: S) -> Self {
        Coalesced {
            inner,
            gathered: Vec::new(),
            sent: 0,
        }
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
}

impl<S: AsyncWrite + Unpin> Coalesced<S> {
    /// Writes out everything gathered, then lets the buffer go.
    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.gathered.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.gathered[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.gathered = Vec::new();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Coalesced<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.gathered.len() >= GATHER_BYTES {
            ready!(this.poll_write_out(cx))?;
        }
        if this.gathered.is_empty() && buf.len() >= GATHER_BYTES {
            // Nothing to gather it with: not copied (say, a large binary message whole).
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        if this.gathered.is_empty() {
            // One allocation for the burst, not one per doubling.
            this.gathered.reserve(GATHER_BYTES.max(buf.len()));
        }
        this.gathered.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_out(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_out(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Coalesced<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn writes_wait_for_a_flush_and_then_leave_together() {
        let (near, mut far) = tokio::io::duplex(64 * 1024);
        let mut near = Coalesced::new(near);
        near.write_all(b"one ").await.unwrap();
        near.write_all(b"two").await.unwrap();
        let mut buf = [0u8; 16];
        let nothing_yet =
            tokio::time::timeout(std::time::Duration::from_millis(20), far.read(&mut buf)).await;
        assert!(nothing_yet.is_err(), "nothing leaves before a flush");
        near.flush().await.unwrap();
        let n = far.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"one two");
        assert_eq!(
            near.gathered.capacity(),
            0,
            "the buffer is let go once written"
        );
    }

    #[tokio::test]
    async fn a_full_buffer_is_written_out_without_a_flush() {
        let (near, mut far) = tokio::io::duplex(4 * GATHER_BYTES);
        let mut near = Coalesced::new(near);
        let chunk = vec![7u8; 1000];
        while near.gathered.len() < GATHER_BYTES {
            near.write_all(&chunk).await.unwrap();
        }
        let gathered = near.gathered.len();
        near.write_all(b"!").await.unwrap();
        assert_eq!(near.gathered, b"!", "the full buffer went out first");
        let mut received = vec![0u8; gathered];
        far.read_exact(&mut received).await.unwrap();
        assert!(received.iter().all(|&b| b == 7));
    }

    #[tokio::test]
    async fn a_large_write_with_nothing_gathered_goes_straight_through() {
        let (near, mut far) = tokio::io::duplex(4 * GATHER_BYTES);
        let mut near = Coalesced::new(near);
        let large = vec![9u8; GATHER_BYTES + 1];
        near.write_all(&large).await.unwrap();
        assert_eq!(near.gathered.capacity(), 0, "not copied into a buffer");
        let mut received = vec![0u8; large.len()];
        far.read_exact(&mut received).await.unwrap();
        assert_eq!(received, large);
    }

    #[tokio::test]
    async fn a_socket_that_takes_part_gets_the_rest_later() {
        // A pipe that holds less than a burst: the flush waits until the far end reads.
        let (near, mut far) = tokio::io::duplex(1024);
        let mut near = Coalesced::new(near);
        let burst: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        near.write_all(&burst).await.unwrap();
        let reader = tokio::spawn(async move {
            let mut received = vec![0u8; 10_000];
            far.read_exact(&mut received).await.unwrap();
            received
        });
        near.flush().await.unwrap();
        assert_eq!(reader.await.unwrap(), burst);
    }
}
