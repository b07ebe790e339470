//! A restart never loosens governance (`daemon/src/state.rs`): a key degraded by a halt is
//! still degraded, with the same expiry, after haltd stops on SIGTERM and again after it is
//! killed with SIGKILL while streams are open, and `haltctl state show` lists it; a
//! conversation's committed TURN-ACID state survives the restart; a state store that does not
//! match the ledger stops the start (exit 4) and is never reset.

use std::{process::Command, thread, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    haltctl_bin,
    rig::{chat, Rig},
    spawn_in_netns, trip_here, EventKind, Haltd,
};
use serde_json::Value;

use crate::UPSTREAM_BIN;

const KEY: &str = "Bearer key-restart";

/// Trips a stream of `auth` (operator) and waits until its key's mode change is recorded.
fn degrade(rig: &Rig, auth: &str) -> Result<()> {
    let admin = rig.haltd.admin_url();
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=200 pace_ms=5]]", true),
        Some(auth),
        |p, ev| {
            if matches!(ev.kind, EventKind::Token(_)) && p.tokens == 2 {
                let _ = trip_here(&format!("{admin}/admin/streams/{}/trip", p.stream_id), None);
            }
        },
    )?;
    o.halted_cleanly("OPERATOR_TRIP")?;
    rig.wait_record("mode change", |r| r["mode_change"]["to"] == "degraded")?;
    Ok(())
}

/// The degraded entry of `fingerprint` in `GET /admin/mode`, if any.
fn degraded_entry(rig: &Rig, fingerprint: &str) -> Result<Option<Value>> {
    let mode = rig.get_admin("/admin/mode")?;
    Ok(mode["keys"]
        .as_array()
        .and_then(|l| l.iter().find(|k| k["key"] == fingerprint).cloned()))
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

/// `haltctl --json ARGS` against the rig's haltd, from the client namespace: its output as
/// JSON and the plain output of the same command.
fn haltctl(rig: &Rig, args: &[&str]) -> Result<(Value, String)> {
    let run = |json: bool| -> Result<String> {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &rig.pair.cli])
            .arg(haltctl_bin()?)
            .arg("--admin")
            .arg(rig.haltd.admin.to_string())
            .arg("--admin-token-file")
            .arg(rig.haltd.admin_token_file());
        if json {
            c.arg("--json");
        }
        let out = c.args(args).output()?;
        ensure!(
            out.status.success(),
            "haltctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    Ok((serde_json::from_str(&run(true)?)?, run(false)?))
}

/// haltd again, on the ledger (and so the state directory) of the one `rig` ran; the old
/// instance is returned, to keep its directory until the test ends.
fn restart(rig: &mut Rig, extra: &[&str]) -> Result<Haltd> {
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
    let fp = rig.haltd.key_fingerprint(KEY)?;
    degrade(&rig, KEY)?;
    let before = degraded_entry(&rig, &fp)?.context("degraded after the halt")?;
    let until = before["until_unix_ms"].as_u64().context("a timer")?;
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
    let after = degraded_entry(&rig, &fp)?.context("degraded after SIGTERM")?;
    ensure!(
        after["until_unix_ms"].as_u64() == Some(until) && after["cause"] == before["cause"],
        "after SIGTERM: {after}, before: {before}"
    );
    ensure!(served_degraded(&rig, KEY)?, "served in full after SIGTERM");
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
    let held = rig.get_admin("/admin/state")?;
    ensure!(
        held["held"]["scopes"]
            .as_array()
            .is_some_and(|s| s.iter().any(|r| r["scope"] == format!("key:{fp}"))),
        "haltctl state show does not list the key: {held}"
    );

    // SIGKILL with streams open.
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
    kept.push(restart(&mut rig, &extra)?);
    let after = degraded_entry(&rig, &fp)?.context("degraded after SIGKILL")?;
    ensure!(
        after["until_unix_ms"].as_u64() == Some(until),
        "after SIGKILL: {after}, before: {before}"
    );
    ensure!(served_degraded(&rig, KEY)?, "served in full after SIGKILL");

    // `haltctl state show` lists the key; `haltctl state reset` ends it, recorded with the
    // operator's identity, and the store forgets it too.
    let scope = format!("key:{fp}");
    let (shown, text) = haltctl(&rig, &["state", "show"])?;
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
    haltctl(&rig, &["state", "reset", "--scope", &scope])?;
    ensure!(
        degraded_entry(&rig, &fp)?.is_none(),
        "still degraded after the reset"
    );
    rig.wait_record("the reset", |r| {
        r["admin"]["action"] == "mode" && r["admin"]["request"]["scope"] == scope.as_str()
    })?;
    let (shown, _) = haltctl(&rig, &["state", "show"])?;
    ensure!(
        !shown["held"]["scopes"]
            .as_array()
            .is_some_and(|l| l.iter().any(|r| r["scope"] == scope.as_str())),
        "the store still holds the reset scope: {shown}"
    );
    drop(rig);
    drop(kept);
    Ok(())
}

#[test]
fn a_store_that_does_not_match_its_ledger_stops_the_start() -> Result<()> {
    let mut rig = Rig::start(UPSTREAM_BIN, &[])?;
    degrade(&rig, KEY)?;
    let status = rig.haltd.stop()?;
    ensure!(status.success(), "SIGTERM: {status}");
    // The store removed: the ledger records a degrade that no store holds.
    let store = rig.haltd.state_dir.join("state.db");
    for f in ["state.db", "state.db-wal", "state.db-shm"] {
        let _ = std::fs::remove_file(rig.haltd.state_dir.join(f));
    }
    ensure!(!store.exists());
    let mut args = vec!["--source", "openai", "--upstream", rig.up.url.as_str()];
    let refused = Haltd::start_with_ledger(&rig.pair, Some(&rig.haltd.ledger), &args);
    let err = format!("{:#}", refused.expect_err("a start with a removed store"));
    ensure!(
        err.contains("does not match the ledger") || err.contains("exit status: 4"),
        "{err}"
    );
    // With --state-mismatch degrade-node it starts, every key degraded, recorded.
    args.extend_from_slice(&["--state-mismatch", "degrade-node"]);
    let ledger = rig.haltd.ledger.clone();
    let next = Haltd::start_with_ledger(&rig.pair, Some(&ledger), &args)?;
    let old = std::mem::replace(&mut rig.haltd, next);
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
    drop(old);
    Ok(())
}
