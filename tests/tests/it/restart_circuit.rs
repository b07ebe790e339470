//! TokenCircuit forgets nothing in a restart (`daemon/src/circuit/store/persist.rs`,
//! `daemon/src/circuit/dispatched.rs`): after SIGTERM, and again after SIGKILL with streams
//! open, and again after the ledger rotated (logrotate's move and SIGHUP) and haltd restarted
//! on the new segment, a conversation's backoff clock still charges a premature retry two units, a budget
//! used up stays used up when the transcript no longer shows its failures, and a failed
//! turn's dispatched call is still listed and its retry still refused. `haltctl reconcile`
//! then records `not_done` in the ledger with the operator's identity, and the retry goes out
//! once.

use std::{fs, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{rig::Rig, temp_dir, Haltd};
use serde_json::{json, Value};

use crate::restart_state::{
    crash_under_load, degrade, degraded_entry, restart, same_degraded, KEY,
};
use crate::tool_circuit::{
    circuit_halt, conversation, first_call_id, then_call, tool_call_deltas, CHAT, PARIS,
};
use crate::UPSTREAM_BIN;

const FAILED: &str = "HTTP 503 Service Unavailable";
const RETRY: &str = "[[script:tool_call tokens=2]]";

fn header(id: &str) -> [(&str, &str); 1] {
    [("x-haltd-conversation-id", id)]
}

/// A conversation whose first turn asks the scripted model for `directive`.
fn opening(directive: &str) -> Value {
    json!({
        "model": "scripted",
        "stream": true,
        "tools": [{"type": "function", "function": {"name": "get_weather",
                   "parameters": {"type": "object"}}}],
        "messages": [{"role": "user", "content": directive}],
    })
}

/// What the test set up before the first restart, to check after each.
struct Held {
    /// The premature retry's conversation, its second request.
    premature: Value,
    /// The dispatched call's reference.
    reference: String,
}

fn set_up(rig: &Rig) -> Result<Held> {
    // "early": call_prev came back 503 and the model retried at once (2 units of 3).
    let b = conversation(PARIS, FAILED, RETRY);
    let o = rig.stream_headers(CHAT, &b, &header("early"), |_, _| {})?;
    ensure!(o.error.is_none() && tool_call_deltas(&o) >= 2, "{o:?}");
    let retry = first_call_id(&o)?;
    let premature = then_call(
        conversation(PARIS, FAILED, ""),
        &retry,
        &format!("{FAILED} {RETRY}"),
    )?;
    // "denied": a 403 uses up permission/auth; haltd answers the next request itself.
    let b = conversation(PARIS, "HTTP 403 Forbidden: permission denied", RETRY);
    let o = rig.stream_headers(CHAT, &b, &header("denied"), |_, _| {})?;
    ensure!(
        o.status == 409,
        "permission/auth answered without the model: {o:?}"
    );
    // "dispatched": the upstream dies after the model's first call reached the client (a
    // call goes out once judged: whole, when the next one starts).
    let o = rig.stream_headers(
        CHAT,
        &opening("[[script:tool_call calls=2 die=1]]"),
        &header("dispatched"),
        |_, _| {},
    )?;
    ensure!(tool_call_deltas(&o) >= 1 && o.error.is_some(), "{o:?}");
    let rec = rig.turn_record(&o.stream_id)?;
    let call = &rec["tool_calls"][0];
    ensure!(
        rec["turn_status"] == "failed"
            && call["reconciliation"] == "required"
            && call["delivered_unix_ms"].as_u64().is_some(),
        "{rec}"
    );
    let reference = call["ref"].as_str().context("the call's ref")?.to_owned();
    // Everything queued is written before the kill (`GET /admin/state` waits for it).
    rig.get_admin("/admin/state")?;
    Ok(Held {
        premature,
        reference,
    })
}

/// Item 1's invariants after a restart (`how`).
fn check(rig: &Rig, held: &Held, how: &str) -> Result<()> {
    // The clock: the retry came early, 2 units; another early one would pass 3.
    let o = rig.stream_headers(CHAT, &held.premature, &header("early"), |_, _| {})?;
    let a = circuit_halt(&o).with_context(|| format!("premature retry after {how}"))?;
    ensure!(
        a["failure_class"] == "transient" && a["retry_count"] == 2,
        "{how}: {a}"
    );
    // The used-up budget, with a transcript trimmed of the failure.
    let trimmed = opening(RETRY);
    let o = rig.stream_headers(CHAT, &trimmed, &header("denied"), |_, _| {})?;
    ensure!(
        o.status == 409,
        "{how}: a trimmed transcript restored the budget: {o:?}"
    );
    // The dispatched call: listed, and its retry refused.
    let listed = rig.get_admin("/admin/reconcile")?;
    ensure!(
        listed["calls"][0]["ref"] == held.reference.as_str()
            && listed["calls"].as_array().map(Vec::len) == Some(1),
        "{how}: {listed}"
    );
    let o = rig.stream_headers(CHAT, &opening(RETRY), &header("dispatched"), |_, _| {})?;
    let a = circuit_halt(&o).with_context(|| format!("dispatched retry after {how}"))?;
    ensure!(
        a["failure_class"] == "ambiguous_effect"
            && a["safety_justification"]
                .as_str()
                .is_some_and(|s| s.contains(&held.reference)),
        "{how}: {a}"
    );
    Ok(())
}

#[test]
fn circuit_memory_and_dispatched_calls_survive_sigterm_and_sigkill() -> Result<()> {
    let dir = temp_dir("restart-circuit")?;
    let path = dir.join("haltd.toml");
    fs::write(
        &path,
        "[tool_circuit]\nenabled = true\nbudgets = { transient = 3 }\n\
         backoff = { base_ms = 60000, cap_ms = 60000 }\n",
    )?;
    let config = path.to_string_lossy().into_owned();
    let extra = ["--config", config.as_str(), "--degraded-for-s", "3600"];
    let mut rig = Rig::start(UPSTREAM_BIN, &extra)?;
    let held = set_up(&rig)?;
    let gauge = rig
        .haltd
        .metrics()?
        .sum("haltd_tool_circuit_unreconciled_calls");
    ensure!(gauge == 1.0, "unreconciled gauge {gauge}");

    let status = rig.haltd.stop()?;
    ensure!(status.success(), "SIGTERM: {status}");
    let mut kept: Vec<Haltd> = vec![restart(&mut rig, &extra)?];
    check(&rig, &held, "SIGTERM")?;
    kept.push(crash_under_load(&mut rig, &extra)?);
    check(&rig, &held, "SIGKILL")?;

    // A ledger rotation, then a restart on the new segment: the store linked to its first
    // record keeps everything, a degraded key included.
    let fp = rig.haltd.scope_of(KEY)?;
    degrade(&rig, KEY)?;
    let before = degraded_entry(&rig, &fp)?.context("degraded after the halt")?;
    rotate(&rig)?;
    let status = rig.haltd.stop()?;
    ensure!(status.success(), "SIGTERM after the rotation: {status}");
    kept.push(restart(&mut rig, &extra)?);
    check(&rig, &held, "rotation and restart")?;
    same_degraded(&rig, &fp, &before, "rotation and restart")?;
    let gauge = rig
        .haltd
        .metrics()?
        .sum("haltd_tool_circuit_unreconciled_calls");
    ensure!(
        gauge == 1.0,
        "unreconciled gauge after the restarts: {gauge}"
    );

    reconcile_not_done(&rig, &held)?;
    drop(rig);
    drop(kept);
    Ok(())
}

/// logrotate's `postrotate`: the ledger moved aside, SIGHUP, and haltd's first record of the
/// new segment written.
fn rotate(rig: &Rig) -> Result<()> {
    let ledger = &rig.haltd.ledger;
    fs::rename(ledger, ledger.with_extension("jsonl.1")).context("moving the ledger aside")?;
    let pid = libc::pid_t::try_from(rig.haltd.pid().context("haltd is not running")?)?;
    // SAFETY: kill(2) on the haltd child this test started and has not reaped.
    let signalled = unsafe { libc::kill(pid, libc::SIGHUP) };
    ensure!(signalled == 0, "kill(SIGHUP)");
    haltd_tests::wait_for(Duration::from_secs(5), "the new segment", || {
        Ok(ledger.exists().then_some(()))
    })?;
    let first = rig
        .wait_record("the new segment's first record", |r| {
            r["segment"]["continues_seq"].as_u64().is_some()
        })
        .with_context(|| rig.haltd.log_tail(20))?;
    ensure!(first["seq"].as_u64().is_some_and(|s| s > 0), "{first}");
    Ok(())
}

/// `haltctl reconcile` lists the call; `not_done` is recorded with the operator's identity,
/// and lets one retry out.
fn reconcile_not_done(rig: &Rig, held: &Held) -> Result<()> {
    let text = rig.haltctl(false, &["reconcile"])?;
    ensure!(
        text.contains(&held.reference)
            && text.contains("conversation dispatched")
            && text.contains("tool get_weather")
            && text.contains("unreconciled"),
        "{text}"
    );
    let r = &held.reference;
    let shown = rig.haltctl(false, &["circuit", "show"])?;
    ensure!(
        shown.contains("1 unreconciled dispatched call(s)"),
        "{shown}"
    );
    let done = rig.haltctl(false, &["reconcile", r, "--outcome", "not_done"])?;
    ensure!(done.contains("not_done (by"), "{done}");
    println!("$ haltctl reconcile\n{text}$ haltctl reconcile {r} --outcome not_done\n{done}");
    let rec = rig.wait_record("the reconcile record", |rec| {
        rec["admin"]["action"] == "reconcile" && rec["admin"]["call"]["ref"] == r.as_str()
    })?;
    ensure!(
        rec["admin"]["actor"].is_object() && rec["admin"]["call"]["outcome"] == "not_done",
        "{rec}"
    );
    println!("its ledger record's admin field: {}", rec["admin"]);
    let again = rig.haltctl(true, &["reconcile", r, "--outcome", "done"]);
    ensure!(
        again.as_ref().is_err_and(|e| e.to_string().contains("409")),
        "an outcome is recorded once: {again:?}"
    );
    let unknown = rig.haltctl(true, &["reconcile", "000000000000", "--outcome", "done"]);
    ensure!(
        unknown
            .as_ref()
            .is_err_and(|e| e.to_string().contains("404")),
        "{unknown:?}"
    );
    let o = rig.stream_headers(CHAT, &opening(RETRY), &header("dispatched"), |_, _| {})?;
    ensure!(
        o.error.is_none() && tool_call_deltas(&o) >= 1,
        "the one retry: {o:?}"
    );
    let all = rig.get_admin("/admin/reconcile?all=true")?;
    ensure!(all["calls"][0]["retried"] == true, "{all}");
    let gauge = rig
        .haltd
        .metrics()?
        .sum("haltd_tool_circuit_unreconciled_calls");
    ensure!(gauge == 0.0, "unreconciled gauge {gauge}");
    Ok(())
}
