//! The kill loop (issue 13, point 5): SIGKILL haltd at random moments under heavy trip and turn
//! load, again and again, on one ledger. After every kill the chain verifies (`haltctl ledger
//! verify`, against the key and the head) and every record haltd answered for is there: a halt
//! the client saw (its terminal event), an admin trip it acknowledged (`200`), a committed turn
//! (the client saw `[DONE]`). Every restart on the killed ledger must succeed: a torn tail is
//! cut and recorded, a file one record past its head is caught up. And a restart never
//! loosens governance: the degraded scopes the new haltd holds are exactly those the ledger's
//! mode changes left degraded, each with the same end (`daemon/src/state.rs`).
//!
//! With a scripted upstream (`Options::upstream_bin`), TokenCircuit's memory and the failed
//! turns' dispatched calls are checked at every restart too (`kill_loop/circuit.rs`).
//!
//! Nothing is left behind: each killed haltd leaves its cgroup leaf (its gate programs attached,
//! no process in it), and the next start must remove it and say so in its log
//! (`daemon/src/gate/cgroup/leftovers.rs`); the report counts the leaves the starts removed.
//!
//! Run from `cargo xtask test` (a short loop, `crash::kill_loop_keeps_every_acknowledged_record`)
//! and `cargo xtask bench --kill-loop` (`bench-kill-loop`, 1,000 kills).

use std::{
    collections::{BTreeMap, HashSet},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

mod circuit;

use anyhow::{anyhow, Result};
use serde_json::{json, Value};

use crate::{
    daemon::Haltd,
    ledger::{read_ledger, state_dir_for, verify_ledger},
    netns::{in_netns, spawn_in_netns, NetPair},
    sse, temp_dir,
};

/// How to run the loop.
#[derive(Debug, Clone)]
pub struct Options {
    pub kills: usize,
    /// Concurrent streaming clients.
    pub clients: usize,
    /// Print a progress line every this many kills (0: never).
    pub progress_every: usize,
    /// Start a fresh ledger (and state directory) every this many kills: haltd verifies the
    /// whole chain at every start, so one ledger for 1,000 rounds would make each start slower
    /// than the last.
    pub kills_per_ledger: usize,
    /// `scripted-upstream`: proxy it with `[tool_circuit]` enabled and check TokenCircuit's
    /// state at every restart; `None`: the built-in source only.
    pub upstream_bin: Option<String>,
}

/// What the loop did and found.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub kills: usize,
    pub restarts: usize,
    /// Restarts that cut a torn tail (a `recovery` record).
    pub recoveries: usize,
    /// Kills that left the file one record past its head (the restart catches the head up).
    pub head_catchups: usize,
    /// Acknowledged records checked present, by kind.
    pub halts_checked: usize,
    pub admin_checked: usize,
    pub turns_checked: usize,
    /// Restarts whose degraded scopes were checked against the ledger's, and the scopes
    /// checked (a restart never loosens governance: `daemon/src/state.rs`).
    pub state_checks: usize,
    pub scopes_checked: usize,
    /// Restarts whose TokenCircuit state was checked: the dispatched calls (against the
    /// ledger) and the settled used-up budgets checked.
    pub circuit_checks: usize,
    pub dispatched_checked: usize,
    pub budgets_checked: usize,
    pub premature_checked: usize,
    /// Leftover cgroup leaves the starts removed (their log lines), and the restarts that
    /// removed the leaf of the haltd killed just before.
    pub leaves_removed: usize,
    pub killed_leaves_removed: usize,
    /// What went wrong (an empty list is a pass).
    pub failures: Vec<String>,
    pub wall: Duration,
}

impl Report {
    pub fn acknowledged_checked(&self) -> usize {
        self.halts_checked + self.admin_checked + self.turns_checked
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "kills {}, restarts {}, recoveries: torn tail cut {}, head one record behind {}; acknowledged records checked {} (halts {}, admin trips {}, committed turns {}); degraded state checked at {} restarts ({} scopes); TokenCircuit state checked at {} restarts ({} dispatched calls, {} used-up budgets, {} premature retries); cgroup leaves removed at the starts {} (the killed haltd's at {} restarts); failures {}, wall {:.1} s",
            self.kills,
            self.restarts,
            self.recoveries,
            self.head_catchups,
            self.acknowledged_checked(),
            self.halts_checked,
            self.admin_checked,
            self.turns_checked,
            self.state_checks,
            self.scopes_checked,
            self.circuit_checks,
            self.dispatched_checked,
            self.budgets_checked,
            self.premature_checked,
            self.leaves_removed,
            self.killed_leaves_removed,
            self.failures.len(),
            self.wall.as_secs_f64()
        )
    }
}

