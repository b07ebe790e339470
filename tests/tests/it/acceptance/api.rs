//! The client API and the admin API: a client that goes away mid-stream, trips on ended,
//! unknown and malformed ids, admin trip races, `/v1/completions`, and curl as a real client.

use std::{
    io::{BufReader, Read},
    net::{SocketAddr, TcpStream},
    process::{Command, Stdio},
    sync::{Arc, Barrier},
    time::Duration,
};

use anyhow::{anyhow, ensure, Context, Result};
use haltd_tests::{
    in_netns, raw_exchange_on, spawn_in_netns,
    sse::{self, classify, SseParser},
    trip_here, wait_for, EventKind, Haltd, NetPair, StreamOutcome, TEST_ADMIN_TOKEN,
};
use serde_json::{json, Value};

use super::{
    chat, chat_url, check_every_record_states_gate, check_gate_stated, check_operator_trip,
    read_head, send_request, sse_events, stop_and_verify, stop_and_verify_text, stream_in,
    stream_tripped_at, wait_idle,
};

fn trip_url(haltd: &Haltd, id: &str) -> String {
    format!("{}/admin/streams/{id}/trip", haltd.admin_url())
}

// ---------------------------------------------------------------------------------------------
// 5. A client that goes away mid-stream; trips on ended, unknown and malformed ids.

