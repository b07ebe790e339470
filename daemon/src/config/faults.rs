//! `--fault`: the test-only faults a `fault-injection` build accepts; any other build refuses
//! them.

use std::time::Duration;

use super::{err, ConfigError};

/// Faults injected for tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// The emitter keeps sending tokens after a trip, so only the kernel stops it.
    pub emitter_ignores_halt: bool,
    /// The watchdog thread stops (heartbeats included) this long after start.
    pub watchdog_stall_after: Option<Duration>,
    /// A data-plane worker or the watchdog panics after N tokens ([`crate::crash`]).
    pub panic: Option<crate::crash::PanicFault>,
    /// Every ledger record takes this much longer to write (a busy disk).
    pub ledger_slow_write: Option<Duration>,
    /// The client socket is shut down and its connection closed right after the release phase
    /// of a turn's Nth text (the moment a trip, a failed send or a gone client can close it),
    /// before the pipeline goes on with the same connection.
    pub close_during_step: Option<u64>,
    /// Every state-store write after the first N fails (`state.rs`): a disk that stopped
    /// taking the store's writes.
    pub state_write_fails_after: Option<u64>,
    /// The named in-process detector never returns, the first time it judges a turn's token
    /// 20 (`exfil`: its first text; `safety`: SafetyCheck at its first turn's end): its worker
    /// hangs (`progress.rs`).
    pub detector_hang: Option<crate::detect::DetectorId>,
    /// Every ledger write from the Nth on (counted from the start) fails with EIO.
    pub ledger_write_fails_after: Option<u64>,
    /// `silent-rewrite=FROM>TO`: every produced text has FROM replaced by TO on its way to
    /// the client, with nothing typed to say so: the silent correction SafetyCheck's
    /// `no_silent_correction` exists to catch.
    /// Leaked once at start (a test-only flag), so that `Faults` stays `Copy`.
    pub silent_rewrite: Option<(&'static str, &'static str)>,
}

pub(super) fn parse_faults(faults: &[String]) -> Result<Faults, ConfigError> {
    let mut out = Faults::default();
    if faults.is_empty() {
        return Ok(out);
    }
    if !cfg!(feature = "fault-injection") {
        return Err(err("fault", "this build has no fault injection (build with the `fault-injection` feature, as `cargo xtask test` does)"));
    }
    for f in faults {
        if f == "emitter-ignores-halt" {
            out.emitter_ignores_halt = true;
        } else if let Some(ms) = f.strip_prefix("watchdog-stall-after-ms=") {
            let ms: u64 = ms.parse().map_err(|_| {
                err(
                    "fault",
                    format!("{f:?}: N must be a whole number of milliseconds"),
                )
            })?;
            out.watchdog_stall_after = Some(Duration::from_millis(ms));
        } else if let Some(ms) = f.strip_prefix("ledger-slow-write-ms=") {
            let ms: u64 = ms.parse().map_err(|_| {
                err(
                    "fault",
                    format!("{f:?}: N must be a whole number of milliseconds"),
                )
            })?;
            out.ledger_slow_write = Some(Duration::from_millis(ms));
        } else if let Some(n) = f.strip_prefix("close-during-step=") {
            let n: u64 = n.parse().ok().filter(|&n| n >= 1).ok_or_else(|| {
                err(
                    "fault",
                    format!("{f:?}: N must be a whole number, at least 1"),
                )
            })?;
            out.close_during_step = Some(n);
        } else if let Some(n) = f.strip_prefix("state-write-fails-after=") {
            let n: u64 = n
                .parse()
                .map_err(|_| err("fault", format!("{f:?}: N must be a whole number")))?;
            out.state_write_fails_after = Some(n);
        } else if let Some(name) = f.strip_prefix("detector-hang=") {
            let id = crate::detect::DetectorId::ALL
                .into_iter()
                .find(|d| d.as_str() == name)
                .ok_or_else(|| {
                    err(
                        "fault",
                        format!("{f:?}: NAME must be one of halt_monitor, surprise, compute_budget, latency_anomaly, exfil, safety"),
                    )
                })?;
            out.detector_hang = Some(id);
        } else if let Some(n) = f.strip_prefix("ledger-write-fails-after=") {
            let n: u64 = n.parse().ok().filter(|&n| n >= 1).ok_or_else(|| {
                err(
                    "fault",
                    format!("{f:?}: N must be a whole number, at least 1"),
                )
            })?;
            out.ledger_write_fails_after = Some(n);
        } else if let Some(spec) = f.strip_prefix("silent-rewrite=") {
            out.silent_rewrite = Some(silent_rewrite(f, spec)?);
        } else if let Some(spec) = f.strip_prefix("panic-after-tokens=") {
            let fault = crate::crash::PanicFault::parse(spec)
                .map_err(|e| err("fault", format!("{f:?}: {e}")))?;
            out.panic = Some(fault);
        } else {
            return Err(err(
                "fault",
                format!(
                    "unknown fault {f:?} (known: emitter-ignores-halt, watchdog-stall-after-ms=N, ledger-slow-write-ms=N, panic-after-tokens=N[,thread=worker|watchdog], close-during-step=N, state-write-fails-after=N, detector-hang=NAME, ledger-write-fails-after=N, silent-rewrite=FROM>TO)"
                ),
            ));
        }
    }
    Ok(out)
}

/// `silent-rewrite=FROM>TO`: the two strings, leaked once (a test-only flag read at start) so
/// that [`Faults`] stays `Copy`.
fn silent_rewrite(f: &str, spec: &str) -> Result<(&'static str, &'static str), ConfigError> {
    let (from, to) = spec
        .split_once('>')
        .filter(|(from, _)| !from.is_empty())
        .ok_or_else(|| {
            err(
                "fault",
                format!("{f:?}: expected silent-rewrite=FROM>TO with FROM not empty"),
            )
        })?;
    let leak = |s: &str| -> &'static str { Box::leak(s.to_owned().into_boxed_str()) };
    Ok((leak(from), leak(to)))
}
