//! The io_uring driver of a worker: the event loop, submission (with back-pressure when the
//! submission ring is full), and the dispatch of each completion to its connection by
//! `user_data` (the connection's slab key and the operation kind, [`ud`]).

use std::{io, os::fd::AsRawFd, time::Duration};

use io_uring::{opcode, squeue, types};

use super::Worker;
use crate::metrics::dataplane::RingEvent;

pub(super) const OP_ACCEPT: u64 = 1;
pub(super) const OP_WAKE: u64 = 2;
pub(super) const OP_RECV: u64 = 3;
pub(super) const OP_SEND: u64 = 4;
pub(super) const OP_TIMER: u64 = 5;
pub(super) const OP_LINK_TIMEOUT: u64 = 6;
pub(super) const OP_CANCEL: u64 = 7;
pub(super) const OP_UP_CONNECT: u64 = 8;
pub(super) const OP_UP_SEND: u64 = 9;
pub(super) const OP_UP_RECV: u64 = 10;
pub(super) const OP_UP_LINK: u64 = 11;
/// Receive on the client socket while a proxied turn runs (notices a client that left).
pub(super) const OP_WATCH: u64 = 12;
pub(super) const OP_CANCEL_UP: u64 = 13;
/// Key used for the listener and the eventfd, which are not connections.
pub(super) const WORKER_KEY: u64 = u32::MAX as u64;
pub(super) fn ud(key: usize, op: u64) -> u64 {
    ((key as u64) << 8) | op
}

impl Worker {
    /// Counts `n` ring events of `kind` (`haltd_ring_events_total`; rare, never per token).
    pub(super) fn ring_event(&self, kind: RingEvent, n: u64) {
        self.shared.metrics.dataplane.ring_event(kind, n);
    }

