//! Nothing left behind (issue 33, item 3): the cgroup leaves of haltd processes that are gone,
//! and a ledger whose head is missing.
//!
//! - A start removes the leaf of every earlier haltd that is gone, killed (`SIGKILL`, reaped)
//!   or a zombie (killed, not reaped by its parent), logs each and names them in its start
//!   record (`daemon/src/gate/cgroup/leftovers.rs`); a clean stop removes its own leaf where
//!   the cgroup it was started in lets the user it serves as write it (a delegated cgroup, as
//!   systemd's `Delegate=yes` makes the unit's). That the programs keep policing the sockets
//!   of a removed leaf is `kernel_gate::egress::egress_holds_after_its_leaf_is_removed`.
//! - A ledger with records but no head stops the start (exit 3, the error says what to do),
//!   until `haltctl ledger reanchor --operator NAME` takes the chain as it stands, recorded in
//!   it (`daemon/src/ledger/reanchor.rs`).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    gate::{cgroup2_mount, cgroup_of, in_cgroup},
    haltctl_bin, in_netns, read_ledger, require_root, sse, state_dir_for, temp_dir, verify_ledger,
    wait_for, Haltd, NetPair,
};
use serde_json::{json, Value};

/// haltd's own leaf while it serves (`haltd.<pid>.<start>.<n>`).
fn leaf_of(haltd: &Haltd) -> Result<PathBuf> {
    let leaf = cgroup_of(haltd.pid().context("haltd is not running")?)?;
    let name = leaf_name(&leaf);
    ensure!(
        name.starts_with("haltd.") && name.split('.').count() == 4,
        "haltd serves from {}, not a leaf of its own",
        leaf.display()
    );
    Ok(leaf)
}

fn leaf_name(leaf: &Path) -> String {
    leaf.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// haltd's start record (its first `lifecycle` record saying `started`).
fn start_record(haltd: &Haltd) -> Result<Value> {
    haltd.wait_record("the start record", |r| {
        r["kind"] == "lifecycle"
            && r["message"]
                .as_str()
                .is_some_and(|m| m.contains(") started: "))
    })
}

/// The next start removed `leaf`, logged it with `why` and named it in its start record.
fn check_removed(next: &Haltd, leaf: &Path, why: &str) -> Result<()> {
    let name = leaf_name(leaf);
    ensure!(
        !leaf.exists(),
        "{} is still there after the next start",
        leaf.display()
    );
    let log = next.log_file("stderr.log")?;
    let line = log
        .lines()
        .find(|l| l.contains("removed the cgroup leaf") && l.contains(&name))
        .with_context(|| format!("no log line names the removed leaf {name}:\n{log}"))?;
    ensure!(line.contains(why), "the removal says why ({why}): {line}");
    let start = start_record(next)?;
    let message = start["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains("removed_cgroup_leaves=[") && message.contains(&name),
        "the start record names the removed leaf {name}: {message}"
    );
    println!("removed {name}: {line}");
    Ok(())
}

/// `kill -9`: the killed haltd's leaf stays (its programs attached, no process in it) until
/// the next start, which removes it and says so.
#[test]
fn a_start_removes_the_leaf_of_a_killed_haltd() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let mut first = Haltd::start(&pair, &[])?;
    let leaf = leaf_of(&first)?;
    first.crash()?;
    ensure!(
        leaf.is_dir(),
        "the killed haltd's leaf {} is gone before any start",
        leaf.display()
    );
    let next = Haltd::start(&pair, &[])?;
    check_removed(&next, &leaf, "exited")?;
    ensure!(
        next.removed_leaves()?
            .iter()
            .any(|p| p.ends_with(&leaf_name(&leaf))),
        "Haltd::removed_leaves reads the removal"
    );
    Ok(())
}

/// The state (`/proc/<pid>/stat` field 3) of process `pid`.
fn proc_state(pid: u32) -> Result<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let (_, rest) = stat.rsplit_once(')').context("stat without a command")?;
    rest.split_whitespace()
        .next()
        .and_then(|s| s.chars().next())
        .context("stat without a state")
}

