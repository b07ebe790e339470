//! Operator trips of Messages turns, with the kernel gate on (the harness's default): in the
//! middle of the text, of a tool call's input, of the thinking, and of a batch turn, at
//! B = 5 and at B = 0. The SDK's stream ends cleanly: no exception, `stop_reason:
//! "refusal"`, haltd's halt object (the `haltd` field of `message_delta`) with the trip's
//! index and at most B post-trip tokens, exactly that many frames (deltas and tool_use
//! starts) after the trip index, `usage.output_tokens` their sum; the flight recorder's turn
//! record and the kernel's verdicts agree (every halted end passed by its nonce, no frame
//! dropped). And an emitter that ignores the halt: at most B frames past the trip reach the
//! SDK, whether the kernel or the watchdog's halt stops it.

use std::collections::BTreeMap;

use anyhow::{ensure, Context, Result};
use haltd_tests::{rig::Rig, Haltd, NetPair};
use serde_json::{json, Value};

use super::{
    frames_seen, refused, sdk, stream_id, tripping, turn, verdicts, verdicts_since, Trips,
    WEATHER_TOOL,
};
use crate::UPSTREAM_BIN;

/// Token frames a stream has when it is tripped: past a tool call's header and two pieces
/// of its input.
const TRIP_AT: u64 = 4;

/// Arguments of 600 characters, sent in 300 pieces.
fn long_args() -> String {
    format!(
        "{{'location': 'Paris, France', 'note': '{}'}}",
        "n".repeat(560)
    )
}

/// The turns: (what is tripped, the turn's own SDK arguments). Each has its own key: a trip
/// degrades its key.
fn turns(b: u64) -> Vec<(&'static str, Vec<String>)> {
    let text = "[[script:normal tokens=300 pace_ms=20]]".to_owned();
    let tool = format!(
        "[[script:tool_call tokens=1 args_chunks=300 pace_ms=20 args=\"{}\"]]",
        long_args()
    );
    let thinking = "[[script:normal tokens=300 reasoning=300 pace_ms=20]]".to_owned();
    let key = |what: &str| format!("sk-ant-trip-{what}-b{b}");
    let t = |mode: &str, what: &'static str, prompt: &str, extra: &[&str]| {
        let mut args = turn(&["--mode", mode, "--api-key", &key(what), "--prompt", prompt]);
        args.extend(turn(extra));
        (what, args)
    };
    vec![
        t("stream", "text", &text, &[]),
        t("stream", "tool-input", &tool, &["--tools", WEATHER_TOOL]),
        t(
            "stream",
            "thinking",
            &thinking,
            &["--thinking-budget", "1024"],
        ),
        t("create-stream-raw", "raw-text", &text, &[]),
        t("create", "batch", &text, &[]),
    ]
}

/// One tripped turn against its trip and its record.
fn check_trip(rig: &Rig, what: &str, r: &Value, trip: &(u16, Value), b: u64) -> Result<()> {
    let (code, trip) = trip;
    ensure!(*code == 200, "{what}: the trip got {code} {trip}");
    let batch = r["mode"] == "create";
    ensure!(
        trip["kernel_enforced"] == true && trip["budget"] == if batch { 0 } else { b },
        "{what}: {trip}"
    );
    let halt = refused(r, "OPERATOR_TRIP").with_context(|| what.to_owned())?;
    let tau = trip["trip_token_index"].as_u64().context("τ")?;
    let post = halt["post_trip_tokens"]
        .as_u64()
        .context("post_trip_tokens")?;
    ensure!(halt["trip_token_index"] == tau, "{what}: {halt} / {trip}");
    ensure!(post <= b, "{what}: {post} tokens past the trip, B {b}: {r}");
    let rec = rig.turn_record(&stream_id(r)?)?;
    ensure!(
        rec["trip_cause"] == "OPERATOR_TRIP"
            && rec["turn_status"] == "failed"
            && rec["trip_token_index"] == tau
            && rec["halt_tokens_post_trip"] == post,
        "{what}: the record disagrees with the SDK's halt {halt}: {rec}"
    );
    if batch {
        // A halted batch turn: no content at all.
        ensure!(r["content_types"] == json!([]) && post == 0, "{what}: {r}");
        return Ok(());
    }
    let seen = frames_seen(r) as u64;
    ensure!(
        seen == tau + post && r["usage"]["output_tokens"] == tau + post,
        "{what}: {seen} frames at the SDK, τ {tau} + {post} post-trip: {r}"
    );
    let kinds = match what {
        "tool-input" => json!(["text", "tool_use"]),
        "thinking" => json!(["thinking"]),
        _ => json!(["text"]),
    };
    ensure!(r["content_types"] == kinds, "{what}: {r}");
    if what == "tool-input" {
        let call = &r["tool_uses"][0];
        ensure!(call["name"] == "get_weather", "{what}: {r}");
    }
    Ok(())
}

