//! Operator trips of Responses turns, with the kernel gate on (the harness's default): in the
//! middle of the text, of a function call's arguments, of the reasoning, and of a batch
//! turn, at B = 5 and at B = 0. The driver trips its own turn through the admin API once it
//! has seen [`TRIP_AT`] token frames (`--trip-after`). The SDK's stream ends cleanly: no
//! exception, `response.incomplete` with `incomplete_details.reason: "content_filter"` and
//! haltd's halt object (the response's `haltd` member) with the trip's index and at most B
//! post-trip tokens; exactly that many token frames (deltas and function calls' headers)
//! after the trip index, `usage.output_tokens` their sum; the flight recorder's turn record
//! and the kernel's verdicts agree (every halted end passed by its nonce, no frame dropped).
//! The same, with the turns passed through to the scripted upstream's own `/v1/responses`
//! (`--upstream-surfaces`). And an emitter that ignores the halt (`--fault
//! emitter-ignores-halt`): at most B frames past the trip reach the SDK, the kernel passing
//! the halted end by its nonce or dropping the frame past B.

use anyhow::{ensure, Context, Result};
use haltd_tests::{rig::Rig, Haltd, NetPair};
use serde_json::{json, Value};

use super::{refused, sdk, stream_id, trip_args, turn};
use crate::{
    messages::{tripping_on, verdicts, verdicts_since},
    UPSTREAM_BIN,
};

/// Token frames the SDK has seen when the driver trips: past a call's header and two pieces
/// of its arguments.
pub(crate) const TRIP_AT: u64 = 4;

/// Arguments of 600 characters, sent in 300 pieces.
pub(crate) fn long_args() -> String {
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
    let reasoning = "[[script:normal tokens=300 reasoning=300 pace_ms=20]]".to_owned();
    // A token a millisecond: some go out between the driver's trip and haltd's.
    let fast = "[[script:normal tokens=300 pace_ms=1]]".to_owned();
    let key = |what: &str| format!("sk-trip-{what}-b{b}");
    let t = |mode: &str, what: &'static str, prompt: &str, extra: &[&str]| {
        let mut args = turn(&["--mode", mode, "--api-key", &key(what), "--prompt", prompt]);
        args.extend(turn(extra));
        (what, args)
    };
    vec![
        t("stream", "text", &text, &[]),
        t("stream", "arguments", &tool, &["--tools", "weather"]),
        t("stream", "reasoning", &reasoning, &[]),
        t("helper", "helper-text", &text, &[]),
        t("stream", "fast-text", &fast, &[]),
        t("create", "batch", &text, &[]),
    ]
}

/// One tripped turn against its trip and its record.
fn check_trip(rig: &Rig, what: &str, r: &Value, b: u64) -> Result<()> {
    let trip = &r["trip"];
    ensure!(
        trip["status"] == 200 && trip["error"].is_null(),
        "{what}: the trip: {r}"
    );
    let trip = &trip["body"];
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
        // A halted batch turn: no output at all.
        ensure!(r["output_types"] == json!([]) && post == 0, "{what}: {r}");
        return Ok(());
    }
    // The trip came after the driver saw TRIP_AT frames: τ is at least that (more when
    // tokens went out while the trip was on its way).
    ensure!(
        r["trip"]["after_frames"] == TRIP_AT && tau >= TRIP_AT,
        "{what}: τ {tau}: {r}"
    );
    let seen = r["frames"].as_u64().context("frames")?;
    ensure!(
        seen == tau + post && r["usage"]["output_tokens"] == tau + post,
        "{what}: {seen} frames at the SDK, τ {tau} + {post} post-trip: {r}"
    );
    let kinds = match what {
        "arguments" => json!(["message", "function_call"]),
        "reasoning" => json!(["reasoning"]),
        _ => json!(["message"]),
    };
    ensure!(r["output_types"] == kinds, "{what}: {r}");
    // The SDK's helper has no halted response to return: `get_final_response()` raises, as
    // docs/wire-format.md says.
    let final_error = if r["mode"] == "helper" {
        json!("RuntimeError")
    } else {
        Value::Null
    };
    ensure!(r["final_error"] == final_error, "{what}: {r}");
    if what == "arguments" {
        // The call's arguments, cut short: a beginning of the whole.
        let whole = long_args().replace('\'', "\"");
        let call = &r["function_calls"][0];
        let got = call["arguments"].as_str().unwrap_or("?");
        ensure!(
            call["name"] == "get_weather" && whole.starts_with(got) && got.len() < whole.len(),
            "{what}: {r}"
        );
    }
    Ok(())
}

