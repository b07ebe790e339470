//! The largest token event a [`ChunkEncoder`] can write: the per-stream byte bound the kernel
//! gate holds every post-trip frame to (docs/architecture.md §6: post-trip bytes are capped per
//! stream at the stream's own largest possible token event).
//!
//! A token event is one frame: [`ChunkEncoder::token_event`] (a token of at most
//! [`MAX_TOKEN_TEXT_BYTES`], `first` or not), [`ChunkEncoder::text_event`] (text of at most
//! the cap) and, on a stream with `tool_calls`, [`ChunkEncoder::tool_call_event`] (id, name and
//! arguments within their caps). The bound is
//!
//! ```text
//! E = F + T × P
//! ```
//!
//! - `F`: the size of the event with every text empty and every number at its longest: the
//!   logprobs `-0.000…001` (the f32 with the longest `Display`, [`MAX_LOGPROB_BYTES`]), the
//!   completions `text_offset` `usize::MAX`, the chat role present (`first`). It is measured by
//!   writing that event with the encoder itself, so it includes the stream's exact head
//!   (`data: `, `id`, `object`, `created`, the escaped `model`). A completions event's
//!   alternatives are an object whose keys dedupe, so the template uses distinct one-byte keys
//!   and subtracts them.
//! - `T` = [`MAX_TOKEN_TEXT_BYTES`] (64): every text in a token event is at most that long (the
//!   token by splitting, alternatives by truncation).
//! - `P`: bytes per byte of text, summed over the texts the event writes. A text written as a
//!   JSON string grows by at most 6 bytes per byte (a control character is escaped as
//!   `\u001f`; `"` and `\` take 2; anything else, multibyte characters included, 1 per byte). A
//!   text written as a string *and* as its `bytes` array (chat logprob entries) grows by at most
//!   9 per byte: a `bytes` entry is at most 3 digits and a comma, and the bytes with 3 digits
//!   (≥ 100) escape to 1 or 2 bytes, so the worst byte is a control character of two digits
//!   (`\u001f` + `31,`). So:
//!
//! | stream | `P` |
//! |---|---|
//! | logprobs off (either endpoint) | 6 (the content) |
//! | chat, logprobs on, `k` alternatives | 6 (content) + 9 (the entry's token and bytes) + 9k |
//! | completions, logprobs on, `k` alternatives | 6 (text) + 6 (`tokens[0]`) + 6k (keys) |
//!
//! With `H` the head (`data: ` up to `"choices":[`: 107 + digits of `created` + escaped model
//! for chat, 97 + … for completions) and `L` = 48, `F - H` is 94 (chat, logprobs off), 62
//! (completions, logprobs off), 156 + L + k(35 + L) − [k > 0] (chat, logprobs on) and
//! 150 + L + k(4 + L) − [k > 0] (completions, logprobs on), each chat figure 10 more with
//! `reasoning`; a test checks these against the measured template.
//!
//! Tool-call frames (chat streams with `tool_calls`): a header frame carries the id (at most
//! [`MAX_TOOL_CALL_ID_BYTES`]) and name (at most [`MAX_TOOL_NAME_BYTES`]) with empty
//! arguments, an argument frame at most `T` bytes of arguments; all are JSON strings (6 per
//! byte) and the call index a `u32`. Their bound is
//! `max(F_header + 6 × (128 + 64), F_args + 6 × T)`, measured the same way, and
//! [`ChunkEncoder::max_event_bytes`] is the larger of the two bounds.
//!
//! How tight: a worst-case event (every text at its cap of control characters, every number at
//! its longest) reaches the bound to within one byte per `bytes` array (the last entry has no
//! comma), over 99 % of it for every configuration (tested).

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use crate::wire::{
    encode::{
        Channel, ChunkEncoder, Token, ToolCallDelta, MAX_TOKEN_TEXT_BYTES, MAX_TOOL_CALL_ID_BYTES,
        MAX_TOOL_NAME_BYTES, MAX_TOP_LOGPROBS,
    },
    endpoint::Endpoint,
    stream_id::StreamId,
};

/// Longest logprob as written: `Display` of an f32 never uses an exponent, and the longest is
/// that of the smallest negative subnormal, `-0.000…001` (−1e-45, 48 bytes; checked over all
/// 2^32 values once, and by a test over every binade). Non-finite values are written as
/// `-9999.0`.
pub const MAX_LOGPROB_BYTES: usize = 48;
pub use crate::wire::json_write::{ESCAPED_PER_BYTE, LONGEST_LOGPROB};
/// Bytes a text written both as a JSON string and as its `bytes` array takes per byte, at most
/// (`\u001f` and `31,`).
pub const ESCAPED_AND_BYTES_PER_BYTE: usize = 9;

/// The Responses bound per alternatives asked (index 0: no logprobs; `k + 1`: `k`), once
/// computed; 0 until then.
static RESPONSES_BOUNDS: [AtomicU32; MAX_TOP_LOGPROBS as usize + 2] =
    [const { AtomicU32::new(0) }; MAX_TOP_LOGPROBS as usize + 2];

