//! A restart never loosens governance (`daemon/src/state.rs`): a key degraded by a halt is
//! still degraded, with the same expiry, after haltd stops on SIGTERM and again after it is
//! killed with SIGKILL while streams are open, and `haltctl state show` lists it; a
//! conversation's committed TURN-ACID state survives the restart; a removed store is rebuilt
//! from the ledger, and another haltd's store stops the start (exit 4), never reset; a failed
//! store write fails haltd closed.

use std::{thread, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    rig::{chat, Rig},
    spawn_in_netns, Haltd,
};
use serde_json::Value;

use crate::UPSTREAM_BIN;

pub(crate) const KEY: &str = "Bearer key-restart";

/// Trips a stream of `auth` (operator) and waits until its key's mode change is recorded.
pub(crate) fn degrade(rig: &Rig, auth: &str) -> Result<()> {
    rig.trip_stream_of(auth)?;
    rig.wait_record("mode change", |r| r["mode_change"]["to"] == "degraded")?;
    Ok(())
}

/// The degraded entry of `scope` (its name, `header:<fp>`) in `GET /admin/mode`, if any.
pub(crate) fn degraded_entry(rig: &Rig, scope: &str) -> Result<Option<Value>> {
    let mode = rig.get_admin("/admin/mode")?;
    Ok(mode["keys"]
        .as_array()
        .and_then(|l| l.iter().find(|k| k["scope"] == scope).cloned()))
}

/// The committed state (TURN-ACID) of `fingerprint` in `GET /admin/conversations`.
fn committed(rig: &Rig, fingerprint: &str) -> Result<Value> {
    let all = rig.get_admin("/admin/conversations")?;
    all["conversations"]
        .as_array()
        .and_then(|l| l.iter().find(|c| c["key"] == fingerprint).cloned())
        .context("no committed state for the key")
}

/// A request of `auth` is served degraded (`x-haltd-mode: degraded`).
fn served_degraded(rig: &Rig, auth: &str) -> Result<bool> {
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=3]]", true),
        Some(auth),
        |_, _| {},
    )?;
    Ok(o.mode_header.as_deref() == Some("degraded"))
}

/// `haltctl --json ARGS` as JSON, and the plain output of the same command.
fn haltctl(rig: &Rig, args: &[&str]) -> Result<(Value, String)> {
    Ok((
        serde_json::from_str(&rig.haltctl(true, args)?)?,
        rig.haltctl(false, args)?,
    ))
}

/// haltd again, on the ledger (and so the state directory) of the one `rig` ran; the old
/// instance is returned, to keep its directory until the test ends.
pub(crate) fn restart(rig: &mut Rig, extra: &[&str]) -> Result<Haltd> {
    let mut args = vec!["--source", "openai", "--upstream", rig.up.url.as_str()];
    args.extend_from_slice(extra);
    let ledger = rig.haltd.ledger.clone();
    let next = Haltd::start_with_ledger(&rig.pair, Some(&ledger), &args)?;
    Ok(std::mem::replace(&mut rig.haltd, next))
}

