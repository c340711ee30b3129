//! The protobuf codec of every Synapse gRPC call: tonic's own (`tonic_prost`), with call
//! buffers that start at 1 KiB rather than 8. tonic allocates an encode and a decode
//! buffer for each call when it starts, so a `StreamMessages` stream held open by an idle
//! agent kept 16 KiB of buffers it never filled; a busy stream's buffers grow to what it
//! sends and keep that size (BENCHMARKS.md, *Idle connections*).

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Where a call's buffers start.
const BUFFER_START: usize = 1024;

/// How much an encoder writes before it yields (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

/// `tonic_prost::ProstCodec` with smaller starting buffers; named by `build.rs` as the
/// generated services' codec.
#[derive(Debug, Clone, Copy)]
pub struct SmallBufferCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallBufferCodec<T, U> {
    fn default() -> Self {
        SmallBufferCodec(PhantomData)
    }
}

impl<T, U> Codec for SmallBufferCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(BUFFER_START, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::new(BUFFER_START, YIELD_THRESHOLD))
    }
}