/// Something haltd answered for, by stream id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Acked {
    /// The client saw the halt's terminal event.
    Halt(String),
    /// The admin API answered 200 to a trip.
    AdminTrip(String),
    /// The client saw `[DONE]` of a turn that ended normally.
    Turn(String),
}

/// Runs the loop on a fresh ledger in `pair`'s namespaces.
pub fn run(pair: &NetPair, opts: &Options) -> Result<Report> {
    let t0 = Instant::now();
    let mut dir = temp_dir("kill-loop")?;
    let mut report = Report::default();
    let upstream = match &opts.upstream_bin {
        Some(bin) => Some(crate::upstream::ScriptedUpstream::start(pair, bin, &[])?),
        None => None,
    };
    let mut settled = Vec::new();
    let mut killed_leaf = None;
    for i in 0..opts.kills {
        if i > 0 && i % opts.kills_per_ledger.max(1) == 0 && report.failures.is_empty() {
            let _ = std::fs::remove_dir_all(&dir);
            dir = temp_dir("kill-loop")?;
        }
        let ledger = dir.join("ledger.jsonl");
        let first = i % opts.kills_per_ledger.max(1) == 0;
        if first {
            settled.clear();
        }
        let round = Round {
            index: i,
            first,
            clients: opts.clients,
            upstream: upstream.as_ref().map(|u| u.url.as_str()),
        };
        match one_kill(
            pair,
            &ledger,
            &round,
            &settled,
            &mut killed_leaf,
            &mut report,
        ) {
            Ok(now) => settled = now,
            Err(e) => report.failures.push(format!("kill {i}: {e:#}")),
        }
        report.wall = t0.elapsed();
        if opts.progress_every > 0 && (i + 1) % opts.progress_every == 0 {
            eprintln!("kill-loop: {}/{}: {report}", i + 1, opts.kills);
        }
        if report.failures.len() >= 5 {
            break; // enough to act on; the ledger is kept for a look
        }
    }
    report.wall = t0.elapsed();
    if report.failures.is_empty() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("kill-loop: ledger kept in {}", dir.display());
    }
    Ok(report)
}

/// One round's place in the loop.
struct Round<'a> {
    index: usize,
    /// The first on its ledger: nothing to check yet.
    first: bool,
    clients: usize,
    /// The scripted upstream's URL: proxy it, with TokenCircuit.
    upstream: Option<&'a str>,
}

