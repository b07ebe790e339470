//! `scripted-upstream`: a scripted OpenAI-compatible inference server that stands in for vLLM
//! or llama.cpp server in haltd's integration tests and benchmarks.
//!
//! ```text
//! scripted-upstream --listen ADDR:PORT (default --log FILE) (default --framing chunked|close) (default --ready-file FILE)
//!     [--keep-alive [--keep-alive-idle-ms MS]] [--tls-cert PEM --tls-key PEM]
//! ```
//!
//! Once bound it prints `listening on ADDR:PORT` (the real port when asked for port 0) and, with
//! `--ready-file`, writes that address (no newline) to the file, atomically. It runs until
//! killed. HTTP/1.1 is hand-written over tokio sockets so that every byte on the wire is under
//! the script's control: one request per connection, every response says `connection: close`.
//! With `--keep-alive` (for a reverse proxy's connection pool in the benches), a streamed
//! response with chunked framing to a request that did not say `connection: close` says
//! `connection: keep-alive` instead, and once it has ended normally the connection waits for
//! the next request; every other response still closes its connection. With
//! `--keep-alive-idle-ms`, a kept connection that waits longer than that for its next request
//! is closed (uvicorn's `--timeout-keep-alive`).
//!
//! With `--tls-cert` and `--tls-key` (PEM: the certificate chain, leaf first, and its private
//! key) it speaks TLS (ALPN `http/1.1`) on `--listen`: an in-process TLS front (tokio-rustls)
//! terminates each connection and relays its plaintext to the same server on a private
//! loopback port, one plain connection per TLS connection, so every script, the log and the
//! connection numbers behave as without TLS. A peer that closes (or resets) its TLS connection
//! closes the relayed one, which cancels the request as before; a response that ends with a
//! close ends the TLS connection with `close_notify` and a FIN. (A reset, `die rst=1`, reaches
//! the peer as a close.) A failed handshake is printed to stderr and leaves no log line.
//!
//! Routes: `GET /v1/models`; `POST /v1/embeddings` (a 4-dimensional embedding per input, made
//! from its text; 400 without `input`); `POST /v1/chat/completions` and `POST /v1/completions`, streamed
//! (`"stream": true`, SSE) or batch (one JSON body built from the same script); `POST
//! /v1/responses` (OpenAI's Responses API) and `POST /v1/messages` (Anthropic's Messages API)
//! in vLLM's shapes, streamed or batch (see [Native surfaces](#native-surfaces)); anything else
//! is a 404 with an OpenAI-style JSON error. Streamed bodies use `--framing` (default
//! `chunked`, one HTTP chunk per SSE event as uvicorn/vLLM do; `close`: no length, the body ends
//! at connection close, as some llama.cpp builds do).
//!
//! # Scripts
//!
//! The request's text (chat: the last message's `content`, a string or `{type:"text"}` parts,
//! trailing system messages without a directive skipped; completions: `prompt`; Responses:
//! `input` as a string, or its last item, trailing system / developer messages without a
//! directive skipped: a message's `content` string or `input_text` parts, a
//! `function_call_output`'s `output`; Messages: the last message's `content`, a string or its
//! `text` blocks and `tool_result` blocks' content) selects a script with a directive; without
//! one the script is `normal`:
//!
//! ```text
//! [[script:NAME key=value key="value with spaces" ...]]
//! ```
//!
//! Keys every script takes (defaults in parentheses): `tokens=N` (8); `pace_ms=P`, the delay
//! before each SSE chunk (0); `first_ms=F`, an extra delay before the first chunk (0);
//! `per_chunk=K`, tokens per chunk (1); `finish=stop|length|tool_calls|abort|error|content_filter`
//! (stop; tool_calls for `tool_call`); `neginf_at=I[,I..]`, logprob -9999.0, vLLM's -inf
//! sentinel; `low_at=I[,I..]`, logprob ln 0.001; `words=a,b,c`, token texts, cycled (common
//! English words with a leading space, the first token `The`); `model=NAME`, the `model` the
//! answer reports (the request's), as a backend that answers under another name or another
//! model; `framing=chunked|close`
//! (overrides `--framing` for this request); `no_logprobs=1`, never send logprobs, like a
//! backend without logprob support; `token_ids=1`, logprob entries name their token
//! `token_id:<index>` (vLLM's `--return-tokens-as-token-ids` form), so their texts do not
//! spell the content; `align=1`, each content chunk waits for the next multiple of `pace_ms`
//! on CLOCK_MONOTONIC instead of `pace_ms` after the previous one, so that all streams of one
//! pace send their tokens at the same instants, like the sequences of one decode batch,
//! whenever each began; `drop_reused=1`, a request that arrives on a kept-alive connection
//! (not its first) is read and then left unanswered, its connection closed at once (logged
//! `dropped`), as when an upstream's keep-alive timeout closes the connection just as a
//! request goes out; `reasoning=N` (chat), the first `N` of the `tokens` go out as
//! `delta.reasoning_content` (batch: `message.reasoning_content`), as a reasoning model's
//! thinking does under vLLM's reasoning parser, with logprobs like any token (a chunk of
//! `per_chunk` never mixes the two). Other tokens have logprob ln 0.9 and are their own
//! top alternative; the other alternatives are made up deterministically.
//!
//! | script | after the `tokens` content tokens |
//! |---|---|
//! | `normal` | final chunk, usage chunk (if `stream_options.include_usage`), `[DONE]` |
//! | `tool_call` | tool-call deltas (`name=` (default get_weather), `args_chunks=` (default 3), `calls=1\|2`, `args=` the first call's arguments, JSON written with `'` for `"`; `name_every=1`: every arguments delta repeats the call's `id`, `type` and `name`, as llama.cpp's server sends them (OpenAI and vLLM name the call in its first delta only); `needs_tool=1`: as `normal` when the request's `tools` do not offer `name`, as a model cannot call a tool it was not given; `die=1`: the connection is cut 300 ms after the calls, a turn that fails after they were dispatched), then as `normal` |
//! | `error_event` | `data: {"error":{..}}` (`code=` (default 400), `msg=`, `object=1` adds vLLM's `"object":"error","param":null`), `[DONE]` |
//! | `llama_error` | `error: {"code":..,"message":..,"type":..}` and a blank line (`code=` (default 500), `msg=`), end |
//! | `garbage` | `data: {this is not json`, then `after=` (default 4) more tokens and a normal end |
//! | `stall` | nothing more; the connection stays open `hold_ms=` (default 60000), then closes |
//! | `die` | close abruptly: no final chunk, no `[DONE]`, no 0-chunk; `rst=1`: RST (SO_LINGER 0) |
//! | `status` | (before anything) HTTP `code=` (default 500) with a JSON error (`msg=`, `retry_after=S`; `empty=1`: no body at all, as llama-cpp-python refuses an `x-request-id` that is not a UUID) |
//! | `slow_head` | (before the head) wait `head_ms=` (default 2000), then as `normal` |
//! | `bench` | as `normal`, token texts ` t<NS>`: CLOCK_MONOTONIC ns read just before the write |
//!
//! **Continuations** (haltd's grounded resume, issue 16): a chat request whose last message is
//! the assistant's is continued, in vLLM's shape (`continue_final_message: true`,
//! `add_generation_prompt: false`) or llama.cpp's (a prefill: neither flag; a mix is a 400).
//! Its directive is read from the last user message; it gets `resume=N` tokens (6), none of
//! them unlikely, whose texts are the words of the evidence in the request's `[grounding]`
//! segment (system messages, one `[claim, evidence, confidence, source]` line per snippet),
//! each with a leading space; the script's `words` without a segment.
//!
//! An unknown script or key, or a bad value, gets a 400 whose message says what was wrong, so a
//! typo in a test fails loudly instead of running the default script.
//!
//! **Webhooks**: `POST /hooks/<name>` receives what haltd escalates (`--escalation-url`),
//! logged like any request: `/hooks/fail-N` answers 503 to its first `N` requests, then 200;
//! any other name 200.
//!
//! # Native surfaces
//!
//! `/v1/responses` and `/v1/messages` run the same scripts with the same keys (`tokens`,
//! `pace_ms`, `first_ms`, `per_chunk`, `align`, `words`, `reasoning` (a reasoning item /
//! thinking block before the answer), `finish`, `framing`, `drop_reused`, `no_logprobs`,
//! `token_ids`, `neginf_at`, `low_at`; `tool_call` with `name`, `args`, `args_chunks`,
//! `calls`, `needs_tool` (the request's flat `tools[].name`) and `die`; `error_event`,
//! `garbage`, `stall`, `die`, `status`, `slow_head`, `bench`); `llama_error` is a 400, and
//! chat's `name_every`, `object`, `n`, continuations do not apply. Each delta event is one
//! step (one HTTP chunk per event); a step of `per_chunk` tokens is one delta; the tool-call
//! header and each arguments piece count as a token, as in chat. Ids are deterministic, not
//! vLLM's random ones: items `item_<seq>_<output_index>`, calls `call_<seq>_<call>` (chat's
//! tool-call id), responses `resp_<seq>`, messages `chatcmpl-<seq>` (vLLM's Messages answer
//! carries its chat completion's id), thinking signatures `sig_<seq>_<index>`. JSON keys are
//! in alphabetical order as vLLM's pydantic dumps of the OpenAI types have them (`type` first
//! in Messages events). The shapes follow vLLM main at commit 0001948b:
//! vllm/entrypoints/openai/responses/serving.py (`responses_stream_generator`),
//! streaming_events.py (01e4fce0, `SimpleStreamingEventProcessor`), api_router.py (SSE as
//! `event: <type>` + `data:`, no `[DONE]`), and vllm/entrypoints/anthropic/serving.py
//! (`message_stream_converter`) and api_router.py.
//!
//! Responses, streamed; every event has `type` (the SSE event name too) and `sequence_number`
//! from 0:
//!
//! ```text
//! response.created, response.in_progress     {response: status in_progress, output [], usage null}
//! reasoning=N:  response.output_item.added   {item: {type reasoning, id, summary [],
//!                                             status in_progress}}
//!               response.reasoning_part.added {part: {type reasoning_text, text ""}}
//!               response.reasoning_text.delta* {delta, item_id, output_index, content_index 0}
//!               response.reasoning_text.done, response.reasoning_part.done,
//!               response.output_item.done
//! answer:       response.output_item.added   {item: {type message, role assistant,
//!                                             content [], status in_progress}}
//!               response.content_part.added  {part: {type output_text, text "",
//!                                             annotations [], logprobs []}}
//!               response.output_text.delta*  {delta, item_id, output_index, content_index 0,
//!                                             logprobs}
//!               response.output_text.done {text, logprobs []}, response.content_part.done,
//!               response.output_item.done    {item: the message, its output_text with all
//!                                             logprobs}
//! tool_call:    per call response.output_item.added {item: {type function_call, id, call_id, name,
//!               arguments "", status in_progress}}, response.function_call_arguments.delta*
//!               {delta, item_id, output_index}, response.function_call_arguments.done {arguments,
//!               name}, response.output_item.done
//! end:          response.completed {response: status completed, or incomplete with
//!               incomplete_details.reason max_output_tokens (finish=length) / content_filter;
//!               output (the done items); usage {input_tokens, input_tokens_details.cached_tokens,
//!               output_tokens, output_tokens_details.reasoning_tokens, total_tokens}}
//! ```
//!
//! `logprobs` entries (`{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`, as
//! chat's) come only when `include` has `"message.output_text.logprobs"` (vLLM's condition),
//! with `top_logprobs` alternatives, unless `no_logprobs=1`; reasoning deltas carry none.
//! (Older vLLM opened a reasoning item with `response.content_part.added` of a
//! `reasoning_text` part instead of `response.reasoning_part.added`.) `error_event` writes
//! `event: error` `{type: error, code: "<code>", message, param: null, sequence_number}` (with
//! `failed=1`: `response.failed` with `response.status: failed`, `response.error: {code,
//! message}`) and ends the body; vLLM itself, on an error mid-stream, fails to serialize chat's
//! error object and cuts the stream with no terminal event, which `die` plays. Batch: one
//! Response object (`output`: reasoning, message, function_call items). `status` and batch
//! errors: chat's OpenAI error JSON.
//!
//! Messages, streamed (each event's `type` first, and its SSE event name):
//!
//! ```text
//! message_start {message: {id, type message, role assistant, content [], model, stop_reason null,
//!               stop_sequence null, usage {input_tokens, output_tokens 0}}}
//! ping          only with ping=1 (Anthropic's API sends one; vLLM does not)
//! reasoning=N:  content_block_start {index, content_block {type thinking, thinking ""}},
//!               content_block_delta* {delta {type thinking_delta, thinking}},
//!               content_block_delta {delta {type signature_delta, signature}}, content_block_stop
//! answer:       content_block_start {content_block {type text, text ""}},
//!               content_block_delta* {delta {type text_delta, text}}, content_block_stop
//! tool_call:    per call content_block_start {content_block {type tool_use, id, name, input {}}},
//!               content_block_delta* {delta {type input_json_delta, partial_json}},
//!               content_block_stop
//! end:          message_delta {delta {stop_reason end_turn|max_tokens|tool_use (null for other
//!               finishes, as vLLM maps them), stop_sequence null}, usage {input_tokens,
//!               output_tokens}}, message_stop
//! ```
//!
//! `error_event` writes `event: error` `{type: error, error: {type, message}}` and ends the body
//! without `message_stop`, as vLLM does; the error `type` is Anthropic's for `code=`
//! (invalid_request_error 400, authentication_error 401, permission_error 403,
//! not_found_error 404, rate_limit_error 429, overloaded_error 503/529, api_error other 5xx).
//! Batch: one Message object (`content`: thinking with its signature, text, tool_use with
//! `input` the parsed arguments, or the string where `args=` is not JSON). `status` and batch
//! errors: `{type: error, error: {type, message}}` with that type. No logprobs.
//!
//! # Log
//!
//! With `--log FILE`, JSON Lines appended (and flushed) per request: at the start of a
//! scripted request (chat, completions, responses, messages)
//! `{"seq","event":"started","method","path","headers","body","script"}`, and when any request
//! ends `{"seq","method","path","headers","body","script","tokens_sent","outcome","elapsed_ms",
//! "cancelled_after_ms"}` (plus `"error"` when the directive was refused); see [`Outcome`] for
//! the outcomes. `headers` maps lower-cased names to values (repeats joined with `, `; every
//! header, so `authorization`, `x-api-key`, `anthropic-version` and `anthropic-beta` are there
//! when sent), `path` tells the routes apart, `body` is the request JSON or null, `script` is
//! null outside the scripted routes, and `tokens_sent` counts content tokens plus tool-call
//! deltas. Times are milliseconds (three decimals) from the moment the request was fully read.
//! Every line also has `"conn"`, the 1-based number of the connection the request came on (in
//! accept order), and `"conn_request"`, the request's 1-based place on that connection.
//!
//! While a response is being written the read half of the socket is watched: a peer that closes
//! (or a write that fails) cancels the request at once, also during pacing sleeps and stalls, so
//! tests can check that a proxy really dropped its upstream.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs::{self, File, OpenOptions},
    io::{self, Write as _},
    net::SocketAddr,
    ops::Range,
    path::{Path, PathBuf},
    str::FromStr,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

