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
//!   extractor has it whole). One the budget cannot take fails, and [`Charged::refusal`]
//!   says so, for the endpoint to answer 503 (413 past the whole budget) in its shape.
//! - A gRPC call's body ([`charge_grpc`]) is a stream of length-prefixed messages that
//!   may stay open for hours. tonic reads each message into one buffer, which keeps the
//!   size of the largest so far until the call ends, so the call holds as much of the
//!   budget as its largest message of at least `BUDGETED_BYTES`, charged as its bytes
//!   arrive. A message the budget cannot take fails the call `UNAVAILABLE`; one larger
//!   than the whole budget, `RESOURCE_EXHAUSTED` as soon as its length prefix says so.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, ready};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use hyper::body::{Frame, SizeHint};

use super::budget::{BUDGETED_BYTES, ByteBudget, Reserved};

/// Why a charged body was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The budget holds as many bytes as it may now: the client may send it again later.
    Busy,
    /// Larger than the whole budget: it can never be taken.
    LargerThanBudget,
}

impl Refusal {
    /// What the refusal says, for a budget of `budget` bytes.
    pub fn text(self, budget: usize) -> String {
        match self {
            Refusal::Busy => {
                "the bridge is reading as many large request bodies as it may; send it again later"
                    .into()
            }
            Refusal::LargerThanBudget => format!(
                "the request body is larger than the bridge's read budget of {budget} bytes"
            ),
        }
    }
}

/// Whether a charged body was refused, readable once the endpoint has answered.
#[derive(Clone, Debug, Default)]
pub struct Charged(Arc<OnceLock<Refusal>>);

impl Charged {
    pub fn refusal(&self) -> Option<Refusal> {
        self.0.get().copied()
    }

    fn refuse(&self, refusal: Refusal) {
        let _ = self.0.set(refusal);
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
            charged,
        })
    })
}

/// A refused body's error, for an extractor or tonic to fail on.
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// How a body's bytes are counted against the budget.
enum Counting {
    /// As one piece, from its first byte once it has read `BUDGETED_BYTES`.
    Whole { read: u64 },
    /// Message by message.
    Grpc(GrpcMessages),
}

/// Where a gRPC body's reading is: in a message's 5-byte prefix (a flag and a big-endian
/// length), or in a message, `read` bytes of its `length`.
#[derive(Default)]
struct GrpcMessages {
    prefix: [u8; 5],
    prefix_read: usize,
    length: u64,
    read: u64,
    in_message: bool,
}

struct BudgetedBody {
    body: Body,
    budget: ByteBudget,
    counting: Counting,
    /// What the body holds of the budget: all it read, for a plain body; for a gRPC call,
    /// as much as its largest message so far (tonic's buffer keeps that size).
    held: Option<Reserved>,
    charged: Charged,
}

impl BudgetedBody {
    /// Charges a frame of `data` just read.
    fn charge(&mut self, data: &[u8]) -> Result<(), Refusal> {
        let budget = self.budget.bytes();
        match &mut self.counting {
            Counting::Whole { read } => {
                *read += data.len() as u64;
                if *read < BUDGETED_BYTES {
                    return Ok(());
                }
                // The first charge covers the small start the body read uncharged.
                if hold_at_least(&mut self.held, &self.budget, *read) {
                    return Ok(());
                }
                Err(if *read > budget as u64 {
                    Refusal::LargerThanBudget
                } else {
                    Refusal::Busy
                })
            }
            Counting::Grpc(messages) => {
                let mut data = data;
                while !data.is_empty() {
                    if !messages.in_message {
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
                            messages.read = 0;
                            messages.in_message = length > 0;
                            // It could never be taken: refused before it is sent.
                            if messages.length >= BUDGETED_BYTES && messages.length > budget as u64
                            {
                                return Err(Refusal::LargerThanBudget);
                            }
                        }
                        continue;
                    }
                    let n = (messages.length - messages.read).min(data.len() as u64);
                    data = &data[n as usize..];
                    messages.read += n;
                    messages.in_message = messages.read < messages.length;
                    // Charged up to this message's bytes so far, past what the body holds.
                    if messages.length >= BUDGETED_BYTES
                        && !hold_at_least(&mut self.held, &self.budget, messages.read)
                    {
                        return Err(Refusal::Busy);
                    }
                }
                Ok(())
            }
        }
    }
}

/// Makes `held` at least `bytes` of `budget`, taking what it lacks; false when the budget
/// has not that much free.
fn hold_at_least(held: &mut Option<Reserved>, budget: &ByteBudget, bytes: u64) -> bool {
    let owed = bytes.saturating_sub(held.as_ref().map_or(0, Reserved::bytes));
    if owed == 0 {
        return true;
    }
    let Some(taken) = budget.try_reserve(owed) else {
        return false;
    };
    match held {
        Some(held) => held.merge(taken),
        None => *held = Some(taken),
    }
    true
}