#[test]
fn client_disconnect_mid_stream() -> Result<()> {
    const K: usize = 5;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "2000"])?;
    let api = haltd.api;
    let (id, got) = in_netns(&pair.cli, move || -> Result<(String, usize)> {
        let s = send_request(
            api,
            "/v1/chat/completions",
            &chat("Leaving early", 5, 5000, true),
        )?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut r = BufReader::new(s);
        let id = read_head(&mut r)?;
        let mut parser = SseParser::default();
        let mut tokens = 0;
        let mut buf = [0_u8; 4096];
        while tokens < K {
            let n = r.read(&mut buf)?;
            ensure!(n > 0, "EOF after {tokens} tokens");
            tokens += parser
                .feed(&buf[..n])
                .iter()
                .filter(|(_, d)| matches!(classify(d), EventKind::Token(_)))
                .count();
        }
        Ok((id, tokens))
        // The connection closes here.
    })?;
    println!("client gone: closed {id} after {got} tokens");
    ensure!(!id.is_empty(), "no x-haltd-stream-id");
    wait_idle(&haltd).with_context(|| haltd.log_tail(20))?;
    let turn = haltd.wait_record("turn record of the gone client", |r| {
        r["kind"] == "turn" && r["stream_id"] == id.as_str()
    })?;
    ensure!(turn["outcome"] == "client_gone", "turn record: {turn}");
    let gone = haltd.trip(&id, None)?;
    ensure!(gone.0 == 409, "trip on the ended stream: {gone:?}");
    let never = haltd.trip("hs_ffffffff00000000", None)?;
    ensure!(never.0 == 404, "trip on a never-issued id: {never:?}");
    for bad in ["hs_nothex0000000000", "hs_0123", "nope"] {
        let r = haltd.trip(bad, None)?;
        ensure!(
            r.0 == 400 && r.1["error"]["type"] == "invalid_request_error",
            "trip on malformed id {bad}: {r:?}"
        );
    }
    println!("client gone: trips answered 409 (ended), 404 (never issued), 400 (malformed)");
    let records = stop_and_verify(haltd)?;
    ensure!(
        !records.iter().any(|r| r["kind"] == "incident"),
        "the refused trips left incidents"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 6. Admin trip races (and the gate stated as enforcing).

/// Two trips of one stream sent at the same instant, on connections opened beforehand: one
/// wins (200), the other gets 409 with the winner's trip_token_index.
fn race_trips(admin: SocketAddr, cli: &str, id: &str) -> Vec<(u16, Value)> {
    let request = format!(
        "POST /admin/streams/{id}/trip HTTP/1.1\r\nhost: {admin}\r\n\
         authorization: Bearer {TEST_ADMIN_TOKEN}\r\ncontent-type: application/json\r\n\
         content-length: 0\r\n\r\n"
    );
    let barrier = Arc::new(Barrier::new(2));
    let racers: Vec<_> = (0..2)
        .map(|_| {
            let (b, req) = (Arc::clone(&barrier), request.clone());
            spawn_in_netns(cli, move || -> Result<(u16, Value)> {
                let s = TcpStream::connect_timeout(&admin, Duration::from_secs(5))?;
                s.set_nodelay(true)?;
                b.wait();
                let r = raw_exchange_on(s, req.as_bytes(), Duration::from_secs(10))?;
                Ok((r.status, r.json().unwrap_or(Value::Null)))
            })
        })
        .collect();
    racers
        .into_iter()
        .map(|h| match h.join() {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => (0, Value::String(format!("{e:#}"))),
            Err(_) => (0, Value::String("racer panicked".into())),
        })
        .collect()
}

/// A stream halted by a won race: its id and trip index.
type Halted = (String, Value);

/// The result of one racing stream: what it received and the answers to the two trips.
type Raced = Result<(StreamOutcome, Vec<(u16, Value)>)>;

/// `streams` streams, each of which races two operator trips at its token 3 + i % 4.
fn spawn_racers(
    pair: &NetPair,
    haltd: &Haltd,
    url: &str,
    streams: usize,
) -> Vec<std::thread::JoinHandle<Raced>> {
    let admin = haltd.admin;
    (0..streams)
        .map(|i| {
            let (url, cli) = (url.to_owned(), pair.cli.clone());
            spawn_in_netns(&pair.cli, move || -> Raced {
                let mut answers = Vec::new();
                let body = chat("Races", i as u64, 300, true);
                let o = sse::stream(&url, &body, Duration::from_secs(30), |p, ev| {
                    if answers.is_empty()
                        && matches!(ev.kind, EventKind::Token(_))
                        && p.tokens == 3 + i % 4
                    {
                        answers = race_trips(admin, &cli, p.stream_id);
                    }
                })?;
                Ok((o, answers))
            })
        })
        .collect()
}

/// Each race has one winner (200) and one loser (409 `already_tripped` with the winner's
/// trip index), and the stream halted as tripped. Returns the halted streams with their trip
/// index, and what went wrong.
fn judge_races(
    handles: Vec<std::thread::JoinHandle<Raced>>,
    haltd: &Haltd,
) -> Result<(Vec<Halted>, Vec<String>)> {
    let mut failures = Vec::new();
    let mut halted = Vec::new();
    for h in handles {
        let (o, mut answers) = h.join().map_err(|_| anyhow!("client thread panicked"))??;
        answers.sort_by_key(|a| a.0);
        let [(200, won), (409, lost)] = answers.as_slice() else {
            failures.push(format!(
                "two concurrent trips of {} answered {answers:?}",
                o.stream_id
            ));
            continue;
        };
        check_operator_trip(&o, Some(&(200, won.clone())), 5, &|| haltd.log_tail(20))?;
        halted.push((o.stream_id.clone(), won["trip_token_index"].clone()));
        if lost["error"]["type"] != "already_tripped"
            || lost["trip_token_index"] != won["trip_token_index"]
            || !won["trip_token_index"].is_u64()
        {
            failures.push(format!(
                "race on {}: winner {won}, loser {lost}",
                o.stream_id
            ));
        }
    }
    Ok((halted, failures))
}

/// A re-trip of each halted stream answers 409 `already_tripped` with its trip index;
/// returns what went wrong.
fn retrip_halted(pair: &NetPair, haltd: &Haltd, halted: &[Halted]) -> Result<Vec<String>> {
    let mut failures = Vec::new();
    for (id, index) in halted {
        let again = in_netns(&pair.cli, {
            let u = trip_url(haltd, id);
            move || trip_here(&u, None)
        })?;
        if again.0 != 409
            || again.1["error"]["type"] != "already_tripped"
            || again.1["trip_token_index"] != *index
        {
            failures.push(format!(
                "re-trip of the halted {id} (trip_token_index {index}): {again:?}"
            ));
        }
    }
    Ok(failures)
}

#[test]
fn admin_trip_races() -> Result<()> {
    const STREAMS: usize = 10;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "3000"])?;
    let url = chat_url(&haltd);
    let handles = spawn_racers(&pair, &haltd, &url, STREAMS);
    let (halted, mut failures) = judge_races(handles, &haltd)?;
    // The same question asked later, deterministically: a stream that ended because it was
    // tripped is still the tripped stream (409, its cause and trip_token_index).
    failures.extend(retrip_halted(&pair, &haltd, &halted)?);
    // A trip after the stream completed normally.
    let done = stream_in(&haltd, &url, &chat("Short", 1, 4, true), |_, _| {})?;
    ensure!(
        done.tokens == 4 && done.done_at.is_some(),
        "short stream: {done:?}"
    );
    let late = in_netns(&pair.cli, {
        let u = trip_url(&haltd, &done.stream_id);
        move || trip_here(&u, None)
    })?;
    ensure!(
        late.0 == 409 && late.1["error"]["type"] == "finished",
        "trip after completion: {late:?}"
    );
    wait_idle(&haltd)?;
    check_gate_stated(&haltd, true)?;
    let m = haltd.metrics()?;
    let trips = m.value_or_zero("haltd_watchdog_trips_total", &[("cause", "OPERATOR_TRIP")])?;
    ensure!(
        trips == STREAMS as f64,
        "{trips} trips counted for {STREAMS} races"
    );
    let (records, text) = stop_and_verify_text(haltd)?;
    let incidents = records.iter().filter(|r| r["kind"] == "incident").count();
    ensure!(
        incidents == STREAMS,
        "{incidents} incidents for {STREAMS} streams tripped twice"
    );
    check_every_record_states_gate(&text, "enforcing")?;
    println!(
        "trip races: {STREAMS} races; late trip on a completed stream 409; {} failures",
        failures.len()
    );
    ensure!(
        failures.is_empty(),
        "trip races:\n  {}",
        failures.join("\n  ")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 7. /v1/completions: streaming, batch, legacy logprobs, trips.

/// Checks one legacy `logprobs` object for `toks` starting at byte offset `start`; returns the
/// token logprobs.
fn check_legacy_logprobs(
    lp: &Value,
    toks: &[String],
    start: usize,
    n_top: usize,
) -> Result<Vec<f64>> {
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .context("tokens")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    ensure!(tokens == toks, "logprobs.tokens {tokens:?} != {toks:?}");
    let lps: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .context("token_logprobs")?
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    ensure!(
        lps.len() == toks.len() && lps.iter().all(|&l| l <= 0.0),
        "token_logprobs {lps:?}"
    );
    let top = lp["top_logprobs"].as_array().context("top_logprobs")?;
    ensure!(top.len() == toks.len(), "top_logprobs {top:?}");
    for (t, &l) in top.iter().zip(&lps) {
        let alts = t.as_object().context("top_logprobs entry is an object")?;
        ensure!(
            (1..=n_top).contains(&alts.len())
                && alts.values().all(|v| v.as_f64().is_some_and(|a| a <= 0.0)),
            "top_logprobs entry {t}"
        );
        let best = alts
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::MIN, f64::max);
        ensure!(
            l <= best + 1e-6,
            "sampled logprob {l} above the best alternative {best}"
        );
    }
    let mut offset = start;
    let want: Vec<usize> = toks
        .iter()
        .map(|t| {
            let o = offset;
            offset += t.len();
            o
        })
        .collect();
    let offsets: Vec<usize> = lp["text_offset"]
        .as_array()
        .context("text_offset")?
        .iter()
        .filter_map(|v| v.as_u64().map(|v| v as usize))
        .collect();
    ensure!(offsets == want, "text_offset {offsets:?}, want {want:?}");
    Ok(lps)
}

