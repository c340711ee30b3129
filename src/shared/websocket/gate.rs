//! Inbound WebSocket frames judged by their headers, before their payload is read.
//!
//! tungstenite reads a frame whole into memory before it says anything about it, and past
//! its size limit it fails the connection without a close frame. The gate sits below it,
//! reads each frame header (RFC 6455 §5.2) as the bytes pass, and refuses a message that
//! is larger than the connection's limit, or large and beyond what the bridge-wide
//! [`ByteBudget`] has free: the refused frames are skipped unread, and tungstenite is
//! handed an empty Pong in their place, so that [`Socket::recv`](super::Socket::recv)
//! wakes and reports the refusal while the connection goes on. Only a message refused
//! after some of its fragments were passed up cannot be skipped (tungstenite holds the
//! start of it): that one fails the read with a [`Refusal`] the socket closes on.
//!
//! Bytes of passed messages of at least [`BUDGETED_BYTES`] stay reserved until the
//! connection asks for the message after them: until then they are in tungstenite's
//! buffers or in the endpoint's hands.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::shared::budget::{BUDGETED_BYTES, ByteBudget, Reserved};

/// The longest frame header: 2 bytes, a 64-bit length and a masking key.
const MAX_HEADER: usize = 14;
/// Reads with no more room than this go through the gate's own buffer.
const SMALL_READ: usize = 64;
/// A masked, empty, final Pong: what tungstenite reads where a refused frame was.
const PONG: [u8; 6] = [0x8A, 0x80, 0, 0, 0, 0];

/// Why the gate would not pass a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Larger than the connection may send.
    TooLarge { bytes: u64, limit: u64 },
    /// Large, and the bridge is already holding as many bytes of large messages as it may.
    OverBudget { bytes: u64 },
    /// A text message that is not UTF-8 (reported by tungstenite, not the gate).
    NotUtf8,
    /// A frame RFC 6455 forbids (unmasked, an unknown opcode, a control frame over 125
    /// bytes or fragmented), which tungstenite would read whole before refusing it.
    Protocol(&'static str),
}

impl Refusal {
    /// The RFC 6455 close code that names this refusal.
    pub fn close_code(&self) -> u16 {
        match self {
            Refusal::TooLarge { .. } => 1009,
            Refusal::OverBudget { .. } => 1013,
            Refusal::NotUtf8 => 1007,
            Refusal::Protocol(_) => 1002,
        }
    }

    /// The close frame's reason (at most 123 bytes).
    pub fn close_reason(&self) -> &'static str {
        match self {
            Refusal::TooLarge { .. } => "message too large",
            Refusal::OverBudget { .. } => "too many large messages in flight; try again later",
            Refusal::NotUtf8 => "text frame is not valid UTF-8",
            Refusal::Protocol(_) => "protocol error",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::TooLarge { bytes, limit } => write!(
                f,
                "Message too large: {bytes} bytes; the limit is {limit} bytes"
            ),
            Refusal::OverBudget { bytes } => write!(
                f,
                "Message of {bytes} bytes refused: the bridge is reading as many large messages as it may; send it again later"
            ),
            Refusal::NotUtf8 => write!(f, "Text frame is not valid UTF-8"),
            Refusal::Protocol(why) => write!(f, "Frame refused: {why}"),
        }
    }
}

impl std::error::Error for Refusal {}

/// What the gate allows a connection.
#[derive(Clone, Debug)]
pub struct Limits {
    /// The largest message, all its fragments together.
    pub max_message: u64,
    /// Shared by every connection of the bridge.
    pub budget: Option<ByteBudget>,
}

enum State {
    /// Reading a frame header.
    Header,
    /// Passing payload bytes up.
    Pass {
        left: u64,
        /// Each byte is reserved from the budget as it passes (a large message's).
        reserve: bool,
        /// The message is whole once these bytes have passed.
        ends_message: bool,
    },
    /// Skipping this many more payload bytes of a refused message.
    Skip(u64),
}

/// What a frame header says.
struct Header {
    len: usize,
    fin: bool,
    opcode: u8,
    masked: bool,
    payload: u64,
}

enum Verdict {
    Pass {
        reserve: bool,
        ends_message: bool,
    },
    /// Skipped; `first` when it is the refused message's first frame, where the Pong goes.
    Skip {
        first: bool,
    },
}

