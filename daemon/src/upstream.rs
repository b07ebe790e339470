//! The upstream protocol layer: everything the data plane needs to proxy one turn to an
//! OpenAI-compatible backend (vLLM, llama.cpp server, Ollama) over HTTP/1.1, plain or in TLS
//! (`tls.rs`), with no I/O.
//!
//! The data plane owns the sockets and the io_uring completions; this module only turns bytes
//! into decisions and back, so each piece can be tested exhaustively without a network:
//!
//! ```text
//! ClientRequest (crate::wire, the client body parsed once)
//!             ──request::prepare_turn──► upstream body (always stream: true, logprobs on)
//!             ──request::write_http_request──► request bytes ──► upstream socket
//! upstream socket bytes ──response::ResponseReader──► status + de-chunked body
//!                       ──sse::SseParser──► SSE events, lent from its reused buffers
//!                       ──chunk::ChunkReader──► tokens with logprobs, finish reason, usage,
//!                                               or the upstream's error, read with no JSON
//!                                               DOM into a chunk whose buffers are reused
//!                                               (chunk::parse_event: into a new one)
//!                       ──framing──► how the text is cut into frames, one token each
//! ```
//!
//! Between turns, the watch thread (`crate::upstream_watch`, a layer up: it does blocking
//! I/O) keeps the upstream's name resolved and probes it, publishing both in `health.rs` for
//! the data plane's connects and for `/readyz`.
//!
//! haltd always streams from the upstream, even for a client's batch request, so that the
//! detectors see every token as it is generated and a trip can cancel the generation by
//! closing the upstream connection (vLLM aborts a request whose connection closes).
//!
//! Every parser here is incremental (bytes may arrive split anywhere), bounded (a size limit
//! on every buffer that input can grow) and total (any input gives a value or a typed error,
//! never a panic): the upstream is a separate process that can be buggy, restarted or
//! replaced, and its failure must end in a clean terminal event for the client (G3, G7).

pub mod api_key;
pub mod chunk;
pub mod degraded;
pub mod failure;
pub mod framing;
pub mod health;
pub mod metrics;
pub mod native;
pub mod request;
pub mod response;
pub mod sse;
pub mod tls;
pub mod url;

#[cfg(test)]
pub(crate) mod alloc_tests;

pub use api_key::UpstreamApiKey;
pub use chunk::{
    parse_event, ChunkError, ChunkReader, FinishReason, Parsed, UpToken, UpstreamChunk,
    UpstreamError, UpstreamEvent, Usage,
};
pub use failure::{CancelReason, FailureSource, UpstreamFailure, UpstreamFailureKind};
pub use native::{NativeSurfaces, UpstreamSurface};
pub use request::{
    prepare_turn, valid_header_value, write_http_request, write_http_request_with, DegradedShape,
    UpstreamTurn, CHAT_PATH, COMPLETIONS_PATH, MODELS_PATH,
};
pub use response::{Framing, Progress, ResponseError, ResponseHead, ResponseReader};
pub use sse::{SseError, SseEvent, SseEventRef, SseParser};
pub use tls::{TlsConfigError, TlsLink, UpstreamTls};
pub use url::{UpstreamUrl, UrlError};
