//! The io_uring driver of a worker: the event loop, submission (with back-pressure when the
//! submission ring is full) of operations that own their buffers (`op.rs`), and the dispatch
//! of each completion, with its buffer handed back, to the connection that submitted it.

use std::{
    io,
    os::fd::{AsRawFd, RawFd},
    time::Duration,
};

use io_uring::{opcode, squeue, types, IoUring};

use crate::dataplane::Io;
use crate::dataplane::{
    driver::op::{Op, OpBuf, OpKind, Owner},
    ConnTag, Step, Worker,
};
use crate::metrics::dataplane::RingEvent;

/// Submission (and completion) ring size of each worker.
const RING_ENTRIES: u32 = 1024;

/// `IORING_RECVSEND_POLL_FIRST` (Linux 5.19), in a receive's `ioprio`.
const RECV_POLL_FIRST: u16 = 1;

/// How a worker's ring was set up: what the kernel does for each completion.
///
/// Every token costs at least two completions (the upstream receive, the client send). On a
/// plain ring, the kernel half of a completion (a receive's copy once its poll fired) is task
/// work that interrupts the worker wherever it runs (`TWA_SIGNAL`), one interruption per
/// completion. A ring built with `DEFER_TASKRUN` and `SINGLE_ISSUER` (Linux 6.1) keeps that
/// work until the worker itself waits for completions, and then runs it all in one go in
/// `io_uring_enter`: no interruption, and the batch shares one kernel entry. It may only be
/// entered by the thread that enabled it, which each worker's own ring is (`run`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) enum RingSetup {
    /// `DEFER_TASKRUN` and `SINGLE_ISSUER`, created disabled and enabled by the worker's
    /// thread when it starts.
    Deferred,
    /// A kernel that refused those flags (before 6.1): a plain ring.
    Plain,
}

impl RingSetup {
    /// Builds a worker's ring: deferred task work when the kernel has it, else plain.
    pub(in crate::dataplane) fn build() -> io::Result<(IoUring, Self)> {
        let deferred = IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_r_disabled()
            .build(RING_ENTRIES);
        match deferred {
            Ok(ring) => Ok((ring, RingSetup::Deferred)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Ok((IoUring::new(RING_ENTRIES)?, RingSetup::Plain))
            }
            Err(e) => Err(e),
        }
    }

    /// A receive into `len` bytes at `ptr` on a socket that is most likely empty (its last
    /// receive took what was there): on a deferred ring (so Linux 6.1, past 5.19) it waits
    /// for data first (`POLL_FIRST`) instead of trying a receive that finds nothing.
    pub(in crate::dataplane) fn recv_when_ready(
        self,
        fd: RawFd,
        ptr: *mut u8,
        len: usize,
    ) -> squeue::Entry {
        let ioprio = match self {
            RingSetup::Deferred => RECV_POLL_FIRST,
            RingSetup::Plain => 0,
        };
        opcode::Recv::new(types::Fd(fd), ptr, len as u32)
            .ioprio(ioprio)
            .build()
    }
}

