//! The ledger: a tampered chain is detected and refused, and a crash (SIGKILL) keeps every
//! record written before it.

use std::{fs, path::Path, process::Command, thread, time::Duration};

use anyhow::{anyhow, ensure, Context, Result};
use haltd_tests::{
    copy_ledger, haltctl_bin, spawn_in_netns, sse, temp_dir, verify_ledger, verify_ledger_copy,
    wait_for, Haltd, NetPair, PORT_API,
};
use serde_json::Value;

use super::{
    chat, chat_url, check_operator_trip, connect_refused, serve_refused, stop_and_verify,
    stream_in, stream_tripped_at, wait_idle,
};

// ---------------------------------------------------------------------------------------------
// 8. Ledger: verify, tamper, fail closed.

#[test]
fn ledger_tamper_is_detected_and_refused() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "2000"])?;
    let url = chat_url(&haltd);
    stream_in(&haltd, &url, &chat("One", 1, 5, true), |_, _| {})?;
    let (t, trip) = stream_tripped_at(&haltd, &url, &chat("Two", 2, 300, true), 2)?;
    check_operator_trip(&t, trip.as_ref(), 5, &|| haltd.log_tail(20))?;
    wait_idle(&haltd)?;
    let path = haltd.ledger.clone();
    let dir = temp_dir("tamper")?;
    let intact = dir.join("intact.jsonl");
    {
        let mut haltd = haltd;
        haltd.stop()?;
        let out = verify_ledger(&path)?;
        println!("ledger: {}", out.trim());
        copy_ledger(&path, &intact)?;
    }
    let text = fs::read_to_string(&intact)?;
    let lines: Vec<&str> = text.lines().collect();
    ensure!(lines.len() >= 3, "only {} ledger lines", lines.len());
    // Flip one digit of the year in the `ts` field of a middle record: still valid JSON.
    let line_no = lines.len() / 2 + 1;
    let line = lines[line_no - 1];
    let at = line.find("\"ts\":\"").context("record without ts")? + "\"ts\":\"".len() + 2;
    let mut bytes = text.clone().into_bytes();
    let start: usize = lines[..line_no - 1].iter().map(|l| l.len() + 1).sum();
    let b = &mut bytes[start + at];
    ensure!(b.is_ascii_digit(), "ts digit {:?}", *b as char);
    *b = if *b == b'9' { b'8' } else { *b + 1 };
    let tampered = dir.join("tampered.jsonl");
    fs::write(&tampered, &bytes)?;
    let out = Command::new(haltctl_bin()?)
        .args(["ledger", "verify", "--state-dir"])
        .arg(haltd_tests::state_dir_for(&tampered))
        .arg(&tampered)
        .output()?;
    let shown = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "tampered line {line_no}: haltctl ledger verify exit {:?}: {}",
        out.status.code(),
        shown.trim()
    );
    ensure!(
        out.status.code() == Some(1),
        "verify of the tampered file exited {:?}: {shown}",
        out.status.code()
    );
    ensure!(
        shown.contains(&format!("line {line_no}")),
        "verify does not name line {line_no}: {shown}"
    );
    // haltd refuses to append to it.
    let (code, msg, took) = serve_refused(&pair, &tampered, &[])?;
    println!(
        "tampered ledger: haltd serve exit {code} after {:.0} ms: {}",
        took.as_secs_f64() * 1e3,
        msg.lines().last().unwrap_or_default()
    );
    ensure!(code != 0, "haltd served on a tampered ledger: {msg}");
    ensure!(
        msg.contains(&format!("line {line_no}")),
        "haltd's refusal does not name line {line_no}: {msg}"
    );
    ensure!(
        fs::read(&tampered)? == bytes,
        "haltd changed the tampered ledger"
    );
    connect_refused(&pair, PORT_API)?;
    // The intact copy still verifies (the tamper, not the copy, broke it).
    verify_ledger_copy(&intact)?;
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