#[path = "scripted-upstream/messages.rs"]
mod messages;
#[path = "scripted-upstream/native.rs"]
mod native;
#[cfg(test)]
#[path = "scripted-upstream/native_tests.rs"]
mod native_tests;
#[path = "scripted-upstream/responses.rs"]
mod responses;

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use serde_json::{json, Map, Value};
use tokio::{
    io::{AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{
        tcp::{ReadHalf, WriteHalf},
        TcpListener, TcpSocket, TcpStream,
    },
};

/// How a streamed response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Framing {
    /// `transfer-encoding: chunked`, one HTTP chunk per SSE event (uvicorn, vLLM).
    Chunked,
    /// No length: the body ends when the connection closes (some llama.cpp builds).
    Close,
}

/// A scripted OpenAI-compatible upstream for haltd's tests (see the crate docs for scripts).
#[derive(Debug, Parser)]
#[command(name = "scripted-upstream")]
struct Args {
    /// Address to listen on; port 0 picks a free port, printed as `listening on ADDR:PORT`.
    #[arg(long)]
    listen: SocketAddr,
    /// Append one JSON line per request (and one when a completion starts) to this file.
    #[arg(long)]
    log: Option<PathBuf>,
    /// Body framing of streamed responses.
    #[arg(long, value_enum, default_value_t = Framing::Chunked)]
    framing: Framing,
    /// Write the bound address to this file once listening.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Keep the connection open after a streamed, chunked response that ended normally, unless
    /// the request said `connection: close` (see the crate docs).
    #[arg(long)]
    keep_alive: bool,
    /// With `--keep-alive`: close a kept connection idle this long (ms) before its next request.
    #[arg(long)]
    keep_alive_idle_ms: Option<u64>,
    /// Speak TLS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    // A thousand-stream bench holds a thousand sockets here; the usual soft limit is 1024.
    raise_nofile_limit();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    rt.block_on(serve(args))
}

fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes into `lim`, which outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit only reads `lim`.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            eprintln!(
                "scripted-upstream: raising RLIMIT_NOFILE: {}",
                io::Error::last_os_error()
            );
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock `bench-proxy` reads on the same machine.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes into `ts`; CLOCK_MONOTONIC always exists on Linux, so
    // the call cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    // Both fields are non-negative for CLOCK_MONOTONIC.
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[derive(Debug)]
struct Server {
    framing: Framing,
    keep_alive: bool,
    keep_alive_idle: Option<Duration>,
    log: Option<Mutex<File>>,
    seq: AtomicU64,
    /// Connections accepted so far.
    conns: AtomicU64,
    /// Requests so far per `/hooks/` path (a webhook receiver for haltd's escalations).
    hooks: Mutex<std::collections::HashMap<String, u32>>,
}

impl Server {
    /// Appends one line; each line is a single `write` on an O_APPEND file, under a mutex, then
    /// flushed, so a test tailing the file never sees a torn or late line.
    fn log(&self, v: &Value) {
        let Some(log) = &self.log else { return };
        let mut line = v.to_string();
        line.push('\n');
        // A poisoned lock only means another request panicked; the file itself is fine.
        let mut f = log.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = f.write_all(line.as_bytes()).and_then(|()| f.flush()) {
            eprintln!("scripted-upstream: writing the log: {e}");
        }
    }
}

async fn serve(args: Args) -> Result<()> {
    let log = match &args.log {
        Some(p) => Some(Mutex::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("opening the log {}", p.display()))?,
        )),
        None => None,
    };
    let listener = listen(args.listen).with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let listener = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            // The scripts are served on a private port behind the TLS front.
            let acceptor = tls_acceptor(cert, key)?;
            let inner = listen(SocketAddr::from(([127, 0, 0, 1], 0))).context("binding")?;
            let inner_addr = inner.local_addr().context("reading the inner address")?;
            tokio::spawn(tls_front(listener, acceptor, inner_addr));
            inner
        }
        _ => listener,
    };
    println!("listening on {addr}");
    if let Some(p) = &args.ready_file {
        write_ready_file(p, addr)?;
    }
    let server = Arc::new(Server {
        framing: args.framing,
        keep_alive: args.keep_alive,
        keep_alive_idle: args.keep_alive_idle_ms.map(Duration::from_millis),
        log,
        seq: AtomicU64::new(0),
        conns: AtomicU64::new(0),
        hooks: Mutex::default(),
    });
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(handle_conn(Arc::clone(&server), stream));
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning; the peer will retry or fail.
                eprintln!("scripted-upstream: accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// The TLS server configuration of `--tls-cert` and `--tls-key`.
fn tls_acceptor(cert: &Path, key: &Path) -> Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::{pem::PemObject as _, CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .with_context(|| format!("reading {}", cert.display()))?;
    let key =
        PrivateKeyDer::from_pem_file(key).with_context(|| format!("reading {}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("TLS certificate and key")?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(cfg)))
}

/// Accepts TLS connections on `public` and relays each one's plaintext to `inner`.
async fn tls_front(public: TcpListener, acceptor: tokio_rustls::TlsAcceptor, inner: SocketAddr) {
    loop {
        let tcp = match public.accept().await {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                eprintln!("scripted-upstream: accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            let mut tls = match acceptor.accept(tcp).await {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("scripted-upstream: TLS handshake: {e}");
                    return;
                }
            };
            let Ok(mut plain) = TcpStream::connect(inner).await else {
                return;
            };
            let _ = plain.set_nodelay(true);
            // Ends when either side closes; the other is then closed too.
            let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
        });
    }
}

/// A listener with a deep accept queue: `TcpListener::bind` asks for 128, and a thousand-stream
/// bench connecting at once overflows that; the dropped SYNs come back after a 1 s retransmit
/// timeout and show up as a second of made-up latency.
fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let sock = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    // The kernel caps this at net.core.somaxconn.
    sock.listen(8192)
}

/// Written to a temporary name and renamed, so a test polling for the file never reads half.
fn write_ready_file(p: &Path, addr: SocketAddr) -> Result<()> {
    let mut tmp = p.as_os_str().to_owned();
    tmp.push(".tmp");
    fs::write(&tmp, addr.to_string())
        .with_context(|| format!("writing {}", Path::new(&tmp).display()))?;
    fs::rename(&tmp, p).with_context(|| format!("renaming to {}", p.display()))
}

// ---------------------------------------------------------------------------------------------
// Requests

#[derive(Debug)]
struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

const MAX_HEAD: usize = 64 * 1024;
const MAX_BODY: usize = 16 * 1024 * 1024;