/// The turns at budget `b`, tripped; then the kernel's verdicts: every halted end passed by
/// its nonce, nothing dropped (userspace kept to B).
fn trips_at(b: u64) -> Result<Vec<Value>> {
    let rig = Rig::start(UPSTREAM_BIN, &["--budget", &b.to_string()])?;
    let turns = turns(b);
    let args: Vec<Vec<String>> = turns.iter().map(|(_, a)| a.clone()).collect();
    let before = verdicts(&rig.haltd)?;
    let (r, trips): (Vec<Value>, Trips) =
        tripping(&rig.haltd, TRIP_AT, || sdk(&rig.haltd, &[], &args))?;
    for ((what, _), r) in turns.iter().zip(&r) {
        let trip = trips
            .get(&stream_id(r)?)
            .with_context(|| format!("{what} was not tripped: {r}"))?;
        check_trip(&rig, what, r, trip, b)?;
    }
    let m = rig.haltd.metrics()?;
    ensure!(
        m.value("haltd_kernel_gate_enabled", &[])? == 1.0,
        "no kernel gate"
    );
    let gate = verdicts_since(&rig.haltd, &before)?;
    let got = |v: &str| gate.get(v).copied().unwrap_or(0.0);
    let streams = turns.len() as f64 - 1.0;
    ensure!(
        got("pass_terminal") >= streams,
        "fewer halted ends passed by the kernel than streams halted: {gate:?}"
    );
    for v in [
        "drop_budget",
        "drop_bytes",
        "drop_frame_size",
        "drop_after_terminal",
        "drop_no_state",
    ] {
        ensure!(got(v) == 0.0, "the kernel dropped frames ({v}): {gate:?}");
    }
    Ok(r)
}

#[test]
fn trips_mid_text_tool_input_and_thinking_end_the_sdk_stream_within_b() -> Result<()> {
    for b in [5, 0] {
        let r = trips_at(b)?;
        // The docs quote a halted stream as the SDK sees it.
        println!("messages trip, B = {b}, mid-text: {}", r[0]);
    }
    Ok(())
}

/// Budget of the streams whose emitter ignores the halt.
const IGNORED_B: u64 = 5;

