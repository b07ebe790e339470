//! The wire layer: what haltd reads from and writes to a client, with no I/O and no daemon
//! state ([wire-format.md](../../../docs/wire-format.md)).
//!
//! ```text
//! client bytes ──http::parse_head──► RequestHead (method, path, sizes, Authorization)
//!              ──request::ClientRequest──► the body, parsed once; each token source takes its
//!                                           view of it
//! a Messages API body ──messages::request::to_chat──► the chat body it is served as
//! a Responses API body ──responses::request::to_chat──► the chat body it is served as
//!   (both through fields, the checked reads, and chat_content, the messages they write)
//! tokens ──encode::ChunkEncoder──► SSE token events, final events, batch bodies
//!                                  (encode::bound: the largest token event, E)
//! a trip ──terminal::Halt──► the terminal frame, nonce at byte 31
//!        ──http::write_head / write_error_response──► response heads and error bodies
//! ```
//!
//! Modules above it use it (the data plane, the halt core, the upstream protocol in
//! [`crate::upstream`]); it uses none of them, only [`crate::codes`] for the failure codes the
//! terminal event names. Inside the layer each module names its siblings by their own path
//! (`crate::wire::http::HttpError`), never through the re-exports below, so the layer's module
//! graph has no cycle either.

pub mod chat_content;
pub mod encode;
pub mod endpoint;
pub mod fields;
pub mod http;
pub mod json_write;
pub mod messages;
pub mod request;
pub mod responses;
pub mod secret;
pub mod stream_id;
pub mod surface;
pub mod terminal;
pub mod text;
pub mod token;
pub mod trace;

pub use encode::{
    bound::{LONGEST_LOGPROB, MAX_LOGPROB_BYTES},
    Channel, ChunkEncoder, Token, ToolCallDelta, MAX_TOKEN_TEXT_BYTES, MAX_TOOL_CALL_ID_BYTES,
    MAX_TOOL_NAME_BYTES, MAX_TOP_LOGPROBS,
};
pub use endpoint::Endpoint;
pub use http::{HttpError, RequestHead};
pub use request::{Ask, BuiltinTurn, ClientRequest};
pub use secret::Secret;
pub use stream_id::{nonce_hex, BadStreamId, StreamId};
pub use terminal::Halt;
pub use text::{truncate_chars, truncate_text};
