//! Least privilege of a running haltd (docs/operations.md, "Privileges"): while streams and
//! the admin API are in use, every thread's capability sets in `/proc/<pid>/task/*/status`
//! are empty (effective, permitted, inheritable, ambient and, as haltd starts as root with
//! `CAP_SETPCAP`, bounding) and `no_new_privs` is set; the kernel gate still bounds a trip on
//! a socket accepted after the drop (the emitter ignores the halt, so only the kernel can);
//! `--user` runs the same as an unprivileged uid, with the ledger and the state directory
//! written as that user; a `--user` that does not exist is a configuration error (exit 2).

use std::{
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use haltd::privs::ThreadCaps;
use haltd_tests::{
    haltd_bin, spawn_in_netns,
    sse::{self, chat_body},
    temp_dir, trip_here, verify_ledger, EventKind, Haltd, NetPair,
};
use serde_json::Value;

const BUDGET: u64 = 3;
/// The trip lands after this many tokens reached the client.
const TRIP_AT: usize = 40;

/// Every thread of process `pid`, as `/proc` shows it.
fn threads(pid: u32) -> Result<Vec<ThreadCaps>> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?;
        // A thread that ended between the listing and the read is skipped.
        if let Ok(t) = ThreadCaps::read(&task.path()) {
            out.push(t);
        }
    }
    Ok(out)
}

/// Prints one line per thread and checks that none holds anything.
fn check_threads(pid: u32, what: &str) -> Result<Vec<ThreadCaps>> {
    let all = threads(pid)?;
    for t in &all {
        println!(
            "{what}: tid {} {:<16} CapEff={:016x} CapPrm={:016x} CapInh={:016x} CapAmb={:016x} CapBnd={:016x} NoNewPrivs={}",
            t.tid, t.name, t.effective, t.permitted, t.inheritable, t.ambient, t.bounding,
            u8::from(t.no_new_privs)
        );
    }
    for t in &all {
        ensure!(
            !t.holds_any() && t.bounding == 0 && t.no_new_privs,
            "{what}: thread {} ({}) holds capabilities or lacks no_new_privs: {t:?}",
            t.tid,
            t.name
        );
    }
    // The threads that parse input are among those read: the data-plane workers (client and
    // upstream bytes) and the main thread (admin API and /metrics), with the watchdog and the
    // ledger writer.
    for name in [
        "haltd",
        "haltd-dp-0",
        "haltd-dp-1",
        "haltd-watchdog",
        "haltd-ledger",
    ] {
        ensure!(
            all.iter().any(|t| t.name == name),
            "{what}: no thread named {name} among {:?}",
            all.iter().map(|t| &t.name).collect::<Vec<_>>()
        );
    }
    // The watchdog took SCHED_FIFO with CAP_SYS_NICE before it dropped it; the priority stays.
    let watchdog = all
        .iter()
        .find(|t| t.name == "haltd-watchdog")
        .context("no watchdog")?;
    let policy = sched_policy(pid, &watchdog.tid)?;
    ensure!(
        policy == libc::SCHED_FIFO as u32,
        "{what}: the watchdog runs with scheduling policy {policy}, not SCHED_FIFO"
    );
    Ok(all)
}

/// A thread's scheduling policy: field 41 of `/proc/<pid>/task/<tid>/stat`.
fn sched_policy(pid: u32, tid: &str) -> Result<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let (_, rest) = stat.rsplit_once(')').context("no ')' in stat")?;
    rest.split_whitespace()
        .nth(41 - 3)
        .context("stat has no field 41")?
        .parse()
        .context("field 41 of stat")
}

fn long_chat(max_tokens: u32) -> Value {
    let mut body = chat_body("Tell me about rivers", max_tokens, true);
    body["ignore_eos"] = true.into();
    body
}

/// A stream the client trips after [`TRIP_AT`] tokens; returns the tokens the client got
/// after the trip point haltd answered (the trip's `trip_token_index`).
fn tripped_stream(haltd: &Haltd) -> thread::JoinHandle<Result<i64>> {
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let admin = haltd.admin_url();
    spawn_in_netns(&haltd.client_ns, move || {
        let mut trip = None;
        let outcome = sse::stream(
            &url,
            &long_chat(100_000),
            Duration::from_secs(30),
            |p, ev| {
                if trip.is_none() && matches!(ev.kind, EventKind::Token(_)) && p.tokens == TRIP_AT {
                    trip = Some(trip_here(
                        &format!("{admin}/admin/streams/{}/trip", p.stream_id),
                        Some("OPERATOR_TRIP"),
                    ));
                }
            },
        )?;
        let (status, body) = trip.context("the stream ended before the trip")??;
        ensure!(status == 200, "trip answered {status}: {body}");
        let idx = body["trip_token_index"]
            .as_u64()
            .context("no trip_token_index")?;
        Ok(outcome.tokens as i64 - idx as i64)
    })
}

