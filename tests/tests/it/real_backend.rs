//! Root-only conformance tests against a real inference server: llama.cpp's OpenAI-compatible
//! server (`python -m llama_cpp.server` from `llama-cpp-python`, the version `cargo xtask
//! setup` pins) serving a tiny random-weight model made from a seed
//! (`tests/llama/make_model.py`). The `proxy` and `detectors` tests run against the scripted
//! upstream, which can only show the mismatches its authors thought of; these run the same
//! paths against a server nobody here wrote, and keep their scripted twins for what a real
//! server cannot be made to do (a stall, garbage, an error event mid-stream).
//!
//! Covered: forwarding of both endpoints in stream and batch mode, `/v1/models` and the
//! official SDK; what the real server sends differently (byte-fragment tokens with empty text,
//! `bytes: null`, no usage chunk, a bad model name served anyway, its error shapes); upstream
//! failures it can be made to have (killed mid-stream, a prompt over its context window,
//! nobody listening); the operator trip within B; the HaltMonitor on real logprobs; the
//! exfiltration hold-back on real token boundaries; and cancellation seen from the server's
//! side: after a trip or a client that went away, it logs the disconnect and its CPU falls
//! idle.

use std::{
    io::{Read, Write},
    net::TcpStream,
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    in_netns,
    llama::{LlamaServer, LLAMA_MODEL_ALIAS, LLAMA_N_CTX},
    openai_sdk,
    rig::Rig,
    trip_here, EventKind, Haltd, StreamOutcome,
};
use serde_json::{json, Value};

/// haltd in front of llama.cpp's server.
type LlamaRig = Rig<LlamaServer>;

const SECRET: &str = "Bearer sk-haltd-test-SECRET-4711";

fn rig(haltd_extra: &[&str]) -> Result<LlamaRig> {
    Rig::start_llama(&[], haltd_extra)
}

/// A chat request for `max_tokens` tokens, sampled with `seed`.
fn chat(max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": LLAMA_MODEL_ALIAS,
        "stream": stream,
        "max_tokens": max_tokens,
        "seed": 7,
        "messages": [{"role": "user", "content": "Tell me about rivers."}],
    })
}

fn completion(max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": LLAMA_MODEL_ALIAS,
        "stream": stream,
        "max_tokens": max_tokens,
        "seed": 7,
        "prompt": "Rivers are",
    })
}

/// The token frames: chunks without a finish reason that carry text (the empty text of a
/// byte-fragment token included), as JSON.
fn frames(o: &StreamOutcome) -> Vec<Value> {
    o.events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter(|v| {
            let c = &v["choices"][0];
            c["finish_reason"].is_null()
                && (c["delta"]["content"].is_string() || c["text"].is_string())
        })
        .collect()
}

/// Whether `n` tokens answer a request for `max`: llama-cpp-python 0.3.36 does not stop at
/// `max_tokens` on a token that begins a multi-byte character, but generates the up to 3
/// tokens that complete it (`multibyte_fix` in `llama.py`), and streams each.
fn answers_max(n: usize, max: usize) -> bool {
    (max..=max + 3).contains(&n)
}

/// A frame's text.
fn frame_text(f: &Value) -> &str {
    let c = &f["choices"][0];
    c["delta"]["content"]
        .as_str()
        .or_else(|| c["text"].as_str())
        .unwrap_or("")
}

fn ended(o: &StreamOutcome, reason: &str) -> Result<()> {
    ensure!(o.status == 200, "status {} body {:?}", o.status, o.body);
    ensure!(
        o.finish_reason.as_deref() == Some(reason),
        "finish_reason {:?} (expected {reason}); events {:?}",
        o.finish_reason,
        o.events
    );
    ensure!(o.error.is_none(), "error {:?}", o.error);
    ensure!(o.done_at.is_some(), "no [DONE]");
    ensure!(o.malformed == 0 && o.events_after_done == 0);
    Ok(())
}