/// `inner`, whose inbound frames are judged by [`Limits`].
pub struct Gate<S> {
    inner: S,
    limits: Limits,
    state: State,
    /// The start of a header cut short by the end of a read, examined with the next.
    carry: Vec<u8>,
    /// The data message being read, passed up: its declared bytes so far, those passed,
    /// and what they reserved.
    message_bytes: u64,
    message_passed: u64,
    message_reserved: Option<Reserved>,
    /// The rest of a refused message's fragments are skipped too.
    skipping_message: bool,
    /// One entry per message passed up whole, oldest first, with what it reserved.
    passed: VecDeque<Option<Reserved>>,
    refused: VecDeque<Refusal>,
    /// Judged bytes not yet handed to a reader that had little room.
    ready: VecDeque<u8>,
}

impl<S> Gate<S> {
    pub fn new(inner: S, limits: Limits) -> Self {
        Gate {
            inner,
            limits,
            state: State::Header,
            carry: Vec::new(),
            message_bytes: 0,
            message_passed: 0,
            message_reserved: None,
            skipping_message: false,
            passed: VecDeque::new(),
            refused: VecDeque::new(),
            ready: VecDeque::new(),
        }
    }

    /// The oldest refusal not yet reported.
    pub fn take_refusal(&mut self) -> Option<Refusal> {
        self.refused.pop_front()
    }

    /// The connection is done with the oldest message passed up: its reservation goes back.
    pub fn release_one(&mut self) {
        self.passed.pop_front();
    }

    /// Judges the bytes of one read, `region`, in place: what passes is moved to its front
    /// and the number of those bytes returned. A header cut short is kept for the next
    /// read, unless the stream ended (`eof`), when it passes as it is.
    fn examine(&mut self, region: &mut [u8], eof: bool) -> io::Result<usize> {
        let (mut read, mut written) = (0, 0);
        while read < region.len() {
            let left = region.len() - read;
            match self.state {
                State::Pass {
                    left: n,
                    reserve,
                    ends_message,
                } => {
                    let k = left.min(usize::try_from(n).unwrap_or(usize::MAX));
                    if reserve {
                        // Reserved as the bytes come, not when a header declares them: a
                        // header alone holds nothing.
                        self.reserve(k as u64)?;
                    }
                    region.copy_within(read..read + k, written);
                    (read, written) = (read + k, written + k);
                    self.state = match n - k as u64 {
                        0 => {
                            if ends_message {
                                self.message_ended();
                            }
                            State::Header
                        }
                        left => State::Pass {
                            left,
                            reserve,
                            ends_message,
                        },
                    };
                }
                State::Skip(n) => {
                    let k = left.min(usize::try_from(n).unwrap_or(usize::MAX));
                    read += k;
                    self.state = rest(n, k, State::Skip);
                }
                State::Header => {
                    let Some(header) = parse_header(&region[read..]) else {
                        if eof {
                            region.copy_within(read.., written);
                            written += left;
                        } else {
                            self.carry.extend_from_slice(&region[read..]);
                        }
                        break;
                    };
                    match self.judge(&header)? {
                        Verdict::Pass {
                            reserve,
                            ends_message,
                        } => {
                            region.copy_within(read..read + header.len, written);
                            written += header.len;
                            self.state = if header.payload == 0 {
                                if ends_message {
                                    self.message_ended();
                                }
                                State::Header
                            } else {
                                State::Pass {
                                    left: header.payload,
                                    reserve,
                                    ends_message,
                                }
                            };
                        }
                        Verdict::Skip { first } => {
                            if first {
                                // A refused frame is masked, so its header has room.
                                region[written..written + PONG.len()].copy_from_slice(&PONG);
                                written += PONG.len();
                            }
                            self.state = rest(header.payload, 0, State::Skip);
                        }
                    }
                    read += header.len;
                }
            }
        }
        Ok(written)
    }

