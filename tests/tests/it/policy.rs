//! Issue 37, points 1 and 2: routes take their turns (B, batch-only, detector modes) and every
//! record and access-log line names the route and profile; `haltctl detector mode` switches a
//! detector for new turns under load, never for an open stream, and the switch survives a
//! restart; `mkp` refuses a start and a switch that break its floor; `--lock-policy` refuses
//! every change that loosens, over the admin API and on SIGHUP.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering::SeqCst},
        Mutex,
    },
    time::Instant,
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    rig::{chat, Rig},
    sse, temp_dir, Haltd,
};
use serde_json::Value;

use crate::UPSTREAM_BIN;

/// Surprise in observe mode by default: three tokens of ln 0.001 (~10 bits) lift the mean of
/// a window of 4 above 6 bits.
const SURPRISE: &str = "[detectors.surprise]\nwindow = 4\nthreshold_bits = 6.0\nmin_tokens = 2\n";

const ROUTES: &str = "\n[[routes]]\nname = \"strict\"\nmodel = \"strict*\"\nbudget = 0\n\
                      batch_only = true\n[routes.detectors.surprise]\nmode = \"hard\"\n\n\
                      [[routes]]\nname = \"msgs\"\nsurface = \"messages\"\nbudget = 2\n";

/// A turn that breaches the surprise threshold at its second token.
fn surprising(model: &str, stream: bool) -> Value {
    let mut body = chat("[[script:normal tokens=6 low_at=1,2,3]]", stream);
    body["model"] = model.into();
    body
}

/// B, the modes and the profile as gauges; the strict route's trip and the default route's
/// observed findings as counters.
fn check_route_metrics(rig: &Rig) -> Result<()> {
    let m = rig.haltd.metrics()?;
    for (route, b) in [("strict", 0.0), ("msgs", 2.0), ("default", 5.0)] {
        let got = m.value("haltd_budget", &[("route", route)])?;
        ensure!(got == b, "haltd_budget{{route={route}}} = {got}");
    }
    let strict_mode = m.value(
        "haltd_detector_mode",
        &[
            ("detector", "surprise"),
            ("route", "strict"),
            ("mode", "hard"),
        ],
    )?;
    let default_mode = m.value(
        "haltd_detector_mode",
        &[
            ("detector", "surprise"),
            ("route", "default"),
            ("mode", "hard"),
        ],
    )?;
    let full = m.value("haltd_profile", &[("profile", "full")])?;
    ensure!(
        strict_mode == 1.0 && default_mode == 0.0 && full == 1.0,
        "modes {strict_mode} {default_mode}, profile {full}"
    );
    let trips = m.value(
        "haltd_policy_trips_total",
        &[
            ("detector", "surprise"),
            ("mode", "hard"),
            ("route", "strict"),
        ],
    )?;
    let observed = m.value(
        "haltd_policy_findings_total",
        &[
            ("detector", "surprise"),
            ("mode", "observe"),
            ("route", "default"),
        ],
    )?;
    ensure!(
        trips == 1.0 && observed >= 1.0,
        "trips {trips}, observed findings {observed}"
    );
    Ok(())
}

/// Each stream's access-log line names its route and the profile.
fn check_access_log(access: &str, expected: &[(&String, &str)]) -> Result<()> {
    let log = std::fs::read_to_string(access)?;
    for (id, route) in expected {
        let line: Value = log
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|l| l["stream_id"] == id.as_str())
            .with_context(|| format!("no access-log line for {id}: {log}"))?;
        ensure!(
            line["route"] == *route && line["profile"] == "full",
            "{line}"
        );
    }
    Ok(())
}

