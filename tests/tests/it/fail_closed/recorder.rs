//! The flight recorder's failure, end to end: a write that fails with EIO (`--fault
//! ledger-write-fails-after=N`), and a ledger on a tmpfs that fills up.

use std::{
    fs,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{agent, in_netns, temp_dir, verify_ledger, Haltd, NetPair, StreamOutcome};
use serde_json::{json, Value};

use super::{run_streams, BUDGET, TOKEN_INTERVAL_US};

const STREAMS: usize = 3;

/// How many records a fresh haltd with `extra` writes before it is ready.
fn records_at_start(pair: &NetPair, extra: &[&str]) -> Result<usize> {
    let h = Haltd::start(pair, extra)?;
    Ok(h.ledger_records()?.len())
}

/// GET `path` on haltd's API from the client namespace: status and JSON body.
fn get(haltd: &Haltd, path: &str) -> Result<(u16, Value)> {
    let url = format!("{}{path}", haltd.api_url());
    in_netns(&haltd.client_ns, move || -> Result<(u16, Value)> {
        let mut resp = agent(Duration::from_secs(5)).get(&url).call()?;
        let status = resp.status().as_u16();
        Ok((status, resp.body_mut().read_json()?))
    })
}

/// A short batch turn from the client namespace: its status and body.
fn short_turn(haltd: &Haltd) -> Result<(u16, String)> {
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    in_netns(&haltd.client_ns, move || -> Result<(u16, String)> {
        let body = json!({"model": "builtin", "max_tokens": 2,
            "messages": [{"role": "user", "content": "short"}]});
        let resp = agent(Duration::from_secs(5))
            .post(&url)
            .header("authorization", "Bearer recorder-test")
            .send_json(body);
        match resp {
            Ok(mut r) => {
                let status = r.status().as_u16();
                // A turn whose record failed is cut: its body may end early.
                let text = r
                    .body_mut()
                    .read_to_string()
                    .unwrap_or_else(|e| e.to_string());
                Ok((status, text))
            }
            Err(e) => Ok((0, e.to_string())),
        }
    })
}

/// Every long stream ended with RECORDER_FAILURE, within B of its trip at the client; the
/// worst time from `failed_at` to a stream's terminal event.
fn check_streams(outcomes: &[StreamOutcome], failed_at: Instant) -> Result<f64> {
    let mut worst = 0f64;
    for o in outcomes {
        o.halted_cleanly("RECORDER_FAILURE")
            .with_context(|| format!("stream {}: {:?}", o.stream_id, o.error))?;
        let err = o.error.as_ref().context("error object")?;
        let tau = err["trip_token_index"]
            .as_u64()
            .context("trip_token_index")?;
        let post = err["post_trip_tokens"]
            .as_u64()
            .context("post_trip_tokens")?;
        ensure!(post <= BUDGET, "{post} post-trip tokens: {err}");
        ensure!(
            o.tokens as u64 <= tau + BUDGET,
            "stream {}: {} tokens at the client, trip at {tau}",
            o.stream_id,
            o.tokens
        );
        let end = o.end_at();
        worst = worst.max(end.saturating_duration_since(failed_at).as_secs_f64() * 1e3);
    }
    Ok(worst)
}

/// New turns refused, and both health endpoints naming the recorder.
fn check_refusals(haltd: &Haltd, cause: &str) -> Result<()> {
    let (status, body) = short_turn(haltd)?;
    ensure!(
        status == 503 && body.contains("recorder_failed"),
        "{status} {body}"
    );
    let (status, health) = get(haltd, "/healthz")?;
    ensure!(
        status == 503 && health["status"] == "recorder_failed",
        "{status} {health}"
    );
    ensure!(health["recorder_ok"] == false, "{health}");
    let (status, ready) = get(haltd, "/readyz")?;
    ensure!(status == 503, "{status} {ready}");
    let text = ready.to_string();
    ensure!(
        text.contains("recorder_failed") && text.contains(cause),
        "/readyz does not say why ({cause}): {ready}"
    );
    Ok(())
}

/// Starts long streams, lets them flow, runs `before` (if any), then makes haltd write a
/// record (a short turn): the streams' outcomes and when that turn was sent.
fn streams_then_a_record(
    haltd: &Haltd,
    before: impl FnOnce() -> Result<()>,
) -> Result<(Vec<StreamOutcome>, Instant)> {
    thread::scope(|s| {
        let streams = s.spawn(|| run_streams(haltd, STREAMS));
        thread::sleep(Duration::from_millis(400));
        before()?;
        let failed_at = Instant::now();
        let (status, body) = short_turn(haltd)?;
        let body: String = body.chars().take(160).collect();
        // Unrecorded, it is not answered as complete: cut, or refused.
        ensure!(
            status == 0 || (status == 503 && body.contains("recorder_failed")),
            "the turn whose record failed got {status} {body}"
        );
        println!("recorder: the turn whose record failed got {status} {body}");
        let outcomes = streams
            .join()
            .map_err(|_| anyhow::anyhow!("streams panicked"))??;
        Ok((outcomes, failed_at))
    })
}

#[test]
fn a_failing_ledger_write_halts_every_stream_and_refuses_turns() -> Result<()> {
    let pair = NetPair::new()?;
    let pace = TOKEN_INTERVAL_US.to_string();
    let base = ["--budget", "5", "--builtin-token-interval-us", &pace];
    let n = records_at_start(&pair, &base)? + 1;
    let fault = format!("ledger-write-fails-after={n}");
    let mut args = base.to_vec();
    args.extend(["--fault", &fault]);
    let mut haltd = Haltd::start(&pair, &args)?;
    let (outcomes, failed_at) = streams_then_a_record(&haltd, || Ok(()))?;
    let worst = check_streams(&outcomes, failed_at)?;
    check_refusals(&haltd, "Input/output error")?;
    println!(
        "recorder (EIO at write {n}): {STREAMS} streams halted with RECORDER_FAILURE, the last {worst:.1} ms after the failing turn was sent; post-trip tokens {:?}",
        outcomes
            .iter()
            .map(|o| o.error.as_ref().map(|e| e["post_trip_tokens"].clone()))
            .collect::<Vec<_>>()
    );
    let ledger = haltd.ledger.clone();
    let state_dir = haltd.state_dir.clone();
    haltd.stop()?;
    // A restart without the fault: the chain the failure left verifies, and grows.
    let state = state_dir.display().to_string();
    let again = Haltd::start_with_ledger(&pair, Some(&ledger), &["--state-dir", &state])?;
    ensure!(short_turn(&again)?.0 == 200, "the restarted haltd serves");
    drop(again);
    let report = verify_ledger(&ledger)?;
    println!(
        "recorder: after a restart without the fault: {}",
        report.trim()
    );
    Ok(())
}

/// A tmpfs of `size` at `mount`, in haltd's own mount namespace: the wrapper haltd runs
/// through (it execs haltd, whose pid the harness keeps).
fn tmpfs_wrapper(mount: &Path, size: &str) -> Vec<String> {
    vec![
        "unshare".into(),
        "--mount".into(),
        "--propagation".into(),
        "private".into(),
        "sh".into(),
        "-c".into(),
        format!("mount -t tmpfs -o size={size} haltd-test-disk \"$0\" && exec \"$@\""),
        mount.display().to_string(),
    ]
}

/// Fills the file system of `dir` (seen through haltd's `/proc/PID/root`) until a write fails.
fn fill(dir: &Path) -> Result<u64> {
    let path = dir.join("filler");
    let chunk = vec![0u8; 4096];
    let mut f = fs::File::create(&path).with_context(|| format!("{}", path.display()))?;
    let mut written = 0u64;
    loop {
        match std::io::Write::write(&mut f, &chunk) {
            Ok(0) | Err(_) => return Ok(written),
            Ok(k) => written += k as u64,
        }
    }
}

#[test]
fn a_full_disk_halts_every_stream_and_refuses_turns() -> Result<()> {
    let pair = NetPair::new()?;
    let dir = temp_dir("full-disk")?;
    let mount: PathBuf = dir.join("disk");
    fs::create_dir_all(&mount)?;
    let ledger = mount.join("ledger.jsonl");
    let wrapper = tmpfs_wrapper(&mount, "2m");
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let pace = TOKEN_INTERVAL_US.to_string();
    let haltd = Haltd::start_wrapped(
        &pair,
        Some(&ledger),
        &wrapper,
        &["--budget", "5", "--builtin-token-interval-us", &pace],
    )?;
    let pid = haltd.pid().context("pid")?;
    // The tmpfs exists only in haltd's mount namespace: reach it through its root.
    let seen = PathBuf::from(format!("/proc/{pid}/root")).join(mount.strip_prefix("/")?);
    ensure!(
        seen.join("ledger.jsonl").exists(),
        "no ledger in haltd's tmpfs"
    );
    let (outcomes, failed_at) = streams_then_a_record(&haltd, || {
        let filled = fill(&seen)?;
        println!("full disk: filled the tmpfs with {filled} more bytes");
        Ok(())
    })?;
    let worst = check_streams(&outcomes, failed_at)?;
    check_refusals(&haltd, "No space left on device")?;
    println!(
        "full disk: {STREAMS} streams halted with RECORDER_FAILURE, the last {worst:.1} ms after the turn whose record found the disk full"
    );
    // Outside haltd's namespace nothing was mounted.
    ensure!(
        !ledger.exists(),
        "the tmpfs leaked into the test's mount namespace"
    );
    drop(haltd);
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}
