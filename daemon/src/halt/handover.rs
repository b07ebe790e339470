//! Where this process stands in a hand-over to or from another haltd (docs/operations.md
//! "Upgrading"; the start's side: `server/takeover.rs`, the old process's: `lifecycle.rs`).
//!
//! While two processes serve (from the successor's hand-over request until the old process
//! exits) each is the other's **peer**: a halt in either degrades its scope in the shared state
//! store, and each turn that starts in the other reads what changed there first
//! ([`HaltCore::adopt_peer_degradations`]), so a scope one of them degraded is degraded in both
//! from the other's next turn on. An operator's `haltctl mode full` ends a scope in the process
//! it reaches only: the peer keeps it degraded until it exits (it fails closed).

use std::{
    os::fd::{FromRawFd, OwnedFd},
    sync::{
        atomic::{AtomicBool, Ordering::SeqCst},
        Mutex,
    },
    time::SystemTime,
};

use super::HaltCore;

/// The hand-over flags of one process.
#[derive(Debug, Default)]
pub struct Handover {
    /// Another haltd serves beside this one.
    peer: AtomicBool,
    /// This process hands over (its successor's SIGUSR2): it accepts no more connections, and
    /// its drain serves the turns of the connections it has, keeping none of them.
    pub handing_over: AtomicBool,
    /// The client listener is shut down: the workers stop accepting.
    pub listener_shut: AtomicBool,
    /// The pid of the successor whose hand-over request this process answered, until that
    /// successor takes over or exits.
    successor: Mutex<Option<u32>>,
}

impl Handover {
    /// Whether another haltd serves beside this one.
    pub fn peer(&self) -> bool {
        self.peer.load(SeqCst)
    }

    pub fn set_peer(&self, on: bool) {
        self.peer.store(on, SeqCst);
    }

    /// Takes `pid` as the successor; fails with the pid of one already under way.
    pub fn begin_for(&self, pid: u32) -> Result<(), u32> {
        let mut s = self.successor.lock().unwrap_or_else(|p| p.into_inner());
        match *s {
            Some(other) => Err(other),
            None => {
                *s = Some(pid);
                Ok(())
            }
        }
    }

    /// The successor under way, if any.
    pub fn successor(&self) -> Option<u32> {
        *self.successor.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The successor took over or is gone.
    pub fn clear_successor(&self) {
        *self.successor.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl HaltCore {
    /// While a peer serves: the degraded scopes it stored that this process does not hold,
    /// held now and recorded (`by: peer`), before the turn that asks is admitted. A lock and a
    /// `PRAGMA data_version` per turn start, and only during a hand-over. Returns whether the
    /// store could not be read: the turn then runs degraded (fail closed).
    pub fn adopt_peer_degradations(&self) -> bool {
        if !self.handover.peer() {
            return false;
        }
        match self.state.peer_scopes() {
            Ok(None) => false,
            Ok(Some(rows)) => {
                let now = (SystemTime::now(), crate::clock::monotonic_ns());
                for ch in self.modes.adopt_peer(&rows, now.0, now.1) {
                    self.record_mode_change(&ch);
                }
                false
            }
            Err(e) => {
                tracing::error!(error = %e, "reading the peer's degraded scopes from the state store failed; this turn runs degraded");
                true
            }
        }
    }
}

impl HaltCore {
    /// Queues a `lifecycle` record saying `message` (a step of a hand-over); a ledger that
    /// fails fails the daemon closed.
    pub fn record_lifecycle(&self, message: String) {
        let rec = crate::ledger::Record {
            kind: crate::ledger::RecordKind::Lifecycle,
            kernel_gate: self.kernel_gate_label().into(),
            message: Some(message),
            ..crate::ledger::Record::default()
        };
        if let Err(e) = self.ledger.append(rec) {
            self.record_failed(&e);
        }
    }

    /// During a hand-over, a halt that degrades its scope does so before its terminal event
    /// goes out, and waits until the change is in the state store: the client's next request
    /// may reach the peer, which must find the scope degraded. Blocks the caller (a data-plane
    /// worker, once per such halt, only while a peer serves) for the ledger's fsync and the
    /// store's commit. The halt's completion then does not degrade it again.
    pub fn degrade_before_terminal(
        &self,
        slot: &crate::stream::Slot,
        snap: &crate::stream::SlotSnapshot,
    ) {
        if !self.handover.peer() || !snap.halt_degrades || self.shutting_down.load(SeqCst) {
            return;
        }
        slot.halt_degrades.store(false, SeqCst);
        let cause = snap
            .trip_cause
            .unwrap_or(crate::codes::FailureCode::WatchdogTrip);
        if !crate::modes::cause_degrades(cause) {
            return;
        }
        if let Some(ch) = self.modes.enter(snap.scope(), cause, &snap.id.to_string()) {
            self.record_mode_change(&ch);
            if let Err(e) = self.ledger.flush() {
                tracing::error!(error = %e, "waiting for the degradation's record failed");
            }
            self.state.flush();
        }
    }
}

/// `pidfd_open(2)`: a descriptor that names process `pid` for as long as it is open.
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Waits until the process of `pidfd` has exited (its pidfd turns readable).
pub async fn exited(pidfd: OwnedFd) -> std::io::Result<()> {
    // SAFETY: the AsyncFd owns the descriptor, which stays open and the same until it drops.
    let fd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)?
    };
    let _ready = fd.readable().await?;
    Ok(())
}