/// Chat streams: every token is a frame (byte fragments as empty ones), logprobs only when
/// asked, and a usage chunk although the server sends none.
fn chat_streams(rig: &LlamaRig) -> Result<()> {
    let o = rig.stream(
        "/v1/chat/completions",
        &chat(48, true),
        Some(SECRET),
        |_, _| {},
    )?;
    ended(&o, "length")?;
    let fs = frames(&o);
    ensure!(
        answers_max(fs.len(), 48),
        "48 tokens asked, {} frames: {:?}",
        fs.len(),
        o.events
    );
    for f in &fs {
        ensure!(
            f["choices"][0]["logprobs"].is_null(),
            "logprobs not asked: {f}"
        );
        ensure!(f["model"] == LLAMA_MODEL_ALIAS, "{f}");
    }
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(
        rec["turn_status"] == "committed" && rec["outcome"] == "completed",
        "{rec}"
    );
    ensure!(
        rec["upstream"]["status"] == 200 && rec["tokens_emitted"] == fs.len(),
        "{rec}"
    );

    // With logprobs and usage asked. The random model writes single bytes of multi-byte
    // characters: llama.cpp sends them as tokens with empty text, which haltd passes on as
    // empty frames with their logprobs (each a token under the budget).
    let mut b = chat(48, true);
    b["logprobs"] = json!(true);
    b["top_logprobs"] = json!(2);
    b["stream_options"] = json!({"include_usage": true});
    let o = rig.stream("/v1/chat/completions", &b, None, |_, _| {})?;
    ended(&o, "length")?;
    let fs = frames(&o);
    ensure!(answers_max(fs.len(), 48), "{} frames", fs.len());
    let mut empty = 0;
    for f in &fs {
        let entry = &f["choices"][0]["logprobs"]["content"][0];
        let lp = entry["logprob"]
            .as_f64()
            .with_context(|| format!("logprob: {f}"))?;
        ensure!((-9999.0..=0.0).contains(&lp), "{f}");
        ensure!(
            entry["token"] == frame_text(f),
            "the entry names the frame's text: {f}"
        );
        let alts = entry["top_logprobs"].as_array().map_or(99, Vec::len);
        ensure!((1..=2).contains(&alts), "two alternatives asked: {f}");
        empty += usize::from(frame_text(f).is_empty());
    }
    ensure!(
        empty > 0,
        "no byte-fragment token in 48 (seed 7): {:?}",
        o.text
    );
    let usage = o
        .events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .find(|v| v["usage"].is_object())
        .context("a usage chunk, as asked")?;
    ensure!(
        usage["usage"]["completion_tokens"] == fs.len(),
        "haltd's count (the server sends no usage): {usage}"
    );
    Ok(())
}

/// Batch answers and the completions endpoint.
fn batches_and_completions(rig: &LlamaRig) -> Result<()> {
    let (status, _, v) = rig.post("/v1/chat/completions", &chat(16, false), None)?;
    ensure!(status == 200, "{status} {v}");
    ensure!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    ensure!(v["choices"][0]["finish_reason"] == "length", "{v}");
    // haltd's count of what it was sent (the server sends no usage).
    let n = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    ensure!(answers_max(n as usize, 16), "{v}");

    let mut c = completion(12, true);
    c["logprobs"] = json!(1);
    let o = rig.stream("/v1/completions", &c, None, |_, _| {})?;
    ended(&o, "length")?;
    let fs = frames(&o);
    ensure!(
        answers_max(fs.len(), 12),
        "{} frames: {:?}",
        fs.len(),
        o.events
    );
    for f in &fs {
        let lps = &f["choices"][0]["logprobs"]["token_logprobs"];
        ensure!(lps.as_array().map(Vec::len) == Some(1), "{f}");
    }
    let (status, _, v) = rig.post("/v1/completions", &completion(8, false), None)?;
    ensure!(
        status == 200 && v["object"] == "text_completion",
        "{status} {v}"
    );
    ensure!(v["choices"][0]["finish_reason"] == "length", "{v}");
    Ok(())
}