#[test]
fn completions_endpoint() -> Result<()> {
    const N: u32 = 24;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "2000"])?;
    let url = format!("{}/v1/completions", haltd.api_url());
    let body = |stream: bool, max: u32| {
        json!({"model": "builtin", "prompt": "Rivers run to", "seed": 11, "max_tokens": max,
               "stream": stream, "logprobs": 2, "ignore_eos": true})
    };
    let o = stream_in(&haltd, &url, &body(true, N), |_, _| {})?;
    ensure!(
        o.tokens == N as usize
            && o.finish_reason.as_deref() == Some("length")
            && o.done_at.is_some()
            && o.malformed == 0,
        "completions stream: {} tokens, finish {:?}, error {:?}",
        o.tokens,
        o.finish_reason,
        o.error
    );
    let mut streamed = Vec::new();
    let mut text = String::new();
    let mut streamed_lps = Vec::new();
    for e in &o.events {
        let EventKind::Token(t) = &e.kind else {
            continue;
        };
        let v: Value = serde_json::from_str(&e.data)?;
        let choice = &v["choices"][0];
        ensure!(
            choice["text"] == t.as_str() && v["object"] == "text_completion",
            "token event {}",
            e.data
        );
        streamed_lps.extend(
            check_legacy_logprobs(&choice["logprobs"], std::slice::from_ref(t), text.len(), 2)
                .with_context(|| format!("token event {}", e.data))?,
        );
        text.push_str(t);
        streamed.push(t.clone());
    }
    // Batch: the same request in one body.
    let (u, b) = (url.clone(), body(false, N));
    let (status, _, batch) = in_netns(&pair.cli, move || {
        sse::post(&u, &b, Duration::from_secs(30))
    })?;
    ensure!(status == 200, "batch status {status}: {batch}");
    let v: Value = serde_json::from_str(&batch)?;
    let choice = &v["choices"][0];
    ensure!(
        choice["text"] == text.as_str() && choice["finish_reason"] == "length",
        "batch choice {choice} (streamed text {text:?})"
    );
    let batch_lps = check_legacy_logprobs(&choice["logprobs"], &streamed, 0, 2)?;
    ensure!(
        batch_lps == streamed_lps,
        "batch token_logprobs differ from the streamed ones"
    );
    // A tripped completions stream.
    let (t, trip) = stream_tripped_at(&haltd, &url, &body(true, 400), 3)?;
    let post = check_operator_trip(&t, trip.as_ref(), 5, &|| haltd.log_tail(20))?;
    println!("completions: {N} streamed tokens = batch, legacy logprobs ok; tripped stream: {post} post-trip tokens");
    wait_idle(&haltd)?;
    check_gate_stated(&haltd, true)?;
    let (_, text) = stop_and_verify_text(haltd)?;
    check_every_record_states_gate(&text, "enforcing")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 9. curl as a real client.