    pub(super) fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        let mut full = false;
        loop {
            // SAFETY: every entry points into buffers owned by `self.conns` (or the worker)
            // that stay alive and unmoved until the matching completion is reaped.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            if !full {
                full = true;
                self.ring_event(RingEvent::SqFull, 1);
            }
            if let Err(e) = self.ring.submit() {
                // In the middle of a completion there is no reaping to make room: as before,
                // the worker fails (and the daemon stops, fail closed).
                self.ring_event(RingEvent::SubmitError, 1);
                return Err(e);
            }
        }
    }

    /// After each wait: whether the completion ring overflowed into the kernel's backlog,
    /// and whether the kernel lost completions or rejected submissions since the last look
    /// (three atomic loads of the shared ring header per loop pass).
    pub(super) fn check_ring(&mut self) {
        if self.ring.submission().cq_overflow() {
            self.ring_event(RingEvent::CqOverflow, 1);
        }
        let cq_dropped = self.ring.completion().overflow();
        if let Some(n) = counter_delta(cq_dropped, &mut self.cq_dropped_seen) {
            self.ring_event(RingEvent::CqDropped, u64::from(n));
            tracing::error!(
                worker = self.id,
                lost = n,
                "the kernel dropped io_uring completions; connections waiting on them may hang"
            );
        }
        let sq_dropped = self.ring.submission().dropped();
        if let Some(n) = counter_delta(sq_dropped, &mut self.sq_dropped_seen) {
            self.ring_event(RingEvent::SqDropped, u64::from(n));
            tracing::error!(
                worker = self.id,
                dropped = n,
                "the kernel rejected io_uring submissions as invalid"
            );
        }
    }

    pub(super) fn run(&mut self) -> io::Result<()> {
        self.arm_accept()?;
        self.arm_wake()?;
        loop {
            let mut retry = false;
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {
                    // EBUSY: completions wait in the kernel's overflow backlog because the
                    // completion ring is full; EAGAIN: the kernel is short of memory for
                    // requests. Both pass: reap what is there (which makes room), then submit
                    // again. Submissions not taken stay queued in the ring.
                    self.ring_event(RingEvent::SubmitError, 1);
                    tracing::warn!(worker = self.id, error = %e, "io_uring_enter: retrying after reaping completions");
                    retry = true;
                }
                Err(e) => {
                    self.ring_event(RingEvent::SubmitError, 1);
                    return Err(e);
                }
            }
            self.check_ring();
            self.cqes.clear();
            self.cqes
                .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            let cqes = std::mem::take(&mut self.cqes);
            if retry && cqes.is_empty() {
                // Nothing to reap (EAGAIN): do not spin on the kernel.
                std::thread::sleep(Duration::from_millis(1));
            }
            for &(data, res) in &cqes {
                self.complete(data, res)?;
            }
            self.cqes = cqes;
        }
    }

    pub(super) fn arm_accept(&mut self) -> io::Result<()> {
        let e = opcode::Accept::new(
            types::Fd(self.listener.as_raw_fd()),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
        .flags(libc::SOCK_CLOEXEC)
        .build()
        .user_data(ud(WORKER_KEY as usize, OP_ACCEPT));
        self.push(&e)
    }

    pub(super) fn arm_wake(&mut self) -> io::Result<()> {
        let fd = self.shared.wakers[self.id as usize].as_raw_fd();
        let ptr: *mut u64 = &mut *self.wake_buf;
        let e = opcode::Read::new(types::Fd(fd), ptr.cast(), 8)
            .build()
            .user_data(ud(WORKER_KEY as usize, OP_WAKE));
        self.push(&e)
    }

    pub(super) fn complete(&mut self, data: u64, res: i32) -> io::Result<()> {
        let key = (data >> 8) as usize;
        let op = data & 0xff;
        if key == WORKER_KEY as usize {
            return match op {
                OP_ACCEPT => {
                    if res >= 0 {
                        self.accepted(res);
                    } else if res != -libc::EINTR && res != -libc::ECONNABORTED {
                        tracing::warn!(error = %io::Error::from_raw_os_error(-res), "accept failed");
                        if res == -libc::EMFILE || res == -libc::ENFILE {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                    self.arm_accept()
                }
                OP_WAKE => {
                    self.scan_tripped();
                    self.arm_wake()
                }
                _ => Ok(()),
            };
        }
        let Some(conn) = self.conns.get_mut(key) else {
            return Ok(());
        };
        match op {
            OP_RECV => {
                conn.recv_inflight = false;
                self.on_recv(key, res)?;
            }
            OP_LINK_TIMEOUT => conn.link_inflight = false,
            OP_SEND => self.on_send(key, res)?,
            OP_TIMER => {
                conn.timer_inflight = false;
                if !conn.closing {
                    self.step(key)?;
                }
            }
            OP_CANCEL => conn.cancel_inflight = conn.cancel_inflight.saturating_sub(1),
            OP_UP_CONNECT => self.on_up_connect(key, res)?,
            OP_UP_SEND => self.on_up_send(key, res)?,
            OP_UP_RECV => self.on_up_recv(key, res)?,
            OP_UP_LINK => self.on_up_link(key)?,
            OP_WATCH => self.on_watch(key, res)?,
            OP_CANCEL_UP => {
                if let Some(up) = conn.up.as_mut() {
                    up.cancel_inflight = up.cancel_inflight.saturating_sub(1);
                }
            }
            _ => {}
        }
        self.maybe_finish_close(key);
        Ok(())
    }
}

/// How far a wrapping kernel counter moved since `seen` (which it then becomes); `None` when
/// it did not.
fn counter_delta(now: u32, seen: &mut u32) -> Option<u32> {
    let n = now.wrapping_sub(*seen);
    *seen = now;
    (n != 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use io_uring::IoUring;

    use super::*;

    /// What `Worker::check_ring` relies on: completions past a full completion ring set the
    /// overflow flag (kernels with IORING_FEAT_NODROP keep them in a backlog) or count as
    /// dropped (older kernels), and reaping then entering the kernel again flushes the backlog.
    #[test]
    fn a_full_completion_ring_shows_in_the_counters_check_ring_reads() {
        let Ok(mut ring) = IoUring::new(2) else {
            eprintln!("no io_uring here (kernel.io_uring_disabled?): skipped");
            return;
        };
        let cq = ring.params().cq_entries();
        for i in 0..cq + 2 {
            let nop = opcode::Nop::new().build().user_data(u64::from(i));
            // SAFETY: a NOP points at no memory.
            unsafe { ring.submission().push(&nop) }.expect("room after each submit");
            ring.submit().expect("submit");
        }
        let overflowed = ring.submission().cq_overflow();
        let dropped = ring.completion().overflow();
        assert!(
            overflowed || dropped == 2,
            "flag {overflowed}, dropped {dropped}"
        );
        assert_eq!(ring.submission().dropped(), 0);
        let mut reaped = ring.completion().count() as u32;
        if overflowed {
            ring.submit_and_wait(0).expect("enter flushes the backlog");
            reaped += ring.completion().count() as u32;
            assert!(!ring.submission().cq_overflow(), "backlog flushed");
            assert_eq!(reaped, cq + 2, "no completion lost");
        }
    }
}