/// Three complete turns and one tripped one, all recorded; returns the records.
fn record_turns(first: &Haltd) -> Result<Vec<Value>> {
    for i in 0..3 {
        let o = stream_in(
            first,
            &chat_url(first),
            &chat("before the crash", i, 10, true),
            |_, _| {},
        )?;
        ensure!(
            o.finish_reason.as_deref() == Some("length"),
            "turn {i}: {:?}",
            o.finish_reason
        );
    }
    let (o, trip) = stream_tripped_at(
        first,
        &chat_url(first),
        &chat("tripped before the crash", 9, 500, true),
        3,
    )?;
    check_operator_trip(&o, trip.as_ref(), 5, &|| first.log_tail(20))?;
    wait_for(
        Duration::from_secs(5),
        "4 turn records and 1 incident",
        || {
            let r = first.ledger_records()?;
            let turns = r.iter().filter(|r| r["kind"] == "turn").count();
            let incidents = r.iter().filter(|r| r["kind"] == "incident").count();
            Ok((turns == 4 && incidents == 1).then_some(r))
        },
    )
}

/// A new haltd on the ledger the crash left continues its chain.
fn resume_the_chain(pair: &NetPair, kept: &Path, after_crash: &[Value]) -> Result<()> {
    let second =
        Haltd::start_with_ledger(pair, Some(kept), &["--builtin-token-interval-us", "2000"])?;
    let o = stream_in(
        &second,
        &chat_url(&second),
        &chat("after the restart", 1, 5, true),
        |_, _| {},
    )?;
    ensure!(
        o.finish_reason.as_deref() == Some("length"),
        "{:?}",
        o.finish_reason
    );
    let records = stop_and_verify(second)?;
    ensure!(
        records.len() > after_crash.len() + 1,
        "the restarted haltd appended nothing"
    );
    ensure!(
        records[after_crash.len()]["prev_hash"] == after_crash[after_crash.len() - 1]["hash"],
        "the restarted haltd did not continue the chain"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 11. A crash keeps the record (G7)

/// SIGKILL haltd while streams are open: every record written before the crash survives, the
/// chain verifies, and a new haltd resumes the same ledger (its chain goes on).
#[test]
fn crash_keeps_the_ledger() -> Result<()> {
    let pair = NetPair::new()?;
    let mut first = Haltd::start(&pair, &["--builtin-token-interval-us", "2000"])?;
    let kept = temp_dir("crash")?.join("ledger.jsonl");
    let before = record_turns(&first)?;
    // A stream still open when the process dies.
    let api = chat_url(&first);
    let client = spawn_in_netns(&first.client_ns, move || {
        sse::stream(
            &api,
            &chat("open at the crash", 11, 100_000, true),
            Duration::from_secs(20),
            |_, _| {},
        )
    });
    thread::sleep(Duration::from_millis(200));
    first.crash()?;
    let open = client
        .join()
        .map_err(|_| anyhow!("client thread panicked"))??;
    ensure!(
        open.done_at.is_none(),
        "a stream open at the crash cannot end with [DONE]"
    );
    copy_ledger(&first.ledger, &kept)?;
    let report = verify_ledger_copy(&kept)?;
    let after_crash = haltd_tests::read_ledger(&kept)?;
    ensure!(
        after_crash.len() >= before.len(),
        "records lost: {} before, {} after",
        before.len(),
        after_crash.len()
    );
    for (a, b) in before.iter().zip(&after_crash) {
        ensure!(a == b, "record changed by the crash:\n{a}\n{b}");
    }
    println!(
        "crash: {} records survived SIGKILL ({report})",
        after_crash.len()
    );
    // The new haltd resumes the ledger where the crash left it, with its head: a copy has
    // none, and a ledger without its head is refused until an operator re-anchors it.
    let resumed = resume_the_chain(&pair, &first.ledger, &after_crash);
    drop(first);
    resumed
}