/// Issue 29 point 1: a batch reply with a forced tool call equals llama.cpp's own batch answer
/// (names, arguments, finish reason; ids differ). The server streams the tool's whole name in
/// every delta; haltd's batch body, rebuilt from that stream, once named the call
/// `get_weatherget_weather…`.
fn batch_tool_calls_equal_its_own(rig: &LlamaRig) -> Result<()> {
    let mut b = chat(24, false);
    b["temperature"] = json!(0);
    b["messages"] = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    // The schema keeps the arguments ASCII. With a free string, the random model writes
    // characters whose UTF-8 bytes span tokens, and llama-cpp-python's own stream sends those
    // tokens as empty text (its batch answer has them): no proxy that streams can rebuild them.
    b["tools"] = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]},
                       "days": {"type": "integer"}}, "required": ["city", "days"]}}}]);
    b["tool_choice"] = json!({"type": "function", "function": {"name": "get_weather"}});
    let (status, _, through) = rig.post("/v1/chat/completions", &b, None)?;
    ensure!(status == 200, "{status} {through}");
    let (status, own) = rig.post_upstream("/v1/chat/completions", &b)?;
    ensure!(status == 200, "llama.cpp's own: {status} {own}");
    let own = crate::proxy::batch_tool_calls(&own);
    ensure!(
        own["tool_calls"][0][0] == "get_weather" && own["finish_reason"] == "tool_calls",
        "{own}"
    );
    let through = crate::proxy::batch_tool_calls(&through);
    ensure!(
        through == own,
        "haltd's batch {through} but llama.cpp's own {own}"
    );
    Ok(())
}

#[test]
fn llama_cpp_streams_batches_and_models_reach_clients_and_the_sdk() -> Result<()> {
    let rig = rig(&[])?;
    chat_streams(&rig)?;
    batches_and_completions(&rig)?;
    batch_tool_calls_equal_its_own(&rig)?;

    let url = rig.url("/v1/models");
    let models = in_netns(&rig.haltd.client_ns, move || {
        haltd_tests::get_json_here(&url)
    })?;
    ensure!(models["data"][0]["id"] == LLAMA_MODEL_ALIAS, "{models}");

    // The official SDK sees normal streams and answers.
    let base = format!("{}/v1", rig.haltd.api_url());
    let ns = rig.pair.cli.clone();
    let sdk = |args: &[&str]| -> Result<Value> {
        let mut all = vec!["--base-url", base.as_str(), "--model", LLAMA_MODEL_ALIAS];
        all.extend_from_slice(args);
        openai_sdk(&ns, &all)
    };
    let r = sdk(&["--max-tokens", "20", "--seed", "3"])?;
    ensure!(r["ok"] == true && r["finish_reason"] == "length", "{r}");
    let r = sdk(&["--no-stream", "--max-tokens", "10"])?;
    ensure!(r["ok"] == true && r["finish_reason"] == "length", "{r}");
    let r = sdk(&[
        "--endpoint",
        "completions",
        "--logprobs",
        "--max-tokens",
        "9",
    ])?;
    let n = r["logprobs_tokens"].as_u64().unwrap_or(0) as usize;
    ensure!(r["ok"] == true && answers_max(n, 9), "{r}");

    ensure!(
        !std::fs::read_to_string(&rig.haltd.ledger)?.contains("SECRET-4711"),
        "the ledger holds the API key"
    );
    Ok(())
}

/// Token frames so far of the stream in `p` reached `n`: [`haltd_tests::sse::Progress`]
/// counts non-empty ones only, so the caller counts frames itself.
fn is_frame(ev: &haltd_tests::SseEvent) -> bool {
    matches!(ev.kind, EventKind::Token(_))
        || serde_json::from_str::<Value>(&ev.data).is_ok_and(|v| {
            let c = &v["choices"][0];
            c["finish_reason"].is_null() && c["delta"]["content"] == ""
        })
}

