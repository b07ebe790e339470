//! Fail closed on panic (G3, docs/spec.md): a panic that nothing deliberately contains ends the
//! process at once, and the next start records it in the flight recorder.
//!
//! A panicking thread unwinds and dies alone. A dead data-plane worker leaves its clients
//! hanging on sockets nobody serves while the other workers keep answering `/healthz` with 200;
//! a dead watchdog lets the heartbeat go stale, so every stream halts with `HEARTBEAT_LOST`,
//! but the process lingers, useless, and nothing restarts it. So `haltd serve` installs a
//! process-wide panic hook ([`install`]) that, for every panic not inside [`contain`]:
//!
//! 1. appends one line to the crash file ([`file_for`]: `<ledger>.crash`) with a single
//!    `write(2)`: thread name, message and location (cut to a fixed buffer), unix time, pid;
//! 2. writes the same line to stderr (fd 2, also one `write(2)`);
//! 3. ends the process with `_exit(`[`EXIT_CODE`]`)`. The kernel closes every socket (each
//!    client sees EOF or a reset within milliseconds, far inside `--heartbeat-deadline-ms`),
//!    the kernel gate's maps and program go with the process, and systemd restarts haltd
//!    (`Restart=on-failure`).
//!
//! The hook takes no lock, because the panicking thread may hold any lock of the daemon (the
//! ledger's, a stream table mutex, stderr's), and allocates nothing of its own (std has already
//! formatted a `panic!` message with arguments when the hook runs). It formats into a buffer on
//! its own stack and reads only a `OnceLock`,
//! a thread-local counter and the kernel (`prctl`, `getpid`, `gettid`, `clock_gettime`,
//! `open`, `write`, `_exit`). It does not fsync: the line is in the page cache when the
//! process ends, which survives the process (not a power loss). It does not capture a
//! backtrace (that allocates and locks). Records still queued for the ledger writer are lost,
//! as with SIGKILL (docs/fhr-schema.md §4).
//!
//! A panic inside [`contain`] (SafetyCheck runs each predicate in it: a panicking predicate is a
//! violation, not a crash) only gets the default hook's message; its `catch_unwind` result is
//! handled by the caller as before. This is why haltd does not build with `panic = "abort"`.
//!
//! The file is opened with `O_APPEND`, not truncated: if haltd panics again before a start
//! got as far as recording the file (a crash loop), every crash keeps its line.
//!
//! At the next start, [`recover`] turns every line of the crash file into a `crash` ledger
//! record, logs it at ERROR, counts it in `haltd_crashes_recovered_total` and removes the file.

pub mod containment;
mod fault;
mod hook;
mod recover;

pub use containment::contain;
pub use fault::{watchdog_pass, worker_step, PanicFault, PanicThread};
pub use hook::{file_for, install, InstallError, EXIT_CODE};
pub use recover::{recover, RecoverError};
