//! What one token frame carries, for every surface's encoder: the token, its channel, a tool
//! call's piece, and the caps on each text that bound a frame's size
//! ([`crate::wire::encode::bound`]).

/// Longest text one token frame carries, in bytes.
///
/// Real tokenizer tokens are short: BPE vocabularies are dominated by tokens of a few bytes,
/// their rare long entries are runs of spaces or punctuation (indentation, separator lines),
/// and the built-in source's longest token is 13 bytes. A token whose text is longer
/// is split, at UTF-8 character boundaries, into pieces of at most this many bytes, each its own
/// frame counted as one token (see `docs/wire-format.md`, "Framing"). The cap is what makes
/// [`crate::wire::ChunkEncoder::max_event_bytes`] small: every text an event carries (the token, its
/// `bytes`, each alternative) is bounded by it. 64 keeps real tokens whole, and a chat event
/// with 20 alternatives under 15 KiB (with a short model name).
pub const MAX_TOKEN_TEXT_BYTES: usize = 64;
/// Longest function name a tool-call frame carries whole (OpenAI's own limit on function
/// names); a proxied upstream that sends a longer one fails the turn as malformed.
pub const MAX_TOOL_NAME_BYTES: usize = 64;
/// Longest tool-call id a tool-call frame carries (vLLM's `chatcmpl-tool-<32 hex>` is 46
/// bytes, OpenAI's `call_<24>` 29); longer fails the turn as malformed.
pub const MAX_TOOL_CALL_ID_BYTES: usize = 128;

/// One generated token as the encoder needs it.
#[derive(Debug, Clone, Copy)]
pub struct Token<'a> {
    pub text: &'a str,
    pub logprob: f32,
    /// Alternatives, most likely first; the encoder writes at most `top_logprobs` of them,
    /// each cut to [`MAX_TOKEN_TEXT_BYTES`] at a character boundary.
    pub top: &'a [(&'a str, f32)],
}

/// Which field of a chat delta a token's text goes in.
///
/// Reasoning models (vLLM with a reasoning parser, Ollama, DeepSeek-R1 and Qwen3 servers)
/// stream their thinking as `delta.reasoning_content` before the answer's `delta.content`.
/// haltd governs both alike (observed, scanned, counted, halted within B) and forwards each in
/// its own field, so a token carries its channel from the source to the encoder. Completions
/// have only `text`: the channel is always [`Channel::Content`] there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Channel {
    /// `delta.content` (chat), `text` (completions).
    #[default]
    Content,
    /// `delta.reasoning_content` (chat only).
    Reasoning,
}

impl Channel {
    /// The chat delta's key and colon, as written.
    pub(in crate::wire) fn delta_key(self) -> &'static [u8] {
        match self {
            Channel::Content => b"\"content\":",
            Channel::Reasoning => b"\"reasoning_content\":",
        }
    }
}

/// One call's part of a chat tool-call delta, as a frame carries it: a header (`id` and
/// `type`, the function's `name`, empty `arguments`) or a piece of the arguments.
#[derive(Debug, Clone, Copy)]
pub struct ToolCallDelta<'a> {
    /// The call's position in `tool_calls` (its `index`).
    pub index: u32,
    /// At most [`MAX_TOOL_CALL_ID_BYTES`]; written with `"type":"function"`.
    pub id: Option<&'a str>,
    /// At most [`MAX_TOOL_NAME_BYTES`].
    pub name: Option<&'a str>,
    /// At most [`MAX_TOKEN_TEXT_BYTES`] in a streamed frame.
    pub arguments: &'a str,
}