/// What the server does with a bad model name and a prompt over its context window.
fn requests_the_server_refuses_or_not(rig: &LlamaRig) -> Result<()> {
    // llama.cpp's server serves its one model under any name: no error to pass on.
    let mut b = chat(6, true);
    b["model"] = json!("no-such-model");
    let o = rig.stream("/v1/chat/completions", &b, None, |_, _| {})?;
    ended(&o, "length")?;
    ensure!(answers_max(frames(&o).len(), 6), "{:?}", o.events);

    // A field of the wrong type: the server's validation fails as a 500 (OpenAI's error
    // shape, type `internal_server_error`), which haltd answers as 502 `http_status`.
    let mut bad = chat(4, true);
    bad["top_p"] = json!("hot");
    let (status, _, v) = rig.post("/v1/chat/completions", &bad, None)?;
    ensure!(status == 502, "{status} {v}");
    ensure!(v["error"]["code"] == "UPSTREAM_FAILURE", "{v}");
    ensure!(v["error"]["upstream"]["kind"] == "http_status", "{v}");
    ensure!(v["error"]["upstream"]["status"] == 500, "{v}");

    // A prompt over the context window: the server has already answered 200 with
    // `text/event-stream` when it finds out, and drops the connection.
    let mut big = chat(4, true);
    big["messages"][0]["content"] = json!("x ".repeat(LLAMA_N_CTX));
    let o = rig.stream("/v1/chat/completions", &big, None, |_, _| {})?;
    o.halted_cleanly("UPSTREAM_FAILURE")
        .with_context(|| format!("{:?}", o.events))?;
    let err = o.error.clone().unwrap_or_default();
    ensure!(err["upstream"]["kind"] == "early_eof", "{err}");
    ensure!(frames(&o).is_empty(), "{:?}", o.events);
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["upstream"]["failure"]["kind"] == "early_eof", "{rec}");
    big["stream"] = json!(false);
    let (status, _, v) = rig.post("/v1/chat/completions", &big, None)?;
    ensure!(status == 502, "{status} {v}");
    ensure!(v["error"]["code"] == "UPSTREAM_FAILURE", "{v}");
    ensure!(v["error"]["upstream"]["kind"] == "early_eof", "{v}");
    Ok(())
}

#[test]
fn llama_cpp_failures_end_typed_killed_mid_stream_included() -> Result<()> {
    let mut rig = rig(&[])?;
    requests_the_server_refuses_or_not(&rig)?;

    // The server dies mid-stream.
    let pid = rig.up.pid;
    let mut seen = 0;
    let o = rig.stream("/v1/chat/completions", &chat(3000, true), None, |_, ev| {
        if is_frame(ev) {
            seen += 1;
            if seen == 5 {
                // SAFETY: kill(2) on the server process this test started and still holds.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
    })?;
    o.halted_cleanly("UPSTREAM_FAILURE")
        .with_context(|| format!("{:?}", o.events))?;
    let err = o.error.clone().unwrap_or_default();
    let kind = err["upstream"]["kind"].as_str().unwrap_or("").to_owned();
    ensure!(kind == "early_eof" || kind == "io_error", "{err}");
    ensure!(frames(&o).len() < 3000, "{}", frames(&o).len());
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["upstream"]["failure"]["kind"] == kind.as_str(), "{rec}");
    ensure!(rec["turn_status"] == "failed", "{rec}");
    rig.up.kill()?;

    // Nobody listening now.
    let (status, _, v) = rig.post("/v1/chat/completions", &chat(4, true), None)?;
    ensure!(status == 502, "{status} {v}");
    ensure!(v["error"]["upstream"]["kind"] == "connect_refused", "{v}");
    let m = rig.haltd.metrics()?;
    for kind in ["early_eof", "connect_refused"] {
        let n = m
            .value("haltd_upstream_failures_total", &[("kind", kind)])
            .unwrap_or(0.0);
        ensure!(
            n >= 1.0,
            "haltd_upstream_failures_total{{kind={kind}}} = {n}"
        );
    }
    Ok(())
}

/// Waits until the server has logged `n` disconnects, then checks that it stays idle: the
/// generation stopped, not only the stream to haltd. Returns how long the wait took.
fn server_stopped_generating(up: &LlamaServer, n: usize) -> Result<Duration> {
    let t0 = Instant::now();
    loop {
        let seen = up.log_text().matches("Disconnected from client").count();
        if seen >= n {
            break;
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(5),
            "the server logged {seen} disconnects, not {n}: {}",
            up.log_text()
        );
        thread::sleep(Duration::from_millis(20));
    }
    let took = t0.elapsed();
    let cpu0 = up.cpu_ns()?;
    thread::sleep(Duration::from_millis(800));
    let busy = Duration::from_nanos(up.cpu_ns()? - cpu0);
    ensure!(
        busy < Duration::from_millis(150),
        "the server used {busy:?} of CPU in the 800 ms after the disconnect: still generating"
    );
    Ok(took)
}

/// An operator trip: at most B frames after τ, and the server stops generating.
fn operator_trip_cancels_the_generation(rig: &LlamaRig) -> Result<()> {
    let admin = rig.haltd.admin_url();
    let mut tripped = None;
    let mut seen = 0;
    let o = rig.stream(
        "/v1/chat/completions",
        &chat(3500, true),
        Some("Bearer trip"),
        |p, ev| {
            if is_frame(ev) {
                seen += 1;
                if seen == 5 && tripped.is_none() {
                    let url = format!("{admin}/admin/streams/{}/trip", p.stream_id);
                    tripped = Some(trip_here(&url, None));
                }
            }
        },
    )?;
    o.halted_cleanly("OPERATOR_TRIP")?;
    let (code, info) = tripped.context("tripped")??;
    ensure!(code == 200, "{code} {info}");
    let tau = info["trip_token_index"].as_u64().context("τ")? as usize;
    let n = frames(&o).len();
    ensure!(
        n <= tau + 5,
        "{} frames after τ = {tau}: more than B = 5",
        n - tau
    );
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["upstream"]["cancel_reason"] == "trip", "{rec}");
    let took = server_stopped_generating(&rig.up, 1)?;
    println!("real_backend: trip at τ = {tau}, {n} frames; the server logged the disconnect after {took:?}");
    Ok(())
}

