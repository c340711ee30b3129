//! HTTP request bodies charged to the bridge-wide [`ByteBudget`] as they arrive, as large
//! WebSocket messages are: without it, one HTTP/2 connection could hold a few hundred
//! bodies of up to `max_body_bytes` each, trickled in for the body timeout (or gRPC
//! messages of up to `max_message_bytes`, on streams with no timeout), and nothing caps
//! connections.
//!
//! What a client only declares (`Content-Length`, a gRPC message's length prefix) is not
//! charged: sending the bytes is what costs the bridge memory.
//! - A plain body ([`charge`]) is charged once [`BUDGETED_BYTES`] of it have arrived, for
//!   all it has read, and holds the bytes until it is dropped (once the handler's
//!   extractor has it whole). One the budget cannot take fails, and [`Charged::refused`]
//!   says so, for the endpoint to answer 503 in its own shape.
//! - A gRPC call's body ([`charge_grpc`]) is a stream of length-prefixed messages that
//!   may stay open for hours, so each message of at least `BUDGETED_BYTES` is charged on
//!   its own, as its bytes arrive, until the call asks for what follows it (tonic then has
//!   it decoded and handed over). One the budget cannot take fails the call `UNAVAILABLE`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use hyper::body::{Frame, SizeHint};

use super::budget::{BUDGETED_BYTES, ByteBudget, Reserved};

/// The text a refused body's 503 says.
pub const REFUSED: &str =
    "the bridge is reading as many large request bodies as it may; send it again later";

/// Whether a charged body was refused, readable once the endpoint has answered.
#[derive(Clone, Debug, Default)]
pub struct Charged(Arc<AtomicBool>);

impl Charged {
    pub fn refused(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    fn refuse(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// `request` with its body charged to `budget` as one piece.
pub fn charge(request: Request, budget: &ByteBudget) -> (Request, Charged) {
    let charged = Charged::default();
    let request = budgeted(
        request,
        budget,
        Counting::Whole { read: 0 },
        charged.clone(),
    );
    (request, charged)
}

/// `request`, a gRPC call, with each large message of its body charged to `budget`.
pub fn charge_grpc(request: Request, budget: &ByteBudget) -> Request {
    let counting = Counting::Grpc(GrpcMessages::default());
    budgeted(request, budget, counting, Charged::default())
}

fn budgeted(
    request: Request,
    budget: &ByteBudget,
    counting: Counting,
    charged: Charged,
) -> Request {
    let budget = budget.clone();
    request.map(|body| {
        Body::new(BudgetedBody {
            body,
            budget,
            counting,
            held: None,
            let_go: None,
            charged,
        })
    })
}

/// The bridge holds as many bytes of large bodies as it may.
#[derive(Debug)]
struct OverBudget;

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REFUSED)
    }
}

impl std::error::Error for OverBudget {}

/// How a body's bytes are counted against the budget.
enum Counting {
    /// As one piece, from its first byte once it has read `BUDGETED_BYTES`.
    Whole { read: u64 },
    /// Message by message.
    Grpc(GrpcMessages),
}

/// Where a gRPC body's reading is: in a message's 5-byte prefix (a flag and a big-endian
/// length), or `left` bytes short of a message's end.
#[derive(Default)]
struct GrpcMessages {
    prefix: [u8; 5],
    prefix_read: usize,
    left: u64,
    /// Whether the message being read is large enough to charge.
    large: bool,
    /// Its length, for the refusal.
    length: u64,
}

struct BudgetedBody {
    body: Body,
    budget: ByteBudget,
    counting: Counting,
    /// What the body (or the gRPC message being read) holds of the budget.
    held: Option<Reserved>,
    /// What gRPC messages read whole hold, let go once the call asks for more.
    let_go: Option<Reserved>,
    charged: Charged,
}

/// A frame the budget could not take.
enum Refused {
    Body,
    GrpcMessage { bytes: u64 },
}

impl BudgetedBody {
    /// Charges a frame of `data` just read.
    fn charge(&mut self, data: &[u8]) -> Result<(), Refused> {
        match &mut self.counting {
            Counting::Whole { read } => {
                *read += data.len() as u64;
                if *read < BUDGETED_BYTES {
                    return Ok(());
                }
                // The first charge covers the small start the body read uncharged.
                let owed = if self.held.is_some() {
                    data.len() as u64
                } else {
                    *read
                };
                let taken = self.budget.try_reserve(owed).ok_or(Refused::Body)?;
                hold(&mut self.held, taken);
                Ok(())
            }
            Counting::Grpc(messages) => {
                let mut data = data;
                while !data.is_empty() {
                    if messages.left == 0 {
                        let n = (5 - messages.prefix_read).min(data.len());
                        let at = messages.prefix_read;
                        messages.prefix[at..at + n].copy_from_slice(&data[..n]);
                        messages.prefix_read += n;
                        data = &data[n..];
                        if messages.prefix_read == 5 {
                            messages.prefix_read = 0;
                            let length = u32::from_be_bytes(
                                messages.prefix[1..].try_into().expect("4 bytes"),
                            );
                            messages.length = u64::from(length);
                            messages.left = messages.length;
                            messages.large = messages.length >= BUDGETED_BYTES;
                        }
                        continue;
                    }
                    let n = messages.left.min(data.len() as u64);
                    data = &data[n as usize..];
                    messages.left -= n;
                    if messages.large {
                        let taken = (self.budget.try_reserve(n)).ok_or(Refused::GrpcMessage {
                            bytes: messages.length,
                        })?;
                        hold(&mut self.held, taken);
                    }
                    if messages.left == 0
                        && let Some(read) = self.held.take()
                    {
                        hold(&mut self.let_go, read);
                    }
                }
                Ok(())
            }
        }
    }
}

