//! No gate, no service: `haltd serve` refuses to start without its gate, and
//! `--no-kernel-gate` is stated everywhere (the userspace watchdog still holds B).

use std::{fs, path::Path, time::Duration};

use anyhow::{anyhow, ensure, Context, Result};
use haltd_tests::{
    haltctl_bin, spawn_in_netns, sse, temp_dir, trip_here, EventKind, Haltd, NetPair,
    StreamOutcome, PORT_ADMIN, PORT_API, PORT_METRICS,
};
use serde_json::Value;

use super::{
    chat, chat_url, check_every_record_states_gate, check_gate_stated, check_operator_trip,
    connect_refused, serve_refused, stop_and_verify_text, stream_in, wait_idle,
};

// ---------------------------------------------------------------------------------------------
// 1. No gate, no service.

/// `haltd serve` with a missing or non-BPF gate object exits non-zero at once, says why (the
/// gate) and how to run without it (`--no-kernel-gate`), and never listens.
#[test]
fn refuses_to_start_without_the_gate() -> Result<()> {
    let pair = NetPair::new()?;
    let dir = temp_dir("nogate")?;
    let garbage = dir.join("garbage.bpf.o");
    fs::write(&garbage, b"this is not an ELF BPF object\n\x00\x01\x02")?;
    let elf_no_bpf = dir.join("elf-not-bpf.o");
    fs::copy(haltctl_bin()?, &elf_no_bpf).context("copying haltctl as a non-BPF ELF")?;
    for object in [Path::new("/nonexistent"), &garbage, &elf_no_bpf] {
        let obj = object.to_string_lossy().into_owned();
        let (code, out, took) =
            serve_refused(&pair, &dir.join("ledger.jsonl"), &["--bpf-object", &obj])?;
        println!(
            "no gate ({obj}): exit {code} after {:.0} ms: {}",
            took.as_secs_f64() * 1e3,
            out.lines().last().unwrap_or_default()
        );
        ensure!(code != 0, "haltd exited 0 with --bpf-object {obj}: {out}");
        ensure!(
            took < Duration::from_secs(5),
            "refusing took {took:?} with --bpf-object {obj}"
        );
        ensure!(
            out.contains("kernel halt gate") && out.contains("--no-kernel-gate"),
            "the message does not name the gate and --no-kernel-gate: {out}"
        );
        for port in [PORT_API, PORT_ADMIN, PORT_METRICS] {
            connect_refused(&pair, port)?;
        }
    }
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. --no-kernel-gate is stated everywhere; the userspace watchdog still holds B.

#[test]
fn no_kernel_gate_is_stated_everywhere() -> Result<()> {
    const BUDGET: u64 = 5;
    const TRIPPED: usize = 12;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--no-kernel-gate",
            "--budget",
            &BUDGET.to_string(),
            "--builtin-token-interval-us",
            "1000",
        ],
    )?;
    check_gate_stated(&haltd, false)?;
    let url = chat_url(&haltd);
    let normal = stream_in(&haltd, &url, &chat("Rivers", 1, 30, true), |_, _| {})?;
    ensure!(
        normal.tokens == 30
            && normal.finish_reason.as_deref() == Some("length")
            && normal.done_at.is_some(),
        "normal stream: {} tokens, finish {:?}",
        normal.tokens,
        normal.finish_reason
    );
    // Tripped streams, concurrently, at k = 1..=TRIPPED tokens.
    let admin = haltd.admin_url();
    let handles: Vec<_> = (0..TRIPPED)
        .map(|i| {
            let (url, admin) = (url.clone(), admin.clone());
            spawn_in_netns(
                &pair.cli,
                move || -> Result<(StreamOutcome, Option<(u16, Value)>)> {
                    let mut trip = None;
                    let body = chat(&format!("Lakes {i}"), i as u64, 400, true);
                    let o = sse::stream(&url, &body, Duration::from_secs(30), |p, ev| {
                        if trip.is_none()
                            && matches!(ev.kind, EventKind::Token(_))
                            && p.tokens == i + 1
                        {
                            let u = format!("{admin}/admin/streams/{}/trip", p.stream_id);
                            trip = Some(trip_here(&u, None).unwrap_or((0, Value::Null)));
                        }
                    })?;
                    Ok((o, trip))
                },
            )
        })
        .collect();
    let mut posts = Vec::new();
    for h in handles {
        let (o, trip) = h.join().map_err(|_| anyhow!("client thread panicked"))??;
        posts.push(check_operator_trip(&o, trip.as_ref(), BUDGET, &|| {
            haltd.log_tail(30)
        })?);
    }
    println!("no kernel gate: post-trip tokens {posts:?} (budget {BUDGET})");
    wait_idle(&haltd)?;
    check_gate_stated(&haltd, false)?;
    let m = haltd.metrics()?;
    ensure!(
        m.value_or_zero("haltd_watchdog_trips_total", &[("cause", "OPERATOR_TRIP")])?
            == TRIPPED as f64,
        "trips not counted"
    );
    let (records, text) = stop_and_verify_text(haltd)?;
    let n = check_every_record_states_gate(&text, "disabled")?;
    let incidents = records.iter().filter(|r| r["kind"] == "incident").count();
    ensure!(
        incidents == TRIPPED,
        "{incidents} incident records for {TRIPPED} trips"
    );
    println!("no kernel gate: {n} ledger records, all say kernel_gate disabled");
    Ok(())
}
