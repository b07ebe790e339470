//! The OpenAI Responses API (`POST /v1/responses`), served by translation as the Messages API
//! is: [`request`] rewrites a Responses request into the chat body every source and detector
//! already governs (docs/wire-format.md, "Responses API requests"), and [`encode`] and
//! [`terminal`] write what the client reads (the event stream, the Response of a batch turn,
//! the halted end) in the Responses schema (docs/wire-format.md, "Responses API"). Errors are
//! OpenAI's, as chat's.

pub mod encode;
pub mod object;
pub mod request;
pub mod terminal;