#[test]
fn a_degraded_key_stays_degraded_with_its_expiry_across_sigterm_and_sigkill() -> Result<()> {
    let extra = ["--degraded-for-s", "3600"];
    let mut rig = Rig::start(UPSTREAM_BIN, &extra)?;
    let fp = rig.haltd.scope_of(KEY)?;
    degrade(&rig, KEY)?;
    let before = degraded_entry(&rig, &fp)?.context("degraded after the halt")?;
    // A conversation with committed turns (TURN-ACID) keeps them too.
    let other = "Bearer conv-committed";
    for _ in 0..2 {
        ensure!(!served_degraded(&rig, other)?, "{other} is degraded");
    }
    let other_fp = rig.haltd.key_fingerprint(other)?;
    let turns = committed(&rig, &other_fp)?;
    ensure!(turns["turns_committed"] == 2, "{turns}");

    // SIGTERM, then a new haltd on the same ledger and state directory.
    let status = rig.haltd.stop()?;
    ensure!(status.success(), "SIGTERM: {status}");
    let mut kept = vec![restart(&mut rig, &extra)?];
    same_degraded(&rig, &fp, &before, "SIGTERM")?;
    let gauge = rig.haltd.metrics()?.sum("haltd_degraded_scopes");
    ensure!(
        gauge == 1.0,
        "haltd_degraded_scopes = {gauge} after SIGTERM"
    );
    let after_turns = committed(&rig, &other_fp)?;
    ensure!(
        after_turns["turns_committed"] == 2
            && after_turns["tokens_committed"] == turns["tokens_committed"]
            && after_turns["last_committed_turn"] == turns["last_committed_turn"],
        "committed state after SIGTERM: {after_turns}, before: {turns}"
    );
    ensure!(
        !served_degraded(&rig, "Bearer other-key")?,
        "another key is degraded"
    );

    // SIGKILL with streams open.
    kept.push(crash_under_load(&mut rig, &extra)?);
    same_degraded(&rig, &fp, &before, "SIGKILL")?;
    show_and_reset(&rig, &fp)?;
    drop(rig);
    drop(kept);
    Ok(())
}

/// `fp` is degraded with the same end and cause as `before`, and served degraded.
pub(crate) fn same_degraded(rig: &Rig, fp: &str, before: &Value, after_what: &str) -> Result<()> {
    let after =
        degraded_entry(rig, fp)?.with_context(|| format!("not degraded after {after_what}"))?;
    ensure!(
        after["until_unix_ms"].as_u64().is_some()
            && after["until_unix_ms"] == before["until_unix_ms"]
            && after["cause"] == before["cause"],
        "after {after_what}: {after}, before: {before}"
    );
    ensure!(
        served_degraded(rig, KEY)?,
        "served in full after {after_what}"
    );
    Ok(())
}