impl Worker {
    pub(in crate::dataplane) fn run(&mut self) -> io::Result<()> {
        if self.io.ring_setup == RingSetup::Deferred {
            // Created disabled in the spawning thread: this thread becomes its one issuer.
            self.io.ring.submitter().register_enable_rings()?;
        }
        self.io.arm_accept()?;
        self.io.arm_wake(Box::new(0))?;
        let beat = self.io.shared.workers.get(self.io.id as usize).cloned();
        loop {
            let mut retry = false;
            // For the watchdog (`progress.rs`): waiting here is no stall, a step that never
            // returns is.
            if let Some(b) = &beat {
                b.waiting();
            }
            let waited = self.io.ring.submit_and_wait(1);
            if let Some(b) = &beat {
                b.handling();
            }
            match waited {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {
                    // EBUSY: completions wait in the kernel's overflow backlog because the
                    // completion ring is full; EAGAIN: the kernel is short of memory for
                    // requests. Both pass: reap what is there (which makes room), then submit
                    // again. Submissions not taken stay queued in the ring.
                    self.io.ring_event(RingEvent::SubmitError, 1);
                    tracing::warn!(worker = self.io.id, error = %e, "io_uring_enter: retrying after reaping completions");
                    retry = true;
                }
                Err(e) => {
                    self.io.ring_event(RingEvent::SubmitError, 1);
                    return Err(e);
                }
            }
            self.io.check_ring();
            self.io.cqes.clear();
            self.io.cqes.extend(
                self.io
                    .ring
                    .completion()
                    .map(|c| (c.user_data(), c.result())),
            );
            let cqes = std::mem::take(&mut self.io.cqes);
            if retry && cqes.is_empty() {
                // Nothing to reap (EAGAIN): do not spin on the kernel.
                std::thread::sleep(Duration::from_millis(1));
            }
            for &(data, res) in &cqes {
                self.complete(data, res)?;
            }
            self.io.cqes = cqes;
            self.finish_closes();
        }
    }

    /// A completion: its operation leaves the table, and its buffer goes back to the owner
    /// with the result. The operation of a connection that is gone is dropped here, buffer
    /// and all.
    pub(in crate::dataplane) fn complete(&mut self, user_data: u64, res: i32) -> io::Result<()> {
        let Some(op) = self.io.ops.take(user_data) else {
            return Ok(());
        };
        let kind = op.kind;
        match op.owner {
            Owner::Worker => self.worker_op(kind, op, res),
            Owner::Conn { key, serial } => {
                let tag = ConnTag { key, serial };
                let Some(mut step) = self.step_of(tag) else {
                    return Ok(());
                };
                step.conn.ops -= 1;
                let reissue = step
                    .conn
                    .turn
                    .as_ref()
                    .and_then(|t| t.grounding.as_ref())
                    .is_some_and(|g| g.reissue.is_some());
                step.on_op(kind, op.into_buf(res), res)?;
                step.send_waiting_final()?;
                if reissue {
                    // A grounded continuation waits for the old upstream socket
                    // (`ground/continuation.rs`).
                    step.maybe_reissue()?;
                }
                // After the step has returned: the connection may close now.
                self.maybe_finish_close(tag);
                Ok(())
            }
        }
    }

