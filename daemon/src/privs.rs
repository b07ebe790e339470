//! Least privilege: once the kernel gate is loaded and attached and the listeners are bound,
//! haltd gives up every capability, in every thread, for good.
//!
//! Measured on kernel 6.18 with `kernel.unprivileged_bpf_disabled = 2` (the test
//! `kernel_gate::privileges` keeps measuring it): everything haltd does with the gate after
//! the load works from a thread that holds no capability at all, because the kernel checks
//! privilege when a map or program is created, loaded or attached, and afterwards only the
//! mode of the descriptor the process holds. Governing a new socket (`halt_adopt` at
//! establishment, or a `SOCKHASH` insertion through the map's fd), writing a policy or a
//! port, stamping the heartbeat with `BPF_PROG_RUN` and draining the ring buffer all pass with
//! empty capability sets. Loading the gate needs `CAP_BPF` (map and program creation) and
//! `CAP_NET_ADMIN` (the `SOCKHASH`, the socket program types, the cgroup attachment), plus
//! write access to the cgroup tree; none of that is done again later. The table, and what this
//! does not protect: docs/operations.md, "Privileges".
//!
//! How every thread ends up with nothing ([`drop_thread`] on each; Linux capabilities, the
//! bounding set and `no_new_privs` are per thread, and a new thread copies its creator's):
//! - `haltd serve` does everything privileged while it is the only thread ([`only_thread`]
//!   checks), then switches to `--user` if asked ([`account::switch_to`], keeping its
//!   capabilities across the `setresuid`);
//! - it starts the watchdog thread, which takes `SCHED_FIFO` (`CAP_SYS_NICE`) and then drops
//!   everything itself before it reads any state;
//! - the main thread drops everything; the ledger writer, the data-plane workers and any
//!   thread a library starts later are created after that and inherit empty sets;
//! - before it serves, [`check_process`] reads every thread's sets from `/proc` and refuses to
//!   go on if any thread still holds a capability.

use std::{fs, io, path::Path};

use caps::{CapSet, Capability};

pub mod account;

pub use account::Account;

/// Why the privilege drop failed; haltd does not serve with privileges it meant to give up.
#[derive(Debug, thiserror::Error)]
pub enum PrivError {
    #[error("{op}: {source}")]
    Caps {
        op: &'static str,
        #[source]
        source: caps::errors::CapsError,
    },
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "{threads} threads run before the privilege drop (expected 1): a thread started before it would keep every capability"
    )]
    NotAlone { threads: usize },
    #[error("thread {tid} ({name}) still holds capabilities after the drop: {caps}")]
    Survived {
        tid: String,
        name: String,
        caps: String,
    },
    #[error("switching to --user {user} (uid {uid}, gid {gid}): {op}: {source}; --user needs root (or CAP_SETUID and CAP_SETGID)")]
    Switch {
        user: String,
        uid: u32,
        gid: u32,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

fn caps_err(op: &'static str) -> impl FnOnce(caps::errors::CapsError) -> PrivError {
    move |source| PrivError::Caps { op, source }
}

/// What happened to the calling thread's bounding set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bounding {
    /// Emptied (the thread had `CAP_SETPCAP`).
    Cleared,
    /// Left as it was: without `CAP_SETPCAP` it cannot shrink. With empty permitted, ambient
    /// and inheritable sets and `no_new_privs`, nothing in it can be gained back.
    Kept,
}

/// Drops every capability of the calling thread for good: sets `no_new_privs`, empties the
/// bounding set (if `CAP_SETPCAP` allows), then the ambient, inheritable, effective and
/// permitted sets, and checks that none is left.
pub fn drop_thread() -> Result<Bounding, PrivError> {
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) changes only the calling thread's flag.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(PrivError::Io {
            op: "setting no_new_privs",
            source: io::Error::last_os_error(),
        });
    }
    let bounding = if caps::has_cap(None, CapSet::Permitted, Capability::CAP_SETPCAP)
        .map_err(caps_err("reading the permitted set"))?
    {
        caps::raise(None, CapSet::Effective, Capability::CAP_SETPCAP)
            .map_err(caps_err("raising CAP_SETPCAP"))?;
        caps::clear(None, CapSet::Bounding).map_err(caps_err("emptying the bounding set"))?;
        Bounding::Cleared
    } else {
        Bounding::Kept
    };
    // Effective before permitted: the kernel refuses an effective set wider than permitted.
    for (set, op) in [
        (CapSet::Ambient, "emptying the ambient set"),
        (CapSet::Inheritable, "emptying the inheritable set"),
        (CapSet::Effective, "emptying the effective set"),
        (CapSet::Permitted, "emptying the permitted set"),
    ] {
        caps::clear(None, set).map_err(caps_err(op))?;
    }
    let now = ThreadCaps::read(Path::new("/proc/thread-self"))?;
    if now.holds_any() {
        return Err(now.survived());
    }
    Ok(bounding)
}