/// The Responses bound (`crate::wire::responses::encode::max_event_bytes`), computed once
/// per process for each `top`: it depends on nothing else (a stream id is always 19 bytes,
/// `hs_` and 16 hex digits; the model is not written in a frame), and writing its templates
/// took some 22,000 instructions, a twentieth of a short turn.
fn responses_bound(stream_id: StreamId, top: Option<usize>) -> u32 {
    let top = top.map(|k| k.min(MAX_TOP_LOGPROBS as usize));
    let slot = &RESPONSES_BOUNDS[top.map_or(0, |k| k + 1)];
    match slot.load(Relaxed) {
        0 => {
            let e = crate::wire::responses::encode::max_event_bytes(stream_id, top);
            let e = u32::try_from(e).unwrap_or(u32::MAX);
            slot.store(e, Relaxed);
            e
        }
        e => e,
    }
}

/// Distinct one-byte keys for the completions template (its alternatives must not dedupe).
const TEMPLATE_KEYS: &str = "abcdefghijklmnopqrstuvwxyz";

impl ChunkEncoder {
    /// An upper bound on the byte length of any single token event this encoder writes
    /// (a token frame, a text frame of the one-token-per-character rule, and on a stream with
    /// `tool_calls` a tool-call frame), for texts within the caps: `E = F + T × P`, see the
    /// module docs and `docs/wire-format.md`. Computed per call (one small allocation for the
    /// template); call it once per turn.
    pub fn max_event_bytes(&self) -> u32 {
        if self.endpoint == Endpoint::Messages {
            let e = crate::wire::messages::encode::max_event_bytes(self.stream_id, &self.model);
            return u32::try_from(e).unwrap_or(u32::MAX);
        }
        if self.endpoint == Endpoint::Responses {
            return responses_bound(self.stream_id, self.logprobs.then(|| self.top_n()));
        }
        let tokens = self.max_token_event_bytes();
        let tools = if self.tool_calls && self.endpoint == Endpoint::Chat {
            self.max_tool_call_event_bytes()
        } else {
            0
        };
        u32::try_from(tokens.max(tools)).unwrap_or(u32::MAX)
    }

    /// The bound on token and text frames alone: `F + T × P`.
    pub fn max_token_event_bytes(&self) -> usize {
        self.token_event_fixed_bytes() + MAX_TOKEN_TEXT_BYTES * self.bytes_per_text_byte()
    }

    /// `P`: bytes a token event grows by, at most, per byte of its texts.
    pub fn bytes_per_text_byte(&self) -> usize {
        let k = self.top_n();
        match (self.endpoint, self.logprobs) {
            (_, false) => ESCAPED_PER_BYTE,
            (Endpoint::Chat | Endpoint::Messages | Endpoint::Responses, true) => {
                ESCAPED_PER_BYTE + ESCAPED_AND_BYTES_PER_BYTE * (1 + k)
            }
            (Endpoint::Completion, true) => ESCAPED_PER_BYTE * (2 + k),
        }
    }

    /// `F`: the token event with every text empty and every number at its longest.
    pub fn token_event_fixed_bytes(&self) -> usize {
        let k = self.top_n();
        let mut top = [("", LONGEST_LOGPROB); MAX_TOP_LOGPROBS as usize];
        let mut key_bytes = 0;
        if self.endpoint == Endpoint::Completion && self.logprobs {
            for (i, slot) in top.iter_mut().enumerate().take(k) {
                slot.0 = &TEMPLATE_KEYS[i..=i];
                key_bytes += 1;
            }
        }
        let tok = Token {
            text: "",
            logprob: LONGEST_LOGPROB,
            top: &top[..k],
        };
        // A reasoning delta's key is the longer one: a stream that may carry reasoning is
        // bounded on it.
        let channel = if self.reasoning && self.endpoint == Endpoint::Chat {
            Channel::Reasoning
        } else {
            Channel::Content
        };
        let mut out = Vec::with_capacity(1024);
        self.token_event(&mut out, tok, usize::MAX, true, channel);
        out.len() - key_bytes
    }

    /// The bound on tool-call frames: a header (id, name) or an argument piece, whichever is
    /// larger.
    pub fn max_tool_call_event_bytes(&self) -> usize {
        let mut out = Vec::with_capacity(512);
        let mut call = ToolCallDelta {
            index: u32::MAX,
            id: Some(""),
            name: Some(""),
            arguments: "",
        };
        self.tool_call_event(&mut out, call, true);
        let header = out.len() + ESCAPED_PER_BYTE * (MAX_TOOL_CALL_ID_BYTES + MAX_TOOL_NAME_BYTES);
        out.clear();
        call.id = None;
        call.name = None;
        self.tool_call_event(&mut out, call, true);
        let args = out.len() + ESCAPED_PER_BYTE * MAX_TOKEN_TEXT_BYTES;
        header.max(args)
    }

    /// `H`: `data: ` and the chunk head up to `"choices":[`.
    pub fn head_bytes(&self) -> usize {
        let mut out = Vec::with_capacity(256);
        self.chunk_head(&mut out);
        "data: ".len() + out.len()
    }
}

#[cfg(test)]
mod tests;