/// Reads one request; `None` if the peer closed before sending a byte. `carry` holds bytes
/// already read from the connection (the start of this request, on a kept-alive connection);
/// it is left holding whatever followed a request with a `content-length` body (the next one,
/// pipelined), and empty otherwise.
async fn read_request(s: &mut TcpStream, carry: &mut Vec<u8>) -> Result<Option<Request>> {
    let mut buf = std::mem::take(carry);
    let (mut req, head_len) = loop {
        if !buf.is_empty() {
            if let Some(parsed) = parse_head(&buf)? {
                break parsed;
            }
            ensure!(buf.len() < MAX_HEAD, "request head over {MAX_HEAD} bytes");
        }
        buf.reserve(8192);
        let n = s.read_buf(&mut buf).await.context("reading the request")?;
        if n == 0 {
            if buf.is_empty() {
                return Ok(None);
            }
            bail!("connection closed inside the request head");
        }
    };
    let chunked = req
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let length: usize = match req.header("content-length") {
        Some(v) => v.trim().parse().context("bad content-length")?,
        None => 0,
    };
    ensure!(length <= MAX_BODY, "request body over {MAX_BODY} bytes");
    let has_body = chunked || length > 0;
    if has_body
        && buf.len() == head_len
        && req
            .header("expect")
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
    {
        // curl waits (1 s) for this before sending a large body.
        s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .context("writing 100 Continue")?;
    }
    loop {
        let have = &buf[head_len..];
        if chunked {
            if let Some(body) = decode_chunked(have)? {
                req.body = body;
                break;
            }
        } else if have.len() >= length {
            req.body = have[..length].to_vec();
            carry.extend_from_slice(&have[length..]);
            break;
        }
        ensure!(have.len() <= MAX_BODY + 4096, "request body too large");
        buf.reserve(8192);
        let n = s.read_buf(&mut buf).await.context("reading the body")?;
        ensure!(n > 0, "connection closed inside the request body");
    }
    Ok(Some(req))
}

/// A complete request head and its length, or `None` if more bytes are needed.
fn parse_head(buf: &[u8]) -> Result<Option<(Request, usize)>> {
    let mut hs = [httparse::EMPTY_HEADER; 64];
    let mut r = httparse::Request::new(&mut hs);
    match r.parse(buf).context("parsing the request head")? {
        httparse::Status::Complete(len) => {
            let req = Request {
                method: r.method.unwrap_or_default().to_owned(),
                path: r.path.unwrap_or_default().to_owned(),
                headers: r
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect(),
                body: Vec::new(),
            };
            Ok(Some((req, len)))
        }
        httparse::Status::Partial => Ok(None),
    }
}

/// A complete chunked body, or `None` if more bytes are needed. Trailers are skipped.
fn decode_chunked(mut data: &[u8]) -> Result<Option<Vec<u8>>> {
    let mut body = Vec::new();
    loop {
        let (skip, size) = match httparse::parse_chunk_size(data) {
            Ok(httparse::Status::Complete(v)) => v,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(_) => bail!("bad chunk size in the request body"),
        };
        data = &data[skip..];
        let size = usize::try_from(size).context("chunk too large")?;
        if size == 0 {
            // Trailer lines, then an empty line.
            loop {
                let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
                    return Ok(None);
                };
                if eol == 0 {
                    return Ok(Some(body));
                }
                data = &data[eol + 2..];
            }
        }
        ensure!(body.len() + size <= MAX_BODY, "request body too large");
        if data.len() < size + 2 {
            return Ok(None);
        }
        ensure!(
            &data[size..size + 2] == b"\r\n",
            "chunk not followed by CRLF"
        );
        body.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

// ---------------------------------------------------------------------------------------------
// Connections

/// How a request ended, as logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The script ran to its end (for `garbage`, `error_event`, `llama_error` too).
    Completed,
    /// The peer closed or a write failed before the script's end.
    Cancelled,
    /// `die` closed the connection.
    Died,
    /// `stall` held the connection for `hold_ms` and then closed it: nobody cancelled.
    Stalled,
    /// The peer closed while `stall` was holding the connection.
    StalledThenCancelled,
    /// An error status was sent: `status`, batch `error_event`/`llama_error`, 404, bad input.
    Status,
    /// `drop_reused`: a request on a kept-alive connection was left unanswered.
    Dropped,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Cancelled => "cancelled",
            Self::Died => "died",
            Self::Stalled => "stalled",
            Self::StalledThenCancelled => "stalled_then_cancelled",
            Self::Status => "status",
            Self::Dropped => "dropped",
        }
    }
}

