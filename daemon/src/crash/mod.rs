//! Fail closed on panic (DESIGN G3): a panic that nothing deliberately contains ends the
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

mod fault;
mod hook;
mod recover;

use std::{
    cell::Cell,
    panic::{catch_unwind, UnwindSafe},
    path::{Path, PathBuf},
};

pub use fault::{watchdog_pass, worker_step, PanicFault, PanicThread};
pub use hook::{install, InstallError};
pub use recover::{recover, RecoverError};

/// Exit status of a process ended by an uncontained panic: 101, what Rust itself uses for a
/// panic that ends `main`, so it means "panic" whichever path took the process down.
/// (70 is a data-plane worker whose io_uring ring failed; 1 a start-up error; 2 invalid flags.)
pub const EXIT_CODE: i32 = 101;

/// The crash file of the ledger at `ledger`: the same path with `.crash` appended
/// (`haltd-ledger.jsonl` → `haltd-ledger.jsonl.crash`), so it lives where the ledger lives and
/// the next haltd on that ledger finds it.
pub fn file_for(ledger: &Path) -> PathBuf {
    let mut s = ledger.as_os_str().to_owned();
    s.push(".crash");
    PathBuf::from(s)
}

thread_local! {
    /// How many [`contain`] calls this thread is inside. Const-initialised: reading it in the
    /// hook allocates nothing.
    static CONTAINED: Cell<u32> = const { Cell::new(0) };
}

/// Restores the depth when [`contain`] returns (also if `catch_unwind` itself were left by
/// a foreign exception).
struct DepthGuard;

impl Drop for DepthGuard {
    fn drop(&mut self) {
        CONTAINED.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// `catch_unwind` for a panic the caller deliberately contains: the hook leaves a panic inside
/// it to the default hook (message on stderr) and the caller gets `Err(payload)` as from
/// `std::panic::catch_unwind`. Every `catch_unwind` in haltd goes through here; one that did
/// not would be ended by the hook as a crash.
pub fn contain<F: FnOnce() -> R + UnwindSafe, R>(f: F) -> std::thread::Result<R> {
    CONTAINED.with(|d| d.set(d.get().saturating_add(1)));
    let _guard = DepthGuard;
    catch_unwind(f)
}

/// Whether the current thread is inside [`contain`]. False while its thread-locals are being
/// destroyed (nothing can be contained there).
fn contained() -> bool {
    CONTAINED.try_with(|d| d.get() > 0).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_file_sits_next_to_the_ledger() {
        assert_eq!(
            file_for(Path::new("/var/lib/haltd/ledger.jsonl")),
            PathBuf::from("/var/lib/haltd/ledger.jsonl.crash")
        );
        assert_eq!(
            file_for(Path::new("haltd-ledger.jsonl")),
            PathBuf::from("haltd-ledger.jsonl.crash")
        );
    }

    #[test]
    fn contain_nests_and_restores_the_depth() {
        assert!(!contained());
        let inner = contain(|| {
            assert!(contained());
            let r = contain(|| -> u32 { panic!("inner") });
            assert!(r.is_err());
            assert!(contained(), "the outer containment still holds");
            7
        });
        assert_eq!(inner.ok(), Some(7));
        assert!(!contained());
    }
}
