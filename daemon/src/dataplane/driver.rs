//! The ring driver: the worker's io_uring, the operations that own their buffers while the
//! kernel has them, and the timer that sweeps upstream deadlines. It turns completions into
//! the events the connection, turn and upstream code handles (`ring.rs` `complete`), each on a
//! `Step` of one connection (`step.rs`).

pub(in crate::dataplane) mod conns;
pub(in crate::dataplane) mod deadline;
pub(in crate::dataplane) mod op;
pub(in crate::dataplane) mod ring;
pub(in crate::dataplane) mod step;
pub(in crate::dataplane) mod ticks;
pub(in crate::dataplane) mod wake;