    fn worker_op(&mut self, kind: OpKind, op: Op, res: i32) -> io::Result<()> {
        match (kind, op.into_buf(res)) {
            (OpKind::Accept, _) => {
                if res >= 0 {
                    self.accepted(res);
                } else if self
                    .io
                    .shared
                    .handover
                    .listener_shut
                    .load(std::sync::atomic::Ordering::SeqCst)
                {
                    // Handed over: the listener is shut down (`reuseport::shut_down`), and
                    // this worker accepts no more.
                    return Ok(());
                } else if res != -libc::EINTR && res != -libc::ECONNABORTED {
                    tracing::warn!(error = %io::Error::from_raw_os_error(-res), "accept failed");
                    if res == -libc::EMFILE || res == -libc::ENFILE {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                self.io.arm_accept()
            }
            (OpKind::Wake, OpBuf::Word(w)) => {
                self.on_wake();
                self.io.arm_wake(w)
            }
            (OpKind::Sweep, OpBuf::Time(ts)) => self.on_sweep(ts),
            (OpKind::Tick, OpBuf::Time(ts)) => self.on_scan_tick(ts),
            (OpKind::DrainTick, OpBuf::Time(ts)) => self.on_drain_tick(ts),
            _ => Ok(()),
        }
    }
}

impl Step<'_> {
    /// A connection's operation completed: its handler, with the buffer back.
    fn on_op(&mut self, kind: OpKind, buf: OpBuf, res: i32) -> io::Result<()> {
        let conn = &mut *self.conn;
        match (kind, buf) {
            (OpKind::Recv, OpBuf::Recv(b)) => {
                conn.recv_op = None;
                if conn.tls.is_some() {
                    return self.on_tls_recv(res, b);
                }
                conn.rbuf = Some(b);
                self.on_recv(res)
            }
            (OpKind::RecvDeadline, OpBuf::Time(ts)) => {
                conn.read_ts = Some(ts);
                Ok(())
            }
            (OpKind::Send, OpBuf::Send { buf, off }) => self.on_send(res, buf, off),
            (OpKind::Timer, OpBuf::Time(ts)) => {
                conn.timer_ts = Some(ts);
                conn.timer_op = None;
                if conn.closing {
                    return Ok(());
                }
                self.step()
            }
            (OpKind::Watch, buf) => {
                conn.watch_op = None;
                match buf {
                    OpBuf::Time(ts) => conn.watch_ts = Some(ts),
                    OpBuf::Recv(b) => conn.watch_buf = Some(b),
                    _ => {}
                }
                self.on_watch(res)
            }
            (OpKind::UpConnect, _) => self.on_up_connect(res),
            (OpKind::UpSend, OpBuf::Send { buf, off }) => self.on_up_send(res, buf, off),
            (OpKind::UpRecv, OpBuf::Recv(b)) => self.on_up_recv(res, b),
            (OpKind::UpDeadline, OpBuf::Time(ts)) => self.on_up_link(ts),
            (OpKind::Score, OpBuf::Fd(fd)) => self.on_score(res, fd),
            (OpKind::ScoreDeadline, OpBuf::Time(ts)) => {
                self.on_score_deadline(ts);
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

impl Io {
    /// Counts `n` ring events of `kind` (`haltd_ring_events_total`; rare, never per token).
    pub(in crate::dataplane) fn ring_event(&self, kind: RingEvent, n: u64) {
        self.shared.metrics.dataplane.ring_event(kind, n);
    }

    /// Submits `entry`, an operation that owns `buf` until its completion: the entry points
    /// only into `buf`'s heap memory (a `Vec`'s or a `Box`'s), which moving `buf` into the op
    /// table does not move. Returns the operation's `user_data` (what a cancellation names).
    pub(in crate::dataplane) fn submit(
        &mut self,
        owner: Owner,
        kind: OpKind,
        buf: OpBuf,
        entry: squeue::Entry,
    ) -> io::Result<u64> {
        let user_data = self.ops.insert(owner, kind, buf);
        if let Err(e) = self.push(&entry.user_data(user_data)) {
            // Not submitted: the kernel never saw the buffer.
            self.ops.take(user_data);
            return Err(e);
        }
        Ok(user_data)
    }

    fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        let mut full = false;
        loop {
            // SAFETY: every entry points into memory owned by its operation in `self.ops`
            // (`submit`), which stays there, alive and unmoved, until the completion is reaped.
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
    pub(in crate::dataplane) fn check_ring(&mut self) {
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

    pub(in crate::dataplane) fn arm_accept(&mut self) -> io::Result<()> {
        let fd = types::Fd(self.listener.as_raw_fd());
        let e = opcode::Accept::new(fd, std::ptr::null_mut(), std::ptr::null_mut())
            .flags(libc::SOCK_CLOEXEC)
            .build();
        self.submit(Owner::Worker, OpKind::Accept, OpBuf::None, e)
            .map(drop)
    }

    fn arm_wake(&mut self, mut word: Box<u64>) -> io::Result<()> {
        let fd = types::Fd(self.shared.wakers[self.id as usize].as_raw_fd());
        let ptr: *mut u64 = &mut *word;
        let e = opcode::Read::new(fd, ptr.cast(), 8).build();
        self.submit(Owner::Worker, OpKind::Wake, OpBuf::Word(word), e)
            .map(drop)
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

    /// What `Io::check_ring` relies on: completions past a full completion ring set the
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
