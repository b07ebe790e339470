//! Issue 13, point 5: the kill loop at full length. SIGKILL haltd at random moments under heavy
//! trip and turn load, `--kills` times (1,000 by default) on one ledger; after every kill the
//! chain verifies against its key and head, and every record haltd answered for is present
//! (`haltd_tests::kill_loop`); haltd proxies `scripted-upstream` (taken from this executable's
//! directory) with TokenCircuit on, and its state is checked at every restart too. Prints progress every `--progress-every` kills and the counts at
//! the end; exits 1 on any failure. Root only (network namespaces, the kernel gate).
//!
//! `cargo xtask bench --kill-loop [KILLS]` runs it alone; `cargo xtask bench` runs it last.

use anyhow::{ensure, Result};
use clap::Parser;
use haltd_tests::{kill_loop, require_root, NetPair};

#[derive(Parser)]
struct Args {
    /// SIGKILLs (and restarts) to run.
    #[arg(long, default_value_t = 1000)]
    kills: usize,
    /// Concurrent streaming clients (one more thread trips streams through the admin API).
    #[arg(long, default_value_t = 6)]
    clients: usize,
    /// Print a progress line every this many kills.
    #[arg(long, default_value_t = 25)]
    progress_every: usize,
    /// A fresh ledger every this many kills (each start verifies the whole chain).
    #[arg(long, default_value_t = 100)]
    kills_per_ledger: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    require_root()?;
    let pair = NetPair::new()?;
    let report = kill_loop::run(
        &pair,
        &kill_loop::Options {
            kills: args.kills,
            clients: args.clients,
            progress_every: args.progress_every,
            kills_per_ledger: args.kills_per_ledger,
            upstream_bin: Some(haltd_tests::bench_files::sibling("scripted-upstream")?),
        },
    )?;
    println!("bench-kill-loop: {report}");
    for f in &report.failures {
        println!("  failure: {f}");
    }
    ensure!(report.failures.is_empty(), "the kill loop failed");
    Ok(())
}