    fn judge(&mut self, header: &Header) -> io::Result<Verdict> {
        // What tungstenite would read whole before refusing it is refused here, unread.
        let forbidden = if !header.masked {
            Some("a client frame must be masked")
        } else if matches!(header.opcode, 3..=7 | 11..=15) {
            Some("unknown opcode")
        } else if header.opcode >= 8 && (!header.fin || header.payload > 125) {
            Some("a control frame is at most 125 bytes and not fragmented")
        } else {
            None
        };
        if let Some(why) = forbidden {
            return Err(fatal(Refusal::Protocol(why)));
        }
        if header.opcode >= 8 {
            return Ok(Verdict::Pass {
                reserve: false,
                ends_message: false,
            });
        }
        let first = header.opcode != 0;
        if first {
            self.message_bytes = 0;
            self.message_passed = 0;
            self.message_reserved = None;
            self.skipping_message = false;
        } else if self.skipping_message {
            self.skipping_message = !header.fin;
            return Ok(Verdict::Skip { first: false });
        }
        self.message_bytes = self.message_bytes.saturating_add(header.payload);
        let budgeted = self.limits.budget.is_some() && self.message_bytes >= BUDGETED_BYTES;
        let refusal = if self.message_bytes > self.limits.max_message {
            Some(Refusal::TooLarge {
                bytes: self.message_bytes,
                limit: self.limits.max_message,
            })
        } else if budgeted && !self.admits() {
            Some(Refusal::OverBudget {
                bytes: self.message_bytes,
            })
        } else {
            None
        };
        if let Some(refusal) = refusal {
            if !first {
                // tungstenite holds the message's first fragments: it cannot be skipped.
                return Err(fatal(refusal));
            }
            self.refused.push_back(refusal);
            self.skipping_message = !header.fin;
            return Ok(Verdict::Skip { first: true });
        }
        if budgeted {
            // Fragments passed before the message was large are reserved now.
            let unreserved = self.message_passed - self.reserved_bytes();
            self.reserve(unreserved)?;
        }
        self.message_passed += header.payload;
        Ok(Verdict::Pass {
            reserve: budgeted,
            ends_message: header.fin,
        })
    }

    /// Whether the rest of the current message fits in what the budget has free now.
    fn admits(&self) -> bool {
        let Some(budget) = &self.limits.budget else {
            return true;
        };
        let needed = self.message_bytes - self.reserved_bytes();
        budget.available() as u64 >= needed
    }

    fn reserved_bytes(&self) -> u64 {
        self.message_reserved.as_ref().map_or(0, Reserved::bytes)
    }

    /// Reserves `bytes` more for the current message; past the budget the read fails (the
    /// message is part-way through tungstenite, and cannot be skipped).
    fn reserve(&mut self, bytes: u64) -> io::Result<()> {
        let Some(budget) = &self.limits.budget else {
            return Ok(());
        };
        if bytes == 0 {
            return Ok(());
        }
        let taken = budget.try_reserve(bytes).ok_or_else(|| {
            fatal(Refusal::OverBudget {
                bytes: self.message_bytes,
            })
        })?;
        match &mut self.message_reserved {
            Some(reserved) => reserved.merge(taken),
            None => self.message_reserved = Some(taken),
        }
        Ok(())
    }

    /// The current message is whole: what it reserved waits for the connection to be
    /// done with it (one entry per message tungstenite hands up).
    fn message_ended(&mut self) {
        self.passed.push_back(self.message_reserved.take());
        self.message_bytes = 0;
        self.message_passed = 0;
    }
}

/// A refusal that fails the read: the connection cannot go on.
fn fatal(refusal: Refusal) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, refusal)
}

/// `n - k` more bytes of a skipped payload, or the next header when none are left.
fn rest(n: u64, k: usize, more: fn(u64) -> State) -> State {
    match n - k as u64 {
        0 => State::Header,
        left => more(left),
    }
}

/// The frame header at the start of `bytes`, once all of it is there.
fn parse_header(bytes: &[u8]) -> Option<Header> {
    let (&b0, &b1) = (bytes.first()?, bytes.get(1)?);
    let masked = b1 & 0x80 != 0;
    let (extended, payload) = match b1 & 0x7F {
        126 => (
            2,
            u64::from(u16::from_be_bytes(bytes.get(2..4)?.try_into().ok()?)),
        ),
        127 => (8, u64::from_be_bytes(bytes.get(2..10)?.try_into().ok()?)),
        n => (0, u64::from(n)),
    };
    let len = 2 + extended + if masked { 4 } else { 0 };
    debug_assert!(len <= MAX_HEADER);
    (bytes.len() >= len).then_some(Header {
        len,
        fin: b0 & 0x80 != 0,
        opcode: b0 & 0x0F,
        masked,
        payload,
    })
}

