//! The Anthropic Messages API (`POST /v1/messages`), served by translation: a Messages request
//! body becomes the chat-completions body haltd governs ([`request::to_chat`]), and everything
//! downstream (the built-in model, the proxy, the detectors, TokenCircuit) treats the turn as
//! chat (docs/wire-format.md, "Messages API requests").

pub mod request;
