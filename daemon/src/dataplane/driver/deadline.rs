//! Upstream receive deadlines: one timer per worker instead of a linked timeout per receive.
//!
//! A turn's upstream receive must not wait past its deadline (time to the first event from
//! the request, then the stall deadline from the last event; `upstream_io.rs`
//! `up_arm_recv`). A timeout linked to every receive costs a second submission and a second
//! completion per token; instead each receive notes its deadline, and while any receive is in
//! flight the worker runs one timer ([`OpKind::Sweep`]) that cancels the receives whose
//! deadline passed. A cancelled receive completes with `ECANCELED`, which
//! `upstream_io/recv.rs` `up_recv_failed` reports as the deadline it was (first token or stall).
//!
//! The sweep runs every [`period`]: 1/16 of the smaller of the two deadlines, between 1 ms
//! and 100 ms, so a deadline is enforced at most that late. With nothing in flight the timer
//! is not re-armed (an idle worker does not wake for it).

use std::{io, time::Duration};

use io_uring::{opcode, types};

use crate::clock::monotonic_ns;
use crate::dataplane::{
    driver::op::{OpBuf, OpKind, Owner},
    timespec, Worker,
};
use crate::dataplane::{ConnTag, Io};

/// The worker's sweep timer and the cancellations of one pass (reused, so a pass allocates
/// nothing once it has seen its largest batch).
#[derive(Debug, Default)]
pub(in crate::dataplane) struct Sweep {
    ts: Option<Box<types::Timespec>>,
    armed: bool,
    due: Vec<(ConnTag, u64)>,
}

/// How often the sweep runs: 1/16 of the smaller upstream deadline, within 1..=100 ms.
pub(in crate::dataplane) fn period(first_token: Duration, stall: Duration) -> Duration {
    (first_token.min(stall) / 16).clamp(Duration::from_millis(1), Duration::from_millis(100))
}

impl Worker {
    /// The sweep timer fired: cancel every upstream receive past its deadline; re-arm while
    /// any receive is in flight.
    pub(in crate::dataplane) fn on_sweep(&mut self, ts: Box<types::Timespec>) -> io::Result<()> {
        self.io.sweep.ts = Some(ts);
        self.io.sweep.armed = false;
        let now = monotonic_ns();
        let mut in_flight = false;
        let mut due = std::mem::take(&mut self.io.sweep.due);
        due.clear();
        for (key, conn) in &mut self.conns {
            let tag = ConnTag {
                key,
                serial: conn.serial,
            };
            let Some(up) = conn.up.as_mut() else {
                continue;
            };
            let Some(op) = up.recv_op else {
                continue;
            };
            in_flight = true;
            if now >= up.recv_deadline_ns && !up.recv_cancelled {
                up.recv_cancelled = true;
                due.push((tag, op));
            }
        }
        for &(tag, target) in &due {
            let Some(mut step) = self.step_of(tag) else {
                continue;
            };
            let e = opcode::AsyncCancel::new(target).build();
            // A failed submission is retried at the next pass (the flag is cleared).
            if step.submit(OpKind::Cancel, OpBuf::None, e).is_err() {
                if let Some(up) = step.conn.up.as_mut() {
                    up.recv_cancelled = false;
                }
            }
        }
        self.io.sweep.due = due;
        if in_flight {
            self.io.arm_sweep()?;
        }
        Ok(())
    }
}

impl Io {
    /// Arms the sweep timer unless it is armed.
    pub(in crate::dataplane) fn arm_sweep(&mut self) -> io::Result<()> {
        if self.sweep.armed {
            return Ok(());
        }
        let cfg = &self.shared.cfg;
        let d = period(cfg.upstream_first_token_timeout, cfg.upstream_stall_timeout);
        let mut ts = self
            .sweep
            .ts
            .take()
            .unwrap_or_else(|| Box::new(timespec(d)));
        *ts = timespec(d);
        let e = opcode::Timeout::new(&raw const *ts).build();
        self.submit(Owner::Worker, OpKind::Sweep, OpBuf::Time(ts), e)?;
        self.sweep.armed = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_period_is_a_sixteenth_of_the_smaller_deadline_within_bounds() {
        let ms = Duration::from_millis;
        assert_eq!(period(ms(800), ms(320)), ms(20));
        assert_eq!(period(ms(320), ms(800)), ms(20));
        assert_eq!(period(ms(60_000), ms(30_000)), ms(100));
        assert_eq!(period(ms(60_000), ms(5)), ms(1));
    }
}