impl HttpBody for BudgetedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if let Some(refusal) = this.charged.refusal() {
            return Poll::Ready(Some(Err(this.error(refusal))));
        }
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        let Some(Ok(Some(data))) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) else {
            return Poll::Ready(frame);
        };
        match this.charge(data) {
            Ok(()) => Poll::Ready(frame),
            Err(refusal) => {
                this.held = None;
                this.charged.refuse(refusal);
                Poll::Ready(Some(Err(this.error(refusal))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.charged.refusal().is_none() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl BudgetedBody {
    /// The body's error for `refusal`: for a gRPC call, the status tonic finds among the
    /// error's sources and answers the call with.
    fn error(&self, refusal: Refusal) -> axum::Error {
        let budget = self.budget.bytes();
        let Counting::Grpc(messages) = &self.counting else {
            return axum::Error::new(Refused(refusal.text(budget)));
        };
        let bytes = messages.length;
        axum::Error::new(match refusal {
            Refusal::Busy => tonic::Status::unavailable(format!(
                "message of {bytes} bytes refused: the bridge is reading as many large messages as it may; send it again later"
            )),
            Refusal::LargerThanBudget => tonic::Status::resource_exhausted(format!(
                "message of {bytes} bytes refused: it is larger than the bridge's read budget of {budget} bytes"
            )),
        })
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
        assert_eq!(charged.refusal(), None);
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
        assert_eq!(charged.refusal(), None);
    }

    #[tokio::test]
    async fn a_body_past_what_the_budget_has_free_fails_and_gives_back_what_it_held() {
        let budget = ByteBudget::new(100_000);
        let elsewhere = budget.try_reserve(20_000).unwrap();
        let (mut body, charged) = charged(&[70_000, 20_000, 10], &budget);
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 10_000);
        assert!(body.next().await.unwrap().is_err());
        assert_eq!(charged.refusal(), Some(Refusal::Busy));
        assert_eq!(budget.available(), 80_000);
        assert!(body.next().await.unwrap().is_err(), "stays refused");
        drop(elsewhere);
    }

    #[tokio::test]
    async fn a_body_larger_than_the_whole_budget_is_told_so() {
        let budget = ByteBudget::new(100_000);
        let (mut body, charged) = charged(&[70_000, 40_000], &budget);
        body.next().await.unwrap().unwrap();
        assert!(body.next().await.unwrap().is_err());
        assert_eq!(charged.refusal(), Some(Refusal::LargerThanBudget));
        assert_eq!(budget.available(), 100_000);
    }

    #[tokio::test]
    async fn a_grpc_call_holds_as_much_as_its_largest_message_until_it_ends() {
        let budget = ByteBudget::new(200_000);
        // 105 bytes of a small message, then the large one's prefix and first 49,893 bytes.
        let mut body = grpc(&[100, 100_000, 80_000], 50_003, &budget);
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 200_000 - 49_893);
        body.next().await.unwrap().unwrap();
        assert_eq!(budget.available(), 200_000 - 49_893 - 50_003);
        while let Some(data) = body.next().await {
            data.unwrap();
        }
        assert_eq!(budget.available(), 100_000, "the largest message's size");
        drop(body);
        assert_eq!(budget.available(), 200_000);
    }

    #[tokio::test]
    async fn grpc_prefixes_cut_anywhere_are_read() {
        let budget = ByteBudget::new(200_000);
        let mut body = grpc(&[10, 70_000, 10, 90_000], 3, &budget);
        let mut read = 0;
        while read < 15 + 70_005 {
            read += body.next().await.unwrap().unwrap().len();
        }
        assert_eq!(budget.available(), 130_000);
        while let Some(data) = body.next().await {
            data.unwrap();
        }
        assert_eq!(budget.available(), 110_000);
    }

    #[tokio::test]
    async fn small_grpc_messages_are_not_charged_however_many() {
        let budget = ByteBudget::new(1000);
        let mut body = grpc(&[60_000; 5], 7_000, &budget);
        while let Some(data) = body.next().await {
            data.unwrap();
        }
    }

    fn status_of(error: axum::Error) -> tonic::Status {
        tonic::Status::from_error(Box::new(error))
    }

    #[tokio::test]
    async fn a_grpc_message_past_what_the_budget_has_free_is_unavailable() {
        let budget = ByteBudget::new(100_000);
        let elsewhere = budget.try_reserve(50_000).unwrap();
        let mut body = grpc(&[80_000], 40_000, &budget);
        body.next().await.unwrap().unwrap();
        let status = status_of(body.next().await.unwrap().unwrap_err());
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("80000 bytes"), "{status:?}");
        assert_eq!(budget.available(), 50_000);
        drop(elsewhere);
    }

    #[tokio::test]
    async fn a_grpc_message_larger_than_the_whole_budget_is_refused_by_its_prefix() {
        let budget = ByteBudget::new(100_000);
        let mut body = grpc(&[150_000], 10, &budget);
        let status = status_of(body.next().await.unwrap().unwrap_err());
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("150000 bytes"), "{status:?}");
    }
}