/// One stream of the built-in source, restating a long prompt (its tokens keep coming after
/// the trip: a proxied stream's upstream is cancelled), one token per `pace_us`, with an
/// emitter that ignores the halt (`--fault emitter-ignores-halt`), tripped at its third
/// frame. What the SDK saw, the trip, the stream's incident record and the kernel's verdicts.
fn ignored_halt(pace_us: &str) -> Result<Ignored> {
    let pair = NetPair::new()?;
    let b = IGNORED_B.to_string();
    let haltd = Haltd::start(
        &pair,
        &[
            "--budget",
            &b,
            "--fault",
            "emitter-ignores-halt",
            "--builtin-restate-prompt",
            "--builtin-token-interval-us",
            pace_us,
        ],
    )?;
    let before = verdicts(&haltd)?;
    let prompt = "rivers run to the sea ".repeat(100);
    let common = [
        "--model",
        "builtin",
        "--max-tokens",
        "1000",
        "--prompt",
        prompt.trim(),
    ];
    let (mut r, mut trips) = tripping(&haltd, 3, || {
        sdk(&haltd, &common, &[turn(&["--mode", "stream"])])
    })?;
    let r = r.pop().context("no turn")?;
    let id = stream_id(&r)?;
    let trip = trips
        .remove(&id)
        .with_context(|| format!("not tripped: {r}"))?;
    let incident = haltd.wait_record("the incident", |rec| {
        rec["kind"] == "incident" && rec["stream_id"] == id.as_str()
    })?;
    Ok(Ignored {
        sdk: r,
        trip,
        incident,
        gate: verdicts_since(&haltd, &before)?,
    })
}

/// What [`ignored_halt`] saw.
struct Ignored {
    sdk: Value,
    /// The trip's answer (status, body).
    trip: (u16, Value),
    incident: Value,
    /// The kernel's verdicts during the stream.
    gate: BTreeMap<String, f64>,
}

/// With an emitter that keeps writing after the trip, only the watchdog's halt (after
/// `--halt-grace-ms`) and the kernel gate stop it. At most B frames past the trip reach the
/// SDK either way. Every 2 ms, the emitter outruns the grace: the kernel drops its sixth
/// post-trip frame, and, as docs/architecture.md §10 says of such an emitter, the drop is
/// permanent for the socket, so the halted end is lost too: the SDK sees the connection end
/// (`APIConnectionError`), the incident record's `kernel` says so. Every 20 ms, the
/// watchdog's halted end comes first, after a token or two: a clean refusal whose
/// `usage.output_tokens` counts them (τ plus the post-trip tokens, patched into the frame
/// prepared at the trip). Either pace may end the other way on a slow machine.
#[test]
fn an_emitter_that_ignores_the_halt_is_held_to_b_on_a_messages_stream() -> Result<()> {
    for pace_us in ["2000", "20000"] {
        let Ignored {
            sdk: r,
            trip: (code, trip),
            incident,
            gate,
        } = ignored_halt(pace_us)?;
        ensure!(
            code == 200 && trip["kernel_enforced"] == true,
            "{code} {trip}"
        );
        let tau = trip["trip_token_index"].as_u64().context("τ")?;
        let seen = frames_seen(&r) as u64;
        println!("emitter ignores the halt, a token every {pace_us} µs: τ {tau}, {seen} deltas at the SDK, gate {gate:?}: {r}");
        let b = IGNORED_B;
        ensure!(seen <= tau + b, "{seen} deltas, trip at {tau}, B {b}: {r}");
        let got = |v: &str| gate.get(v).copied().unwrap_or(0.0);
        ensure!(
            got("pass_post_trip") <= b as f64,
            "the kernel passed more than B: {gate:?}"
        );
        if r["ok"] == true {
            let halt = refused(&r, "OPERATOR_TRIP")?;
            let post = halt["post_trip_tokens"]
                .as_u64()
                .context("post_trip_tokens")?;
            ensure!(
                post <= b && seen == tau + post && r["usage"]["output_tokens"] == tau + post,
                "{seen} deltas, τ {tau}, post-trip {post}, usage {}: {r}",
                r["usage"]
            );
            continue;
        }
        ensure!(
            r["exception"] == "APIConnectionError" && r["stop_reason"].is_null(),
            "the end of a stream whose emitter ignored the halt: {r}"
        );
        let kernel = &incident["kernel"];
        ensure!(
            got("drop_budget") > 0.0
                && kernel["dropped"] == true
                && kernel["terminal_sent"] == false
                && kernel["post_trip_frames"].as_u64().is_some_and(|k| k <= b),
            "cut without the kernel's drop: {gate:?} {incident}"
        );
    }
    Ok(())
}
