//! HTTP request bodies charged to the bridge-wide [`ByteBudget`] as they arrive, as large
//! WebSocket messages are: without it, one HTTP/2 connection could hold a few hundred
//! bodies of up to `max_body_bytes` each, trickled in for the body timeout, and nothing
//! caps connections.
//!
//! A body is charged once [`BUDGETED_BYTES`] of it have arrived, for all it has read, and
//! holds the bytes until it is dropped (once the handler's extractor has it whole). What a
//! client only declares (`Content-Length`) is not charged: sending the bytes is what costs
//! the bridge memory. A body the budget cannot take fails, and [`Charged::refused`] says
//! so, for the endpoint to answer 503 in its own shape.

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
}

/// `request` with its body charged to `budget`.
pub fn charge(request: Request, budget: &ByteBudget) -> (Request, Charged) {
    let charged = Charged::default();
    let budget = budget.clone();
    let flag = charged.clone();
    let request = request.map(|body| {
        Body::new(BudgetedBody {
            body,
            budget,
            read: 0,
            held: None,
            charged: flag,
        })
    });
    (request, charged)
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

struct BudgetedBody {
    body: Body,
    budget: ByteBudget,
    /// Bytes read so far.
    read: u64,
    /// What the body holds of the budget, once it has read `BUDGETED_BYTES`.
    held: Option<Reserved>,
    charged: Charged,
}

impl BudgetedBody {
    /// Charges a frame of `bytes` just read; false when the budget cannot take it.
    fn charge(&mut self, bytes: u64) -> bool {
        self.read += bytes;
        if self.read < BUDGETED_BYTES {
            return true;
        }
        // The first charge covers the small start the body read uncharged.
        let owed = if self.held.is_some() {
            bytes
        } else {
            self.read
        };
        match (self.budget.try_reserve(owed), &mut self.held) {
            (None, _) => false,
            (Some(taken), Some(held)) => {
                held.merge(taken);
                true
            }
            (Some(taken), held) => {
                *held = Some(taken);
                true
            }
        }
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
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        if let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref))
            && let Some(data) = data
            && !this.charge(data.len() as u64)
        {
            this.held = None;
            this.charged.0.store(true, Ordering::Release);
            return Poll::Ready(Some(Err(axum::Error::new(OverBudget))));
        }
        Poll::Ready(frame)
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

    fn charged(chunks: &[usize], budget: &ByteBudget) -> (axum::body::BodyDataStream, Charged) {
        let frames: Vec<Result<Bytes, std::convert::Infallible>> = chunks
            .iter()
            .map(|&n| Ok(Bytes::from(vec![b'x'; n])))
            .collect();
        let request = Request::new(Body::from_stream(futures_util::stream::iter(frames)));
        let (request, charged) = charge(request, budget);
        (request.into_body().into_data_stream(), charged)
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
}