#[test]
fn routes_take_their_turns_and_every_record_names_them() -> Result<()> {
    let dir = temp_dir("policy-access")?;
    let access = dir.join("access.log").display().to_string();
    let rig = Rig::with_config(
        UPSTREAM_BIN,
        &format!("{SURPRISE}{ROUTES}"),
        &["--access-log", &access],
    )?;
    // "strict": asked to stream, served as batch (held whole) with B = 0; its surprise is hard.
    let key = sse::fresh_key();
    let strict = rig.stream(
        "/v1/chat/completions",
        &surprising("strict-1", true),
        Some(&key),
        |_, _| {},
    )?;
    ensure!(
        strict.tokens == 0,
        "a batch-only route streamed: {strict:?}"
    );
    let inc = rig.record("incident", &strict.stream_id)?;
    ensure!(
        inc["trip_cause"] == "SURPRISE_THRESHOLD"
            && inc["route"] == "strict"
            && inc["profile"] == "full"
            && inc["budget"] == 0
            && inc["mode"] == "batch",
        "{inc}"
    );
    let turn = rig.turn_record(&strict.stream_id)?;
    ensure!(
        turn["route"] == "strict" && turn["profile"] == "full",
        "{turn}"
    );
    // The default route: the same breach is only observed, and the turn streams with B = 5.
    let key = sse::fresh_key();
    let plain = rig.stream(
        "/v1/chat/completions",
        &surprising("scripted", true),
        Some(&key),
        |_, _| {},
    )?;
    ensure!(
        plain.status == 200 && plain.error.is_none() && plain.tokens == 6,
        "{plain:?}"
    );
    let turn = rig.turn_record(&plain.stream_id)?;
    ensure!(
        turn["route"] == "default" && turn["budget"] == 5 && turn["mode"] == "stream",
        "{turn}"
    );
    check_route_metrics(&rig)?;
    check_access_log(
        &access,
        &[(&strict.stream_id, "strict"), (&plain.stream_id, "default")],
    )?;
    println!("routes: strict incident {inc}\nroutes: default turn {turn}");
    Ok(())
}

#[test]
fn a_route_on_a_key_id_takes_that_keys_turns_after_a_reload() -> Result<()> {
    let mut rig = Rig::with_config(UPSTREAM_BIN, SURPRISE, &[])?;
    let (key, other) = (sse::fresh_key(), sse::fresh_key());
    // Without a key store the key id is the credential's fingerprint, as records show it.
    let id = rig.haltd.key_fingerprint(&key)?;
    let file = rig
        .config_dir
        .as_ref()
        .context("config dir")?
        .join("haltd.toml");
    std::fs::write(
        &file,
        format!("{SURPRISE}\n[[routes]]\nname = \"tenant\"\nkey_id = \"{id}\"\nbudget = 1\n"),
    )?;
    let message = crate::reload::hangup(&mut rig.haltd, 1)?;
    ensure!(
        message.contains("routes tenant, default under profile full"),
        "{message}"
    );
    for (auth, route, b) in [(&key, "tenant", 1), (&other, "default", 5)] {
        // A breach observed: the turn is always recorded.
        let o = rig.stream(
            "/v1/chat/completions",
            &surprising("scripted", true),
            Some(auth),
            |_, _| {},
        )?;
        let turn = rig.turn_record(&o.stream_id)?;
        ensure!(
            turn["route"] == route && turn["budget"] == b,
            "{auth}: {turn}"
        );
        ensure!(
            route != "tenant" || turn["conversation"] == id.as_str(),
            "{turn}"
        );
    }
    Ok(())
}

/// haltd again on `rig`'s ledger and state directory, with its config file.
fn restart(rig: &mut Rig) -> Result<Haltd> {
    let config = rig
        .config_dir
        .as_ref()
        .context("no config")?
        .join("haltd.toml")
        .display()
        .to_string();
    crate::restart_state::restart(rig, &["--config", &config])
}

/// One turn of the load: when it was sent, and whether surprise halted it.
struct Loaded {
    sent: Instant,
    halted: bool,
}

/// The load: short surprising turns back to back, each with a key of its own, until five
/// after the open stream ended.
fn load(rig: &Rig, open_done: &AtomicBool, loaded: &Mutex<Vec<Loaded>>) {
    let mut after_done = 0;
    while after_done < 5 {
        if open_done.load(SeqCst) {
            after_done += 1;
        }
        let sent = Instant::now();
        let key = sse::fresh_key();
        let Ok(o) = rig.stream(
            "/v1/chat/completions",
            &surprising("scripted", true),
            Some(&key),
            |_, _| {},
        ) else {
            continue;
        };
        let halted = o.error.is_some();
        loaded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Loaded { sent, halted });
    }
}

