//! How upstream text becomes token events: one token per event (docs/architecture.md §6), so
//! that after a trip, when every frame carries one event, the kernel gate's count of sends is a
//! count of tokens, and every frame fits the stream's
//! [`crate::wire::ChunkEncoder::max_event_bytes`].
//!
//! The rules (also in `docs/wire-format.md`, "Framing"):
//!
//! - **Per token** ([`Split::Token`]): when a chunk's logprob tokens spell its text exactly,
//!   each token is its own frame. A token longer than [`MAX_TOKEN_TEXT_BYTES`] is cut, at
//!   UTF-8 character boundaries, into pieces of at most that many bytes, each its own frame
//!   counted as one token. An empty token is one empty frame.
//! - **Per character** ([`Split::Chars`]): text without logprobs, or whose tokens do not spell
//!   it (detokenisation held bytes back, tokens written as `bytes:`/`token_id:` forms,
//!   reasoning tokens), is cut into one frame per UTF-8 character, each counted as one token.
//!   A character is the finest unit a text frame can carry; a character that a byte-level
//!   tokenizer spends several tokens on (an emoji) still counts as one.
//! - **Tool calls** (chat): each call in a `delta.tool_calls` list is framed on its own. A call
//!   that carries an `id` or a `name` gets a header frame first (`id`, `type`, the whole
//!   `name`, empty `arguments`), counted as one token: SDKs take the id and name from one
//!   delta, so they are not split; they are capped instead ([`MAX_TOOL_CALL_ID_BYTES`],
//!   [`MAX_TOOL_NAME_BYTES`]; longer is a malformed upstream). The arguments follow as
//!   argument-only deltas, per token when the delta holds one call without a name and its
//!   tokens spell the arguments, else per character; both cut at the cap. Deltas concatenate,
//!   so clients reassemble the same arguments.

use serde_json::Value;

use crate::{
    upstream::chunk::{tokens_spell, UpToken},
    wire::{MAX_TOKEN_TEXT_BYTES, MAX_TOOL_CALL_ID_BYTES, MAX_TOOL_NAME_BYTES},
};

/// Highest number of tool calls in one turn (a call's `index` is below it): more is a
/// malformed upstream, not a reason to grow memory.
pub const MAX_TOOL_CALLS: u32 = 128;

/// How a text is cut into frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// One token: one frame, or pieces of at most [`MAX_TOKEN_TEXT_BYTES`] when longer.
    Token,
    /// Text whose tokens are not known: one frame per UTF-8 character.
    Chars,
}

impl Split {
    /// Bytes of `rest` (the text not yet framed) the next frame carries; 0 when `rest` is
    /// empty.
    pub fn next_len(self, rest: &str) -> usize {
        match self {
            Split::Token => rest.floor_char_boundary(MAX_TOKEN_TEXT_BYTES),
            Split::Chars => rest.chars().next().map_or(0, char::len_utf8),
        }
    }

    /// How many frames (tokens, by the rule) `text` makes: per token at least one (an empty
    /// token is one empty frame), per character one per character.
    pub fn frames(self, text: &str) -> u64 {
        match self {
            Split::Token => {
                let mut rest = text;
                let mut n = 1;
                while rest.len() > MAX_TOKEN_TEXT_BYTES {
                    rest = &rest[self.next_len(rest)..];
                    n += 1;
                }
                n
            }
            Split::Chars => text.chars().count() as u64,
        }
    }

    /// The frames' texts, in order.
    pub fn pieces(self, text: &str) -> impl Iterator<Item = &str> {
        let mut rest = text;
        let mut first = self == Split::Token;
        std::iter::from_fn(move || {
            if rest.is_empty() && !std::mem::take(&mut first) {
                return None;
            }
            first = false;
            let (piece, tail) = rest.split_at(self.next_len(rest));
            rest = tail;
            Some(piece)
        })
    }
}

/// One call's part of an upstream tool-call delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallPart {
    pub index: u32,
    pub id: Option<String>,
    pub name: Option<String>,
    /// The piece of the arguments this delta carries (`""` when none).
    pub arguments: String,
}

