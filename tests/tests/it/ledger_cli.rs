//! `haltctl ledger show|tail` on the ledger of a real haltd: a halt shows as rows naming its
//! stream, cause and bound; `--json` gives the records as written; `tail` prints records as
//! haltd appends them.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use anyhow::{anyhow, ensure, Context, Result};
use haltd_tests::{haltctl_bin, spawn_in_netns, sse, Haltd, NetPair, TEST_SAMPLING};
use serde_json::Value;

/// Streams a turn and trips it at its first token; the stream id.
fn tripped_turn(haltd: &Haltd, ns: &str) -> Result<String> {
    let (tx, rx) = mpsc::channel();
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let streamer = spawn_in_netns(ns, move || {
        sse::stream(
            &url,
            &sse::chat_body("ledger cli", 400, true),
            Duration::from_secs(30),
            sse::report_stream_id(tx),
        )
    });
    let id = rx.recv_timeout(Duration::from_secs(10))?;
    let (status, _) = haltd.trip(&id, None)?;
    ensure!(status == 200, "trip answered {status}");
    streamer
        .join()
        .map_err(|_| anyhow!("streamer thread"))??
        .halted_cleanly("OPERATOR_TRIP")?;
    haltd.wait_record("the halt", |r| {
        r["kind"] == "turn" && r["stream_id"] == id.as_str()
    })?;
    Ok(id)
}

fn haltctl(args: &[&str]) -> Result<String> {
    let out = Command::new(haltctl_bin()?).args(args).output()?;
    ensure!(
        out.status.success(),
        "haltctl {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

#[test]
fn show_prints_a_halt_as_rows_and_json_as_written() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &TEST_SAMPLING)?;
    let id = tripped_turn(&haltd, &pair.cli)?;
    let ledger = haltd.ledger.display().to_string();

    let table = haltctl(&["ledger", "show", &ledger, "--stream", &id])?;
    println!("{table}");
    let mut rows = table.lines();
    let header = rows.next().context("no header")?;
    ensure!(
        header.contains("CAUSE") && header.contains("TRIP@"),
        "{header}"
    );
    let rows: Vec<&str> = rows.collect();
    ensure!(
        rows.iter().all(|r| r.contains(&id)),
        "--stream printed rows of other streams"
    );
    let records = haltd.ledger_records()?;
    let incident = records
        .iter()
        .find(|r| r["kind"] == "incident" && r["stream_id"] == id.as_str())
        .context("no incident record")?;
    let tau = incident["trip_token_index"].to_string();
    let post = incident["halt_tokens_post_trip"].to_string();
    let row = rows
        .iter()
        .find(|r| r.contains("incident"))
        .context("no incident row")?;
    let cells: Vec<&str> = row.split_whitespace().collect();
    ensure!(
        cells.contains(&"OPERATOR_TRIP")
            && cells.contains(&tau.as_str())
            && cells.contains(&post.as_str()),
        "the incident row lacks its cause, τ {tau} or post-trip count {post}: {row}"
    );
    ensure!(
        rows.iter()
            .any(|r| r.contains("admin") && r.contains("answered 200")),
        "no admin row naming the trip's caller: {rows:?}"
    );

    // --json: the records of the stream, byte for byte as the file has them.
    let json = haltctl(&["ledger", "show", &ledger, "--stream", &id, "--json"])?;
    let file = std::fs::read_to_string(&haltd.ledger)?;
    let mine: Vec<&str> = file
        .lines()
        .filter(|l| serde_json::from_str::<Value>(l).is_ok_and(|v| v["stream_id"] == id.as_str()))
        .collect();
    ensure!(
        json.lines().collect::<Vec<_>>() == mine,
        "--json differs from the file's lines of {id}"
    );

    // --kind and --last.
    let last = haltctl(&[
        "ledger",
        "show",
        &ledger,
        "--kind",
        "lifecycle",
        "--last",
        "1",
    ])?;
    let last_rows: Vec<&str> = last.lines().skip(1).collect();
    ensure!(
        last_rows.len() == 1 && last_rows[0].contains("lifecycle"),
        "{last}"
    );
    Ok(())
}

#[test]
fn tail_prints_records_as_haltd_appends_them() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &TEST_SAMPLING)?;
    let mut tail = Command::new(haltctl_bin()?)
        .args([
            "ledger",
            "tail",
            "-n",
            "1",
            "--interval-ms",
            "50",
            "--kind",
            "incident",
        ])
        .arg(&haltd.ledger)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = tail.stdout.take().context("tail's stdout")?;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The header comes at once; no incident yet.
    let header = rx.recv_timeout(Duration::from_secs(5))?;
    ensure!(header.contains("DETAIL"), "{header}");
    let id = tripped_turn(&haltd, &pair.cli)?;
    let row = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(5))
            .with_context(|| format!("tail printed no row for {id}"))?;
        if line.contains(&id) {
            break line;
        }
    };
    println!("tail: {row}");
    ensure!(
        row.contains("incident") && row.contains("OPERATOR_TRIP"),
        "{row}"
    );
    tail.kill()?;
    tail.wait()?;
    Ok(())
}
