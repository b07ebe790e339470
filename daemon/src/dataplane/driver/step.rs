//! A step of one connection: what the driver hands the connection, turn and upstream code
//! when a completion, a timer or a trip concerns that connection.
//!
//! A `Step` borrows the connection (`&mut Conn`) and the worker's [`Io`] (the ring, the shared
//! core, the pool), never the slab of connections. The code it runs cannot look a connection
//! up by key, so it cannot reach a connection that is gone or touch another one: the class of
//! bug where a lookup outlived its connection (`invalid key`) cannot be written there. The
//! connection's key travels inside the step only as the return address of the operations it
//! submits (`Owner::Conn`), which the driver reads back at their completion.
//!
//! Closing is a request (`begin_close`): the connection leaves the slab in the driver once the
//! step has returned and nothing is in flight (`conn/mod.rs` `finish_closes`).

use std::{
    io,
    sync::{atomic::AtomicBool, Arc},
};

use io_uring::squeue;

use crate::dataplane::{
    driver::op::{OpBuf, OpKind, Owner},
    AfterRecord, Conn, Io, Worker,
};

/// One connection's step: the connection, and the worker's means of doing I/O for it.
pub(in crate::dataplane) struct Step<'w> {
    pub(in crate::dataplane) conn: &'w mut Conn,
    pub(in crate::dataplane) io: &'w mut Io,
    /// The return address of this connection's operations (its key and serial).
    pub(in crate::dataplane) owner: Owner,
}

impl Worker {
    /// The step of the connection at `key` with `serial`, if it is still there: a later
    /// connection may have the key of one that is gone, and an event for the one that is
    /// gone (a completion, a record on disk, a grounding answer) is dropped here. This and
    /// `conn_of` are the only places that look a connection up by key (`cargo xtask lint`).
    pub(in crate::dataplane) fn step_of(&mut self, key: usize, serial: u64) -> Option<Step<'_>> {
        let conn = self.conns.get_mut(key).filter(|c| c.serial == serial)?;
        Some(Step {
            conn,
            io: &mut self.io,
            owner: Owner::Conn { key, serial },
        })
    }

    /// The connection at `key` with `serial`, if it is still there, to read.
    pub(in crate::dataplane) fn conn_of(&self, key: usize, serial: u64) -> Option<&Conn> {
        self.conns.get(key).filter(|c| c.serial == serial)
    }
}

impl Step<'_> {
    /// Submits `entry`, an operation of this connection that owns `buf` until its completion
    /// (`Io::submit`), and counts it in flight on the connection.
    pub(in crate::dataplane) fn submit(
        &mut self,
        owner: Owner,
        kind: OpKind,
        buf: OpBuf,
        entry: squeue::Entry,
    ) -> io::Result<u64> {
        debug_assert_eq!(owner, self.owner, "a step submits only its own operations");
        let user_data = self.io.submit(owner, kind, buf, entry)?;
        self.conn.ops += 1;
        Ok(user_data)
    }

    /// Puts an answer of this connection in line for its record: it goes out once `on_disk`
    /// turns `true` (`turn/halt.rs` `send_recorded_answers`).
    pub(in crate::dataplane) fn await_record(
        &mut self,
        after: AfterRecord,
        on_disk: Arc<AtomicBool>,
    ) {
        let (key, serial) = self.owner.conn_tag();
        self.io.awaiting_records.push((key, serial, after, on_disk));
    }

    /// Asks the driver to close this connection once the current pass is over.
    pub(in crate::dataplane) fn close_later(&mut self) {
        self.io.to_close.push(self.owner.conn_tag());
    }
}