fn hold(held: &mut Option<Reserved>, taken: Reserved) {
    match held {
        Some(held) => held.merge(taken),
        None => *held = Some(taken),
    }
}

impl HttpBody for BudgetedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if this.charged.refused() {
            return Poll::Ready(Some(Err(axum::Error::new(OverBudget))));
        }
        // Asked for more: the messages read whole are the call's now.
        this.let_go = None;
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) else {
            return Poll::Ready(frame);
        };
        let Some(data) = data else {
            return Poll::Ready(frame);
        };
        match this.charge(data) {
            Ok(()) => Poll::Ready(frame),
            Err(refused) => {
                (this.held, this.let_go) = (None, None);
                this.charged.refuse();
                Poll::Ready(Some(Err(match refused {
                    Refused::Body => axum::Error::new(OverBudget),
                    // tonic answers the call with the status it finds among the errors.
                    Refused::GrpcMessage { bytes } => {
                        axum::Error::new(tonic::Status::unavailable(format!(
                            "message of {bytes} bytes refused: the bridge is reading as many large messages as it may; send it again later"
                        )))
                    }
                })))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        !self.charged.refused() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::*;

    fn request_of(frames: Vec<Vec<u8>>) -> Request {
        let frames = frames
            .into_iter()
            .map(|frame| Ok::<_, std::convert::Infallible>(Bytes::from(frame)));
        Request::new(Body::from_stream(futures_util::stream::iter(frames)))
    }

    fn charged(chunks: &[usize], budget: &ByteBudget) -> (axum::body::BodyDataStream, Charged) {
        let frames = chunks.iter().map(|&n| vec![b'x'; n]).collect();
        let (request, charged) = charge(request_of(frames), budget);
        (request.into_body().into_data_stream(), charged)
    }

    /// A gRPC body's frames: `messages` (their lengths) laid end to end, cut every `cut`
    /// bytes.
    fn grpc(messages: &[u32], cut: usize, budget: &ByteBudget) -> axum::body::BodyDataStream {
        let mut bytes = Vec::new();
        for &length in messages {
            bytes.push(0);
            bytes.extend(length.to_be_bytes());
            bytes.extend(std::iter::repeat_n(b'x', length as usize));
        }
        let frames = bytes.chunks(cut).map(<[u8]>::to_vec).collect();
        charge_grpc(request_of(frames), budget)
            .into_body()
            .into_data_stream()
    }

    #[tokio::test]
    async fn small_bodies_are_not_charged() {
        let budget = ByteBudget::new(1000);
        let (mut body, charged) = charged(&[30_000, 30_000], &budget);
        while let Some(data) = body.next().await {
            data.unwrap();
        }
        assert!(!charged.refused());
        assert_eq!(budget.available(), 1000);
    }

    #[tokio::test]
    async fn a_large_body_holds_what_it_read_until_dropped() {
        let budget = ByteBudget::new(200_000);
        let (mut body, charged) = charged(&[40_000, 40_000, 40_000], &budget);
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 200_000, "under BUDGETED_BYTES");
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 120_000, "charged from the first byte");
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 80_000);
        drop(body);
        assert_eq!(budget.available(), 200_000);
        assert!(!charged.refused());
    }

    #[tokio::test]
    async fn a_body_past_the_budget_fails_and_gives_back_what_it_held() {
        let budget = ByteBudget::new(100_000);
        let (mut body, charged) = charged(&[70_000, 40_000, 10], &budget);
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 30_000);
        assert!(body.next().await.unwrap().is_err());
        assert!(charged.refused());
        assert_eq!(budget.available(), 100_000);
        assert!(body.next().await.unwrap().is_err(), "stays refused");
    }

    #[tokio::test]
    async fn a_large_grpc_message_holds_its_bytes_until_the_call_asks_for_more() {
        let budget = ByteBudget::new(200_000);
        // 105 bytes of a small message, then the large one's prefix and first 49,893 bytes.
        let mut body = grpc(&[100, 100_000], 50_003, &budget);
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 200_000 - 49_893);
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 200_000 - 49_893 - 50_003);
        body.next().await.unwrap().unwrap();
        assert_eq!(
            budget.available(),
            100_000,
            "read whole, not yet handed over"
        );
        assert!(body.next().await.is_none());
        assert_eq!(budget.available(), 200_000, "asked for more");
    }

    #[tokio::test]
    async fn grpc_prefixes_cut_anywhere_are_read() {
        let budget = ByteBudget::new(200_000);
        let mut body = grpc(&[10, 70_000, 10], 3, &budget);
        let mut read = 0;
        while read < 15 + 70_005 {
            read += body.next().await.unwrap().unwrap().len();
        }
        assert_eq!(budget.available(), 130_000);
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 200_000);
    }

    #[tokio::test]
    async fn small_grpc_messages_are_not_charged_however_many() {
        let budget = ByteBudget::new(1000);
        let mut body = grpc(&[60_000; 5], 7_000, &budget);
        while let Some(data) = body.next().await {
            data.unwrap();
        }
    }

    #[tokio::test]
    async fn a_grpc_message_past_the_budget_is_unavailable() {
        let budget = ByteBudget::new(100_000);
        let mut body = grpc(&[150_000], 60_000, &budget);
        body.next().await.unwrap().unwrap();
        let refused = body.next().await.unwrap().unwrap_err();
        let status = tonic::Status::from_error(Box::new(refused));
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("150000 bytes"), "{status:?}");
        assert_eq!(budget.available(), 100_000);
    }
}