/// SIGKILLs haltd while 4 streams are open, then starts it again; returns the killed one.
pub(crate) fn crash_under_load(rig: &mut Rig, extra: &[&str]) -> Result<Haltd> {
    let load: Vec<_> = (0..4)
        .map(|_| {
            let client = rig.haltd.client();
            spawn_in_netns(&rig.haltd.client_ns, move || {
                let body = chat("[[script:normal tokens=400 pace_ms=5]]", true);
                client.stream(
                    "/v1/chat/completions",
                    &body,
                    Duration::from_secs(10),
                    |_, _| {},
                )
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    let status = rig.haltd.crash()?;
    ensure!(!status.success(), "SIGKILL: {status}");
    for t in load {
        let _ = t.join();
    }
    restart(rig, extra)
}

/// `haltctl state show` lists the key; `haltctl state reset` ends it, recorded with the
/// operator's identity, and the store forgets it too.
fn show_and_reset(rig: &Rig, fp: &str) -> Result<()> {
    let scope = fp.to_owned();
    let (shown, text) = haltctl(rig, &["state", "show"])?;
    ensure!(
        shown["held"]["scopes"]
            .as_array()
            .is_some_and(|l| l.iter().any(|r| r["scope"] == scope.as_str())),
        "{shown}"
    );
    ensure!(
        text.contains(&scope) && text.contains("reflects ledger seq"),
        "{text}"
    );
    haltctl(rig, &["state", "reset", "--scope", &scope])?;
    ensure!(
        degraded_entry(rig, fp)?.is_none(),
        "still degraded after the reset"
    );
    rig.wait_record("the reset", |r| {
        r["admin"]["action"] == "mode" && r["admin"]["request"]["scope"] == scope.as_str()
    })?;
    let (shown, _) = haltctl(rig, &["state", "show"])?;
    ensure!(
        !shown["held"]["scopes"]
            .as_array()
            .is_some_and(|l| l.iter().any(|r| r["scope"] == scope.as_str())),
        "the store still holds the reset scope: {shown}"
    );
    Ok(())
}

/// Removes the state store of `haltd` (the database and its WAL files).
fn remove_store(haltd: &Haltd) {
    for f in ["state.db", "state.db-wal", "state.db-shm"] {
        let _ = std::fs::remove_file(haltd.state_dir.join(f));
    }
}

#[test]
fn a_removed_store_is_rebuilt_and_a_foreign_one_stops_the_start() -> Result<()> {
    let mut rig = Rig::start(UPSTREAM_BIN, &[])?;
    let fp = rig.haltd.scope_of(KEY)?;
    degrade(&rig, KEY)?;
    ensure!(rig.haltd.stop()?.success());
    // Removed: the ledger's one segment holds every mode change, so the start rebuilds the
    // scopes from it; the key is still degraded.
    remove_store(&rig.haltd);
    let mut kept = vec![restart(&mut rig, &[])?];
    ensure!(
        degraded_entry(&rig, &fp)?.is_some(),
        "the key is not degraded after the store was removed"
    );
    ensure!(rig.haltd.stop()?.success());
    // Another haltd's store (another ledger, another node key) in its place: the start stops
    // with exit 4 and the reason.
    let other = Rig::start(UPSTREAM_BIN, &[])?;
    degrade(&other, "Bearer elsewhere")?;
    let mut other_haltd = other.haltd;
    ensure!(other_haltd.stop()?.success());
    remove_store(&rig.haltd);
    for f in ["state.db", "state.db-wal", "state.db-shm"] {
        let from = other_haltd.state_dir.join(f);
        if from.exists() {
            std::fs::copy(from, rig.haltd.state_dir.join(f))?;
        }
    }
    let mut args = vec!["--source", "openai", "--upstream", rig.up.url.as_str()];
    let refused = Haltd::start_with_ledger(&rig.pair, Some(&rig.haltd.ledger), &args);
    let err = format!("{:#}", refused.expect_err("a start with a foreign store"));
    ensure!(
        err.contains("exit status: 4") && err.contains("does not match the ledger"),
        "{err}"
    );
    // With --state-mismatch degrade-node it starts, every key degraded, recorded.
    args.extend_from_slice(&["--state-mismatch", "degrade-node"]);
    let ledger = rig.haltd.ledger.clone();
    let next = Haltd::start_with_ledger(&rig.pair, Some(&ledger), &args)?;
    kept.push(std::mem::replace(&mut rig.haltd, next));
    ensure!(
        served_degraded(&rig, "Bearer any-key")?,
        "the node is not degraded"
    );
    let rec = rig.wait_record("start mismatch", |r| r["mode_change"]["by"] == "start")?;
    ensure!(
        rec["mode_change"]["cause"]
            .as_str()
            .is_some_and(|c| c.contains("state store mismatch")),
        "{rec}"
    );
    drop(rig);
    drop(kept);
    drop(other_haltd);
    Ok(())
}

/// A state-store write that fails (`--fault state-write-fails-after=1`: the start's own link
/// is written, the first turn's commit is not) fails haltd closed, as a failed ledger write
/// does: later turns get 503 `recorder_failed`, and the log names the store.
#[test]
fn a_failed_state_write_fails_haltd_closed() -> Result<()> {
    let rig = Rig::start(UPSTREAM_BIN, &["--fault", "state-write-fails-after=1"])?;
    let first = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=3]]", true),
        Some(KEY),
        |_, _| {},
    )?;
    ensure!(
        first.error.is_none() && first.done_at.is_some(),
        "{first:?}"
    );
    let refused = haltd_tests::wait_for(Duration::from_secs(5), "a refused turn", || {
        let o = rig.stream(
            "/v1/chat/completions",
            &chat("[[script:normal tokens=3]]", true),
            Some(KEY),
            |_, _| {},
        )?;
        Ok((o.status == 503).then_some(o))
    })?;
    let body = refused.body.unwrap_or_default();
    ensure!(body.contains("recorder_failed"), "{body}");
    let log = rig.haltd.log_file("stderr.log")?;
    ensure!(
        log.contains("the state store failed") && log.contains("state-write-fails-after"),
        "{}",
        rig.haltd.log_tail(20)
    );
    Ok(())
}
