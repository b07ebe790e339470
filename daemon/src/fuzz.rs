//! Fuzz harnesses: haltd's parsers of untrusted input, driven through the entry points the
//! daemon itself calls, with the invariants each must keep (docs/fuzzing.md).
//!
//! Each public function takes arbitrary bytes and panics only when an invariant breaks (or
//! when the code under test panics, which fails closed in the daemon: `crate::crash`). Two
//! callers share them, so that what libFuzzer explores is what CI checks:
//!
//! * the libFuzzer targets in `fuzz/` (one line each, built by `cargo xtask fuzz` with the
//!   nightly toolchain and the `fuzz` feature);
//! * the corpus replay test ([`tests`]), a plain `#[test]` that runs every file of
//!   `fuzz/corpus/<target>/` through the same function on stable.
//!
//! | target | input | daemon entry points |
//! |---|---|---|
//! | [`request_head`] | a client's request bytes | `wire::http::parse_head_with`, then the body as the data plane routes it |
//! | [`request_body`] | selector byte + a request body | `ClientRequest::parse`, `builtin_turn`, `upstream::prepare_turn`, SafetyCheck's inputs |
//! | [`messages_request`] | a Messages API request body | `wire::messages::request::to_chat`, then the chat path as in `request_body` ([`chat_path`]) |
//! | [`responses_request`] | a Responses API request body | `wire::responses::request::to_chat`, then the chat path as in `request_body` ([`chat_path`]) |
//! | [`upstream_response`] | an upstream's response bytes | `upstream::ResponseReader` (head, content-length and chunked framing) |
//! | [`upstream_sse`] | an upstream's event-stream body | `upstream::SseParser`, `ChunkReader`, `source::upstream::UpstreamSource` |
//! | [`config_file`] | a `--config` file | `config::parse_config_text`, `ServeArgs::file_settings` |
//! | [`ledger_verify`] | a ledger file | `ledger::verify` (`haltctl ledger verify`, and the scan `Ledger::open` runs) |
//!
//! Incremental parsers are fed the same bytes whole, one byte at a time and in pseudo-random
//! pieces ([`pieces`], seeded by the input so a corpus file replays the same way), and must
//! give the same result every time: the data plane reads sockets in whatever pieces the
//! kernel hands it.

mod config;
mod ledger;
mod messages;
mod request;
mod responses;
mod upstream;

use serde_json::Value;

use crate::{
    upstream::{prepare_turn, request::TOOL_FIELDS},
    wire::{
        request::{DEFAULT_CHAT_MAX_TOKENS, MAX_MAX_TOKENS},
        ClientRequest, Endpoint,
    },
};

#[cfg(test)]
mod tests;

pub use config::config_file;
pub use ledger::ledger_verify;
pub use messages::messages_request;
pub use request::{request_body, request_head};
pub use responses::responses_request;
pub use upstream::{upstream_response, upstream_sse};

/// A translated surface's chat body (a Messages or Responses API request's), read as the data
/// plane reads every chat body. It must be a JSON object that the chat path takes whole: it
/// parses as a chat request, the built-in source serves it under its model with its
/// `max_tokens` (the chat default without one; 1 to 1,000,000) and `stream`, SafetyCheck reads
/// its inputs, and the proxy accepts it in both modes (the upstream body a JSON object with
/// `stream: true`, in degraded mode without tool fields).
fn chat_path(chat: &Value) {
    assert!(chat.is_object(), "{chat}");
    let model = chat["model"].as_str().expect("a model").to_owned();
    let bytes = serde_json::to_vec(chat).expect("a JSON value serialises");
    let req = ClientRequest::parse(Endpoint::Chat, &bytes).expect("the chat body parses");
    let turn = req
        .builtin_turn(&model)
        .unwrap_or_else(|e| panic!("the built-in source refused {chat}: {e:?}"));
    assert_eq!(
        u64::from(turn.max_tokens),
        chat["max_tokens"]
            .as_u64()
            .unwrap_or(u64::from(DEFAULT_CHAT_MAX_TOKENS))
    );
    assert!((1..=MAX_MAX_TOKENS).contains(&turn.max_tokens));
    assert_eq!(turn.ask.stream, chat["stream"] == true);
    let _urls = crate::safety::request_sources(req.json());
    let _system = crate::safety::system_prompt(req.json());
    for degraded in [false, true] {
        let turn = prepare_turn(
            req.clone(),
            degraded.then_some(crate::upstream::DegradedShape::DEFAULT),
        )
        .unwrap_or_else(|e| panic!("the proxy refused {chat}: {e:?}"));
        let sent: Value = serde_json::from_slice(&turn.body).expect("the upstream body is JSON");
        let obj = sent.as_object().expect("the upstream body is an object");
        assert_eq!(obj.get("stream"), Some(&Value::Bool(true)));
        if degraded {
            for f in TOOL_FIELDS {
                assert!(!obj.contains_key(f), "degraded mode forwards {f}");
            }
        }
    }
}

/// FNV-1a of the input: the seed of its pseudo-random cuts.
fn seed(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// `data` cut into pieces of pseudo-random lengths (mostly 1 to 16 bytes, sometimes up to
/// 256), fixed by the input itself.
fn pieces(data: &[u8]) -> Vec<&[u8]> {
    let mut state = seed(data) | 1;
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        // xorshift64
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let len = if state.is_multiple_of(8) {
            1 + (state >> 8) % 256
        } else {
            1 + (state >> 8) % 16
        };
        let (piece, tail) =
            rest.split_at(usize::try_from(len).map_or(rest.len(), |l| l.min(rest.len())));
        out.push(piece);
        rest = tail;
    }
    out
}

/// The three ways every incremental parser is fed the same input: whole, a byte at a time,
/// and in [`pieces`].
fn feedings(data: &[u8]) -> [Vec<&[u8]>; 3] {
    [vec![data], data.chunks(1).collect(), pieces(data)]
}