/// What is shared between the running script and the cancellation watcher.
#[derive(Debug, Default)]
struct Progress {
    tokens: AtomicUsize,
    stalling: AtomicBool,
    /// Everything a client needs was written (`[DONE]` or the error event); a peer that hangs
    /// up now, before the terminating 0-chunk, has not cancelled anything.
    finished: AtomicBool,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

async fn handle_conn(server: Arc<Server>, stream: TcpStream) {
    // One SSE event per write: without NODELAY, Nagle holds each small frame until the previous
    // one is acknowledged, a delay the bench would wrongly charge to the proxy.
    if let Err(e) = stream.set_nodelay(true) {
        eprintln!("scripted-upstream: TCP_NODELAY: {e}");
    }
    // Bytes read past the end of a request, the start of the next one (`--keep-alive`).
    let mut carry = Vec::new();
    let mut at = ConnAt {
        conn: server.conns.fetch_add(1, Ordering::Relaxed) + 1,
        request: 1,
    };
    let mut next = Some(stream);
    while let Some(stream) = next {
        if at.request > 1 && carry.is_empty() {
            if let Some(idle) = server.keep_alive_idle {
                // uvicorn's keep-alive timeout: no next request in time, the connection closes.
                let mut byte = [0u8; 1];
                match tokio::time::timeout(idle, stream.peek(&mut byte)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    _ => return,
                }
            }
        }
        next = handle_request(&server, stream, &mut carry, at).await;
        at.request += 1;
    }
}

/// Where a request came: its connection's number and its place on it (both 1-based).
#[derive(Debug, Clone, Copy)]
struct ConnAt {
    conn: u64,
    request: u64,
}

/// Runs the plan's script against the peer until it ends or the peer hangs up; returns the
/// outcome, when the peer cancelled (since `t0`), and whether the connection stays open.
async fn serve_plan(
    plan: &Plan,
    stream: &mut TcpStream,
    keep_alive: bool,
    carry: &mut Vec<u8>,
    prog: &Progress,
    t0: Instant,
) -> (Outcome, Option<Duration>, bool) {
    let (mut rd, wr) = stream.split();
    let mut out = Out {
        w: wr,
        framing: plan.framing,
        keep_alive,
        frame: Vec::with_capacity(4096),
    };
    // What the peer sends meanwhile is kept only where it may be the next request.
    let mut ignored = Vec::new();
    let sent = if keep_alive {
        &mut *carry
    } else {
        &mut ignored
    };
    // `biased`: a script that has just finished wins over a peer that hung up right after.
    let ended = tokio::select! {
        biased;
        r = run(plan, &mut out, prog) => r.ok(),
        () = peer_gone(&mut rd, sent) => None,
    };
    match ended {
        Some(Outcome::Completed) if keep_alive => (Outcome::Completed, None, true),
        Some(o) => {
            if matches!(o, Outcome::Completed | Outcome::Status | Outcome::Stalled) {
                // A clean FIN after the body; with `close` framing this ends the body.
                let _ = out.w.shutdown().await;
            }
            (o, None, false)
        }
        None if prog.finished.load(Ordering::Relaxed) => (Outcome::Completed, None, false),
        None => {
            let o = if prog.stalling.load(Ordering::Relaxed) {
                Outcome::StalledThenCancelled
            } else {
                Outcome::Cancelled
            };
            (o, Some(t0.elapsed()), false)
        }
    }
}

/// The request's log entry (repeated headers joined with ", " as HTTP allows, and where it
/// came); its script and outcome come later.
fn log_entry(seq: u64, req: &Request, body: Option<&Value>, at: ConnAt) -> Value {
    let mut headers = Map::new();
    for (n, v) in &req.headers {
        match headers.get_mut(n) {
            Some(Value::String(prev)) => {
                prev.push_str(", ");
                prev.push_str(v);
            }
            _ => {
                headers.insert(n.clone(), Value::String(v.clone()));
            }
        }
    }
    json!({
        "seq": seq,
        "method": req.method,
        "path": req.path,
        "headers": headers,
        "body": body.cloned().unwrap_or(Value::Null),
        "script": null,
        "conn": at.conn,
        "conn_request": at.request,
    })
}

/// Serves one request; returns the connection when it stays open for the next one
/// (`--keep-alive`), else closes it (drops it) before the request's log line is written.
async fn handle_request(
    server: &Server,
    mut stream: TcpStream,
    carry: &mut Vec<u8>,
    at: ConnAt,
) -> Option<TcpStream> {
    let req = match read_request(&mut stream, carry).await {
        Ok(Some(r)) => r,
        Ok(None) => return None,
        Err(e) => {
            let body = error_json(400, &format!("{e:#}"));
            // The peer may be gone already; there is nobody else to tell.
            let _ = write_simple(&mut stream, 400, &body, &[]).await;
            return None;
        }
    };
    let t0 = Instant::now();
    let seq = server.seq.fetch_add(1, Ordering::Relaxed) + 1;
    let body: Option<Value> = serde_json::from_slice(&req.body).ok();
    let mut entry = log_entry(seq, &req, body.as_ref(), at);
    let route = req.path.split('?').next().unwrap_or_default();
    if let Some((code, answer)) = whole_answer(server, (&req.method, route), body.as_ref()) {
        answer_whole(server, stream, entry, t0, code, &answer).await;
        return None;
    }
    let endpoint = match (req.method.as_str(), route) {
        ("POST", "/v1/chat/completions") => Endpoint::Chat,
        ("POST", "/v1/completions") => Endpoint::Completions,
        ("POST", "/v1/responses") => Endpoint::Responses,
        ("POST", "/v1/messages") => Endpoint::Messages,
        _ => {
            let msg = format!("no route for {} {}", req.method, req.path);
            let _ = write_simple(&mut stream, 404, &error_json(404, &msg), &[]).await;
            let _ = stream.shutdown().await;
            finish_log(server, entry, 0, Outcome::Status, t0, None);
            return None;
        }
    };
    let plan = match Plan::new(endpoint, body.as_ref(), seq, server.framing) {
        Ok(p) => p,
        Err(msg) => {
            let msg = format!("scripted-upstream: {msg}");
            let _ = write_simple(&mut stream, 400, &error_json(400, &msg), &[]).await;
            let _ = stream.shutdown().await;
            entry["error"] = Value::String(msg);
            finish_log(server, entry, 0, Outcome::Status, t0, None);
            return None;
        }
    };
    entry["script"] = Value::String(plan.script.name.clone());
    if plan.script.drop_reused && at.request > 1 {
        drop(stream);
        finish_log(server, entry, 0, Outcome::Dropped, t0, None);
        return None;
    }
    let mut started = entry.clone();
    started["event"] = Value::String("started".into());
    server.log(&started);

    let keep_alive = server.keep_alive
        && plan.stream
        && plan.framing == Framing::Chunked
        && !req
            .header("connection")
            .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")));
    let prog = Progress::default();
    let (outcome, cancelled_after, kept) =
        serve_plan(&plan, &mut stream, keep_alive, carry, &prog, t0).await;
    if outcome == Outcome::Died && plan.script.rst {
        // SO_LINGER 0: close() sends RST and drops unsent data.
        if let Err(e) = stream.set_zero_linger() {
            eprintln!("scripted-upstream: SO_LINGER: {e}");
        }
    }
    let tokens = prog.tokens.load(Ordering::Relaxed);
    if kept {
        finish_log(server, entry, tokens, outcome, t0, cancelled_after);
        return Some(stream);
    }
    drop(stream);
    finish_log(server, entry, tokens, outcome, t0, cancelled_after);
    None
}

fn finish_log(
    server: &Server,
    mut entry: Value,
    tokens: usize,
    outcome: Outcome,
    t0: Instant,
    cancelled_after: Option<Duration>,
) {
    entry["tokens_sent"] = tokens.into();
    entry["outcome"] = outcome.as_str().into();
    entry["elapsed_ms"] = ms(t0.elapsed()).into();
    entry["cancelled_after_ms"] = cancelled_after.map(ms).into();
    server.log(&entry);
}

/// Resolves when the peer has closed its side (or the socket failed). What the peer sends
/// meanwhile goes to `sent` (up to [`MAX_HEAD`] bytes, the rest is dropped): the caller keeps
/// it as the start of the next request on a kept-alive connection, or ignores it.
async fn peer_gone(r: &mut ReadHalf<'_>, sent: &mut Vec<u8>) {
    let mut buf = [0u8; 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let room = MAX_HEAD.saturating_sub(sent.len());
                sent.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

/// OpenAI's error body. Hand-written (like the chunks) to keep OpenAI's field order on the wire.
fn error_json(code: u16, msg: &str) -> String {
    let kind = if code < 500 {
        "invalid_request_error"
    } else {
        "server_error"
    };
    let mut s = String::from(r#"{"error":{"message":"#);
    esc(&mut s, msg);
    s.push_str(r#","type":"#);
    esc(&mut s, kind);
    s.push_str(r#","code":"#);
    num(&mut s, code);
    s.push_str("}}");
    s
}

/// A complete `application/json` response with content-length framing.
async fn write_simple(
    w: &mut (impl AsyncWrite + Unpin),
    code: u16,
    body: &str,
    extra: &[(&str, String)],
) -> io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {code} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nserver: scripted-upstream\r\n",
        reason(code),
        body.len()
    );
    for (n, v) in extra {
        head.push_str(n);
        head.push_str(": ");
        head.push_str(v);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    head.push_str(body);
    w.write_all(head.as_bytes()).await
}

/// The write half of a streamed response.
struct Out<'a> {
    w: WriteHalf<'a>,
    framing: Framing,
    /// The head says `connection: keep-alive` instead of `close` (`--keep-alive`).
    keep_alive: bool,
    frame: Vec<u8>,
}

impl Out<'_> {
    async fn stream_head(&mut self) -> io::Result<()> {
        let te = match self.framing {
            Framing::Chunked => "transfer-encoding: chunked\r\n",
            Framing::Close => "",
        };
        let connection = if self.keep_alive {
            "keep-alive"
        } else {
            "close"
        };
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\
             connection: {connection}\r\nserver: scripted-upstream\r\n{te}\r\n"
        );
        self.w.write_all(head.as_bytes()).await
    }

    /// One piece of body (one SSE event), in one HTTP chunk and one `write`.
    async fn part(&mut self, data: &[u8]) -> io::Result<()> {
        match self.framing {
            Framing::Close => self.w.write_all(data).await,
            Framing::Chunked => {
                self.frame.clear();
                write!(self.frame, "{:x}\r\n", data.len())?;
                self.frame.extend_from_slice(data);
                self.frame.extend_from_slice(b"\r\n");
                self.w.write_all(&self.frame).await
            }
        }
    }

    /// The end of a well-formed body: the 0-chunk (with `close` framing, the FIN that follows).
    async fn end(&mut self) -> io::Result<()> {
        match self.framing {
            Framing::Chunked => self.w.write_all(b"0\r\n\r\n").await,
            Framing::Close => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Scripts

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
    /// OpenAI's Responses API, in vLLM's shapes (`responses.rs`).
    Responses,
    /// Anthropic's Messages API, in vLLM's shapes (`messages.rs`).
    Messages,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Normal,
    ToolCall,
    ErrorEvent,
    LlamaError,
    Garbage,
    Stall,
    Die,
    Status,
    SlowHead,
    Bench,
}

const FINISH_REASONS: [&str; 6] = [
    "stop",
    "length",
    "tool_calls",
    "abort",
    "error",
    "content_filter",
];

#[derive(Debug)]
struct Script {
    kind: Kind,
    name: String,
    tokens: usize,
    pace: Duration,
    first: Duration,
    per_chunk: usize,
    finish: Option<String>,
    neginf_at: Vec<usize>,
    low_at: Vec<usize>,
    words: Option<Vec<String>>,
    framing: Option<Framing>,
    fn_name: String,
    args_chunks: usize,
    calls: usize,
    /// The first call's arguments (`args=`), else `TOOL_ARGS`.
    args: Option<String>,
    /// Answer as `normal` when the request does not offer the tool.
    needs_tool: bool,
    /// Every arguments delta repeats `id`, `type` and `name` (llama.cpp's shape).
    name_every: bool,
    /// `tool_call die`: the upstream dies a moment after the calls went out (a turn that
    /// fails after its calls were dispatched).
    die_after_tools: bool,
    code: u16,
    msg: Option<String>,
    error_object: bool,
    after: usize,
    hold: Duration,
    rst: bool,
    retry_after: Option<u64>,
    /// `status`: answer with no body.
    empty: bool,
    head: Duration,
    /// Like a backend without logprob support: never send them, whatever was asked.
    no_logprobs: bool,
    /// Logprob entries name their token `token_id:<index>` instead of its text.
    token_ids: bool,
    /// Content chunks go out at multiples of `pace` on CLOCK_MONOTONIC.
    align: bool,
    /// A request on a kept-alive connection (not its first) is left unanswered.
    drop_reused: bool,
    /// The first this many of the `tokens` are the model's reasoning (chat
    /// `delta.reasoning_content`, batch `message.reasoning_content`).
    reasoning: usize,
    /// Tokens a continuation request gets (`resume=N`).
    resume: usize,
    /// Messages: an `event: ping` right after `message_start`, as Anthropic's API sends one.
    ping: bool,
    /// The `model` the answer reports (`model=`), else the request's: a backend that answers
    /// with another name (a dated snapshot, its GGUF path, a served name) or another model.
    model: Option<String>,
    /// Responses `error_event`: `response.failed` instead of an `error` event.
    failed: bool,
}

/// The directive's `key=value` pairs; keys are removed as they are read so that whatever is
/// left over is an unknown key for that script.
#[derive(Debug)]
struct Keys(BTreeMap<String, String>);

impl Keys {
    fn take<T: FromStr>(&mut self, key: &str) -> Result<Option<T>, String> {
        match self.0.remove(key) {
            None => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|_| format!("bad value {v:?} for {key}")),
        }
    }

    fn num(&mut self, key: &str, default: u64) -> Result<u64, String> {
        Ok(self.take(key)?.unwrap_or(default))
    }

    fn count(&mut self, key: &str, default: usize) -> Result<usize, String> {
        Ok(self.take(key)?.unwrap_or(default))
    }

    fn ms(&mut self, key: &str, default: u64) -> Result<Duration, String> {
        Ok(Duration::from_millis(self.num(key, default)?))
    }

    fn indices(&mut self, key: &str) -> Result<Vec<usize>, String> {
        match self.0.remove(key) {
            None => Ok(Vec::new()),
            Some(v) => v
                .split(',')
                .map(|i| {
                    i.trim()
                        .parse()
                        .map_err(|_| format!("bad index {i:?} in {key}"))
                })
                .collect(),
        }
    }

    fn flag(&mut self, key: &str) -> Result<bool, String> {
        match self.0.remove(key).as_deref() {
            None | Some("0" | "false") => Ok(false),
            Some("1" | "true") => Ok(true),
            Some(v) => Err(format!("bad value {v:?} for {key} (0 or 1)")),
        }
    }
}

/// `[[script:NAME k=v k="v w" ...]]`, the last one in `text`; none means `normal`.
fn parse_directive(text: &str) -> Result<(String, Keys), String> {
    const OPEN: &str = "[[script:";
    let Some(start) = text.rfind(OPEN) else {
        return Ok(("normal".to_owned(), Keys(BTreeMap::new())));
    };
    let rest = &text[start + OPEN.len()..];
    let end = rest.find("]]").ok_or("directive without a closing ]]")?;
    let mut chars = rest[..end].trim().chars().peekable();
    let name: String = chars.by_ref().take_while(|c| !c.is_whitespace()).collect();
    let mut keys = BTreeMap::new();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(format!("bad directive: expected key=value near {key:?}"));
        }
        let value: String = if chars.next_if_eq(&'"').is_some() {
            let v: String = chars.by_ref().take_while(|c| *c != '"').collect();
            v
        } else {
            chars.by_ref().take_while(|c| !c.is_whitespace()).collect()
        };
        keys.insert(key, value);
    }
    Ok((name, Keys(keys)))
}

impl Kind {
    /// The script named `name`.
    fn from_name(name: &str) -> Result<Self, String> {
        Ok(match name {
            "normal" => Kind::Normal,
            "tool_call" => Kind::ToolCall,
            "error_event" => Kind::ErrorEvent,
            "llama_error" => Kind::LlamaError,
            "garbage" => Kind::Garbage,
            "stall" => Kind::Stall,
            "die" => Kind::Die,
            "status" => Kind::Status,
            "slow_head" => Kind::SlowHead,
            "bench" => Kind::Bench,
            other => {
                return Err(format!(
                    "unknown script {other:?} (normal, tool_call, error_event, llama_error, \
                     garbage, stall, die, status, slow_head, bench)"
                ))
            }
        })
    }
}

impl Script {
    /// The keys only some kinds of script take.
    fn read_kind_keys(&mut self, k: &mut Keys) -> Result<(), String> {
        let kind = self.kind;
        let s = self;
        match kind {
            Kind::ToolCall => {
                if let Some(n) = k.take("name")? {
                    s.fn_name = n;
                }
                s.args_chunks = k.count("args_chunks", 3)?.max(1);
                s.calls = k.count("calls", 1)?;
                s.args = k.take::<String>("args")?.map(|a| a.replace('\'', "\""));
                s.needs_tool = k.flag("needs_tool")?;
                s.name_every = k.flag("name_every")?;
                s.die_after_tools = k.flag("die")?;
                if !(1..=2).contains(&s.calls) {
                    return Err("calls must be 1 or 2".into());
                }
            }
            Kind::ErrorEvent | Kind::LlamaError | Kind::Status => {
                let default = if kind == Kind::ErrorEvent { 400 } else { 500 };
                s.code = k.take("code")?.unwrap_or(default);
                if !(200..=599).contains(&s.code) {
                    return Err(format!("code {} outside 200..=599", s.code));
                }
                s.msg = k.take("msg")?;
                if kind == Kind::ErrorEvent {
                    s.error_object = k.flag("object")?;
                    s.failed = k.flag("failed")?;
                }
                if kind == Kind::Status {
                    s.retry_after = k.take("retry_after")?;
                    s.empty = k.flag("empty")?;
                }
            }
            Kind::Garbage => s.after = k.count("after", 4)?,
            Kind::Stall => s.hold = k.ms("hold_ms", 60_000)?,
            Kind::Die => s.rst = k.flag("rst")?,
            Kind::SlowHead => s.head = k.ms("head_ms", 2000)?,
            Kind::Normal | Kind::Bench => {}
        }
        Ok(())
    }