/// A client that reads the start of a long stream and goes away.
fn client_gone_cancels_the_generation(rig: &LlamaRig) -> Result<()> {
    let body = chat(3500, true).to_string();
    let addr = rig.haltd.api;
    in_netns(&rig.haltd.client_ns, move || -> Result<()> {
        let mut s = TcpStream::connect(addr)?;
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer gone\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut buf = [0u8; 2048];
        let mut got = 0;
        while got < 1500 {
            let n = s.read(&mut buf)?;
            ensure!(n > 0, "stream ended early");
            got += n;
        }
        Ok(())
    })?; // the socket closes here
    rig.wait_record("client_gone turn", |r| {
        r["kind"] == "turn" && r["upstream"]["cancel_reason"] == "client_gone"
    })?;
    server_stopped_generating(&rig.up, 2)?;
    Ok(())
}

#[test]
fn trips_and_client_disconnects_stop_llama_cpp_generating() -> Result<()> {
    let rig = rig(&[])?;
    operator_trip_cancels_the_generation(&rig)?;
    client_gone_cancels_the_generation(&rig)?;
    // The server is free again: the next turn streams at once.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat(8, true),
        Some("Bearer other"),
        |_, _| {},
    )?;
    ended(&o, "length")?;
    Ok(())
}

/// Greedy decoding (`temperature: 0`): the same request gives the same tokens and logprobs.
fn greedy(max_tokens: u32) -> Value {
    let mut b = chat(max_tokens, true);
    b["temperature"] = json!(0.0);
    b["logprobs"] = json!(true);
    b
}