#[test]
fn curl_sees_a_clean_halt() -> Result<()> {
    if Command::new("curl").arg("--version").output().is_err() {
        println!("curl not installed: skipped");
        return Ok(());
    }
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "5000"])?;
    let body = serde_json::to_string(&chat("Curl me", 4, 400, true))?;
    let child = Command::new("ip")
        .args([
            "netns",
            "exec",
            &pair.cli,
            "curl",
            "-sN",
            "--max-time",
            "30",
        ])
        .args(["-H", "content-type: application/json", "-d", &body])
        .arg(chat_url(&haltd))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting curl")?;
    let id = wait_for(
        Duration::from_secs(10),
        "curl's stream has 3 tokens",
        || {
            let list = haltd.list_streams()?;
            Ok(list["streams"]
                .as_array()
                .and_then(|l| l.first())
                .filter(|s| s["tokens"].as_u64().is_some_and(|t| t >= 3))
                .and_then(|s| s["stream_id"].as_str().map(str::to_owned)))
        },
    )?;
    let (status, trip) = haltd.trip(&id, None)?;
    ensure!(status == 200, "trip: {status} {trip}");
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "curl failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let events = sse_events(text.as_bytes());
    let n = events.len();
    ensure!(n >= 3, "curl got {n} events: {text}");
    let tail = &events[n - 3..];
    let ok = matches!(&tail[0], EventKind::Final { finish_reason, .. } if finish_reason == "content_filter")
        && matches!(&tail[1], EventKind::Error(e) if e["type"] == "halted" && e["code"] == "OPERATOR_TRIP" && e["stream_id"] == id.as_str())
        && tail[2] == EventKind::Done;
    ensure!(
        ok,
        "curl's output does not end with content_filter, error, [DONE]: {tail:?}"
    );
    ensure!(
        text.trim_end().ends_with("data: [DONE]"),
        "curl's output does not end with data: [DONE]: {:?}",
        &text[text.len().saturating_sub(200)..]
    );
    let tokens = events
        .iter()
        .filter(|e| matches!(e, EventKind::Token(_)))
        .count() as u64;
    let idx = trip["trip_token_index"]
        .as_u64()
        .context("trip_token_index")?;
    ensure!(
        tokens <= idx + 5,
        "curl got {tokens} tokens, trip index {idx}"
    );
    println!("curl: {tokens} tokens (trip index {idx}), then content_filter, error, [DONE]");
    stop_and_verify(haltd)?;
    Ok(())
}
