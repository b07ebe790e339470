//! `bench-upstream-path`: the CPU and the allocations haltd spends per proxied token in the
//! upstream protocol layer, outside the data plane's I/O (issue 11, point 4).
//!
//! ```text
//! bench-upstream-path [--tokens 2000] [--rounds 5] [--out FILE]
//! ```
//!
//! No root, no network, no daemon. The bench writes recorded-shape upstream streams into
//! memory (below), then, per stream and round, runs the path a proxied token takes between the
//! upstream socket and the client's send buffer, as the data plane runs it:
//!
//! ```text
//! SSE bytes ──SseParser──► event ──chunk parse──► tokens, text, tool calls
//!           ──framing (Split, tool_call_parts)──► frames ──ChunkEncoder──► client bytes
//! ```
//!
//! Two paths, each over every stream:
//!
//! - `owned`: `SseParser::next_event` and `parse_event`, an owned event and a new chunk per
//!   event (what a caller that keeps the chunk gets);
//! - `reuse`: `SseParser::next_event_ref` and one `ChunkReader` per stream, which read each
//!   event into buffers reused from the previous one.
//!
//! The bytes go to the parser one event per push, as a paced upstream's reads deliver them.
//! Each frame is encoded into one reused buffer (the connection's send buffer), cleared per
//! frame. The figure is wall time per frame (one frame is one token by the framing rule,
//! `docs/wire-format.md`), the median of `--rounds` rounds, and the heap allocations per
//! frame, counted by this binary's global allocator (so exact, not sampled).
//!
//! Streams (each `--tokens` tokens, a role chunk first, then a finish chunk, a usage chunk and
//! `[DONE]`; the text has quotes, newlines and non-ASCII, so some strings carry escapes):
//!
//! - `vllm_chat_lp5`: vLLM / OpenAI chat chunks with logprobs and 5 alternatives, `bytes`;
//! - `llama_chat`: llama.cpp chat chunks without logprobs (`timings`, `system_fingerprint`);
//! - `llama_chat_lp2`: llama.cpp chat chunks with token ids, `bytes`, 2 alternatives;
//! - `vllm_completions_lp3`: vLLM completions chunks, `top_logprobs` as `{token: logprob}`;
//! - `openai_tool_call`: a chat tool call: a header delta, then argument deltas of one token.
//!
//! Output: a table on stdout and the same figures as JSON (`--out`, default
//! `target/bench/upstream-path.json`). A benchmark reports; it fails only if a stream does not
//! parse or gives the wrong number of frames.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    fmt::Write as _,
    fs,
    hint::black_box,
    path::PathBuf,
    sync::atomic::{AtomicU64, Ordering},
    time::Instant,
};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use haltd::{
    upstream::{
        framing::{self, Split},
        parse_event, ChunkReader, Parsed, SseParser, UpToken, UpstreamChunk, UpstreamEvent,
    },
    wire::{Channel, ChunkEncoder, Endpoint, StreamId, Token, ToolCallDelta, MAX_TOP_LOGPROBS},
};
use serde_json::{json, Value};

/// Counts heap allocations (alloc and realloc) made by this process.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Parser, Debug)]
#[command(about = "CPU and allocations per proxied token in the upstream protocol layer")]
struct Args {
    /// Tokens per stream.
    #[arg(long, default_value_t = 2000)]
    tokens: usize,
    /// Timed rounds per stream (the report is their median).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// JSON report.
    #[arg(long, default_value = "target/bench/upstream-path.json")]
    out: PathBuf,
}

/// Words the streams' tokens cycle through: escapes (quote, newline, backslash) and
/// non-ASCII among plain words, as model text has them.
const WORDS: &[&str] = &[
    "The",
    " river",
    " runs",
    " past",
    " the",
    " old",
    " mill",
    ",",
    " and",
    " \"quiet\"",
    " é",
    "té",
    "\n",
    " water",
    " \\",
    " 東京",
    " turns",
    " 42",
    " times",
    ".",
    " It",
];

