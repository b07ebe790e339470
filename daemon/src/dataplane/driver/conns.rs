//! The driver's slab of connections: a connection comes in (accepted, admitted, first
//! receive armed) and goes out (closed once the step that closed it has returned and nothing
//! of it is in flight). What a connection does in between runs on its `Step` (`step.rs`).

use crate::dataplane::{set_nodelay, ConnTag, Worker};

impl Worker {
    /// The listener accepted `fd`: admitted, it joins the slab and its request is read.
    pub(in crate::dataplane) fn accepted(&mut self, fd: libc::c_int) {
        set_nodelay(fd);
        self.io.shared.metrics.dataplane.connections_accepted.inc();
        let Some(conn) = self.io.admit(fd) else {
            return;
        };
        let serial = conn.serial;
        let key = self.conns.insert(conn);
        let Some(mut step) = self.step_of(ConnTag { key, serial }) else {
            return;
        };
        // Its client is watched for stalls while it is open (`drain.rs`).
        if let Err(e) = step.arm_recv().and_then(|()| step.io.arm_scan()) {
            tracing::error!(error = %e, "arming recv failed");
            step.begin_close();
        }
    }

    /// After each pass over the completions: the connections that began to close during it
    /// are closed, those with nothing in flight at once (the others when their last
    /// operation completes, `ring.rs` `complete`).
    pub(in crate::dataplane) fn finish_closes(&mut self) {
        while let Some(tag) = self.io.to_close.pop() {
            self.maybe_finish_close(tag);
        }
    }

    /// Closes the connection of `tag` if it is closing, nothing of it is in flight and nobody
    /// else holds its halt (`Step::finish_close`).
    pub(in crate::dataplane) fn maybe_finish_close(&mut self, tag: ConnTag) {
        let close = self
            .step_of(tag)
            .is_some_and(|mut step| step.finish_close());
        if close {
            self.close_now(tag.key);
        }
    }

    /// The connection at `key` leaves the slab and closes (`Io::closed`).
    pub(in crate::dataplane) fn close_now(&mut self, key: usize) {
        let conn = self.conns.remove(key);
        self.io.closed(conn);
    }
}