    fn new(name: &str, mut k: Keys) -> Result<Self, String> {
        let kind = Kind::from_name(name)?;
        let finish: Option<String> = k.take("finish")?;
        if let Some(f) = &finish {
            if !FINISH_REASONS.contains(&f.as_str()) {
                return Err(format!("bad finish {f:?} ({})", FINISH_REASONS.join(", ")));
            }
        }
        let framing = match k.0.remove("framing").as_deref() {
            None => None,
            Some("chunked") => Some(Framing::Chunked),
            Some("close") => Some(Framing::Close),
            Some(v) => return Err(format!("bad framing {v:?} (chunked or close)")),
        };
        let per_chunk = k.count("per_chunk", 1)?;
        if per_chunk == 0 {
            return Err("per_chunk must be at least 1".into());
        }
        let words =
            k.0.remove("words")
                .map(|w| w.split(',').map(str::to_owned).collect::<Vec<String>>());
        let mut s = Self {
            kind,
            name: name.to_owned(),
            tokens: k.count("tokens", 8)?,
            pace: k.ms("pace_ms", 0)?,
            first: k.ms("first_ms", 0)?,
            per_chunk,
            finish,
            no_logprobs: k.flag("no_logprobs")?,
            token_ids: k.flag("token_ids")?,
            align: k.flag("align")?,
            drop_reused: k.flag("drop_reused")?,
            reasoning: k.count("reasoning", 0)?,
            resume: k.count("resume", 6)?,
            ping: k.flag("ping")?,
            model: k.0.remove("model"),
            neginf_at: k.indices("neginf_at")?,
            low_at: k.indices("low_at")?,
            words,
            framing,
            fn_name: "get_weather".into(),
            args_chunks: 3,
            calls: 1,
            args: None,
            needs_tool: false,
            name_every: false,
            die_after_tools: false,
            code: 500,
            msg: None,
            error_object: false,
            after: 0,
            hold: Duration::ZERO,
            rst: false,
            retry_after: None,
            empty: false,
            head: Duration::ZERO,
            failed: false,
        };
        s.read_kind_keys(&mut k)?;
        if !k.0.is_empty() {
            let left: Vec<&str> = k.0.keys().map(String::as_str).collect();
            return Err(format!(
                "unknown key(s) for script {name}: {}",
                left.join(", ")
            ));
        }
        Ok(s)
    }

    /// A continuation request: `resume` tokens, the grounding's words when it has any,
    /// none of them unlikely.
    fn continue_with(&mut self, words: Vec<String>) {
        self.tokens = self.resume;
        self.low_at.clear();
        self.neginf_at.clear();
        if !words.is_empty() {
            self.words = Some(words);
        }
    }

    fn class(&self, index: usize) -> TokClass {
        if self.neginf_at.contains(&index) {
            TokClass::NegInf
        } else if self.low_at.contains(&index) {
            TokClass::Low
        } else {
            TokClass::Normal
        }
    }

    /// Appends token `index`'s text.
    fn push_token(&self, index: usize, out: &mut String) {
        if self.kind == Kind::Bench {
            // Read as late as possible: the chunk is built and written right after this.
            let _ = write!(out, " t{}", monotonic_ns());
        } else if let Some(w) = &self.words {
            out.push_str(&w[index % w.len()]);
        } else if index == 0 {
            out.push_str("The");
        } else {
            out.push_str(WORDS[index % WORDS.len()]);
        }
    }

    /// What token `index` (text `text`) is called in its logprob entry.
    fn token_name<'a>(&self, index: usize, text: &'a str) -> std::borrow::Cow<'a, str> {
        if self.token_ids {
            format!("token_id:{index}").into()
        } else {
            text.into()
        }
    }

    /// The `count` top alternatives of token `index` (text `text`), most likely first, with
    /// their logprobs. A normally likely token is its own first alternative; an unlikely one
    /// (`low_at`, `neginf_at`) is not among them, as when a sampler picks from the tail.
    fn alternatives<'a>(
        &self,
        index: usize,
        text: &'a str,
        count: usize,
    ) -> impl Iterator<Item = (&'a str, f64)> + 'a {
        let lead = (self.class(index) == TokClass::Normal).then_some(text);
        let others = WORDS
            .iter()
            .cycle()
            .skip((index * 7 + 1) % WORDS.len())
            .take(WORDS.len())
            .map(|w| -> &'a str { w })
            .filter(move |w| *w != text);
        lead.into_iter()
            .chain(others)
            .take(count)
            .enumerate()
            .map(|(rank, w)| (w, rank_logprob(rank)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokClass {
    Normal,
    Low,
    NegInf,
}

impl TokClass {
    fn logprob(self) -> f64 {
        match self {
            Self::Normal => 0.9_f64.ln(),
            Self::Low => 0.001_f64.ln(),
            // vLLM's stand-in for -inf, which JSON cannot carry.
            Self::NegInf => -9999.0,
        }
    }
}

/// ln 0.9 for the first alternative, then ln 0.05, ln 0.025, ... (the sum stays below 1).
fn rank_logprob(rank: usize) -> f64 {
    if rank == 0 {
        return 0.9_f64.ln();
    }
    let mut p = 0.05_f64;
    for _ in 1..rank {
        p /= 2.0;
    }
    p.ln()
}

/// Default token texts (after the first token, `The`), and the made-up alternatives.
const WORDS: [&str; 48] = [
    " the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog", " and", " then", " it",
    " runs", " to", " a", " small", " house", " near", " river", " where", " people", " live",
    " with", " their", " friends", " in", " quiet", " time", " of", " year", " when", " weather",
    " is", " warm", " bright", " day", " light", " water", " tree", " city", " road", " world",
    " good", " new", " first", " last", " long", " great", " little",
];

/// Answers a request with one whole body, closes, and logs how it ended.
async fn answer_whole(
    server: &Server,
    mut stream: TcpStream,
    entry: Value,
    t0: Instant,
    code: u16,
    body: &str,
) {
    let ok = write_simple(&mut stream, code, body, &[]).await.is_ok();
    let _ = stream.shutdown().await;
    let outcome = match (ok, code) {
        (false, _) => Outcome::Cancelled,
        (true, 200) => Outcome::Completed,
        (true, _) => Outcome::Status,
    };
    finish_log(server, entry, 0, outcome, t0, None);
}

/// The answer of a route that answers whole, without a script: `GET /v1/models`, `POST
/// /v1/embeddings` and the webhooks; `None` for any other.
fn whole_answer(
    server: &Server,
    route: (&str, &str),
    body: Option<&Value>,
) -> Option<(u16, String)> {
    match route {
        ("GET", "/v1/models") => Some((200, MODELS.to_owned())),
        ("POST", "/v1/embeddings") => Some(embeddings(body)),
        ("POST", hook) if hook.starts_with("/hooks/") => Some(webhook(server, hook)),
        _ => None,
    }
}

/// The answer to a webhook, `POST /hooks/<name>`: `/hooks/fail-N` answers 503 to its first
/// `N` requests, then 200, as an incident endpoint that is down for a while; any other name
/// answers 200.
fn webhook(server: &Server, path: &str) -> (u16, String) {
    let fails: u32 = path
        .strip_prefix("/hooks/fail-")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let mut hooks = server.hooks.lock().unwrap_or_else(PoisonError::into_inner);
    let seen = hooks.entry(path.to_owned()).or_insert(0);
    *seen += 1;
    if *seen <= fails {
        (
            503,
            error_json(503, &format!("down: request {seen} of {fails} refused")),
        )
    } else {
        (200, r#"{"accepted":true}"#.to_owned())
    }
}

/// The answer to `POST /v1/embeddings`: per input, its length in bytes, its first byte, its
/// last byte and its index, so that a test can tell inputs and their order apart.
fn embeddings(body: Option<&Value>) -> (u16, String) {
    let inputs: Vec<String> = match body.map(|b| &b["input"]) {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
            .collect(),
        _ => return (400, error_json(400, "'input' is required")),
    };
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let b = s.as_bytes();
            let v = [
                b.len() as f64,
                f64::from(b.first().copied().unwrap_or(0)),
                f64::from(b.last().copied().unwrap_or(0)),
                i as f64,
            ];
            json!({"object": "embedding", "index": i, "embedding": v})
        })
        .collect();
    let model = body.and_then(|b| b["model"].as_str()).unwrap_or("scripted");
    let answer = json!({"object": "list", "data": data, "model": model,
                        "usage": {"prompt_tokens": inputs.len(), "total_tokens": inputs.len()}});
    (200, answer.to_string())
}

const MODELS: &str = r#"{"object":"list","data":[{"id":"scripted","object":"model","created":0,"owned_by":"scripted-upstream"}]}"#;

const TOOL_ARGS: [&str; 2] = [
    r#"{"location": "Paris, France", "unit": "celsius"}"#,
    r#"{"location": "Tokyo, Japan", "unit": "celsius"}"#,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lp {
    None,
    /// Chat `logprobs: true` with `top_logprobs` alternatives.
    Chat {
        top: usize,
    },
    /// Completions `logprobs: K`.
    Completions {
        k: usize,
    },
    /// Responses `include: ["message.output_text.logprobs"]` with `top_logprobs` alternatives.
    Responses {
        top: usize,
    },
}

/// Everything about one request that the script run needs.
#[derive(Debug)]
struct Plan {
    endpoint: Endpoint,
    script: Script,
    stream: bool,
    framing: Framing,
    seq: u64,
    id: String,
    created: u64,
    model: String,
    n: usize,
    lp: Lp,
    include_usage: bool,
    prompt_tokens: usize,
}

impl Plan {
    fn new(
        endpoint: Endpoint,
        body: Option<&Value>,
        seq: u64,
        framing: Framing,
    ) -> Result<Self, String> {
        let body = body
            .and_then(Value::as_object)
            .ok_or("request body is not a JSON object")?;
        let continued = continuation(endpoint, body)?;
        let text = match continued {
            Some(_) => last_user_text(body),
            None => request_text(endpoint, body),
        };
        let (name, keys) = parse_directive(&text)?;
        let mut script = Script::new(&name, keys)?;
        if continued.is_some() {
            script.continue_with(grounding_words(body));
        }
        if script.kind == Kind::ToolCall && endpoint == Endpoint::Completions {
            return Err("tool_call needs /v1/chat/completions".into());
        }
        if matches!(script.kind, Kind::LlamaError)
            && matches!(endpoint, Endpoint::Responses | Endpoint::Messages)
        {
            return Err("llama_error needs /v1/chat/completions or /v1/completions".into());
        }
        if script.kind == Kind::ToolCall && script.needs_tool && !offers(body, &script.fn_name) {
            script.kind = Kind::Normal;
        }
        if script.reasoning > 0 && endpoint == Endpoint::Completions {
            return Err("reasoning needs /v1/chat/completions".into());
        }
        let lp = match endpoint {
            _ if script.no_logprobs => Lp::None,
            Endpoint::Chat if body.get("logprobs") == Some(&Value::Bool(true)) => Lp::Chat {
                top: count_field(body, "top_logprobs"),
            },
            Endpoint::Completions if body.get("logprobs").is_some_and(Value::is_u64) => {
                Lp::Completions {
                    k: count_field(body, "logprobs"),
                }
            }
            Endpoint::Responses if responses::wants_logprobs(body) => Lp::Responses {
                top: count_field(body, "top_logprobs"),
            },
            _ => Lp::None,
        };
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Self {
            endpoint,
            stream: body.get("stream") == Some(&Value::Bool(true)),
            framing: script.framing.unwrap_or(framing),
            seq,
            id: match endpoint {
                // vLLM's Messages answer is its chat completion's, id included.
                Endpoint::Chat | Endpoint::Messages => format!("chatcmpl-{seq}"),
                Endpoint::Completions => format!("cmpl-{seq}"),
                Endpoint::Responses => format!("resp_{seq}"),
            },
            created,
            model: match &script.model {
                Some(m) => m.clone(),
                None => body
                    .get("model")
                    .and_then(Value::as_str)
                    .unwrap_or("scripted")
                    .to_owned(),
            },
            n: count_field(body, "n").clamp(1, 64),
            lp,
            include_usage: body
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                == Some(&Value::Bool(true)),
            prompt_tokens: text.split_whitespace().count().max(1),
            script,
        })
    }

    fn object(&self) -> &'static str {
        match (self.endpoint, self.stream) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Responses, _) => "response",
            (Endpoint::Messages, _) => "message",
        }
    }

    fn finish_reason(&self) -> &str {
        match (&self.script.finish, self.script.kind) {
            (Some(f), _) => f,
            (None, Kind::ToolCall) => "tool_calls",
            (None, _) => "stop",
        }
    }

    fn usage(&self, completion_tokens: usize) -> Value {
        let completion = completion_tokens * self.n;
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
               "total_tokens": self.prompt_tokens + completion})
    }

    /// An error answer's body in this surface's schema.
    fn error_body(&self, code: u16) -> String {
        let msg = self.error_message();
        match self.endpoint {
            Endpoint::Messages => messages::error_json(code, &msg),
            _ => error_json(code, &msg),
        }
    }

    fn error_message(&self) -> String {
        self.script.msg.clone().unwrap_or_else(|| {
            format!(
                "scripted {} after {} tokens",
                self.script.name, self.script.tokens
            )
        })
    }
}