/// `haltctl detector list` shows surprise hard on the default route.
fn listed_hard(rig: &Rig) -> Result<()> {
    let list = rig.haltctl(false, &["detector", "list"])?;
    let row = list
        .lines()
        .find(|l| l.starts_with("default") && l.contains("surprise"))
        .with_context(|| list.clone())?;
    ensure!(row.contains("hard"), "{list}");
    // The exfiltration scanner judged every turn too.
    let exfil = list
        .lines()
        .find(|l| l.starts_with("default") && l.contains("exfil"))
        .with_context(|| list.clone())?;
    let judged: u64 = exfil
        .split_whitespace()
        .nth(4)
        .and_then(|n| n.parse().ok())
        .with_context(|| exfil.to_owned())?;
    ensure!(judged > 0, "{list}");
    println!("haltctl detector list:\n{list}");
    Ok(())
}

/// Whether the default route's surprise detector runs hard, as `GET /admin/policy` says.
fn surprise_is_hard(rig: &Rig, after: &str) -> Result<()> {
    let policy = rig.get_admin("/admin/policy")?;
    let mode = policy["routes"][0]["detectors"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["name"] == "surprise"))
        .map(|d| d["mode"].clone());
    ensure!(mode == Some("hard".into()), "after {after}: {policy}");
    Ok(())
}

/// The switch is kept: a new haltd on the same state directory starts with it; and one
/// whose state store is gone replays it from the ledger.
fn kept_after_restart(rig: &mut Rig) -> Result<()> {
    rig.haltd.stop()?;
    let _old = restart(rig)?;
    surprise_is_hard(rig, "a restart")?;
    rig.haltd.stop()?;
    for f in ["state.db", "state.db-wal", "state.db-shm"] {
        let _ = std::fs::remove_file(rig.haltd.state_dir.join(f));
    }
    let _older = restart(rig)?;
    surprise_is_hard(rig, "a start without its state store")?;
    let o = rig.stream(
        "/v1/chat/completions",
        &surprising("scripted", true),
        Some(&sse::fresh_key()),
        |_, _| {},
    )?;
    o.halted_cleanly("SURPRISE_THRESHOLD")
}

#[test]
fn a_runtime_switch_takes_new_turns_under_load_and_survives_a_restart() -> Result<()> {
    let mut rig = Rig::with_config(UPSTREAM_BIN, SURPRISE, &[])?;
    let switched: Mutex<Option<(Instant, Instant, Result<String>)>> = Mutex::new(None);
    let open_done = AtomicBool::new(false);
    let loaded: Mutex<Vec<Loaded>> = Mutex::new(Vec::new());
    let open = std::thread::scope(|s| {
        // The load: short surprising turns back to back, each with a key of its own.
        s.spawn(|| load(&rig, &open_done, &loaded));
        // The open stream: its breach comes after the switch, in the mode it started with.
        let body = chat(
            "[[script:normal tokens=80 pace_ms=10 low_at=60,61,62,63]]",
            true,
        );
        let o = rig.stream(
            "/v1/chat/completions",
            &body,
            Some(&sse::fresh_key()),
            |p, ev| {
                if matches!(ev.kind, haltd_tests::EventKind::Token(_)) && p.tokens == 3 {
                    let asked = Instant::now();
                    let out = rig.haltctl(true, &["detector", "mode", "surprise", "hard"]);
                    *switched.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some((asked, Instant::now(), out));
                }
            },
        );
        open_done.store(true, SeqCst);
        o
    })?;
    let (asked, answered, out) = switched
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .context("the switch never ran")?;
    let answer: Value = serde_json::from_str(&out?)?;
    ensure!(
        answer["detector"] == "surprise"
            && answer["mode"] == "hard"
            && answer["before"]["default"] == "observe",
        "{answer}"
    );
    ensure!(
        open.error.is_none() && open.tokens == 80,
        "the stream open at the switch was judged in the new mode: {:?}",
        open.error
    );
    let loaded = loaded.into_inner().unwrap_or_else(|e| e.into_inner());
    let before: Vec<&Loaded> = loaded.iter().filter(|l| l.sent < asked).collect();
    let after: Vec<&Loaded> = loaded.iter().filter(|l| l.sent > answered).collect();
    let first = loaded.iter().position(|l| l.halted);
    println!(
        "switch: {} turns of load, {} sent before the switch was asked ({} halted), {} after its answer ({} halted); the first halted turn is #{first:?}; the switch took {} ms",
        loaded.len(),
        before.len(),
        before.iter().filter(|l| l.halted).count(),
        after.len(),
        after.iter().filter(|l| l.halted).count(),
        answered.duration_since(asked).as_millis()
    );
    ensure!(
        before.iter().all(|l| !l.halted),
        "a turn sent before the switch was halted"
    );
    ensure!(
        !after.is_empty() && after.iter().all(|l| l.halted),
        "a turn sent after the switch ran in observe mode"
    );
    let rec = rig.wait_record("the switch's record", |r| {
        r["kind"] == "admin" && r["admin"]["action"] == "detector_mode"
    })?;
    ensure!(
        rec["admin"]["outcome"] == "applied"
            && rec["admin"]["actor"].is_object()
            && rec["admin"]["status"] == 200,
        "{rec}"
    );
    println!("switch record: {rec}");
    listed_hard(&rig)?;
    kept_after_restart(&mut rig)
}