/// haltd on `ledger` for `round`.
fn start(pair: &NetPair, ledger: &Path, round: &Round<'_>) -> Result<Haltd> {
    let state = state_dir_for(ledger).display().to_string();
    let mut args = vec![
        "--builtin-token-interval-us".to_owned(),
        "1000".to_owned(),
        "--state-dir".to_owned(),
        state,
    ];
    if let Some(url) = round.upstream {
        let config = ledger.with_file_name("haltd.toml");
        std::fs::write(&config, circuit::CONFIG)?;
        for a in ["--source", "openai", "--upstream", url, "--config"] {
            args.push(a.to_owned());
        }
        args.push(config.display().to_string());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Haltd::start_with_ledger(pair, Some(ledger), &args)
}

/// One round: (re)start haltd on the ledger, load it, SIGKILL it at a random moment, check.
/// Returns the conversations TokenCircuit settled (checked after the next restart).
/// `killed_leaf`: the cgroup leaf of the haltd killed last, which this start must remove; the
/// leaf of the one this round kills on return.
fn one_kill(
    pair: &NetPair,
    ledger: &Path,
    round: &Round<'_>,
    settled_before: &[circuit::Settled],
    killed_leaf: &mut Option<PathBuf>,
    report: &mut Report,
) -> Result<Vec<circuit::Settled>> {
    let before = if ledger.exists() {
        read_ledger(ledger)?.len()
    } else {
        0
    };
    let mut haltd = start(pair, ledger, round)?;
    check_leaves(&haltd, killed_leaf.take(), report)?;
    *killed_leaf = Some(crate::gate::cgroup_of(
        haltd.pid().ok_or_else(|| anyhow!("haltd is not running"))?,
    )?);
    if !round.first {
        report.restarts += 1;
        check_state(&haltd, ledger, before, report)?;
        if round.upstream.is_some() {
            let records = read_ledger(ledger)?;
            let written = records.get(..before).unwrap_or_default();
            circuit::check(&haltd, written, settled_before, report)?;
        }
    }
    let acked = Arc::new(Mutex::new(Vec::new()));
    let settled = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    let proxied = round.upstream.is_some();
    for c in 0..round.clients {
        load.push(stream_client(&haltd, c, proxied, &acked, &stop));
    }
    load.push(admin_tripper(&haltd, &acked, &stop));
    if proxied {
        load.push(circuit::client(&haltd, round.index, &settled, &stop));
    }
    thread::sleep(Duration::from_millis(rand::random_range(20..400)));
    haltd.crash()?;
    report.kills += 1;
    stop.store(true, Ordering::Release);
    for t in load {
        t.join().map_err(|_| anyhow!("a load thread panicked"))?;
    }
    drop(haltd);
    let verified = verify_ledger(ledger)?;
    if verified.contains("one record past its head") {
        report.head_catchups += 1;
    }
    let records = read_ledger(ledger)?;
    let after = records.get(before..).unwrap_or_default();
    report.recoveries += after.iter().filter(|r| r["recovery"].is_object()).count();
    let acked = std::mem::take(&mut *acked.lock().map_err(|_| anyhow!("poisoned"))?);
    check_acked(&acked, after, report)?;
    let settled = std::mem::take(&mut *settled.lock().map_err(|_| anyhow!("poisoned"))?);
    Ok(settled)
}

/// The leftover cgroup leaves `haltd`'s start removed are counted, and among them must be
/// `killed`, the leaf of the haltd killed before it, now gone.
fn check_leaves(haltd: &Haltd, killed: Option<PathBuf>, report: &mut Report) -> Result<()> {
    let removed = haltd.removed_leaves()?;
    report.leaves_removed += removed.len();
    let Some(killed) = killed else {
        return Ok(());
    };
    let name = killed
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    anyhow::ensure!(
        !killed.exists() && removed.iter().any(|p| p.ends_with(&name)),
        "the start after the kill did not remove the killed haltd's cgroup leaf {} (removed: {removed:?})",
        killed.display()
    );
    report.killed_leaves_removed += 1;
    Ok(())
}

/// A client that streams turns one after another, most of them short enough to complete,
/// some long enough to be tripped; it notes what haltd answered for.
fn stream_client(
    haltd: &Haltd,
    c: usize,
    proxied: bool,
    acked: &Arc<Mutex<Vec<Acked>>>,
    stop: &Arc<AtomicBool>,
) -> thread::JoinHandle<()> {
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let (acked, stop) = (Arc::clone(acked), Arc::clone(stop));
    spawn_in_netns(&haltd.client_ns, move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Acquire) {
            n += 1;
            let max_tokens: u32 = if n.is_multiple_of(3) {
                400
            } else {
                rand::random_range(2..30)
            };
            let body = if proxied {
                // The scripted model, at about the built-in source's pace.
                let script = format!("[[script:normal tokens={max_tokens} pace_ms=1]]");
                json!({"model": "scripted", "stream": true,
                       "messages": [{"role": "user", "content": script}]})
            } else {
                json!({
                    "model": "builtin", "stream": true, "max_tokens": max_tokens,
                    "seed": c as u64 * 1_000_000 + n, "ignore_eos": true,
                    "messages": [{"role": "user", "content": "kill loop"}],
                })
            };
            let Ok(o) = sse::stream(&url, &body, Duration::from_secs(10), |_, _| {}) else {
                thread::sleep(Duration::from_millis(5));
                continue;
            };
            let seen = if o.error.is_some() && o.read_error.is_none() {
                Some(Acked::Halt(o.stream_id.clone()))
            } else if o.done_at.is_some() && o.error.is_none() {
                Some(Acked::Turn(o.stream_id.clone()))
            } else {
                None
            };
            if let (Some(a), Ok(mut v)) = (seen, acked.lock()) {
                v.push(a);
            }
        }
    })
}