fn count_field(body: &Map<String, Value>, key: &str) -> usize {
    body.get(key)
        .and_then(Value::as_u64)
        .and_then(|v| usize::try_from(v).ok())
        .unwrap_or(0)
}

/// Whether a chat request continues its last, assistant message, and in which shape: vLLM's
/// (`continue_final_message: true` with `add_generation_prompt: false`) or llama.cpp's
/// (a last assistant message, its prefill, without either flag). A mix is refused, as vLLM
/// refuses `continue_final_message` with `add_generation_prompt`.
fn continuation(
    endpoint: Endpoint,
    body: &Map<String, Value>,
) -> Result<Option<&'static str>, String> {
    let last_role = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str);
    if endpoint != Endpoint::Chat || last_role != Some("assistant") {
        return Ok(None);
    }
    let cont = body.get("continue_final_message");
    let gen = body.get("add_generation_prompt");
    match (cont, gen) {
        (Some(Value::Bool(true)), Some(Value::Bool(false))) => Ok(Some("vllm")),
        (None, None) => Ok(Some("llama_cpp")),
        _ => Err("continue_final_message needs add_generation_prompt: false (vLLM), or neither for a prefill (llama.cpp)".into()),
    }
}

/// The last user message's text (a continuation's directive is there).
fn last_user_text(body: &Map<String, Value>) -> String {
    body.get("messages")
        .and_then(Value::as_array)
        .and_then(|m| {
            m.iter()
                .rev()
                .find(|m| m.get("role") == Some(&json!("user")))
        })
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// The words of the evidence in a continuation's `[grounding]` segment (system messages,
/// lines `[claim, evidence, confidence, source]`), each with a leading space: the tokens the
/// continuation says, so a test can see the grounding reached the model.
fn grounding_words(body: &Map<String, Value>) -> Vec<String> {
    let mut words = Vec::new();
    let systems = body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|m| m.get("role") == Some(&json!("system")))
        .filter_map(|m| m.get("content").and_then(Value::as_str));
    for text in systems {
        let Some(seg) = text.split("[grounding]\n").nth(1) else {
            continue;
        };
        for line in seg.lines().take_while(|l| *l != "[/grounding]") {
            if let Ok(Value::Array(t)) = serde_json::from_str::<Value>(line) {
                let evidence = t.get(1).and_then(Value::as_str).unwrap_or_default();
                words.extend(evidence.split_whitespace().map(|w| format!(" {w}")));
            }
        }
    }
    words
}

/// The text a directive is looked for in.
fn request_text(endpoint: Endpoint, body: &Map<String, Value>) -> String {
    fn joined<'a>(parts: impl Iterator<Item = &'a str>) -> String {
        parts.collect::<Vec<_>>().join("\n")
    }
    match endpoint {
        // A trailing system message without a directive (a proxy's note, like haltd's
        // TokenCircuit note) is skipped: the directive is the conversation's.
        Endpoint::Chat => match body
            .get("messages")
            .and_then(Value::as_array)
            .and_then(|m| {
                let note = |m: &&Value| {
                    m.get("role") == Some(&json!("system")) && !m.to_string().contains("[[script:")
                };
                m.iter().rev().find(|m| !note(m)).or(m.last())
            })
            .and_then(|m| m.get("content"))
        {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => joined(
                parts
                    .iter()
                    .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                    .filter_map(|p| p.get("text").and_then(Value::as_str)),
            ),
            _ => String::new(),
        },
        Endpoint::Completions => match body.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(a)) => joined(a.iter().filter_map(Value::as_str)),
            _ => String::new(),
        },
        Endpoint::Responses => responses::request_text(body),
        Endpoint::Messages => messages::request_text(body),
    }
}

// ---------------------------------------------------------------------------------------------
// Chunk writing. Chunks are written by hand into reused buffers: the bench streams tens of
// thousands of them a second through two worker threads, and building `serde_json::Value`s for
// each would make this server, not the proxy, the bottleneck.

/// Appends `v` as a JSON string.
fn esc(s: &mut String, v: &str) {
    s.push('"');
    for c in v.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            '\r' => s.push_str("\\r"),
            '\t' => s.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(s, "\\u{:04x}", u32::from(c));
            }
            c => s.push(c),
        }
    }
    s.push('"');
}

// Writing into a `String` cannot fail, so the `fmt::Result`s below are dropped.

fn num(s: &mut String, v: impl std::fmt::Display) {
    let _ = write!(s, "{v}");
}

/// `{:?}` keeps a decimal point (`-9999.0`), as Python's json does for floats.
fn float(s: &mut String, v: f64) {
    let _ = write!(s, "{v:?}");
}

fn utf8_bytes(s: &mut String, text: &str) {
    s.push('[');
    for (i, b) in text.bytes().enumerate() {
        if i > 0 {
            s.push(',');
        }
        num(s, b);
    }
    s.push(']');
}

#[derive(Debug, Clone, Copy)]
struct Tok {
    start: usize,
    end: usize,
    index: usize,
}

/// Tokens `range` of the script: their texts one after the other in `texts`, where each is in
/// `toks`.
fn load_tokens(s: &Script, range: Range<usize>, texts: &mut String, toks: &mut Vec<Tok>) {
    texts.clear();
    toks.clear();
    for index in range {
        let start = texts.len();
        s.push_token(index, texts);
        toks.push(Tok {
            start,
            end: texts.len(),
            index,
        });
    }
}

