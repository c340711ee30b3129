//! Two corrections to what the gRPC stack answers on its own.
//!
//! - **An early refusal keeps the request open until it is sent.** A call refused before
//!   its handler runs (no token) drops the request body at once; on an HTTP/2 stream the
//!   client is still sending, that resets the stream with CANCEL, and a reset that races the
//!   response's HEADERS discards them: the client sees `INTERNAL` or `CANCELLED` instead of
//!   the status. Held until the response body is done, the body's drop finds the response
//!   sent, and h2 resets with NO_ERROR after it, as RFC 9113 §8.1 describes.
//! - **A message over the limit is RESOURCE_EXHAUSTED**, as the gateway and gRPC's own
//!   implementations say, not tonic's OUT_OF_RANGE.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::HeaderMap;
use axum::response::Response;
use hyper::body::Frame;
use tonic::{Code, Status};

/// `response`, with `request`'s body kept open until the response's body is done.
pub fn holding_request(request: Request, response: Response) -> Response {
    let held = request.into_body();
    response.map(|body| {
        Body::new(Wrapped {
            body,
            _held: Some(held),
            remap: false,
        })
    })
}

/// Rewrites tonic's OUT_OF_RANGE for an oversized message, in the response's headers (a
/// unary call) or its trailers (a stream).
pub fn oversize_is_resource_exhausted(mut response: Response) -> Response {
    remap(response.headers_mut());
    response.map(|body| {
        Body::new(Wrapped {
            body,
            _held: None,
            remap: true,
        })
    })
}

/// The text tonic's decoder gives an oversized message.
const TOO_LARGE: &str = "Error, decoded message length too large";

fn remap(headers: &mut HeaderMap) {
    // Read whole only when it is OUT_OF_RANGE: building a `Status` from the headers of
    // every answer cost a unary call 1,700 instructions (callgrind, synapse/unary).
    let code = (headers.get("grpc-status")).and_then(|code| code.to_str().ok()?.parse().ok());
    if code != Some(Code::OutOfRange as i32) {
        return;
    }
    let Some(status) = Status::from_header_map(headers) else {
        return;
    };
    if status.code() == Code::OutOfRange && status.message().starts_with(TOO_LARGE) {
        let exhausted = Status::resource_exhausted(status.message().to_owned());
        let _ = exhausted.add_header(headers);
    }
}

struct Wrapped {
    body: Body,
    /// A request body kept open until this one is done.
    _held: Option<Body>,
    remap: bool,
}

impl HttpBody for Wrapped {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let frame = std::task::ready!(Pin::new(&mut this.body).poll_frame(cx));
        Poll::Ready(frame.map(|frame| {
            frame.map(|frame| match frame.into_trailers() {
                Ok(mut trailers) => {
                    if this.remap {
                        remap(&mut trailers);
                    }
                    Frame::trailers(trailers)
                }
                Err(frame) => frame,
            })
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}