/// Checks that the calling thread is the process's only thread (before [`drop_thread`] on the
/// main thread, and before a `--user` switch).
pub fn only_thread() -> Result<(), PrivError> {
    let threads = fs::read_dir("/proc/self/task")
        .map_err(|source| PrivError::Io {
            op: "listing /proc/self/task",
            source,
        })?
        .count();
    if threads == 1 {
        Ok(())
    } else {
        Err(PrivError::NotAlone { threads })
    }
}

/// Checks every thread of the process: none may hold a capability in its permitted,
/// effective, inheritable or ambient set. A thread missed by the drop fails the start.
pub fn check_process() -> Result<usize, PrivError> {
    let tasks = fs::read_dir("/proc/self/task").map_err(|source| PrivError::Io {
        op: "listing /proc/self/task",
        source,
    })?;
    let mut n = 0;
    for task in tasks {
        let task = task.map_err(|source| PrivError::Io {
            op: "listing /proc/self/task",
            source,
        })?;
        match ThreadCaps::read(&task.path()) {
            Ok(t) if t.holds_any() => return Err(t.survived()),
            Ok(_) => n += 1,
            // The thread ended between the listing and the read.
            Err(PrivError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// One thread's capability sets, as `/proc/<pid>/task/<tid>/status` shows them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ThreadCaps {
    pub tid: String,
    pub name: String,
    pub inheritable: u64,
    pub permitted: u64,
    pub effective: u64,
    pub bounding: u64,
    pub ambient: u64,
    pub no_new_privs: bool,
}

impl ThreadCaps {
    /// Reads `dir/status` (`dir` a `/proc/<pid>/task/<tid>` or `/proc/thread-self`).
    pub fn read(dir: &Path) -> Result<Self, PrivError> {
        let text = fs::read_to_string(dir.join("status")).map_err(|source| PrivError::Io {
            op: "reading a thread's /proc status",
            source,
        })?;
        Ok(Self::parse(&text))
    }

    /// Parses the text of a `/proc/.../status` file; missing fields read as 0.
    pub fn parse(status: &str) -> Self {
        let mut t = Self::default();
        for line in status.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            let hex = || u64::from_str_radix(value, 16).unwrap_or(u64::MAX);
            match key {
                "Name" => value.clone_into(&mut t.name),
                "Pid" => value.clone_into(&mut t.tid),
                "CapInh" => t.inheritable = hex(),
                "CapPrm" => t.permitted = hex(),
                "CapEff" => t.effective = hex(),
                "CapBnd" => t.bounding = hex(),
                "CapAmb" => t.ambient = hex(),
                "NoNewPrivs" => t.no_new_privs = value == "1",
                _ => {}
            }
        }
        t
    }

    /// Whether any capability is usable now or can be made usable (the bounding set alone
    /// gives nothing without an exec, which `no_new_privs` keeps from adding any).
    pub fn holds_any(&self) -> bool {
        self.inheritable | self.permitted | self.effective | self.ambient != 0
    }

    fn survived(&self) -> PrivError {
        PrivError::Survived {
            tid: self.tid.clone(),
            name: self.name.clone(),
            caps: format!(
                "CapPrm={:016x} CapEff={:016x} CapInh={:016x} CapAmb={:016x}",
                self.permitted, self.effective, self.inheritable, self.ambient
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_file_parses_into_the_capability_sets() {
        let status = "Name:\thaltd-dp-0\nUmask:\t0022\nPid:\t4242\nNoNewPrivs:\t1\n\
                      CapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n\
                      CapEff:\t0000000000000000\nCapBnd:\t000001ffffffffff\n\
                      CapAmb:\t0000000000000000\n";
        let t = ThreadCaps::parse(status);
        assert_eq!(
            (t.name.as_str(), t.tid.as_str(), t.bounding, t.no_new_privs),
            ("haltd-dp-0", "4242", 0x1ff_ffff_ffff, true)
        );
        assert!(!t.holds_any());
        let t = ThreadCaps::parse(
            &status.replace("CapEff:\t0000000000000000", "CapEff:\t0000008000000000"),
        );
        assert!(t.holds_any(), "CAP_BPF in the effective set: {t:?}");
        assert!(matches!(t.survived(), PrivError::Survived { .. }));
        // An unreadable field counts as held: fail closed.
        assert!(ThreadCaps::parse("CapPrm:\tzz\n").holds_any());
    }

    #[test]
    fn a_thread_that_drops_holds_nothing_and_sets_no_new_privs() {
        // In a thread of its own: the drop is per thread and for good.
        let t = std::thread::spawn(|| {
            drop_thread().expect("drop");
            ThreadCaps::read(Path::new("/proc/thread-self")).expect("read")
        })
        .join()
        .expect("thread");
        assert!(!t.holds_any(), "{t:?}");
        assert!(t.no_new_privs, "{t:?}");
    }
}
