//! io_uring operations that own their buffers (monoio style).
//!
//! The kernel reads and writes an operation's memory from submission until its completion,
//! whatever happens to the connection meanwhile. So the memory is not the connection's:
//! submitting moves it into the operation ([`OpBuf`]), the operation lives in the worker's
//! [`OpTable`] under its `user_data`, and only the completion takes it out again and hands the
//! buffer back to its owner with the result. A connection dropped while an operation is in
//! flight leaves the operation, and its buffer, in the table until the completion arrives:
//! nothing the kernel may still touch is ever freed or moved, and no pointer into a
//! connection's buffers exists.
//!
//! `user_data` is the slot in the table and a generation (a cancellation names the operation
//! it means, not a later one that reused the slot).

use io_uring::types::Timespec;
use slab::Slab;

/// Which handler an operation's completion goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::dataplane) enum OpKind {
    Accept,
    /// The worker's eventfd: a trip raised on another thread.
    Wake,
    /// The client's request.
    Recv,
    /// The request's deadline (linked to its receive).
    RecvDeadline,
    Send,
    /// The built-in source's pacing timer.
    Timer,
    Cancel,
    /// Watching the client while a proxied turn waits (a receive, or a timer after EOF).
    Watch,
    UpConnect,
    UpSend,
    UpRecv,
    /// The deadline linked to an upstream connect or send.
    UpDeadline,
    /// The worker's timer that cancels upstream receives past their deadline (`deadline.rs`).
    Sweep,
    /// Waiting for the external scorer's socket while a token is parked (`score.rs`).
    Score,
    /// The scorer's deadline, linked to its poll.
    ScoreDeadline,
    /// The worker's scan of sends waiting on their client (`drain.rs`).
    Tick,
    /// The worker's checks of draining connections (`drain.rs`).
    DrainTick,
}

/// A socket address for `connect`, as the kernel reads it.
#[derive(Clone, Copy)]
pub(in crate::dataplane) struct SockAddr {
    pub(in crate::dataplane) storage: libc::sockaddr_storage,
    pub(in crate::dataplane) len: libc::socklen_t,
}

impl std::fmt::Debug for SockAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SockAddr")
            .field("family", &self.storage.ss_family)
            .field("len", &self.len)
            .finish()
    }
}

/// The memory an operation owns while the kernel has it.
#[derive(Debug)]
pub(in crate::dataplane) enum OpBuf {
    None,
    /// A receive: the kernel writes into the spare capacity after `len()`; the completion
    /// extends `len()` by what it wrote.
    Recv(Vec<u8>),
    /// A send of `buf[off..]`.
    Send {
        buf: Vec<u8>,
        off: usize,
    },
    /// A timeout's duration (a timer, or a linked deadline).
    Time(Box<Timespec>),
    /// The address of a connect.
    Addr(
        #[expect(
            dead_code,
            reason = "never read here: owned so that the kernel can read it until the connect completes"
        )]
        Box<SockAddr>,
    ),
    /// The eventfd's counter.
    Word(Box<u64>),
    /// A descriptor the operation waits on (the external scorer's connection): owned, so
    /// that it stays open until the completion hands it back.
    Fd(std::os::fd::OwnedFd),
}

/// Who an operation's completion goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::dataplane) enum Owner {
    /// The worker itself (the listener, the eventfd).
    Worker,
    /// A connection: its slab key and its serial (a later connection may reuse the key).
    Conn { key: usize, serial: u64 },
}

/// An operation in flight.
#[derive(Debug)]
pub(in crate::dataplane) struct Op {
    pub(in crate::dataplane) owner: Owner,
    pub(in crate::dataplane) kind: OpKind,
    pub(in crate::dataplane) buf: OpBuf,
    generation: u32,
}

/// The operations in flight, keyed by `user_data`.
#[derive(Debug, Default)]
pub(in crate::dataplane) struct OpTable {
    ops: Slab<Op>,
    generation: u32,
}

impl OpTable {
    /// Puts an operation in the table; returns its `user_data`. Its buffer stays there until
    /// [`take`](Self::take); what the kernel reads or writes is the buffer's heap memory,
    /// which neither this move nor a growing table moves.
    pub(in crate::dataplane) fn insert(&mut self, owner: Owner, kind: OpKind, buf: OpBuf) -> u64 {
        self.generation = self.generation.wrapping_add(1);
        let generation = self.generation;
        let key = self.ops.insert(Op {
            owner,
            kind,
            buf,
            generation,
        });
        (u64::from(generation) << 32) | key as u64
    }

    /// Takes the operation `user_data` names out of the table (at its completion, or when it
    /// was never submitted). `None` for a `user_data` the table does not hold.
    pub(in crate::dataplane) fn take(&mut self, user_data: u64) -> Option<Op> {
        let key = (user_data & u64::from(u32::MAX)) as usize;
        let generation = (user_data >> 32) as u32;
        if self.ops.get(key)?.generation != generation {
            return None;
        }
        Some(self.ops.remove(key))
    }

    /// Operations in flight.
    #[cfg(test)]
    pub(in crate::dataplane) fn len(&self) -> usize {
        self.ops.len()
    }
}

impl Op {
    /// The buffer handed back at completion with result `res`: a receive's length grows by
    /// the bytes the kernel wrote.
    pub(in crate::dataplane) fn into_buf(self, res: i32) -> OpBuf {
        let mut buf = self.buf;
        if let (OpBuf::Recv(b), Ok(n @ 1..)) = (&mut buf, usize::try_from(res)) {
            let len = b.len() + n;
            assert!(len <= b.capacity(), "a receive wrote past its buffer");
            // SAFETY: the kernel wrote `n` bytes into the spare capacity the receive was given
            // (at most `capacity - len`, checked above), so they are initialised.
            unsafe { b.set_len(len) };
        }
        buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_names_one_operation_even_when_its_slot_is_reused() {
        let mut t = OpTable::default();
        let a = t.insert(Owner::Worker, OpKind::Timer, OpBuf::None);
        assert!(t.take(a).is_some());
        let b = t.insert(Owner::Worker, OpKind::Timer, OpBuf::None);
        assert_eq!(a & 0xffff_ffff, b & 0xffff_ffff, "the slot is reused");
        assert!(t.take(a).is_none(), "a stale user_data names nothing");
        assert!(t.take(b).is_some());
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn a_completed_receive_hands_back_what_the_kernel_wrote() {
        let mut t = OpTable::default();
        let mut b = Vec::with_capacity(16);
        let ptr = b.spare_capacity_mut().as_mut_ptr().cast::<u8>();
        let ud = t.insert(
            Owner::Conn { key: 3, serial: 7 },
            OpKind::Recv,
            OpBuf::Recv(b),
        );
        // What the kernel does, through the pointer taken before the move: write into the
        // spare capacity.
        // SAFETY: 5 bytes fit the capacity of 16, which the table keeps alive.
        unsafe { std::ptr::copy_nonoverlapping(b"hello".as_ptr(), ptr, 5) };
        let op = t.take(ud).expect("in the table");
        assert_eq!(op.owner, Owner::Conn { key: 3, serial: 7 });
        match op.into_buf(5) {
            OpBuf::Recv(b) => assert_eq!(b, b"hello"),
            other => panic!("got {other:?}"),
        }
    }
}
