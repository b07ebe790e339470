//! The per-token path of a proxied stream allocates nothing once its buffers have grown:
//! SSE bytes → [`SseParser::next_event_ref`] → [`ChunkReader::read`] → framing
//! ([`Split`]) → [`ChunkEncoder`] into a reused buffer. Counted exactly, per thread, by a
//! counting global allocator (this test binary's: it forwards to the system allocator).
//!
//! One exception, serde_json's: an event whose JSON has an escaped string (`\"`, `\n`, `\\`,
//! `\u....`) costs one allocation, the buffer serde_json unescapes into, which it makes anew
//! for each document and offers no way to reuse.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
};

use serde_json::json;

use crate::{
    upstream::{framing::Split, ChunkReader, Parsed, SseParser},
    wire::{Channel, ChunkEncoder, Endpoint, Token, MAX_TOP_LOGPROBS},
};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: a thread being torn down has no counter; its allocations are not counted.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

pub(crate) fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

/// Token texts with no JSON escape, and with (every window of 6 has one).
const PLAIN: &[&str] = &[
    " The", " river", " x", " é", " 東京", " runs", ".", " y", " 42",
];
const ESCAPED: &[&str] = &[
    " The",
    " \"river\"",
    "\n",
    " é",
    " 東京",
    " runs",
    "\\",
    " 42",
];

/// The SSE bytes of `n` chunks of an `endpoint` stream, one event each, with 5 alternatives
/// per token (`logprobs`) or none.
fn stream(endpoint: Endpoint, logprobs: bool, words: &[&str], n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let w = words[i % words.len()];
            let alts: Vec<_> = (0..5)
                .map(|j| {
                    let t = words[(i + j) % words.len()];
                    json!({"token": t, "logprob": -0.5 - j as f64, "bytes": t.as_bytes()})
                })
                .collect();
            let choice = match (endpoint.request_shape(), logprobs) {
                (Endpoint::Chat, true) => json!({"index": 0, "delta": {"content": w}, "logprobs": {"content": [{"token": w, "logprob": -0.25, "bytes": w.as_bytes(), "top_logprobs": alts}]}, "finish_reason": null}),
                (Endpoint::Chat, false) => json!({"index": 0, "delta": {"content": w}, "logprobs": null, "finish_reason": null}),
                (_, _) => json!({"index": 0, "text": w, "logprobs": {"tokens": [w], "token_logprobs": [-0.25], "top_logprobs": [{" a": -1.0, " b": -2.0, w: -0.25}], "text_offset": [i]}, "finish_reason": null}),
            };
            let c = json!({"id": "chatcmpl-8f9c2a7d", "object": "chat.completion.chunk", "created": 1_718_000_000, "model": "meta-llama/Llama-3.1-8B-Instruct", "choices": [choice]});
            format!("data: {c}\n\n").into_bytes()
        })
        .collect()
}

/// Runs the path over `pieces`; returns the frames written.
fn run(endpoint: Endpoint, pieces: &[Vec<u8>], parts: &mut Parts) -> u64 {
    let mut frames = 0;
    for piece in pieces {
        parts.sse.push(piece);
        while let Some(ev) = parts.sse.next_event_ref().expect("valid SSE") {
            assert_eq!(parts.reader.read(endpoint, ev), Ok(Parsed::Chunk));
            let c = parts.reader.chunk();
            assert_eq!(c.tokens_match_content(), !c.tokens.is_empty());
            for t in &c.tokens {
                let mut tops = [("", 0.0); MAX_TOP_LOGPROBS as usize];
                let n = t.top.len().min(tops.len());
                for (slot, (s, l)) in tops.iter_mut().zip(&t.top) {
                    *slot = (s.as_str(), *l);
                }
                for piece in Split::Token.pieces(&t.text) {
                    parts.out.clear();
                    let tok = Token {
                        text: piece,
                        logprob: t.logprob.unwrap_or(f32::NEG_INFINITY),
                        top: &tops[..n],
                    };
                    parts
                        .enc
                        .token_event(&mut parts.out, tok, 0, false, Channel::Content);
                    frames += 1;
                }
            }
            if c.tokens.is_empty() {
                for piece in Split::Chars.pieces(&c.content) {
                    parts.out.clear();
                    parts
                        .enc
                        .text_event(&mut parts.out, piece, false, Channel::Content);
                    frames += 1;
                }
            }
        }
    }
    frames
}

struct Parts {
    sse: SseParser,
    reader: ChunkReader,
    enc: ChunkEncoder,
    out: Vec<u8>,
}

#[test]
fn the_per_token_path_allocates_nothing_once_warm() {
    for (endpoint, logprobs, words) in [
        (Endpoint::Chat, true, PLAIN),
        (Endpoint::Chat, false, PLAIN),
        (Endpoint::Completion, true, PLAIN),
        (Endpoint::Chat, true, ESCAPED),
    ] {
        let pieces = stream(endpoint, logprobs, words, 600);
        let mut parts = Parts {
            sse: SseParser::new(64 * 1024),
            reader: ChunkReader::default(),
            enc: ChunkEncoder {
                logprobs,
                top_logprobs: 5,
                ..crate::wire::encode::test_encoder(endpoint, "m")
            },
            out: Vec::new(),
        };
        // Warm-up: every buffer grows to the stream's sizes (all the words come by).
        run(endpoint, &pieces[..100], &mut parts);
        let before = allocs();
        let frames = run(endpoint, &pieces[100..], &mut parts);
        let n = allocs() - before;
        assert!(frames >= 500);
        // serde_json's unescape buffer: one per event (each here has an escape), none else.
        let allowed = if words == ESCAPED { 500 } else { 0 };
        assert!(
            n <= allowed,
            "{endpoint:?} logprobs={logprobs}: {n} allocations for {frames} frames"
        );
    }
}