/// Runs streams, the admin API and /metrics against `haltd`, reads every thread while they
/// are in use, and checks that a trip on a stream accepted after the drop is bounded by the
/// kernel alone.
fn exercise(haltd: &Haltd, what: &str) -> Result<()> {
    let pid = haltd.pid().context("haltd pid")?;
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let running = spawn_in_netns(&haltd.client_ns, move || {
        sse::stream(&url, &long_chat(1500), Duration::from_secs(30), |_, _| {})
    });
    let tripped = tripped_stream(haltd);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listed = haltd.list_streams()?;
        let open = listed["streams"].as_array().map_or(0, Vec::len);
        if open >= 1 {
            break;
        }
        ensure!(Instant::now() < deadline, "no stream opened: {listed}");
        thread::sleep(Duration::from_millis(20));
    }
    haltd.metrics()?;
    check_threads(pid, &format!("{what}, streaming"))?;
    let post = tripped
        .join()
        .map_err(|_| anyhow::anyhow!("client panicked"))??;
    println!(
        "{what}: {post} tokens after the trip point (B = {BUDGET}, the emitter ignores the halt)"
    );
    ensure!(
        post <= BUDGET as i64,
        "{post} tokens after the trip point, B = {BUDGET}"
    );
    let dropped = haltd
        .metrics()?
        .value_or_zero("haltd_kernel_frames_total", &[("verdict", "drop_budget")])?;
    ensure!(
        dropped > 0.0,
        "the emitter ignored the halt but the kernel dropped nothing"
    );
    let done = running
        .join()
        .map_err(|_| anyhow::anyhow!("client panicked"))??;
    ensure!(
        done.status == 200 && done.done_at.is_some(),
        "the untripped stream: status {}, error {:?}",
        done.status,
        done.error
    );
    check_threads(pid, &format!("{what}, after the trip"))?;
    Ok(())
}

const FLAGS: [&str; 8] = [
    "--budget",
    "3",
    "--fault",
    "emitter-ignores-halt",
    "--builtin-token-interval-us",
    "2000",
    "--workers",
    "2",
];

#[test]
fn no_thread_of_a_serving_haltd_holds_a_capability() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &FLAGS)?;
    exercise(&haltd, "as root")
}

/// The real, effective, saved and file-system ids of `pid` (`Uid:` or `Gid:` of its status).
fn ids(pid: u32, field: &str) -> Result<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    line.split_whitespace()
        .map(|v| v.parse().context("an id"))
        .collect()
}

fn owner(path: &Path) -> Result<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
    Ok((m.uid(), m.gid()))
}

/// `--user nobody --group nogroup`: haltd loads the gate as root, then runs as 65534, and
/// writes its ledger and state directory (a directory of nobody's) as that user.
#[test]
fn haltd_runs_as_the_user_it_is_given() -> Result<()> {
    const NOBODY: u32 = 65534;
    let dir = temp_dir("as-user")?;
    std::os::unix::fs::chown(&dir, Some(NOBODY), Some(NOBODY))?;
    let ledger = dir.join("ledger.jsonl");
    let state = dir.join("state");
    let state_arg = state.display().to_string();
    let mut extra = FLAGS.to_vec();
    extra.extend([
        "--user",
        "nobody",
        "--group",
        "nogroup",
        "--state-dir",
        &state_arg,
    ]);
    let pair = NetPair::new()?;
    let mut haltd = Haltd::start_with_ledger(&pair, Some(&ledger), &extra)?;
    let pid = haltd.pid().context("haltd pid")?;
    let (uids, gids) = (ids(pid, "Uid:")?, ids(pid, "Gid:")?);
    println!("--user nobody: Uid {uids:?} Gid {gids:?}");
    ensure!(
        uids == [NOBODY; 4] && gids == [NOBODY; 4],
        "uids {uids:?} gids {gids:?}"
    );
    exercise(&haltd, "--user nobody")?;
    let status = haltd.stop()?;
    ensure!(status.success(), "haltd stopped with {status}");
    for p in [&ledger, &state] {
        ensure!(
            owner(p)? == (NOBODY, NOBODY),
            "{} is owned by {:?}",
            p.display(),
            owner(p)?
        );
    }
    let verified = verify_ledger(&ledger)?;
    println!("--user nobody: ledger {verified}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Runs a command that exits by itself (haltd refusing its flags).
fn run_to_exit(cmd: &mut Command) -> Result<std::process::Output> {
    cmd.output().context("running haltd")
}

/// A `--user` that does not exist stops haltd before it loads anything, with exit 2 (a
/// configuration error systemd does not restart) and the name in the message.
#[test]
fn a_missing_user_is_a_configuration_error() -> Result<()> {
    let out = run_to_exit(
        Command::new(haltd_bin()?)
            .args(["serve", "--user", "haltd-no-such-user", "--no-kernel-gate"])
            .args(["--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"]),
    )?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(2)
            && stderr.contains("invalid --user: \"haltd-no-such-user\": no such user"),
        "{}: {stderr}",
        out.status
    );
    let out = run_to_exit(
        Command::new(haltd_bin()?)
            .args([
                "serve",
                "--user",
                "nobody",
                "--group",
                "haltd-no-such-group",
            ])
            .args(["--no-kernel-gate", "--listen", "127.0.0.1:0"]),
    )?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() != Some(2) || !stderr.contains("invalid --group") {
        bail!("{}: {stderr}", out.status);
    }
    Ok(())
}