/// One recorded-shape stream: its SSE bytes cut into the pieces pushed, and what it is.
struct Stream {
    name: &'static str,
    endpoint: Endpoint,
    logprobs: bool,
    top_logprobs: u32,
    tool_calls: bool,
    pieces: Vec<Vec<u8>>,
    /// Frames the stream must give (checked on every round).
    frames: u64,
}

fn sse(out: &mut Vec<Vec<u8>>, v: &Value) {
    out.push(format!("data: {v}\n\n").into_bytes());
}

/// A deterministic logprob in [-12, 0) for token `i`, alternative `j`.
fn lp(i: usize, j: usize) -> f64 {
    let x = (i as u64 * 2_654_435_761 + j as u64 * 40_503) % 10_000;
    -((x as f64) / 10_000.0 + j as f64 * 2.0).min(11.9) - 0.0001
}

fn word(i: usize) -> &'static str {
    WORDS[i % WORDS.len()]
}

fn chat_entry(i: usize, alts: usize, llama: bool) -> Value {
    let top: Vec<Value> = (0..alts)
        .map(|j| {
            let t = word(i + j);
            if llama {
                json!({"id": 1000 + j, "token": t, "bytes": t.as_bytes(), "logprob": lp(i, j)})
            } else {
                json!({"token": t, "logprob": lp(i, j), "bytes": t.as_bytes()})
            }
        })
        .collect();
    let t = word(i);
    if llama {
        json!({"id": 9000 + i, "token": t, "bytes": t.as_bytes(), "logprob": lp(i, 0), "top_logprobs": top})
    } else {
        json!({"token": t, "logprob": lp(i, 0), "bytes": t.as_bytes(), "top_logprobs": top})
    }
}

fn finish(out: &mut Vec<Vec<u8>>, head: &Value, endpoint: Endpoint, n: usize, reason: &str) {
    let mut last = head.clone();
    last["choices"] = match endpoint.request_shape() {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason}])
        }
        Endpoint::Completion => {
            json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": reason}])
        }
    };
    sse(out, &last);
    let mut usage = head.clone();
    usage["choices"] = json!([]);
    usage["usage"] = json!({"prompt_tokens": 17, "completion_tokens": n, "total_tokens": n + 17});
    sse(out, &usage);
    out.push(b"data: [DONE]\n\n".to_vec());
}

fn chat_stream(name: &'static str, n: usize, alts: Option<usize>, llama: bool) -> Stream {
    let head = if llama {
        json!({"created": 1_736_000_000, "id": "chatcmpl-aB3xYz", "model": "qwen2.5-7b-instruct-q4_k_m.gguf", "system_fingerprint": "b4500-6d5b1f1a", "object": "chat.completion.chunk"})
    } else {
        json!({"id": "chatcmpl-8f9c2a7d1e3b4c5a", "object": "chat.completion.chunk", "created": 1_718_000_000, "model": "meta-llama/Llama-3.1-8B-Instruct"})
    };
    let mut pieces = Vec::new();
    let mut c = head.clone();
    c["choices"] = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
    sse(&mut pieces, &c);
    for i in 0..n {
        let logprobs = alts.map_or(
            Value::Null,
            |a| json!({"content": [chat_entry(i, a, llama)]}),
        );
        let choice = if llama {
            json!({"finish_reason": null, "index": 0, "delta": {"content": word(i)}, "logprobs": logprobs})
        } else {
            json!({"index": 0, "delta": {"content": word(i)}, "logprobs": logprobs, "finish_reason": null})
        };
        let mut c = head.clone();
        c["choices"] = json!([choice]);
        if llama && alts.is_none() {
            c["timings"] = json!({"predicted_n": i + 1, "predicted_ms": 20.5 * (i as f64 + 1.0)});
        }
        sse(&mut pieces, &c);
    }
    finish(&mut pieces, &head, Endpoint::Chat, n, "stop");
    let frames: u64 = if alts.is_some() {
        n as u64
    } else {
        (0..n).map(|i| word(i).chars().count() as u64).sum()
    };
    Stream {
        name,
        endpoint: Endpoint::Chat,
        logprobs: alts.is_some(),
        top_logprobs: alts.unwrap_or(0) as u32,
        tool_calls: false,
        pieces,
        frames,
    }
}

