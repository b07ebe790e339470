//! `bench-state-restore`: how long a start takes to restore the degraded scopes from the state
//! store (`daemon/src/state.rs`), at 10,000 scopes by default (target: at most 1 s).
//!
//! ```text
//! bench-state-restore [--scopes 10000] [--rounds 5]
//! ```
//!
//! It writes a real ledger (one start record, fsync'd) and a store that reflects it holding
//! `--scopes` degraded keys, then, per round, times what a start does before serving: open
//! the store (schema check), read it, check it against the ledger (which it reads whole), and
//! restore the scopes into degraded mode. It prints each round and the median, and fails only
//! when a round restored the wrong number of scopes. No root, no network.

use std::{
    path::PathBuf,
    sync::mpsc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{ensure, Context, Result};
use clap::Parser;
use haltd::{
    ledger::{Ledger, LedgerConfig, Record, RecordKind},
    modes::{DegradedScope, KeyId, Modes},
    state::{restore, Point, ScopeRow, Snapshot, StateStore},
};

#[derive(Parser)]
struct Args {
    /// Degraded scopes in the store.
    #[arg(long, default_value_t = 10_000)]
    scopes: u64,
    /// Timed restores; the median is reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dir = std::env::temp_dir().join(format!("haltd-bench-state-{}", std::process::id()));
    let state_dir = dir.join("state");
    std::fs::create_dir_all(&state_dir)?;
    let result = run(&args, &dir, &state_dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// A ledger with one start record, and a store that reflects it holding `args.scopes`
/// degraded keys; returns the ledger's path.
fn prepare(args: &Args, dir: &std::path::Path, state_dir: &std::path::Path) -> Result<PathBuf> {
    let ledger_path: PathBuf = dir.join("ledger.jsonl");
    let ledger = Ledger::open(&LedgerConfig {
        path: &ledger_path,
        state_dir,
        fsync: true,
        kernel_gate: "enforcing",
        slow_write: None,
        fail_writes_from: None,
    })?;
    let (tx, rx) = mpsc::sync_channel(1);
    ledger.append_linked(
        Record {
            kind: RecordKind::Lifecycle,
            runtime_mode: "full".into(),
            kernel_gate: "enforcing".into(),
            message: Some("bench-state-restore".into()),
            ..Record::default()
        },
        move |w| {
            let _ = tx.send(w);
        },
    )?;
    let point: Point = rx.recv().context("the ledger's answer")??.into();
    drop(ledger);
    let scopes: Vec<ScopeRow> = (0..args.scopes)
        .map(|i| ScopeRow {
            scope: format!("key:{}", KeyId(i)),
            since_unix_ms: 1,
            until_unix_ms: Some(u64::MAX / 2),
            cause: "EXFIL_ALERT".into(),
            stream_id: format!("hs_{i:016x}"),
        })
        .collect();
    let (store, _) = StateStore::open(state_dir)?;
    store.replace(Snapshot {
        ledger: Some(point),
        node_check: Some("bench".into()),
        scopes,
        ..Snapshot::default()
    });
    store.flush();
    drop(store);
    Ok(ledger_path)
}

fn run(args: &Args, dir: &std::path::Path, state_dir: &std::path::Path) -> Result<()> {
    let ledger_path = prepare(args, dir, state_dir)?;
    let mut took = Vec::new();
    for round in 0..args.rounds {
        let t = Instant::now();
        let (store, held) = StateStore::open(state_dir)?;
        let restored = restore::check(&held, &ledger_path, "bench")?;
        let modes = Modes::new(DegradedScope::Key, None);
        modes
            .restore(
                &restored.scopes,
                SystemTime::now(),
                haltd::clock::monotonic_ns(),
            )
            .map_err(anyhow::Error::msg)?;
        let d = t.elapsed();
        ensure!(
            modes.degraded_count() as u64 == args.scopes,
            "round {round}: {} scopes restored, {} stored",
            modes.degraded_count(),
            args.scopes
        );
        drop(store);
        println!(
            "round {round}: {} scopes restored in {:.1} ms",
            args.scopes,
            ms(d)
        );
        took.push(d);
    }
    took.sort();
    let median = took[took.len() / 2];
    println!(
        "state restore: {} scopes, median {:.1} ms over {} rounds (min {:.1}, max {:.1}); target at most 1000 ms: {}",
        args.scopes,
        ms(median),
        took.len(),
        ms(took[0]),
        ms(took[took.len() - 1]),
        if median <= Duration::from_secs(1) { "PASS" } else { "MISS" }
    );
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
