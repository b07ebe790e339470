//! A step of one connection: what the driver hands the connection, turn and upstream code
//! when a completion, a timer or a trip concerns that connection.
//!
//! A `Step` borrows the connection (`&mut Conn`) and the worker's [`Io`] (the ring, the shared
//! core, the pool), never the slab of connections. The code it runs cannot look a connection
//! up by key, so it cannot reach a connection that is gone or touch another one: the class of
//! bug where a lookup outlived its connection (`invalid key`) cannot be written there. The
//! connection's key travels inside the step only in its [`ConnTag`], whose fields only the
//! driver reads: the return address of the operations it submits (`Owner::Conn`), read back
//! at their completion.
//!
//! Closing is a request (`begin_close`): the connection leaves the slab in the driver once the
//! step has returned and nothing is in flight (`conn.rs` `finish_closes`).

use std::{
    io,
    sync::{atomic::AtomicBool, Arc},
};

use io_uring::squeue;

use crate::dataplane::{
    driver::op::{OpBuf, OpKind, Owner},
    AfterRecord, Conn, Io, Worker,
};

/// A connection as the driver's lists name it: its slab key and its serial (a later
/// connection may have the key of one that is gone). Only the driver reads them: connection
/// code holds tags (the return address of a grounding round, of a drain, of a record waited
/// for) but cannot look anything up with one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) struct ConnTag {
    pub(in crate::dataplane::driver) key: usize,
    pub(in crate::dataplane::driver) serial: u64,
}

/// One connection's step: the connection, and the worker's means of doing I/O for it.
pub(in crate::dataplane) struct Step<'w> {
    pub(in crate::dataplane) conn: &'w mut Conn,
    pub(in crate::dataplane) io: &'w mut Io,
    /// This connection's tag: the return address of its operations.
    tag: ConnTag,
}

impl Worker {
    /// The step of the connection at `key` with `serial`, if it is still there: a later
    /// connection may have the key of one that is gone, and an event for the one that is
    /// gone (a completion, a record on disk, a grounding answer) is dropped here. This and
    /// `conn_of` are the only places that look a connection up by key (`cargo xtask lint`).
    pub(in crate::dataplane) fn step_of(&mut self, tag: ConnTag) -> Option<Step<'_>> {
        let conn = self
            .conns
            .get_mut(tag.key)
            .filter(|c| c.serial == tag.serial)?;
        Some(Step {
            conn,
            io: &mut self.io,
            tag,
        })
    }

    /// The connection at `key` with `serial`, if it is still there, to read.
    pub(in crate::dataplane) fn conn_of(&self, tag: ConnTag) -> Option<&Conn> {
        self.conns.get(tag.key).filter(|c| c.serial == tag.serial)
    }
}

impl Step<'_> {
    /// This connection's tag, for the driver's lists and a grounding round's answer.
    pub(in crate::dataplane) fn tag(&self) -> ConnTag {
        self.tag
    }

    /// Submits `entry`, an operation of this connection that owns `buf` until its completion
    /// (`Io::submit`), and counts it in flight on the connection.
    pub(in crate::dataplane) fn submit(
        &mut self,
        kind: OpKind,
        buf: OpBuf,
        entry: squeue::Entry,
    ) -> io::Result<u64> {
        let owner = Owner::Conn {
            key: self.tag.key,
            serial: self.tag.serial,
        };
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
        self.io.awaiting_records.push((self.tag, after, on_disk));
    }

    /// Asks the driver to close this connection once the current pass is over.
    pub(in crate::dataplane) fn close_later(&mut self) {
        self.io.to_close.push(self.tag);
    }
}