impl ToolCallPart {
    /// The call needs a header frame (it carries its id or name).
    pub fn has_header(&self) -> bool {
        self.id.is_some() || self.name.is_some()
    }
}

/// A `delta.tool_calls` list read into its parts, in order. Entries that are not objects, and
/// fields that are not strings, are ignored (as the merged record ignores them); an index at
/// or above [`MAX_TOOL_CALLS`], an id over [`MAX_TOOL_CALL_ID_BYTES`] or a name over
/// [`MAX_TOOL_NAME_BYTES`] is an error naming what was wrong.
pub fn tool_call_parts(delta: &Value) -> Result<Vec<ToolCallPart>, String> {
    let mut parts = Vec::new();
    for d in delta.as_array().into_iter().flatten() {
        let Some(obj) = d.as_object() else { continue };
        let index = obj.get("index").and_then(Value::as_u64).unwrap_or(0);
        if index >= u64::from(MAX_TOOL_CALLS) {
            return Err(format!(
                "tool call index {index} (at most {} calls per turn)",
                MAX_TOOL_CALLS
            ));
        }
        let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_owned);
        let id = text(obj.get("id"));
        let function = obj.get("function");
        let name = text(function.and_then(|f| f.get("name")));
        let arguments = text(function.and_then(|f| f.get("arguments"))).unwrap_or_default();
        if let Some(id) = id.as_ref().filter(|i| i.len() > MAX_TOOL_CALL_ID_BYTES) {
            return Err(format!(
                "tool call id of {} bytes (at most {MAX_TOOL_CALL_ID_BYTES})",
                id.len()
            ));
        }
        if let Some(name) = name.as_ref().filter(|n| n.len() > MAX_TOOL_NAME_BYTES) {
            return Err(format!(
                "tool call name of {} bytes (at most {MAX_TOOL_NAME_BYTES})",
                name.len()
            ));
        }
        parts.push(ToolCallPart {
            index: index as u32,
            id,
            name,
            arguments,
        });
    }
    Ok(parts)
}

/// How a delta's arguments are framed: per token when it holds one call without a name whose
/// arguments its tokens spell exactly, else per character.
pub fn tool_arguments_split(parts: &[ToolCallPart], tokens: &[UpToken]) -> Split {
    match parts {
        [p] if p.name.is_none() && tokens_spell(tokens, &p.arguments) => Split::Token,
        _ => Split::Chars,
    }
}

