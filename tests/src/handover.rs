//! The hand-over harness (issue 38): a successor started with `--take-over` beside a running
//! haltd, on the same client port, with its own admin API, metrics port and ledger segment, and
//! the same state directory (docs/operations.md "Upgrading").

use std::time::Duration;

use anyhow::{Context, Result};

use crate::{daemon::Haltd, netns::NetPair};

/// The successor's admin API and metrics ports (the client port is the old haltd's).
pub const PORT_ADMIN_SUCCESSOR: u16 = 8091;
pub const PORT_METRICS_SUCCESSOR: u16 = 9474;

/// The flags that make a haltd the successor of `old`, before `extra` (which may name the
/// admin API to take over from itself).
fn successor_args<'a>(old: &'a Haltd, admin: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let state_dir = old.state_dir.to_str().unwrap_or_default();
    let mut args = vec!["--take-over", "--state-dir", state_dir];
    if !extra.contains(&"--take-over-from") {
        args.extend(["--take-over-from", admin]);
    }
    args.extend_from_slice(extra);
    args
}

impl Haltd {
    /// Spawns the successor of `old` and returns at once (it may fail its start).
    pub fn spawn_successor(pair: &NetPair, old: &Haltd, extra: &[&str]) -> Result<Haltd> {
        Haltd::spawn_successor_on(pair, old, None, extra)
    }

    /// [`Haltd::start_successor`] run through `wrapper` (e.g. `env NOTIFY_SOCKET=...`).
    pub fn start_successor_wrapped(
        pair: &NetPair,
        old: &Haltd,
        wrapper: &[&str],
        extra: &[&str],
    ) -> Result<Haltd> {
        let admin = old.admin.to_string();
        let args = successor_args(old, &admin, extra);
        let ports = (PORT_ADMIN_SUCCESSOR, PORT_METRICS_SUCCESSOR);
        let mut next = Haltd::spawn_on(pair, None, wrapper, &args, ports)?;
        next.wait_ready_line(Duration::from_secs(20))
            .context("the successor did not become ready")?;
        Ok(next)
    }

    /// [`Haltd::spawn_successor`] on the ledger file `ledger` (default: its own directory's).
    pub fn spawn_successor_on(
        pair: &NetPair,
        old: &Haltd,
        ledger: Option<&std::path::Path>,
        extra: &[&str],
    ) -> Result<Haltd> {
        let admin = old.admin.to_string();
        let args = successor_args(old, &admin, extra);
        Haltd::spawn_on(
            pair,
            ledger,
            &[],
            &args,
            (PORT_ADMIN_SUCCESSOR, PORT_METRICS_SUCCESSOR),
        )
    }

    /// Starts the successor of `old` and waits for its `haltd ready` line (`old` answers on
    /// the same port meanwhile, so readiness is not asked of the port).
    pub fn start_successor(pair: &NetPair, old: &Haltd, extra: &[&str]) -> Result<Haltd> {
        let mut next = Haltd::spawn_successor(pair, old, extra)?;
        next.wait_ready_line(Duration::from_secs(20))
            .context("the successor did not become ready")?;
        Ok(next)
    }
}