/// The turns at budget `b`, tripped; then the kernel's verdicts: every halted end passed by
/// its nonce, nothing dropped (userspace kept to B).
fn trips_at(b: u64, extra: &[&str]) -> Result<Vec<Value>> {
    let budget = b.to_string();
    let mut args = vec!["--budget", budget.as_str()];
    args.extend_from_slice(extra);
    let rig = Rig::start(UPSTREAM_BIN, &args)?;
    let turns = turns(b);
    let args: Vec<Vec<String>> = turns.iter().map(|(_, a)| a.clone()).collect();
    let before = verdicts(&rig.haltd)?;
    let common = trip_args(&rig.haltd, TRIP_AT);
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let r = sdk(&rig.haltd, &common, &args)?;
    for ((what, _), r) in turns.iter().zip(&r) {
        check_trip(&rig, what, r, b)?;
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
fn trips_mid_text_arguments_and_reasoning_end_the_sdk_stream_within_b() -> Result<()> {
    for b in [5, 0] {
        let r = trips_at(b, &[])?;
        // The docs quote a halted stream as the SDK sees it.
        println!("responses trip, B = {b}, mid-text: {}", r[0]);
        println!("responses trip, B = {b}, mid-arguments: {}", r[1]);
        println!("responses trip, B = {b}, the SDK's helper: {}", r[3]);
        println!("responses trip, B = {b}, a token a millisecond: {}", r[4]);
    }
    Ok(())
}

#[test]
fn trips_of_a_passed_through_stream_end_the_sdk_stream_within_b() -> Result<()> {
    // The backend's own Responses events, parsed and governed: the same ends as by
    // translation.
    for b in [5, 0] {
        let r = trips_at(b, &crate::passthrough::PASS_THROUGH)?;
        println!(
            "responses trip by pass-through, B = {b}, mid-text: {}",
            r[0]
        );
    }
    Ok(())
}

/// Budget of the stream whose emitter ignores the halt.
const IGNORED_B: u64 = 5;

/// With an emitter that keeps writing after the trip (the built-in source restating a long
/// prompt, a token every `pace_us`; tripped at its third frame), only the watchdog's halt
/// (after `--halt-grace-ms`) and the kernel gate stop it: at most B frames past the trip
/// reach the SDK. Either the watchdog's halted end came first (`response.incomplete`, its
/// counts patched into the end prepared at the trip), or the kernel dropped the frame past B
/// and the connection's end is all the SDK sees, as the incident record's `kernel` says.
#[test]
fn an_emitter_that_ignores_the_halt_is_held_to_b_on_a_responses_stream() -> Result<()> {
    for pace_us in ["2000", "20000"] {
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
        let common = ["--model", "builtin", "--max-output-tokens", "1000"];
        let args = turn(&["--mode", "stream", "--prompt", prompt.trim()]);
        let (mut r, mut trips) =
            tripping_on(&haltd, &["responses"], 3, || sdk(&haltd, &common, &[args]))?;
        let r = r.pop().context("no turn")?;
        let id = stream_id(&r)?;
        let (code, trip) = trips
            .remove(&id)
            .with_context(|| format!("not tripped: {r}"))?;
        let incident = haltd.wait_record("the incident", |rec| {
            rec["kind"] == "incident" && rec["stream_id"] == id.as_str()
        })?;
        let gate = verdicts_since(&haltd, &before)?;
        ensure!(
            code == 200 && trip["kernel_enforced"] == true,
            "{code} {trip}"
        );
        let tau = trip["trip_token_index"].as_u64().context("τ")?;
        let seen = r["frames"].as_u64().context("frames")?;
        println!("responses, emitter ignores the halt, a token every {pace_us} µs: τ {tau}, {seen} frames at the SDK, gate {gate:?}: {r}");
        ensure!(seen <= tau + IGNORED_B, "{seen} frames, trip at {tau}: {r}");
        let got = |v: &str| gate.get(v).copied().unwrap_or(0.0);
        ensure!(
            got("pass_post_trip") <= IGNORED_B as f64,
            "the kernel passed more than B: {gate:?}"
        );
        if r["ok"] == true {
            let halt = refused(&r, "OPERATOR_TRIP")?;
            let post = halt["post_trip_tokens"].as_u64().context("post")?;
            ensure!(
                post <= IGNORED_B
                    && seen == tau + post
                    && r["usage"]["output_tokens"] == tau + post,
                "{seen} frames, τ {tau}, post-trip {post}: {r}"
            );
            continue;
        }
        ensure!(
            r["exception"].is_string() && r["response_status"] != "completed",
            "the end of a stream whose emitter ignored the halt: {r}"
        );
        let kernel = &incident["kernel"];
        ensure!(
            got("drop_budget") > 0.0
                && kernel["dropped"] == true
                && kernel["terminal_sent"] == false
                && kernel["post_trip_frames"]
                    .as_u64()
                    .is_some_and(|k| k <= IGNORED_B),
            "cut without the kernel's drop: {gate:?} {incident}"
        );
    }
    Ok(())
}