/// The frames (tokens, by the rule) a tool-call delta makes: a header per call that has one,
/// then its arguments' frames.
pub fn tool_call_frames(parts: &[ToolCallPart], tokens: &[UpToken]) -> u64 {
    let split = tool_arguments_split(parts, tokens);
    parts
        .iter()
        .map(|p| {
            let args = match split {
                Split::Token => tokens.iter().map(|t| split.frames(&t.text)).sum(),
                Split::Chars => split.frames(&p.arguments),
            };
            u64::from(p.has_header()) + args
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tok(text: &str) -> UpToken {
        UpToken {
            text: text.to_owned(),
            logprob: Some(-0.1),
            top: Vec::new(),
        }
    }

    #[test]
    fn a_long_token_is_cut_at_the_cap_on_char_boundaries() {
        let long = "é".repeat(40); // 80 bytes, 2 per char: cut at 64
        let pieces: Vec<&str> = Split::Token.pieces(&long).collect();
        assert_eq!(pieces.concat(), long);
        assert_eq!(pieces.iter().map(|p| p.len()).collect::<Vec<_>>(), [64, 16]);
        assert_eq!(Split::Token.frames(&long), 2);
        // A 4-byte char straddling the cap moves whole to the next piece.
        let odd = format!("{}𝄞{}", "a".repeat(62), "b".repeat(10));
        let pieces: Vec<&str> = Split::Token.pieces(&odd).collect();
        assert_eq!(pieces.iter().map(|p| p.len()).collect::<Vec<_>>(), [62, 14]);
        assert!(pieces.iter().all(|p| p.len() <= MAX_TOKEN_TEXT_BYTES));
        assert_eq!(Split::Token.frames(&odd), 2);
        // Short and empty tokens are one frame.
        assert_eq!(
            Split::Token.pieces(" river").collect::<Vec<_>>(),
            [" river"]
        );
        assert_eq!(Split::Token.pieces("").collect::<Vec<_>>(), [""]);
        assert_eq!(Split::Token.frames(""), 1);
        assert_eq!(Split::Token.frames(&"x".repeat(64)), 1);
        assert_eq!(Split::Token.frames(&"x".repeat(65)), 2);
        assert_eq!(Split::Token.frames(&"x".repeat(200)), 4);
    }

    #[test]
    fn chars_are_one_frame_each() {
        let text = "a é€𝄞\u{1f}";
        let pieces: Vec<&str> = Split::Chars.pieces(text).collect();
        assert_eq!(pieces, ["a", " ", "é", "€", "𝄞", "\u{1f}"]);
        assert_eq!(Split::Chars.frames(text), 6);
        assert_eq!(Split::Chars.frames(""), 0);
        assert_eq!(Split::Chars.pieces("").count(), 0);
    }

    #[test]
    fn frames_and_pieces_agree() {
        for text in ["", "a", &"ab€".repeat(50), &"𝄞".repeat(17)] {
            for split in [Split::Token, Split::Chars] {
                let pieces: Vec<&str> = split.pieces(text).collect();
                assert_eq!(
                    pieces.len() as u64,
                    split.frames(text),
                    "{split:?} {text:?}"
                );
                assert_eq!(pieces.concat(), text);
            }
        }
    }

    #[test]
    fn tokens_spell_only_exact_concatenations() {
        assert!(tokens_spell(&[tok("The"), tok(" cat")], "The cat"));
        assert!(!tokens_spell(&[tok("The"), tok(" cat")], "The cat."));
        assert!(!tokens_spell(&[tok("token_id:791")], "The"));
        assert!(!tokens_spell(&[], "The"));
        assert!(!tokens_spell(&[], ""));
        assert!(tokens_spell(&[tok("")], ""));
    }

    #[test]
    fn tool_call_parts_read_and_check_the_caps() {
        let parts = tool_call_parts(&json!([
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
            {"index": 1, "function": {"arguments": "{\"a\":1}"}},
            "not an object",
        ]))
        .expect("valid");
        assert_eq!(parts.len(), 2);
        assert!(parts[0].has_header() && !parts[1].has_header());
        assert_eq!(parts[1].arguments, "{\"a\":1}");
        let long = "x".repeat(MAX_TOOL_NAME_BYTES + 1);
        assert!(
            tool_call_parts(&json!([{"index": 0, "function": {"name": long}}]))
                .expect_err("long name")
                .contains("name")
        );
        let id = "x".repeat(MAX_TOOL_CALL_ID_BYTES + 1);
        assert!(tool_call_parts(&json!([{"index": 0, "id": id}]))
            .expect_err("long id")
            .contains("id"));
        assert!(tool_call_parts(&json!([{"index": 128}])).is_err());
        assert!(tool_call_parts(&json!([{"index": 127}])).is_ok());
    }

    #[test]
    fn tool_call_frames_follow_the_rule() {
        let header = tool_call_parts(
            &json!([{"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}]),
        )
        .expect("valid");
        // The header: one frame, whatever the tokens.
        assert_eq!(tool_call_frames(&header, &[tok("f")]), 1);
        let args = tool_call_parts(&json!([{"index": 0, "function": {"arguments": "{\"city\":"}}]))
            .expect("valid");
        // Spelled by its tokens: per token.
        assert_eq!(
            tool_arguments_split(&args, &[tok("{\""), tok("city"), tok("\":")]),
            Split::Token
        );
        assert_eq!(
            tool_call_frames(&args, &[tok("{\""), tok("city"), tok("\":")]),
            3
        );
        // Not spelled (or no logprobs): per character.
        assert_eq!(tool_arguments_split(&args, &[]), Split::Chars);
        assert_eq!(tool_call_frames(&args, &[]), 8);
        // A whole call in one delta (name and arguments): header + characters.
        let whole = tool_call_parts(
            &json!([{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{}"}}]),
        )
        .expect("valid");
        assert_eq!(tool_call_frames(&whole, &[tok("f{}")]), 3);
    }
}
