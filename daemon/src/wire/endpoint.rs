//! Which API endpoint a request came in on, and so which shapes its answer takes.

use serde::Serialize;

/// Largest `max_tokens` accepted, on every endpoint.
pub const MAX_MAX_TOKENS: u32 = 1_000_000;

/// Which endpoint a stream answers: the client's surface.
///
/// [`Endpoint::Messages`] is served by translation ([`crate::wire::messages`]): its request is
/// rewritten into a chat body when it is parsed, so every source, detector and upstream sees a
/// chat turn ([`Endpoint::request_shape`]); only what the client reads (token events, the
/// terminal, batch bodies, errors) is written in the Messages schema. [`Endpoint::Responses`]
/// is served the same way ([`crate::wire::responses`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Endpoint {
    /// OpenAI `POST /v1/chat/completions`.
    #[default]
    Chat = 0,
    /// OpenAI `POST /v1/completions`.
    Completion = 1,
    /// Anthropic `POST /v1/messages`.
    Messages = 2,
    /// OpenAI `POST /v1/responses`.
    Responses = 3,
}

impl Endpoint {
    /// The OpenAI endpoint whose request body and upstream stream this one's turn uses: a
    /// Messages or Responses turn is a chat turn until its tokens are written to the client.
    pub const fn request_shape(self) -> Endpoint {
        match self {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => Endpoint::Chat,
            Endpoint::Completion => Endpoint::Completion,
        }
    }

    /// Whether the request is shaped as chat (messages, tools, reasoning).
    pub const fn is_chat_shaped(self) -> bool {
        matches!(self.request_shape(), Endpoint::Chat)
    }
}