/// Trips live streams through the admin API as fast as it can; notes each `200`.
fn admin_tripper(
    haltd: &Haltd,
    acked: &Arc<Mutex<Vec<Acked>>>,
    stop: &Arc<AtomicBool>,
) -> thread::JoinHandle<()> {
    let (list_url, admin) = (
        format!("{}/admin/streams", haltd.admin_url()),
        haltd.admin_url(),
    );
    let (acked, stop) = (Arc::clone(acked), Arc::clone(stop));
    spawn_in_netns(&haltd.client_ns, move || {
        while !stop.load(Ordering::Acquire) {
            let Ok(list) = crate::http::get_json_here(&list_url) else {
                thread::sleep(Duration::from_millis(5));
                continue;
            };
            let ids: Vec<String> = list["streams"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|s| s["state"] != "halted" && rand::random_bool(0.5))
                .filter_map(|s| s["stream_id"].as_str().map(str::to_owned))
                .collect();
            for id in ids {
                let url = format!("{admin}/admin/streams/{id}/trip");
                if let Ok((200, _)) = crate::http::trip_here(&url, None) {
                    if let Ok(mut v) = acked.lock() {
                        v.push(Acked::AdminTrip(id));
                    }
                }
            }
            thread::sleep(Duration::from_millis(2));
        }
    })
}

/// The degraded scopes haltd restored are those the ledger's first `before` records (what
/// the killed instance wrote) leave degraded, each with the same end.
fn check_state(haltd: &Haltd, ledger: &Path, before: usize, report: &mut Report) -> Result<()> {
    let records = read_ledger(ledger)?;
    let mut want: BTreeMap<String, Value> = BTreeMap::new();
    for r in records.iter().take(before) {
        let ch = &r["mode_change"];
        let Some(scope) = ch["scope"].as_str() else {
            continue;
        };
        if ch["to"] == "degraded" {
            want.insert(scope.to_owned(), ch["until_unix_ms"].clone());
        } else {
            want.remove(scope);
        }
    }
    let url = format!("{}/admin/mode", haltd.admin_url());
    let mode = in_netns(&haltd.client_ns, move || crate::http::get_json_here(&url))?;
    let mut have: BTreeMap<String, Value> = BTreeMap::new();
    if let Some(node) = mode.get("node").filter(|n| !n.is_null()) {
        have.insert("node".to_owned(), node["until_unix_ms"].clone());
    }
    for k in mode["keys"].as_array().into_iter().flatten() {
        let scope = k["scope"].as_str().unwrap_or_default().to_owned();
        have.insert(scope, k["until_unix_ms"].clone());
    }
    report.state_checks += 1;
    report.scopes_checked += want.len();
    anyhow::ensure!(
        have == want,
        "after the restart haltd holds the degraded scopes {have:?}, the ledger says {want:?}"
    );
    Ok(())
}

/// Every acknowledged record is among the records this round wrote.
fn check_acked(acked: &[Acked], records: &[Value], report: &mut Report) -> Result<()> {
    let mut have = HashSet::new();
    for r in records {
        let id = r["stream_id"].as_str().unwrap_or_default().to_owned();
        match r["kind"].as_str() {
            Some("incident") => {
                have.insert(Acked::Halt(id));
            }
            Some("admin") if r["admin"]["action"] == "trip" && r["admin"]["status"] == 200 => {
                have.insert(Acked::AdminTrip(id));
            }
            Some("turn") if r["turn_status"] == "committed" => {
                have.insert(Acked::Turn(id));
            }
            _ => {}
        }
    }
    let missing: Vec<&Acked> = acked.iter().filter(|a| !have.contains(a)).collect();
    for a in acked {
        match a {
            Acked::Halt(_) => report.halts_checked += 1,
            Acked::AdminTrip(_) => report.admin_checked += 1,
            Acked::Turn(_) => report.turns_checked += 1,
        }
    }
    anyhow::ensure!(
        missing.is_empty(),
        "{} acknowledged records missing from the ledger: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    Ok(())
}
