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
//! | [`messages_request`] | a Messages API request body | `wire::messages::request::to_chat`, then the chat path as in `request_body` |
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
mod upstream;

#[cfg(test)]
mod tests;

pub use config::config_file;
pub use ledger::ledger_verify;
pub use messages::messages_request;
pub use request::{request_body, request_head};
pub use upstream::{upstream_response, upstream_sse};

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
