//! The Anthropic Messages API (`POST /v1/messages`), served by translation: [`request`]
//! rewrites a Messages request into the chat body every source and detector already governs,
//! and [`encode`] and [`terminal`] write what the client reads (the event stream, batch
//! bodies, the halted end, errors) in the Messages schema (docs/wire-format.md, "Messages
//! API").

pub mod encode;
pub mod request;
pub mod terminal;