/// The list of chat's (and Responses') logprob entries for `toks` (texts in `texts`), each with
/// its `top` alternatives.
fn write_entries(s: &mut String, p: &Plan, texts: &str, toks: &[Tok], top: usize) {
    s.push('[');
    for (k, t) in toks.iter().enumerate() {
        if k > 0 {
            s.push(',');
        }
        let text = &texts[t.start..t.end];
        let named = p.script.token_name(t.index, text);
        s.push_str(r#"{"token":"#);
        esc(s, &named);
        s.push_str(r#","logprob":"#);
        float(s, p.script.class(t.index).logprob());
        s.push_str(r#","bytes":"#);
        utf8_bytes(s, &named);
        s.push_str(r#","top_logprobs":["#);
        for (j, (alt, lp)) in p.script.alternatives(t.index, text, top).enumerate() {
            if j > 0 {
                s.push(',');
            }
            s.push_str(r#"{"token":"#);
            esc(s, alt);
            s.push_str(r#","logprob":"#);
            float(s, lp);
            s.push_str(r#","bytes":"#);
            utf8_bytes(s, alt);
            s.push('}');
        }
        s.push_str("]}");
    }
    s.push(']');
}

/// The `logprobs` value for `toks` (texts in `texts`); `offset` is the completions
/// `text_offset` of the first of them.
fn write_logprobs(s: &mut String, p: &Plan, texts: &str, toks: &[Tok], offset: usize) {
    match p.lp {
        Lp::None => s.push_str("null"),
        Lp::Chat { top } => {
            s.push_str(r#"{"content":"#);
            write_entries(s, p, texts, toks, top);
            s.push('}');
        }
        Lp::Responses { top } => write_entries(s, p, texts, toks, top),
        Lp::Completions { k } => {
            let list = |s: &mut String, f: &mut dyn FnMut(&mut String, &Tok, &str)| {
                s.push('[');
                for (j, t) in toks.iter().enumerate() {
                    if j > 0 {
                        s.push(',');
                    }
                    f(s, t, &texts[t.start..t.end]);
                }
                s.push(']');
            };
            s.push_str(r#"{"tokens":"#);
            list(s, &mut |s, t, text| {
                esc(s, &p.script.token_name(t.index, text))
            });
            s.push_str(r#","token_logprobs":"#);
            list(s, &mut |s, t, _| {
                float(s, p.script.class(t.index).logprob())
            });
            s.push_str(r#","top_logprobs":"#);
            // vLLM always reports at least the top-1 entry.
            list(s, &mut |s, t, text| {
                s.push('{');
                for (j, (alt, lp)) in p.script.alternatives(t.index, text, k.max(1)).enumerate() {
                    if j > 0 {
                        s.push(',');
                    }
                    esc(s, alt);
                    s.push(':');
                    float(s, lp);
                }
                s.push('}');
            });
            s.push_str(r#","text_offset":"#);
            let mut at = offset;
            list(s, &mut |s, _, text| {
                num(s, at);
                at += text.chars().count();
            });
            s.push('}');
        }
    }
}

/// Builds one request's SSE events.
struct Gen<'p> {
    p: &'p Plan,
    /// `data: {"id":..,"object":..,"created":..,"model":..,"choices":[`
    prefix: String,
    sse: String,
    texts: String,
    toks: Vec<Tok>,
    role_sent: bool,
    /// Characters of text so far (completions `text_offset`).
    offset: usize,
    /// Logprob index of the next generated piece (content tokens, then tool-call deltas).
    next_index: usize,
}

impl<'p> Gen<'p> {
    fn new(p: &'p Plan) -> Self {
        let mut prefix = String::from(r#"data: {"id":"#);
        esc(&mut prefix, &p.id);
        prefix.push_str(r#","object":"#);
        esc(&mut prefix, p.object());
        prefix.push_str(r#","created":"#);
        num(&mut prefix, p.created);
        prefix.push_str(r#","model":"#);
        esc(&mut prefix, &p.model);
        prefix.push_str(r#","choices":["#);
        Self {
            p,
            prefix,
            sse: String::with_capacity(1024),
            texts: String::with_capacity(256),
            toks: Vec::with_capacity(16),
            role_sent: false,
            offset: 0,
            next_index: 0,
        }
    }

    fn load_tokens(&mut self, range: Range<usize>) {
        if !range.is_empty() {
            self.next_index = range.end;
        }
        load_tokens(&self.p.script, range, &mut self.texts, &mut self.toks);
    }

    fn load_piece(&mut self, text: &str) {
        self.texts.clear();
        self.texts.push_str(text);
        self.toks.clear();
        self.toks.push(Tok {
            start: 0,
            end: text.len(),
            index: self.next_index,
        });
        self.next_index += 1;
    }

    /// Whether the next delta carries `role` (the first one of each choice does).
    fn take_role(&mut self) -> bool {
        !std::mem::replace(&mut self.role_sent, true)
    }

    fn begin(&mut self, idx: usize) {
        self.sse.clear();
        self.sse.push_str(&self.prefix);
        self.sse.push_str(r#"{"index":"#);
        num(&mut self.sse, idx);
        self.sse.push(',');
    }

    fn delta_open(&mut self, role: bool) {
        self.sse.push_str(r#""delta":{"#);
        if role {
            self.sse.push_str(r#""role":"assistant""#);
        }
    }

    fn end(&mut self, finish: Option<&str>) {
        self.sse.push_str(r#","finish_reason":"#);
        match finish {
            Some(f) => esc(&mut self.sse, f),
            None => self.sse.push_str("null"),
        }
        self.sse.push_str("}]}\n\n");
    }

    fn logprobs(&mut self) {
        self.sse.push_str(r#","logprobs":"#);
        write_logprobs(&mut self.sse, self.p, &self.texts, &self.toks, self.offset);
    }

    /// A chunk carrying the loaded tokens for choice `idx` (chat: as `reasoning_content`
    /// when `reasoning`).
    fn content(&mut self, idx: usize, role: bool, reasoning: bool) {
        self.begin(idx);
        match self.p.endpoint {
            Endpoint::Chat => {
                self.delta_open(role);
                if role {
                    self.sse.push(',');
                }
                self.sse.push_str(if reasoning {
                    r#""reasoning_content":"#
                } else {
                    r#""content":"#
                });
                esc(&mut self.sse, &self.texts);
                self.sse.push('}');
            }
            // Completions: `Gen` writes only chat's and completions' chunks.
            _ => {
                self.sse.push_str(r#""text":"#);
                esc(&mut self.sse, &self.texts);
            }
        }
        self.logprobs();
        self.end(None);
    }

    /// A tool-call delta: the header (`id`, `type`, `name`, empty arguments) when `header`,
    /// else an arguments piece (with the header's fields again under `name_every`); the loaded piece is what the logprobs describe.
    fn tool(&mut self, idx: usize, role: bool, call: usize, header: bool, args: &str) {
        self.begin(idx);
        self.delta_open(role);
        if role {
            self.sse.push(',');
        }
        self.sse.push_str(r#""tool_calls":[{"index":"#);
        num(&mut self.sse, call);
        if header || self.p.script.name_every {
            let _ = write!(self.sse, r#","id":"call_{}_{call}","#, self.p.seq);
            self.sse
                .push_str(r#""type":"function","function":{"name":"#);
            esc(&mut self.sse, &self.p.script.fn_name);
            self.sse.push_str(r#","arguments":"#);
            esc(&mut self.sse, args);
        } else {
            self.sse.push_str(r#","function":{"arguments":"#);
            esc(&mut self.sse, args);
        }
        self.sse.push_str("}}]}");
        self.logprobs();
        self.end(None);
    }

    fn final_chunk(&mut self, idx: usize, role: bool) {
        self.begin(idx);
        match self.p.endpoint {
            Endpoint::Chat => {
                self.delta_open(role);
                self.sse.push('}');
            }
            _ => self.sse.push_str(r#""text":"""#),
        }
        self.sse.push_str(r#","logprobs":null"#);
        self.end(Some(self.p.finish_reason()));
    }

    fn usage(&mut self, completion_tokens: usize) {
        self.sse.clear();
        self.sse.push_str(&self.prefix);
        self.sse.push_str(r#"],"usage":"#);
        self.sse
            .push_str(&self.p.usage(completion_tokens).to_string());
        self.sse.push_str("}\n\n");
    }

    /// vLLM's mid-stream error event; `object=1` gives the older `ErrorResponse` shape.
    fn error_event(&mut self) {
        let s = &self.p.script;
        let kind = if s.code < 500 {
            "BadRequestError"
        } else {
            "InternalServerError"
        };
        self.sse.clear();
        self.sse.push_str(r#"data: {"error":{"#);
        if s.error_object {
            self.sse.push_str(r#""object":"error","#);
        }
        self.sse.push_str(r#""message":"#);
        esc(&mut self.sse, &self.p.error_message());
        self.sse.push_str(r#","type":"#);
        esc(&mut self.sse, kind);
        if s.error_object {
            self.sse.push_str(r#","param":null"#);
        }
        self.sse.push_str(r#","code":"#);
        num(&mut self.sse, s.code);
        self.sse.push_str("}}\n\n");
    }

    /// llama.cpp's old non-standard `error:` field (not `data:`), which SSE parsers ignore.
    fn llama_error(&mut self) {
        let s = &self.p.script;
        let kind = if s.code < 500 {
            "invalid_request_error"
        } else {
            "server_error"
        };
        self.sse.clear();
        self.sse.push_str(r#"error: {"code":"#);
        num(&mut self.sse, s.code);
        self.sse.push_str(r#","message":"#);
        esc(&mut self.sse, &self.p.error_message());
        self.sse.push_str(r#","type":"#);
        esc(&mut self.sse, kind);
        self.sse.push_str("}\n\n");
    }
}

async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// Until the next multiple of `pace` on CLOCK_MONOTONIC (`align=1`): every stream that waits
/// for the same multiple wakes on the same timer tick.
async fn pause_aligned(pace: Duration) {
    let pace_ns = u64::try_from(pace.as_nanos()).unwrap_or(u64::MAX);
    if pace_ns == 0 {
        return;
    }
    let now = monotonic_ns();
    let next = (now / pace_ns).saturating_add(1).saturating_mul(pace_ns);
    tokio::time::sleep(Duration::from_nanos(next - now)).await;
}

/// `args` cut into `n` pieces of about equal length (on char boundaries).
fn split_args(args: &str, n: usize) -> Vec<&str> {
    let bounds: Vec<usize> = args.char_indices().map(|(i, _)| i).collect();
    let chars = bounds.len();
    let n = n.clamp(1, chars.max(1));
    (0..n)
        .map(|j| {
            let a = bounds.get(j * chars / n).copied().unwrap_or(args.len());
            let b = bounds
                .get((j + 1) * chars / n)
                .copied()
                .unwrap_or(args.len());
            &args[a..b]
        })
        .collect()
}

async fn run(p: &Plan, out: &mut Out<'_>, prog: &Progress) -> io::Result<Outcome> {
    let s = &p.script;
    if s.kind == Kind::Status {
        let extra: Vec<(&str, String)> = s
            .retry_after
            .map(|r| ("retry-after", r.to_string()))
            .into_iter()
            .collect();
        let body = if s.empty {
            String::new()
        } else {
            p.error_body(s.code)
        };
        write_simple(&mut out.w, s.code, &body, &extra).await?;
        return Ok(Outcome::Status);
    }
    pause(s.head).await;
    match (p.stream, p.endpoint) {
        (true, Endpoint::Responses) => {
            native::run_stream(p, out, prog, &mut responses::Stream::new(p)).await
        }
        (true, Endpoint::Messages) => {
            native::run_stream(p, out, prog, &mut messages::Stream::new(p)).await
        }
        (true, _) => run_stream(p, out, prog).await,
        (false, _) => run_batch(p, out, prog).await,
    }
}

/// Content tokens `range`, `per_chunk` to a chunk, each chunk after `pace`.
async fn emit_content(
    g: &mut Gen<'_>,
    out: &mut Out<'_>,
    prog: &Progress,
    range: Range<usize>,
) -> io::Result<()> {
    let s = &g.p.script;
    let mut i = range.start;
    while i < range.end {
        let mut end = (i + s.per_chunk).min(range.end);
        if i < s.reasoning {
            // A chunk is all reasoning or all answer.
            end = end.min(s.reasoning);
        }
        if s.align {
            pause_aligned(s.pace).await;
        } else {
            pause(s.pace).await;
        }
        g.load_tokens(i..end);
        let role = g.take_role();
        for idx in 0..g.p.n {
            g.content(idx, role, i < s.reasoning);
            out.part(g.sse.as_bytes()).await?;
        }
        g.offset += g.texts.chars().count();
        prog.tokens.fetch_add(end - i, Ordering::Relaxed);
        i = end;
    }
    Ok(())
}

/// Whether a request's `tools` offer a function named `name` (chat's
/// `{function: {name}}`, Responses' and Messages' flat `{name}`).
fn offers(body: &Map<String, Value>, name: &str) -> bool {
    body.get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| {
            t.iter()
                .any(|t| t["function"]["name"] == name || t["name"] == name)
        })
}

/// The calls' arguments: `args=` for the first if given, else `TOOL_ARGS`.
fn call_args(s: &Script) -> impl Iterator<Item = (usize, &str)> {
    (0..s.calls).map(move |call| match (&s.args, call) {
        (Some(a), 0) => (call, a.as_str()),
        _ => (call, TOOL_ARGS[call]),
    })
}

async fn emit_tools(g: &mut Gen<'_>, out: &mut Out<'_>, prog: &Progress) -> io::Result<()> {
    let s = &g.p.script;
    for (call, args) in call_args(s) {
        pause(s.pace).await;
        g.load_piece(&s.fn_name);
        let role = g.take_role();
        for idx in 0..g.p.n {
            g.tool(idx, role, call, true, "");
            out.part(g.sse.as_bytes()).await?;
        }
        prog.tokens.fetch_add(1, Ordering::Relaxed);
        for piece in split_args(args, s.args_chunks) {
            pause(s.pace).await;
            g.load_piece(piece);
            for idx in 0..g.p.n {
                g.tool(idx, false, call, false, piece);
                out.part(g.sse.as_bytes()).await?;
            }
            prog.tokens.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// Final chunk(s), the usage chunk if asked for, `[DONE]`, the end of the body.
async fn finish(g: &mut Gen<'_>, out: &mut Out<'_>, prog: &Progress) -> io::Result<Outcome> {
    let role = g.take_role();
    for idx in 0..g.p.n {
        g.final_chunk(idx, role);
        out.part(g.sse.as_bytes()).await?;
    }
    if g.p.include_usage {
        g.usage(prog.tokens.load(Ordering::Relaxed));
        out.part(g.sse.as_bytes()).await?;
    }
    out.part(b"data: [DONE]\n\n").await?;
    prog.finished.store(true, Ordering::Relaxed);
    out.end().await?;
    Ok(Outcome::Completed)
}

async fn run_stream(p: &Plan, out: &mut Out<'_>, prog: &Progress) -> io::Result<Outcome> {
    let s = &p.script;
    out.stream_head().await?;
    let mut g = Gen::new(p);
    pause(s.first).await;
    emit_content(&mut g, out, prog, 0..s.tokens).await?;
    match s.kind {
        Kind::Normal | Kind::Bench | Kind::SlowHead | Kind::Status => {
            finish(&mut g, out, prog).await
        }
        Kind::ToolCall => {
            emit_tools(&mut g, out, prog).await?;
            if s.die_after_tools {
                // Long enough for haltd to judge the calls and send them on.
                pause(Duration::from_millis(300)).await;
                return Ok(Outcome::Died);
            }
            finish(&mut g, out, prog).await
        }
        Kind::ErrorEvent => {
            g.error_event();
            out.part(g.sse.as_bytes()).await?;
            out.part(b"data: [DONE]\n\n").await?;
            prog.finished.store(true, Ordering::Relaxed);
            out.end().await?;
            Ok(Outcome::Completed)
        }
        Kind::LlamaError => {
            g.llama_error();
            out.part(g.sse.as_bytes()).await?;
            prog.finished.store(true, Ordering::Relaxed);
            out.end().await?;
            Ok(Outcome::Completed)
        }
        Kind::Garbage => {
            out.part(b"data: {this is not json\n\n").await?;
            emit_content(&mut g, out, prog, s.tokens..s.tokens + s.after).await?;
            finish(&mut g, out, prog).await
        }
        Kind::Stall => {
            prog.stalling.store(true, Ordering::Relaxed);
            pause(s.hold).await;
            Ok(Outcome::Stalled)
        }
        Kind::Die => Ok(Outcome::Died),
    }
}

/// The same script, answered as one body once it has "generated" everything (pacing included).
async fn run_batch(p: &Plan, out: &mut Out<'_>, prog: &Progress) -> io::Result<Outcome> {
    let s = &p.script;
    pause(s.first).await;
    let mut i = 0;
    while i < s.tokens {
        let end = (i + s.per_chunk).min(s.tokens);
        pause(s.pace).await;
        prog.tokens.fetch_add(end - i, Ordering::Relaxed);
        i = end;
    }
    let mut tool_calls = Vec::new();
    if s.kind == Kind::ToolCall {
        for (call, args) in call_args(s) {
            for _ in 0..=s.args_chunks {
                pause(s.pace).await;
                prog.tokens.fetch_add(1, Ordering::Relaxed);
            }
            tool_calls.push(
                json!({"id": format!("call_{}_{call}", p.seq), "type": "function",
                "function": {"name": s.fn_name, "arguments": args}}),
            );
        }
    }
    let body = match s.kind {
        Kind::Stall => {
            prog.stalling.store(true, Ordering::Relaxed);
            pause(s.hold).await;
            return Ok(Outcome::Stalled);
        }
        Kind::Die => return Ok(Outcome::Died),
        Kind::ErrorEvent | Kind::LlamaError => {
            let body = p.error_body(s.code);
            write_simple(&mut out.w, s.code, &body, &[]).await?;
            return Ok(Outcome::Status);
        }
        Kind::Garbage => "{this is not json".to_owned(),
        _ => {
            let tokens = prog.tokens.load(Ordering::Relaxed);
            match p.endpoint {
                Endpoint::Responses => responses::batch_body(p, tokens),
                Endpoint::Messages => messages::batch_body(p, tokens),
                Endpoint::Chat | Endpoint::Completions => batch_body(p, tool_calls, tokens),
            }
        }
    };
    write_simple(&mut out.w, 200, &body, &[]).await?;
    prog.finished.store(true, Ordering::Relaxed);
    Ok(Outcome::Completed)
}

fn batch_body(p: &Plan, tool_calls: Vec<Value>, completion_tokens: usize) -> String {
    let s = &p.script;
    let mut g = Gen::new(p);
    g.load_tokens(0..s.tokens);
    let mut lp = String::new();
    write_logprobs(&mut lp, p, &g.texts, &g.toks, 0);
    // Written by the same code as the streamed chunks, so the shapes cannot drift apart.
    let logprobs: Value = serde_json::from_str(&lp).unwrap_or(Value::Null);
    let finish = p.finish_reason();
    // The first `reasoning` tokens are the reasoning, the rest the answer.
    let cut = g.toks.get(s.reasoning).map_or(g.texts.len(), |t| t.start);
    let (reasoning, answer) = g.texts.split_at(cut);
    let choices: Vec<Value> = (0..p.n)
        .map(|idx| match p.endpoint {
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant", "content": answer});
                if !reasoning.is_empty() {
                    message["reasoning_content"] = reasoning.into();
                }
                if !tool_calls.is_empty() {
                    message["tool_calls"] = Value::Array(tool_calls.clone());
                    if answer.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                json!({"index": idx, "message": message, "logprobs": logprobs,
                       "finish_reason": finish})
            }
            _ => json!({"index": idx, "text": g.texts,
                "logprobs": logprobs, "finish_reason": finish}),
        })
        .collect();
    json!({"id": p.id, "object": p.object(), "created": p.created, "model": p.model,
           "choices": choices, "usage": p.usage(completion_tokens)})
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives() {
        let (name, keys) = parse_directive(
            "hi [[script:x a=1]] then [[script:error_event code=503 msg=\"engine down\" object=1]]",
        )
        .expect("valid");
        assert_eq!(name, "error_event");
        let s = Script::new(&name, keys).expect("valid");
        assert_eq!(
            (s.code, s.msg.as_deref(), s.error_object),
            (503, Some("engine down"), true)
        );
        let (name, keys) = parse_directive("no directive").expect("valid");
        assert_eq!((name.as_str(), keys.0.len()), ("normal", 0));
        for bad in [
            "[[script:normal tokenz=3]]",
            "[[script:nope]]",
            "[[script:stall rst=1]]",
            "[[script:normal finish=done]]",
            "[[script:normal tokens=x]]",
        ] {
            let (name, keys) = parse_directive(bad).expect("parses");
            assert!(Script::new(&name, keys).is_err(), "{bad}");
        }
        assert!(parse_directive("[[script:normal tokens=3").is_err());
    }

    #[test]
    fn tool_arguments_reassemble() {
        for n in 1..60 {
            assert_eq!(split_args(TOOL_ARGS[0], n).concat(), TOOL_ARGS[0]);
        }
    }

    #[test]
    fn chunked_request_bodies() {
        let wire = b"4\r\n{\"a\"\r\n3;x=y\r\n:1}\r\n0\r\n\r\n";
        assert_eq!(
            decode_chunked(wire).expect("valid").as_deref(),
            Some(&b"{\"a\":1}"[..])
        );
        assert_eq!(
            decode_chunked(&wire[..wire.len() - 1]).expect("valid"),
            None
        );
    }

    #[test]
    fn continuations_in_both_shapes_speak_the_grounding() {
        let seg = "[grounding]\n[\"c\",\"river Nile\",1.0,\"doc\"]\n[/grounding]";
        let msgs = json!([{"role": "system", "content": seg},
            {"role": "user", "content": "[[script:normal tokens=20 low_at=3]]"},
            {"role": "assistant", "content": "The kept"}]);
        let vllm = json!({"messages": msgs, "continue_final_message": true,
            "add_generation_prompt": false, "stream": true});
        let llama = json!({"messages": msgs, "stream": true});
        for (body, shape) in [(&vllm, "vllm"), (&llama, "llama_cpp")] {
            let obj = body.as_object().expect("object");
            assert_eq!(continuation(Endpoint::Chat, obj), Ok(Some(shape)));
            let plan = Plan::new(Endpoint::Chat, Some(body), 1, Framing::Chunked).expect("plan");
            assert_eq!(plan.script.tokens, 6, "resume=6 by default");
            assert!(
                plan.script.low_at.is_empty(),
                "a continuation is not unlikely"
            );
            let mut text = String::new();
            for i in 0..3 {
                plan.script.push_token(i, &mut text);
            }
            assert_eq!(text, " river Nile river");
        }
        let mixed = json!({"messages": msgs, "continue_final_message": true});
        let obj = mixed.as_object().expect("object");
        assert!(continuation(Endpoint::Chat, obj).is_err());
        let plain = json!({"messages": [{"role": "user", "content": "hi"}]});
        let obj = plain.as_object().expect("object");
        assert_eq!(continuation(Endpoint::Chat, obj), Ok(None));
    }
}
