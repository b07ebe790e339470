//! `--take-over`: the successor's side of a hand-over (docs/operations.md "Upgrading"; the
//! old process's side: `admin/handover.rs` and `lifecycle.rs`).
//!
//! 1. The gate is loaded into this process's own cgroup leaf and passes its self-test first: a
//!    successor that cannot police streams never touches the haltd it would replace.
//! 2. [`ask`]: `POST /admin/handover` to the old haltd (`--take-over-from`, default `--admin`).
//!    It records a hand-over record, stops moving its state store's point, and answers with
//!    that record's seq and hash: this process's ledger segment starts there. From then on
//!    both are peers (`halt/handover.rs`).
//! 3. The listeners are bound beside the old ones (`SO_REUSEPORT`, `reuseport.rs`), the
//!    privileges go, the ledger segment and the state store are opened, the workers start.
//! 4. Once this process serves ([`complete`]): after `--take-over-overlap-ms`, new connections
//!    are steered to this listener, and the old process gets SIGUSR2: it stops accepting once
//!    its accept queue is empty, drains, and exits. When it is gone, this process is alone.
//!
//! A successor that fails at any step exits with its reason on stderr; the old process notices
//! that it exited before SIGUSR2 (its pidfd), records it, and serves on as before.

use std::{
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use hyper::{Method, StatusCode};
use serde::Deserialize;

use super::StartError;
use crate::{
    admin::client::{AdminClient, ClientError},
    config::Config,
    halt::HaltCore,
};

/// The haltd this process takes over from, as its answer named it.
#[derive(Debug)]
pub(super) struct Predecessor {
    pub(super) pid: u32,
    /// Its ledger segment, and its hand-over record there.
    pub(super) segment: PathBuf,
    pub(super) seq: u64,
    pub(super) hash: String,
    /// Opened at its answer, so that the signal and the wait reach that process and no other.
    pidfd: OwnedFd,
    /// When it answered.
    asked_at: Instant,
}

#[derive(Deserialize)]
struct Answer {
    pid: u32,
    segment: PathBuf,
    seq: u64,
    hash: String,
}

/// Asks the haltd at `--take-over-from` to hand over. `Ok(None)`: nothing answers there (the
/// first start of a pair of instances), and this start goes on alone.
pub(super) fn ask(cfg: &Config) -> Result<Option<Predecessor>, StartError> {
    let addr = cfg
        .args
        .take_over_from
        .as_ref()
        .unwrap_or(&cfg.args.admin)
        .to_string();
    let refused = |why: String| StartError::TakeOver(format!("--take-over from {addr}: {why}"));
    let client = AdminClient::new(&addr, cfg.args.admin_token_file.as_deref()).map_err(refused)?;
    let body = serde_json::json!({
        "pid": std::process::id(),
        "ledger": cfg.args.ledger,
    });
    let (status, text) = match client.request(Method::POST, "/admin/handover", Some(&body)) {
        Ok(answer) => answer,
        Err(ClientError::Connect { source, .. }) => {
            tracing::info!(admin = %addr, error = %source, "--take-over: no haltd answers there; starting without a hand-over");
            return Ok(None);
        }
        Err(e) => return Err(refused(e.to_string())),
    };
    if status != StatusCode::OK {
        return Err(refused(format!(
            "the running haltd refused the hand-over ({status}): {text}"
        )));
    }
    let a: Answer = serde_json::from_str(&text)
        .map_err(|e| refused(format!("its answer {text:?} does not parse: {e}")))?;
    let pidfd = crate::halt::handover::pidfd_open(a.pid)
        .map_err(|e| refused(format!("pidfd_open({}): {e}", a.pid)))?;
    match crate::reuseport::enable_migration() {
        Ok(true) => {}
        Ok(false) => tracing::info!(
            sysctl = crate::reuseport::MIGRATE_SYSCTL,
            "set to 1: connections still queued on the old listener when it shuts down move to this one instead of being reset"
        ),
        Err(e) => {
            return Err(refused(format!(
                "setting {} = 1: {e}",
                crate::reuseport::MIGRATE_SYSCTL
            )))
        }
    }
    tracing::info!(
        pid = a.pid,
        segment = %a.segment.display(),
        seq = a.seq,
        "--take-over: the running haltd recorded its hand-over; this one starts beside it"
    );
    Ok(Some(Predecessor {
        pid: a.pid,
        segment: a.segment,
        seq: a.seq,
        hash: a.hash,
        pidfd,
        asked_at: Instant::now(),
    }))
}

/// The hand-over's end, once this process serves: the overlap, the steering, SIGUSR2 to the old
/// process, and its exit. Records each step; never fails the process (the old one drains by
/// its own clock once signalled).
pub(super) async fn complete(shared: Arc<HaltCore>, pred: Predecessor, listener: OwnedFd) {
    let ready_ms = pred.asked_at.elapsed().as_millis();
    let overlap = Duration::from_millis(shared.cfg.args.take_over_overlap_ms);
    tokio::time::sleep(overlap).await;
    if let Err(e) = crate::reuseport::steer_to_newest(listener.as_fd()) {
        tracing::warn!(error = %e, "steering new connections to this listener failed; the group keeps sharing them until the old listener shuts down");
    }
    let signalled = Instant::now();
    // SAFETY: pidfd_send_signal on a pidfd this process owns, with no siginfo.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pred.pidfd.as_raw_fd(),
            libc::SIGUSR2,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        tracing::error!(pid = pred.pid, error = %e, "telling the old haltd to hand over (SIGUSR2) failed; both processes serve on");
        shared.record_lifecycle(format!(
            "hand-over from pid {}: SIGUSR2 failed ({e}); both processes serve on",
            pred.pid
        ));
        return;
    }
    tracing::info!(
        pid = pred.pid,
        ready_ms = ready_ms as u64,
        overlap_ms = overlap.as_millis() as u64,
        "told the old haltd to hand over (SIGUSR2): it stops accepting and drains"
    );
    if let Err(e) = crate::halt::handover::exited(pred.pidfd).await {
        tracing::warn!(pid = pred.pid, error = %e, "waiting for the old haltd to exit failed");
    }
    shared.handover.set_peer(false);
    if let Err(e) = crate::reuseport::unsteer(listener.as_fd()) {
        tracing::warn!(error = %e, "taking the steering program off the listener group failed");
    }
    let drained_ms = signalled.elapsed().as_millis();
    tracing::info!(
        pid = pred.pid,
        drained_ms = drained_ms as u64,
        "hand-over complete: the old haltd exited; this one serves alone"
    );
    shared.record_lifecycle(format!(
            "hand-over from pid {} complete: this process served {ready_ms} ms after asking, both accepted for {} ms, and the old one exited {drained_ms} ms after SIGUSR2",
            pred.pid,
            overlap.as_millis(),
        ),
    );
}
