//! The ring driver: the worker's io_uring, the operations that own their buffers while the
//! kernel has them, and the timer that sweeps upstream deadlines. It turns completions into
//! the events the connection, turn and upstream code handles (`ring.rs` `complete`).

pub(in crate::dataplane) mod deadline;
pub(in crate::dataplane) mod op;
pub(in crate::dataplane) mod ring;
