//! Halts the watchdog claimed, waiting for their incident record to be on disk.
//!
//! The incident is on disk before the client can see the halt (issue 13, point 5). The
//! watchdog never waits for the disk itself: an fsync on its thread takes what the disk takes
//! (hundreds of ms on a busy one), the heartbeat would stall meanwhile, and every open stream
//! would halt with `HEARTBEAT_LOST`. So it queues the record ([`Ledger::append_then`]) and
//! goes on beating; each round finishes the halts whose record the ledger's writer reported:
//! the terminal frame (unless a send is stuck), `shutdown`, the halt completed. Until then the
//! stream is `HALTING`: its emitter sends nothing more, the kernel gate holds its post-trip
//! budget, and its worker keeps the descriptor open (it closes it only after the halt).
//!
//! [`Ledger::append_then`]: crate::ledger::Ledger::append_then

use std::sync::{atomic::Ordering::SeqCst, Arc, OnceLock};

use crate::{halt::HaltCore, ledger::LedgerError, ledger::Record};

/// A stream whose halt the watchdog claimed.
#[derive(Debug, Clone, Copy)]
pub struct Claimed {
    /// Its slot in the stream table.
    pub idx: u32,
    /// Its client socket (open until the halt completes: only its worker closes it, after).
    pub fd: i32,
    /// The emitter had a send in flight: no terminal frame (it could interleave).
    pub send_stuck: bool,
}

/// What the ledger's writer reported for a queued incident.
type Written = Arc<OnceLock<Result<u64, LedgerError>>>;

/// The claimed halts whose incident is not on disk yet, and the buffer terminal frames are
/// encoded in. Owned by the watchdog thread.
#[derive(Debug)]
pub struct Pending {
    waiting: Vec<(Claimed, Written)>,
    buf: Vec<u8>,
}

impl Default for Pending {
    fn default() -> Self {
        Self::new()
    }
}

impl Pending {
    pub fn new() -> Self {
        Pending {
            waiting: Vec::new(),
            buf: Vec::with_capacity(4096),
        }
    }

    /// Queues `rec`, the incident of `claim`; the halt finishes in the round that sees it on
    /// disk. A record that cannot even be queued fails the daemon closed, and the halt
    /// finishes now (nothing will be written to wait for).
    pub fn queue(&mut self, shared: &HaltCore, claim: Claimed, rec: Record) {
        let written: Written = Arc::new(OnceLock::new());
        let report = Arc::clone(&written);
        // Runs on the writer thread: it only stores the result.
        let queued = shared.ledger.append_then(rec, move |r| {
            let _ = report.set(r);
        });
        match queued {
            Ok(()) => self.waiting.push((claim, written)),
            Err(e) => {
                shared.record_failed(&e);
                finish(shared, claim, &mut self.buf);
            }
        }
    }

    /// Whether a claimed halt still waits for its record.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Finishes every halt whose incident the writer reported (written, or failed: then the
    /// daemon fails closed first).
    pub fn finish_written(&mut self, shared: &HaltCore) {
        let mut i = 0;
        while i < self.waiting.len() {
            let Some(result) = self.waiting[i].1.get() else {
                i += 1;
                continue;
            };
            if let Err(e) = result {
                shared.record_failed(e);
            }
            let (claim, _) = self.waiting.swap_remove(i);
            finish(shared, claim, &mut self.buf);
        }
    }
}

/// Ends a claimed stream whose incident is on disk (or could not be written): the terminal
/// frame with a plain non-blocking `send` unless a send is stuck, `shutdown`, the halt
/// completed and published, its worker woken to close the descriptor.
fn finish(shared: &HaltCore, claim: Claimed, buf: &mut Vec<u8>) {
    let slot = shared.table.slot(claim.idx);
    let fd = claim.fd;
    if !claim.send_stuck {
        shared.terminal_wire(&slot.snapshot(claim.idx), buf);
        let n = if buf.is_empty() {
            -1 // TLS, and no terminal could be sealed
        } else {
            // SAFETY: `fd` is the open socket of this slot: the owning worker closes it only
            // after the slot left HALTING, which only this thread can do now.
            unsafe {
                libc::send(
                    fd,
                    buf.as_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            }
        };
        if n < 0 || n as usize != buf.len() {
            tracing::info!(stream_id = %slot.snapshot(claim.idx).id, "watchdog: terminal event not delivered (socket closed or dropped by the kernel gate)");
        }
    }
    // SAFETY: as above; shutdown (not close) ends the stream and wakes pending I/O.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    shared.halt_completed(&slot.snapshot(claim.idx));
    slot.publish_halted();
    shared.wake(slot.worker.load(SeqCst));
}