impl<S: AsyncRead + Unpin> Gate<S> {
    /// Reads into `buf` and judges what came; `buf` has room for a whole header (the
    /// carried part of one and the rest). Ready with nothing new only at the end.
    fn poll_examined(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        debug_assert!(buf.remaining() > MAX_HEADER);
        loop {
            let start = buf.filled().len();
            let carried = std::mem::take(&mut self.carry);
            buf.put_slice(&carried);
            let (mut pending, mut eof) = (false, false);
            match Pin::new(&mut self.inner).poll_read(cx, buf) {
                Poll::Ready(Ok(())) => eof = buf.filled().len() == start + carried.len(),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => pending = true,
            }
            let end = buf.filled().len();
            if end == start {
                return if pending {
                    Poll::Pending
                } else {
                    Poll::Ready(Ok(()))
                };
            }
            let kept = self.examine(&mut buf.filled_mut()[start..end], eof)?;
            buf.set_filled(start + kept);
            if kept > 0 || eof {
                return Poll::Ready(Ok(()));
            }
            if pending {
                return Poll::Pending;
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Gate<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.ready.is_empty() && buf.remaining() > SMALL_READ {
            return this.poll_examined(cx, buf);
        }
        // A reader with little room (tungstenite's reads are larger): judged in a buffer
        // of the gate's own and handed up from it.
        if this.ready.is_empty() {
            let mut own = [0u8; 2 * SMALL_READ];
            let mut own = ReadBuf::new(&mut own);
            std::task::ready!(this.poll_examined(cx, &mut own))?;
            this.ready.extend(own.filled());
        }
        let n = this.ready.len().min(buf.remaining());
        let (front, back) = this.ready.as_slices();
        let from_front = n.min(front.len());
        buf.put_slice(&front[..from_front]);
        buf.put_slice(&back[..n - from_front]);
        this.ready.drain(..n);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Gate<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A masked client frame (mask 0: the payload reads as written).
    fn frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![(u8::from(fin) << 7) | opcode];
        match payload.len() {
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
        out.extend_from_slice(payload);
        out
    }

    /// What the gate passes of `input`, written in pieces of `chunk` bytes.
    async fn through(limits: Limits, input: Vec<u8>, chunk: usize) -> Vec<u8> {
        let (mut near, far) = tokio::io::duplex(1 << 20);
        let mut gate = Gate::new(far, limits);
        let writer = tokio::spawn(async move {
            for piece in input.chunks(chunk) {
                near.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
        });
        let mut out = Vec::new();
        bounded(gate.read_to_end(&mut out)).await.unwrap();
        writer.await.unwrap();
        out
    }

    /// A gate over a stream that holds `input`, then ends.
    async fn gate_over(input: &[u8], limits: Limits) -> Gate<tokio::io::DuplexStream> {
        let (mut near, far) = tokio::io::duplex(1 << 20);
        near.write_all(input).await.unwrap();
        Gate::new(far, limits)
    }

    fn limited(max_message: u64) -> Limits {
        Limits {
            max_message,
            budget: None,
        }
    }

    /// Every read here ends, or the test fails rather than hangs.
    async fn bounded<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(std::time::Duration::from_secs(10), f)
            .await
            .expect("the read ends")
    }

    #[tokio::test]
    async fn frames_within_the_limits_pass_unchanged_however_the_reads_fall() {
        let mut input = frame(true, 1, b"hello");
        input.extend(frame(false, 1, &[b'a'; 300]));
        input.extend(frame(true, 9, b"ping"));
        input.extend(frame(true, 0, &[b'b'; 70_000]));
        for chunk in [1, 3, 7, 1000, 1 << 20] {
            let limits = Limits {
                max_message: 1 << 20,
                budget: Some(ByteBudget::new(1 << 20)),
            };
            let out = through(limits, input.clone(), chunk).await;
            let first_difference = out.iter().zip(&input).position(|(a, b)| a != b);
            assert_eq!(
                (out.len(), first_difference),
                (input.len(), None),
                "pieces of {chunk}"
            );
        }
    }

    #[tokio::test]
    async fn a_message_over_the_limit_is_skipped_for_a_pong_and_reported() {
        let mut input = frame(true, 1, &[b'x'; 200]);
        input.extend(frame(true, 1, b"next"));
        let mut fragmented = frame(false, 2, &[b'y'; 150]);
        fragmented.extend(frame(true, 0, b"tail"));
        input.extend(fragmented);
        input.extend(frame(true, 1, b"last"));
        for chunk in [1, 5, 4096] {
            let mut gate = gate_over(&input, limited(100)).await;
            let mut out = Vec::new();
            let mut buf = vec![0; chunk];
            loop {
                let n = bounded(gate.read(&mut buf)).await.unwrap();
                if n == 0 {
                    break;
                }
                out.extend_from_slice(&buf[..n]);
            }
            let mut expected = PONG.to_vec();
            expected.extend(frame(true, 1, b"next"));
            expected.extend(PONG);
            expected.extend(frame(true, 1, b"last"));
            assert_eq!(out, expected, "read in pieces of {chunk}");
            assert_eq!(
                gate.take_refusal(),
                Some(Refusal::TooLarge {
                    bytes: 200,
                    limit: 100
                })
            );
            assert_eq!(
                gate.take_refusal(),
                Some(Refusal::TooLarge {
                    bytes: 150,
                    limit: 100
                })
            );
            assert_eq!(gate.take_refusal(), None);
        }
    }

    #[tokio::test]
    async fn large_messages_hold_the_budget_until_released_and_are_refused_past_it() {
        let budget = ByteBudget::new(100_000);
        let mut input = frame(true, 2, &[1; 70_000]);
        input.extend(frame(true, 2, &[2; 70_000]));
        input.extend(frame(true, 2, &[3; 10]));
        let limits = Limits {
            max_message: 1 << 20,
            budget: Some(budget.clone()),
        };
        let mut gate = gate_over(&input, limits).await;
        let mut out = Vec::new();
        bounded(gate.read_to_end(&mut out)).await.unwrap();
        let mut expected = frame(true, 2, &[1; 70_000]);
        expected.extend(PONG);
        expected.extend(frame(true, 2, &[3; 10]));
        assert_eq!(out, expected);
        assert_eq!(
            gate.take_refusal(),
            Some(Refusal::OverBudget { bytes: 70_000 })
        );
        assert_eq!(budget.available(), 30_000, "the first is still held");
        gate.release_one();
        assert_eq!(budget.available(), 100_000);
    }

    #[tokio::test]
    async fn a_fragment_that_breaks_the_limit_after_others_passed_fails_the_read() {
        let mut input = frame(false, 1, &[b'a'; 60]);
        input.extend(frame(true, 0, &[b'b'; 60]));
        let mut gate = gate_over(&input, limited(100)).await;
        let mut out = Vec::new();
        let err = bounded(gate.read_to_end(&mut out)).await.unwrap_err();
        let refusal = err.get_ref().and_then(|e| e.downcast_ref::<Refusal>());
        assert_eq!(
            refusal,
            Some(&Refusal::TooLarge {
                bytes: 120,
                limit: 100
            })
        );
    }

    #[tokio::test]
    async fn frames_tungstenite_would_read_whole_before_refusing_are_refused_unread() {
        let mut unmasked = frame(true, 1, b"hi");
        unmasked[1] &= 0x7F;
        let big_ping = frame(true, 9, &[0; 200]);
        let fragmented_ping = frame(false, 9, b"p");
        let reserved = frame(true, 3, b"x");
        for input in [unmasked, big_ping, fragmented_ping, reserved] {
            let mut gate = gate_over(&input, limited(1 << 20)).await;
            let mut out = Vec::new();
            let err = bounded(gate.read_to_end(&mut out)).await.unwrap_err();
            let refusal = err.get_ref().and_then(|e| e.downcast_ref::<Refusal>());
            assert!(matches!(refusal, Some(Refusal::Protocol(_))), "{refusal:?}");
            assert_eq!(refusal.unwrap().close_code(), 1002);
        }
    }

    #[tokio::test]
    async fn a_header_alone_holds_nothing_of_the_budget() {
        let budget = ByteBudget::new(1 << 20);
        let mut input = header_of(1 << 19);
        input.extend_from_slice(&[0; 10]);
        let limits = Limits {
            max_message: 1 << 20,
            budget: Some(budget.clone()),
        };
        let (mut near, far) = tokio::io::duplex(1 << 20);
        let mut gate = Gate::new(far, limits);
        near.write_all(&input).await.unwrap();
        let mut buf = vec![0; 4096];
        let n = bounded(gate.read(&mut buf)).await.unwrap();
        assert_eq!(n, input.len());
        assert_eq!(budget.available(), (1 << 20) - 10, "only what arrived");
    }

    #[tokio::test]
    async fn control_frames_inside_a_skipped_message_still_pass() {
        let mut input = frame(false, 1, &[b'x'; 200]);
        input.extend(frame(true, 9, b"ping"));
        input.extend(frame(true, 0, b"tail"));
        input.extend(frame(true, 1, b"after"));
        let mut gate = gate_over(&input, limited(100)).await;
        let mut out = Vec::new();
        bounded(gate.read_to_end(&mut out)).await.unwrap();
        let mut expected = PONG.to_vec();
        expected.extend(frame(true, 9, b"ping"));
        expected.extend(frame(true, 1, b"after"));
        assert_eq!(out, expected);
    }

    /// The header of a masked, final text frame of `len` bytes, alone.
    fn header_of(len: usize) -> Vec<u8> {
        let mut header = vec![0x81, 0x80 | 127];
        header.extend_from_slice(&(len as u64).to_be_bytes());
        header.extend_from_slice(&[0, 0, 0, 0]);
        header
    }
}