fn completions_stream(n: usize, alts: usize) -> Stream {
    let head = json!({"id": "cmpl-5f1c8e2d9a7b", "object": "text_completion", "created": 1_718_000_000, "model": "meta-llama/Llama-3.1-8B"});
    let mut pieces = Vec::new();
    for i in 0..n {
        let top: serde_json::Map<String, Value> = (0..alts)
            .map(|j| (word(i + j).to_owned(), json!(lp(i, j))))
            .collect();
        let mut c = head.clone();
        c["choices"] = json!([{"index": 0, "text": word(i), "logprobs": {"text_offset": [i * 4], "token_logprobs": [lp(i, 0)], "tokens": [word(i)], "top_logprobs": [top]}, "finish_reason": null, "stop_reason": null}]);
        c["usage"] = Value::Null;
        sse(&mut pieces, &c);
    }
    finish(&mut pieces, &head, Endpoint::Completion, n, "length");
    Stream {
        name: "vllm_completions_lp3",
        endpoint: Endpoint::Completion,
        logprobs: true,
        top_logprobs: alts as u32,
        tool_calls: false,
        pieces,
        frames: n as u64,
    }
}

fn tool_call_stream(n: usize) -> Stream {
    let head = json!({"id": "chatcmpl-9a8b7c6d", "object": "chat.completion.chunk", "created": 1_694_268_190, "model": "gpt-4o-mini", "system_fingerprint": "fp_44709d6fcb"});
    let mut pieces = Vec::new();
    let mut c = head.clone();
    c["choices"] = json!([{"index": 0, "delta": {"role": "assistant", "content": null, "tool_calls": [{"index": 0, "id": "call_abc123def456", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}, "logprobs": null, "finish_reason": null}]);
    sse(&mut pieces, &c);
    let args = [
        "{\"", "city", "\":\"", "Paris", "\",\"", "unit", "\":\"", "c", "\"}", " ",
    ];
    let mut frames = 1;
    for i in 0..n {
        let a = args[i % args.len()];
        frames += a.chars().count() as u64;
        let mut c = head.clone();
        c["choices"] = json!([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": a}}]}, "logprobs": null, "finish_reason": null}]);
        sse(&mut pieces, &c);
    }
    finish(&mut pieces, &head, Endpoint::Chat, n, "tool_calls");
    Stream {
        name: "openai_tool_call",
        endpoint: Endpoint::Chat,
        logprobs: false,
        top_logprobs: 0,
        tool_calls: true,
        pieces,
        frames,
    }
}

fn encoder(s: &Stream) -> ChunkEncoder {
    ChunkEncoder {
        endpoint: s.endpoint,
        stream_id: StreamId {
            slot: 17,
            generation: 3,
        },
        created: 1_764_600_000,
        model: "meta-llama/Llama-3.1-8B-Instruct".into(),
        logprobs: s.logprobs,
        top_logprobs: s.top_logprobs,
        tool_calls: s.tool_calls,
        reasoning: false,
        blocks: std::cell::Cell::default(),
        output: std::cell::RefCell::default(),
    }
}

/// Frames and encodes one content token (`Split::Token`): its pieces, as the data plane.
fn encode_token(
    enc: &ChunkEncoder,
    out: &mut Vec<u8>,
    t: &UpToken,
    state: &mut (usize, bool),
) -> u64 {
    let mut tops: [(&str, f32); MAX_TOP_LOGPROBS as usize] = [("", 0.0); MAX_TOP_LOGPROBS as usize];
    let n = t.top.len().min(tops.len());
    for (slot, (s, l)) in tops.iter_mut().zip(&t.top).take(n) {
        *slot = (s.as_str(), *l);
    }
    let mut frames = 0;
    for piece in Split::Token.pieces(&t.text) {
        out.clear();
        let tok = Token {
            text: piece,
            logprob: t.logprob.unwrap_or(f32::NEG_INFINITY),
            top: &tops[..n],
        };
        enc.token_event(out, tok, state.0, state.1, Channel::Content);
        black_box(&*out);
        state.0 += piece.len();
        state.1 = false;
        frames += 1;
    }
    frames
}

/// Frames and encodes a chunk's tool-call delta: header frames, then argument pieces.
fn encode_tool_calls(
    enc: &ChunkEncoder,
    out: &mut Vec<u8>,
    calls: &Value,
    tokens: &[UpToken],
    state: &mut (usize, bool),
) -> Result<u64> {
    let parts = framing::tool_call_parts(calls).map_err(anyhow::Error::msg)?;
    let split = framing::tool_arguments_split(&parts, tokens);
    let mut frames = 0;
    for p in &parts {
        if p.has_header() {
            out.clear();
            let call = ToolCallDelta {
                index: p.index,
                id: p.id.as_deref(),
                name: p.name.as_deref(),
                arguments: "",
            };
            enc.tool_call_event(out, call, state.1);
            black_box(&*out);
            state.1 = false;
            frames += 1;
        }
        for piece in split.pieces(&p.arguments) {
            out.clear();
            let call = ToolCallDelta {
                index: p.index,
                id: None,
                name: None,
                arguments: piece,
            };
            enc.tool_call_event(out, call, state.1);
            black_box(&*out);
            state.1 = false;
            frames += 1;
        }
    }
    Ok(frames)
}

/// Frames and encodes one parsed chunk; returns the frames written.
fn encode_chunk(
    enc: &ChunkEncoder,
    out: &mut Vec<u8>,
    c: &UpstreamChunk,
    state: &mut (usize, bool),
) -> Result<u64> {
    if let Some(calls) = &c.tool_calls {
        return encode_tool_calls(enc, out, calls, &c.tokens, state);
    }
    if c.tokens_match_content() {
        return Ok(c
            .tokens
            .iter()
            .map(|t| encode_token(enc, out, t, state))
            .sum());
    }
    let mut frames = 0;
    for piece in Split::Chars.pieces(&c.content) {
        out.clear();
        enc.text_event(out, piece, state.1, Channel::Content);
        black_box(&*out);
        state.0 += piece.len();
        state.1 = false;
        frames += 1;
    }
    Ok(frames)
}

/// How events are read.
#[derive(Clone, Copy, Debug)]
enum ReadPath {
    Owned,
    Reuse,
}

impl ReadPath {
    fn name(self) -> &'static str {
        match self {
            ReadPath::Owned => "owned",
            ReadPath::Reuse => "reuse",
        }
    }
}

/// One pass over a stream: every piece pushed, every event parsed, framed and encoded.
fn run_stream(s: &Stream, path: ReadPath, enc: &ChunkEncoder, out: &mut Vec<u8>) -> Result<u64> {
    let mut parser = SseParser::new(256 * 1024);
    let mut reader = ChunkReader::default();
    let mut state = (0usize, true);
    let mut frames = 0;
    let mut done = false;
    for piece in &s.pieces {
        parser.push(piece);
        match path {
            ReadPath::Owned => {
                while let Some(ev) = parser.next_event()? {
                    match parse_event(s.endpoint, &ev)? {
                        UpstreamEvent::Chunk(c) => {
                            frames += encode_chunk(enc, out, &c, &mut state)?
                        }
                        UpstreamEvent::Done => done = true,
                        UpstreamEvent::Error(e) => bail!("{}: upstream error {e:?}", s.name),
                    }
                }
            }
            ReadPath::Reuse => {
                while let Some(ev) = parser.next_event_ref()? {
                    match reader.read(s.endpoint, ev)? {
                        Parsed::Chunk => {
                            frames += encode_chunk(enc, out, reader.chunk(), &mut state)?
                        }
                        Parsed::Done => done = true,
                        Parsed::Error(e) => bail!("{}: upstream error {e:?}", s.name),
                    }
                }
            }
        }
    }
    ensure!(done, "{}: no [DONE]", s.name);
    Ok(frames)
}

struct Row {
    name: &'static str,
    path: ReadPath,
    frames: u64,
    event_bytes: f64,
    ns_per_frame: f64,
    rounds_ns: Vec<f64>,
    allocs_per_frame: f64,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measure(s: &Stream, path: ReadPath, rounds: usize) -> Result<Row> {
    let enc = encoder(s);
    let mut out = Vec::with_capacity(16 * 1024);
    // Warm-up: caches, and the output buffer grown to its size.
    let got = run_stream(s, path, &enc, &mut out)?;
    ensure!(
        got == s.frames,
        "{}: {got} frames, expected {}",
        s.name,
        s.frames
    );
    let mut rounds_ns = Vec::with_capacity(rounds);
    let mut allocs = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let a0 = ALLOCS.load(Ordering::Relaxed);
        let t0 = Instant::now();
        let got = run_stream(s, path, &enc, &mut out)?;
        let ns = t0.elapsed().as_nanos() as f64;
        let a = ALLOCS.load(Ordering::Relaxed) - a0;
        ensure!(
            got == s.frames,
            "{}: {got} frames, expected {}",
            s.name,
            s.frames
        );
        rounds_ns.push(ns / got as f64);
        allocs.push(a as f64 / got as f64);
    }
    let bytes: usize = s.pieces.iter().map(Vec::len).sum();
    Ok(Row {
        name: s.name,
        path,
        frames: s.frames,
        event_bytes: bytes as f64 / s.pieces.len() as f64,
        ns_per_frame: median(&rounds_ns),
        rounds_ns,
        allocs_per_frame: median(&allocs),
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.tokens > 0 && args.rounds > 0,
        "--tokens and --rounds must be positive"
    );
    let n = args.tokens;
    let streams = [
        chat_stream("vllm_chat_lp5", n, Some(5), false),
        chat_stream("llama_chat", n, None, true),
        chat_stream("llama_chat_lp2", n, Some(2), true),
        completions_stream(n, 3),
        tool_call_stream(n),
    ];
    let mut rows = Vec::new();
    for s in &streams {
        for path in [ReadPath::Owned, ReadPath::Reuse] {
            rows.push(measure(s, path, args.rounds)?);
        }
    }
    let mut table = String::new();
    let _ = writeln!(
        table,
        "| stream | frames | bytes/event | ns/frame (median of {}) | allocations/frame |",
        args.rounds
    );
    let _ = writeln!(table, "|---|---:|---:|---:|---:|");
    for r in &rows {
        let _ = writeln!(
            table,
            "| {} | {} | {} | {:.0} | {:.0} | {:.2} |",
            r.name,
            r.path.name(),
            r.frames,
            r.event_bytes,
            r.ns_per_frame,
            r.allocs_per_frame
        );
    }
    print!("{table}");
    let report = json!({
        "bench": "upstream-path",
        "params": {"tokens": n, "rounds": args.rounds},
        "results": rows.iter().map(|r| json!({
            "stream": r.name,
            "path": r.path.name(),
            "frames": r.frames,
            "bytes_per_event": r.event_bytes,
            "ns_per_frame": r.ns_per_frame,
            "rounds_ns_per_frame": r.rounds_ns,
            "allocs_per_frame": r.allocs_per_frame,
        })).collect::<Vec<_>>(),
    });
    if let Some(dir) = args.out.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    fs::write(&args.out, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}