/// mkp with a B above 5, on the flag or on a route, does not start, naming the key.
fn mkp_refuses_to_start() -> Result<()> {
    // At start: mkp with a B above 5, on the flag or on a route, names the key.
    let pair = haltd_tests::NetPair::new()?;
    let dir = temp_dir("mkp")?;
    let ledger = dir.join("ledger.jsonl");
    let (status, stderr) =
        Haltd::start_refused(&pair, &ledger, &["--profile", "mkp", "--budget", "8"])?;
    ensure!(
        !status.success()
            && stderr.contains("invalid --budget: budget: B = 8 is above 5 (profile mkp"),
        "{status}: {stderr}"
    );
    let config = dir.join("haltd.toml");
    std::fs::write(
        &config,
        "[[routes]]\nname = \"wide\"\nmodel = \"w\"\nbudget = 9\n",
    )?;
    let config = config.display().to_string();
    let (status, stderr) =
        Haltd::start_refused(&pair, &ledger, &["--profile", "mkp", "--config", &config])?;
    ensure!(
        !status.success() && stderr.contains("routes.wide.budget: B = 9 is above 5"),
        "{status}: {stderr}"
    );
    println!(
        "mkp at start: {}",
        stderr
            .lines()
            .rev()
            .find(|l| l.contains("routes.wide"))
            .unwrap_or_default()
    );

    Ok(())
}

#[test]
fn mkp_and_the_lock_refuse_what_loosens() -> Result<()> {
    mkp_refuses_to_start()?;
    // At runtime, with --lock-policy: each loosening is refused with 409, a WARN and a record.
    let mut rig = Rig::with_config(
        UPSTREAM_BIN,
        "[detectors.surprise]\nmode = \"hard\"\n",
        &["--budget", "8", "--lock-policy"],
    )?;
    let refusals = [
        (vec!["profile", "set", "mkp"], "budget: B = 8 is above 5"),
        (
            vec!["detector", "mode", "surprise", "observe"],
            "route default: surprise: mode hard -> observe",
        ),
        (
            vec!["mode", "full"],
            "ending a degraded scope loosens the policy",
        ),
    ];
    for (args, why) in &refusals {
        let e = rig.haltctl(false, args).expect_err("refused");
        let e = format!("{e:#}");
        ensure!(
            e.contains("409") && e.contains(why),
            "haltctl {args:?}: {e}"
        );
        println!(
            "lock: haltctl {} -> {}",
            args.join(" "),
            e.lines().next().unwrap_or_default()
        );
    }
    // Tightening is applied.
    rig.haltctl(false, &["detector", "mode", "latency_anomaly", "hard"])?;
    // SIGHUP with a file that loosens: refused whole, and the record says why.
    let file = rig
        .config_dir
        .as_ref()
        .context("config dir")?
        .join("haltd.toml");
    std::fs::write(&file, "[detectors.surprise]\nmode = \"observe\"\n")?;
    let message = crate::reload::hangup(&mut rig.haltd, 1)?;
    ensure!(
        message.contains("reload on SIGHUP failed")
            && message.contains("refused by --lock-policy")
            && message.contains("route default: surprise: mode hard -> observe"),
        "{message}"
    );
    println!("lock on SIGHUP: {message}");
    let refused = rig
        .haltd
        .metrics()?
        .sum("haltd_policy_changes_refused_total");
    ensure!(
        refused == 4.0,
        "haltd_policy_changes_refused_total = {refused}"
    );
    let records = rig.haltd.ledger_records()?;
    let admin_409 = records
        .iter()
        .filter(|r| r["kind"] == "admin" && r["admin"]["status"] == 409)
        .count();
    ensure!(admin_409 == 3, "{admin_409} refused admin records");
    Ok(())
}