/// The HaltMonitor on llama.cpp's logprobs: a reference run gives the probabilities, then a
/// limit between two of them halts the same stream exactly at the first token below it.
fn halt_monitor_trips_on_real_logprobs(rig: &mut LlamaRig) -> Result<()> {
    // Own keys: the exfiltration halt before put the anonymous key into degraded mode.
    let o = rig.stream(
        "/v1/chat/completions",
        &greedy(40),
        Some("Bearer ref"),
        |_, _| {},
    )?;
    ended(&o, "length")?;
    let probs: Vec<f64> = frames(&o)
        .iter()
        .map(|f| {
            f["choices"][0]["logprobs"]["content"][0]["logprob"]
                .as_f64()
                .map(f64::exp)
        })
        .collect::<Option<_>>()
        .context("every frame has its logprob")?;
    // The first token from the 4th on whose probability is below all before it, and a limit
    // halfway between the two.
    let (k, limit) = (3..probs.len())
        .find_map(|i| {
            let min_before = probs[..i].iter().copied().fold(f64::INFINITY, f64::min);
            (probs[i] < min_before * 0.9).then(|| (i, (probs[i] + min_before) / 2.0))
        })
        .with_context(|| format!("no new low after the 3rd token: {probs:?}"))?;
    rig.haltd.stop()?;
    let limit_arg = format!("{limit:.6}");
    let url = rig.up.url.clone();
    rig.haltd = Haltd::start(
        &rig.pair,
        &[
            "--source",
            "openai",
            "--upstream",
            &url,
            "--hard-limit",
            &limit_arg,
        ],
    )?;
    let h = rig.stream(
        "/v1/chat/completions",
        &greedy(40),
        Some("Bearer ref"),
        |_, _| {},
    )?;
    h.halted_cleanly("COHERENCE_BELOW_THRESHOLD")
        .with_context(|| format!("limit {limit_arg}, probabilities {probs:?}"))?;
    let got: Vec<String> = frames(&h)
        .iter()
        .map(|f| frame_text(f).to_owned())
        .collect();
    let want: Vec<String> = frames(&o)[..k]
        .iter()
        .map(|f| frame_text(f).to_owned())
        .collect();
    ensure!(
        got == want,
        "halted at {} frames, not at token {k}: {got:?} vs {want:?}",
        got.len()
    );
    let rec = rig.turn_record(&h.stream_id)?;
    ensure!(rec["trip_token_index"] == k, "{rec}");
    ensure!(rec["upstream"]["cancel_reason"] == "trip", "{rec}");
    Ok(())
}

/// A secret forced by a grammar: llama.cpp samples it in its own tokens (`AKIA` is one), and
/// the hold-back keeps it from the client.
fn exfil_holds_back_a_secret_in_real_tokens(rig: &LlamaRig) -> Result<()> {
    let text = "The access key is AKIAIOSFODNN7EXAMPLE and more text";
    let mut b = chat(60, true);
    b["grammar"] = json!(format!("root ::= \"{text}\""));
    b["logprobs"] = json!(true);
    let o = rig.stream("/v1/chat/completions", &b, None, |_, _| {})?;
    o.halted_cleanly("EXFIL_ALERT")
        .with_context(|| format!("{:?}", o.events))?;
    ensure!(
        !o.text.contains("AKIA") && text.starts_with(o.text.as_str()),
        "{:?}",
        o.text
    );
    let tokens: Vec<String> = frames(&o)
        .iter()
        .map(|f| frame_text(f).to_owned())
        .collect();
    ensure!(!tokens.is_empty(), "the text before the secret passes");
    Ok(())
}

#[test]
fn detectors_judge_llama_cpp_tokens_and_logprobs() -> Result<()> {
    let mut rig = rig(&[])?;
    exfil_holds_back_a_secret_in_real_tokens(&rig)?;
    halt_monitor_trips_on_real_logprobs(&mut rig)
}

/// Issue 29 point 2: llama-cpp-python answers 400, with an empty body, to an `x-request-id`
/// that is not a UUID. haltd sends a v4 UUID of its own upstream (the client's id as
/// `x-haltd-client-request-id`), so a client with any id is served; with
/// `--upstream-request-id client` (the old behaviour) the same request is refused, and the
/// client's error names the status and the headers haltd added.
#[test]
fn a_client_request_id_that_is_no_uuid_reaches_llama_cpp() -> Result<()> {
    // A short chat stream whose client sends an id that is no UUID.
    let with_client_id = |rig: &LlamaRig| {
        rig.stream_headers(
            "/v1/chat/completions",
            &chat(6, true),
            &[("x-request-id", "client-req-7")],
            |_, _| {},
        )
    };
    let rig = rig(&[])?;
    ended(&with_client_id(&rig)?, "length")?;
    drop(rig);

    let rig = rig_with_client_ids()?;
    let o = with_client_id(&rig)?;
    ensure!(o.status == 400, "status {} body {:?}", o.status, o.body);
    let body = o.body.clone().unwrap_or_default();
    ensure!(
        body.contains("answered 400 with an empty body")
            && body.contains("x-request-id")
            && body.contains("--upstream-request-id"),
        "{body}"
    );
    Ok(())
}

