//! The driver's half of the worker's two ticks (`conn/drain.rs`): each walks the slab, asks
//! every connection concerned what its tick found (`Conn::send_stalled`, `Conn::check_drain`),
//! and does what that means: a stalled client cut on its step, a drained connection closed.

use std::io;

use io_uring::types;

use crate::{
    clock::monotonic_ns,
    dataplane::{conn::drain::DrainCheck, ConnTag, Worker},
    metrics::dataplane::StallPhase,
};

impl Worker {
    /// The scan timer fired: the connections are looked at, the stalled ones cut; re-armed
    /// while the worker has a connection.
    pub(in crate::dataplane) fn on_scan_tick(
        &mut self,
        ts: Box<types::Timespec>,
    ) -> io::Result<()> {
        let (scan, timeout) = self.io.scan_fired(ts);
        let now = monotonic_ns();
        let mut stalled = std::mem::take(&mut self.io.tick.stalled);
        stalled.clear();
        stalled.extend(self.conns.iter_mut().filter_map(|(key, c)| {
            c.send_stalled(scan, now, timeout).then_some(ConnTag {
                key,
                serial: c.serial,
            })
        }));
        for &tag in &stalled {
            if let Some(mut step) = self.step_of(tag) {
                step.client_stalled(StallPhase::Stream);
            }
        }
        self.io.tick.stalled = stalled;
        if !self.conns.is_empty() {
            self.io.arm_scan()?;
        }
        Ok(())
    }

    /// The drain timer fired: the drain checks due; re-armed while a connection drains.
    pub(in crate::dataplane) fn on_drain_tick(
        &mut self,
        ts: Box<types::Timespec>,
    ) -> io::Result<()> {
        self.io.drain_fired(ts);
        let now = monotonic_ns();
        self.check_drains(now);
        self.arm_drain_timer(now)
    }

    /// Arms the drain timer, unless it is armed, for the earliest drain check due.
    fn arm_drain_timer(&mut self, now: u64) -> io::Result<()> {
        let due = self
            .io
            .tick
            .draining
            .iter()
            .filter_map(|&tag| self.conn_of(tag).and_then(|c| c.drain_due()))
            .min();
        match due {
            Some(due) => self.io.arm_drain_due(now, due),
            None => Ok(()),
        }
    }

    /// The drain checks due at `now`: a connection whose bytes TCP has all transmitted closes
    /// (gracefully: its FIN follows them); one whose client stalled is cut.
    fn check_drains(&mut self, now: u64) {
        let mut i = 0;
        while i < self.io.tick.draining.len() {
            let tag = self.io.tick.draining[i];
            let check = match self.step_of(tag) {
                None => DrainCheck::NotDraining,
                Some(mut step) => {
                    let check = step.conn.check_drain(now);
                    if check == DrainCheck::Stalled {
                        step.client_stalled(StallPhase::Drain);
                    }
                    check
                }
            };
            match check {
                DrainCheck::Pending => i += 1,
                DrainCheck::NotDraining => {
                    self.io.tick.draining.swap_remove(i);
                }
                DrainCheck::Sent | DrainCheck::Stalled => {
                    self.io.tick.draining.swap_remove(i);
                    self.end_drain(tag);
                }
            }
        }
    }

    /// The drain of the connection of `tag` is over: it closes.
    fn end_drain(&mut self, tag: ConnTag) {
        let Some(step) = self.step_of(tag) else {
            return;
        };
        if step.conn.drain.take().is_some() {
            step.io.shared.metrics.dataplane.connections_draining.dec();
        }
        self.close_now(tag.key);
    }

    /// At shutdown, once the drain timeout ran out: the connections still draining are cut
    /// (reset), so that no client waits on a socket haltd no longer watches.
    pub(in crate::dataplane) fn cut_drains_for_exit(&mut self) {
        let draining = std::mem::take(&mut self.io.tick.draining);
        for tag in draining {
            let cut = self
                .step_of(tag)
                .is_some_and(|step| step.conn.cut_for_exit());
            if cut {
                self.end_drain(tag);
            }
        }
    }
}