/// A haltd killed but not reaped by its parent (this test) is a zombie: `/proc/<pid>` is
/// there, yet it holds nothing. The next start counts it as gone and removes its leaf.
#[test]
fn a_zombie_haltd_counts_as_gone() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let zombie = Haltd::start(&pair, &[])?;
    let leaf = leaf_of(&zombie)?;
    let pid = zombie.pid().context("haltd is not running")?;
    let raw = libc::pid_t::try_from(pid)?;
    // SAFETY: kill(2) on the haltd child this test started; it is not waited for, so it stays
    // a zombie until `zombie` is dropped.
    let killed = unsafe { libc::kill(raw, libc::SIGKILL) };
    ensure!(killed == 0, "kill -9 {pid}");
    wait_for(Duration::from_secs(10), "the killed haltd a zombie", || {
        Ok((proc_state(pid)? == 'Z').then_some(()))
    })?;
    let next = Haltd::start(&pair, &[])?;
    ensure!(
        proc_state(pid)? == 'Z',
        "pid {pid} was reaped before the check"
    );
    check_removed(&next, &leaf, "zombie")?;
    drop(zombie);
    Ok(())
}

/// A SIGTERM stop removes haltd's own leaf on the way out, where the cgroup it was started in
/// is writable by it once its capabilities are dropped: here a cgroup of its own, owned by
/// the user it runs as, as systemd's `Delegate=yes` gives the unit.
#[test]
fn a_stopped_haltd_leaves_no_leaf() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let cg = cgroup2_mount()?.join(format!("haltd-test-stop-{}", std::process::id()));
    fs::create_dir_all(&cg)?;
    let result = stop_in(&pair, &cg);
    let removed = fs::remove_dir(&cg);
    result?;
    removed.with_context(|| format!("removing {}: something stayed in it", cg.display()))
}

fn stop_in(pair: &NetPair, cg: &Path) -> Result<()> {
    let mut haltd = in_cgroup(cg, || Haltd::start(pair, &[]))??;
    let leaf = leaf_of(&haltd)?;
    ensure!(
        leaf.parent() == Some(cg),
        "haltd's leaf {} is not under {}",
        leaf.display(),
        cg.display()
    );
    let status = haltd.stop()?;
    ensure!(status.code() == Some(0), "haltd stopped with {status}");
    ensure!(
        !leaf.exists(),
        "the stopped haltd left its leaf {}; log:\n{}",
        leaf.display(),
        haltd.log_tail(20)
    );
    let log = haltd.log_file("stderr.log")?;
    ensure!(
        log.contains("removed haltd's own cgroup leaf on the way out"),
        "the stop does not say it removed its leaf:\n{log}"
    );
    let records = haltd.ledger_records()?;
    let stop = records.last().context("no record")?;
    let message = stop["message"].as_str().unwrap_or_default();
    // haltd names the leaf as its own mount of the hierarchy shows it.
    let named = format!("/{} removed", leaf_name(&leaf));
    ensure!(
        message.contains("haltd stopping on signal")
            && message.contains("; cgroup leaf ")
            && message.contains(&named),
        "the stop record names the removed leaf: {message}"
    );
    ensure!(
        fs::read_dir(cg)?.flatten().all(|e| !e.path().is_dir()),
        "a leaf stayed in {}",
        cg.display()
    );
    Ok(())
}

/// Three short turns, so that the ledger has records to cut.
fn turns(haltd: &Haltd, n: usize) -> Result<()> {
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    for i in 0..n {
        let body = json!({
            "model": "builtin", "stream": true, "max_tokens": 3, "seed": i,
            "messages": [{"role": "user", "content": "reanchor"}],
        });
        let url = url.clone();
        let o = in_netns(&haltd.client_ns, move || {
            sse::stream(&url, &body, Duration::from_secs(10), |_, _| {})
        })?;
        ensure!(o.done_at.is_some(), "turn {i} did not end: {o:?}");
    }
    Ok(())
}

/// `haltctl ARGS`: exit code, stdout and stderr.
fn haltctl(args: &[&str]) -> Result<(Option<i32>, String, String)> {
    let out = Command::new(haltctl_bin()?).args(args).output()?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The head file of the only ledger in `state`.
fn head_file(state: &Path) -> Result<PathBuf> {
    fs::read_dir(state)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("ledger-") && n.ends_with(".head"))
        })
        .with_context(|| format!("no ledger-<id>.head in {}", state.display()))
}