/// haltd in front of llama.cpp's server, forwarding the client's id as `x-request-id`.
fn rig_with_client_ids() -> Result<LlamaRig> {
    rig(&["--upstream-request-id", "client"])
}

/// `/readyz`'s status, from the client namespace.
fn readyz(haltd: &Haltd) -> Result<u16> {
    let addr = haltd.api;
    in_netns(&haltd.client_ns, move || {
        haltd_tests::raw_exchange(
            addr,
            b"GET /readyz HTTP/1.1\r\nhost: haltd\r\nconnection: close\r\n\r\n",
            Duration::from_secs(5),
        )
        .map(|r| r.status)
    })
}

/// Issue 29 point 3: llama.cpp's server answers nothing else while it streams a long reply, so
/// the `/v1/models` probe times out. While a turn receives its bytes that is a busy backend,
/// not a dead one: `/readyz` stays 200 through a 3,500-token stream (the probe every 250 ms, a
/// 200 ms timeout, down after 2 failures: several probes time out meanwhile, counted in
/// `haltd_upstream_probe_failures_total`). Once the server is gone, `/readyz` turns 503 as it
/// did.
#[test]
fn readiness_holds_while_llama_cpp_is_busy_and_fails_once_it_is_gone() -> Result<()> {
    let mut rig = rig(&[
        "--upstream-probe-interval-ms",
        "250",
        "--upstream-probe-timeout-ms",
        "200",
        "--upstream-probe-failures",
        "2",
    ])?;
    haltd_tests::wait_for(Duration::from_secs(10), "ready", || {
        Ok((readyz(&rig.haltd)? == 200).then_some(()))
    })?;
    let failures = |rig: &LlamaRig| -> Result<f64> {
        rig.haltd
            .metrics()?
            .value_or_zero("haltd_upstream_probe_failures_total", &[])
    };
    let before = failures(&rig)?;
    let (url, body) = (rig.url("/v1/chat/completions"), chat(3500, true));
    let stream = haltd_tests::spawn_in_netns(&rig.haltd.client_ns, move || {
        haltd_tests::sse::stream(&url, &body, Duration::from_secs(60), |_, _| {})
    });
    let mut statuses = Vec::new();
    while !stream.is_finished() {
        statuses.push(readyz(&rig.haltd)?);
        thread::sleep(Duration::from_millis(25));
    }
    let o = stream
        .join()
        .map_err(|_| anyhow::anyhow!("the stream's client panicked"))??;
    ended(&o, "length")?;
    let timed_out = failures(&rig)? - before;
    println!(
        "readiness during a {}-token stream: {} looks, {} not 200; {timed_out} probes timed out meanwhile",
        frames(&o).len(),
        statuses.len(),
        statuses.iter().filter(|&&s| s != 200).count()
    );
    ensure!(
        timed_out >= 1.0,
        "no probe timed out: the server was not busy enough for this test to mean anything"
    );
    ensure!(
        statuses.iter().all(|&s| s == 200),
        "/readyz left 200 while the backend streamed: {statuses:?}"
    );
    rig.up.kill()?;
    let t = Instant::now();
    haltd_tests::wait_for(
        Duration::from_secs(5),
        "/readyz 503 once the server is gone",
        || Ok((readyz(&rig.haltd)? == 503).then_some(())),
    )?;
    println!("the server killed: /readyz 503 after {:?}", t.elapsed());
    Ok(())
}