/// The head file deleted and the last records cut off: the start stops (exit 3, saying what
/// to do) and writes nothing; `haltctl ledger reanchor --operator` takes the chain as it
/// stands, recorded with the operator; then the chain verifies and haltd starts.
#[test]
fn a_missing_head_stops_the_start_until_the_operator_reanchors() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let dir = temp_dir("reanchor")?;
    let ledger = dir.join("ledger.jsonl");
    let state = state_dir_for(&ledger);
    let mut first = Haltd::start_with_ledger(&pair, Some(&ledger), &[])?;
    turns(&first, 3)?;
    first.stop()?;
    let records = read_ledger(&ledger)?;
    ensure!(records.len() >= 5, "{} records", records.len());
    // Cut the last two records off and delete the head: the cut is invisible to the chain.
    let kept = records.len() - 2;
    let text = fs::read_to_string(&ledger)?;
    let cut: String = text.split_inclusive('\n').take(kept).collect();
    fs::write(&ledger, cut)?;
    let head = head_file(&state)?;
    fs::remove_file(&head)?;

    let (status, stderr) = Haltd::start_refused(&pair, &ledger, &[])?;
    ensure!(
        status.code() == Some(3),
        "haltd started or failed otherwise ({status}):\n{stderr}"
    );
    ensure!(
        stderr.contains(&format!("its head {} is missing", head.display()))
            && stderr.contains("haltctl ledger reanchor --operator NAME")
            && stderr.contains("refusing to start"),
        "the error does not say what to do:\n{stderr}"
    );
    ensure!(!head.exists(), "the refused start left a head file behind");
    let incidents = fs::read_to_string(state.join("ledger-incidents.jsonl"))?;
    ensure!(
        incidents.contains("LEDGER_HEAD_MISSING"),
        "no incident line: {incidents}"
    );

    let (st, l) = (state.display().to_string(), ledger.display().to_string());
    let (code, _, err) = haltctl(&["ledger", "reanchor", "--state-dir", &st, &l])
        .context("reanchor without --operator")?;
    ensure!(
        code == Some(2),
        "reanchor without --operator: {code:?} {err}"
    );
    let (code, out, err) = haltctl(&[
        "ledger",
        "reanchor",
        "--operator",
        "alice",
        "--state-dir",
        &st,
        &l,
    ])?;
    ensure!(code == Some(0), "reanchor: {code:?}\n{out}{err}");
    println!("{}", out.trim_end());
    let (code, _, err) = haltctl(&[
        "ledger",
        "reanchor",
        "--operator",
        "alice",
        "--state-dir",
        &st,
        &l,
    ])?;
    ensure!(
        code == Some(1) && err.contains("nothing to re-anchor"),
        "a second reanchor: {code:?} {err}"
    );
    let verified = verify_ledger(&ledger)?;
    println!("after the reanchor: {}", verified.trim_end());

    let after = read_ledger(&ledger)?;
    ensure!(after.len() == kept + 1, "{} records", after.len());
    check_reanchor_record(&after[kept], &records[kept - 1], kept)?;

    let mut next = Haltd::start_with_ledger(&pair, Some(&ledger), &[])?;
    next.stop()?;
    verify_ledger(&ledger)?;
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

/// The re-anchor record: who, and where the chain stood (the last record kept).
fn check_reanchor_record(rec: &Value, last: &Value, kept: usize) -> Result<()> {
    let a = &rec["admin"];
    ensure!(
        rec["kind"] == "admin" && a["action"] == "ledger_reanchor",
        "{rec}"
    );
    ensure!(
        a["actor"]["operator"] == "alice"
            && a["actor"]["transport"] == "local"
            && a["actor"]["uid"] == 0,
        "the operator: {a}"
    );
    ensure!(
        a["reanchor"]["from_seq"] == last["seq"]
            && a["reanchor"]["from_hash"] == last["hash"]
            && a["reanchor"]["records"] == kept,
        "where the chain stood: {a}, last record kept {last}"
    );
    ensure!(
        rec["prev_hash"] == last["hash"],
        "the record continues the chain"
    );
    ensure!(
        rec["message"]
            .as_str()
            .is_some_and(|m| m.contains("re-anchored by the operator alice")),
        "{rec}"
    );
    Ok(())
}
