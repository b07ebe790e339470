//! The kernel gate loaded in the test process itself (the `kernel_gate` and `adversarial`
//! topics), the cgroup v2 hierarchy, and the socket options those tests set.
//!
//! Loading a gate moves the whole process into a cgroup leaf of its own (`haltd.<pid>.<n>`,
//! see `haltd::gate`), and the gate's egress and adoption programs stay attached to that leaf
//! after the gate is dropped. All topics share one test process, so a [`TestGate`] puts the
//! process back into the cgroup it came from when it is dropped, and removes the leaf: a test
//! that runs after a gate test (with the haltd, upstream and client processes it starts) is in
//! the cgroup it would have had in a test binary of its own. It is the drop-guard idea of aya's
//! `NetNsGuard` (which goes back to the network namespace it left) applied to the cgroup.
//! Sockets made while the gate was loaded stay in the leaf, under its programs, until they
//! close, as the kernel keeps a removed cgroup for the sockets that still use it.

use std::{
    fs, io,
    ops::Deref,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use haltd::gate::{GateConfig, GateObject, KernelGate};

use crate::require_root;

/// Where the cgroup v2 hierarchy is mounted (from `/proc/self/mountinfo`).
pub fn cgroup2_mount() -> Result<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.split_whitespace().next() == Some("cgroup2"))
                .then(|| left.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })
        .context("no cgroup2 mount")
}

/// The directory of this process's cgroup v2 (`0::/path` in `/proc/self/cgroup`).
fn current_cgroup() -> Result<PathBuf> {
    let text = fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .context("/proc/self/cgroup has no cgroup v2 entry")?;
    Ok(cgroup2_mount()?.join(path.trim_start_matches('/')))
}

/// The cgroup directory process `pid` sits in, as the test process sees the hierarchy: a
/// haltd's cgroup leaf while it serves.
pub fn cgroup_of(pid: u32) -> Result<PathBuf> {
    let file = format!("/proc/{pid}/cgroup");
    let text = fs::read_to_string(&file).with_context(|| format!("reading {file}"))?;
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .with_context(|| format!("{file} has no cgroup v2 entry"))?;
    Ok(cgroup2_mount()?.join(path.trim_start_matches('/')))
}

/// Runs `f` with the test process moved into the cgroup `cg` (a process started meanwhile,
/// such as a haltd, starts there), then moves it back to the cgroup it came from.
pub fn in_cgroup<T>(cg: &Path, f: impl FnOnce() -> T) -> Result<T> {
    let home = current_cgroup()?;
    let me = std::process::id().to_string();
    fs::write(cg.join("cgroup.procs"), &me)
        .with_context(|| format!("moving the test process into {}", cg.display()))?;
    let out = f();
    fs::write(home.join("cgroup.procs"), &me)
        .with_context(|| format!("moving the test process back to {}", home.display()))?;
    Ok(out)
}

/// A [`KernelGate`] loaded by the test process; dropping it unloads the gate, moves the
/// process back into the cgroup it was in before the load and removes the gate's leaf.
#[derive(Debug)]
pub struct TestGate {
    /// `Some` until drop.
    gate: Option<KernelGate>,
    /// The cgroup the process was in before the load.
    home: PathBuf,
}

impl TestGate {
    /// Loads the gate (the object `HALTD_BPF_OBJECT` names, else the embedded one) with room
    /// for `max_sockets` governed sockets and no heartbeat yet.
    pub fn load(max_sockets: u32, heartbeat_deadline: Duration) -> Result<Self> {
        require_root()?;
        let home = current_cgroup()?;
        let object = match std::env::var_os("HALTD_BPF_OBJECT") {
            Some(path) => GateObject::Path(PathBuf::from(path)),
            None => GateObject::Embedded,
        };
        let gate = KernelGate::load(&GateConfig {
            object,
            max_sockets,
            heartbeat_deadline,
        })
        .context("loading the gate (set HALTD_BPF_OBJECT to the built object)")?;
        Ok(TestGate {
            gate: Some(gate),
            home,
        })
    }
}

impl Deref for TestGate {
    type Target = KernelGate;

    fn deref(&self) -> &KernelGate {
        self.gate.as_ref().expect("the gate is loaded until drop")
    }
}

impl Drop for TestGate {
    fn drop(&mut self) {
        let leaf = self.gate.as_ref().map(|g| g.cgroup().to_path_buf());
        drop(self.gate.take());
        let procs = self.home.join("cgroup.procs");
        if let Err(e) = fs::write(&procs, std::process::id().to_string()) {
            eprintln!("TestGate: moving back to {}: {e}", procs.display());
            return;
        }
        if let Some(leaf) = leaf.filter(|l| l != &self.home) {
            remove_leaf(&leaf);
        }
    }
}

fn remove_leaf(leaf: &Path) {
    match fs::remove_dir(leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => eprintln!("TestGate: removing the cgroup {}: {e}", leaf.display()),
    }
}

/// `setsockopt(fd, level, opt, &v)` for an `int` option.
pub fn set_int(fd: i32, level: i32, opt: i32, v: i32) -> Result<()> {
    // SAFETY: setsockopt reads a live i32 of the size given.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&raw const v).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    ensure!(
        rc == 0,
        "setsockopt({level}, {opt}): {}",
        io::Error::last_os_error()
    );
    Ok(())
}

/// `SO_LINGER {on, 0}`: close resets the connection instead of leaving what is queued (and
/// held back by the egress check) to be retransmitted.
pub fn reset_on_close(s: &impl AsRawFd) -> Result<()> {
    // The same call haltd's gate self-test makes on its own test sockets.
    haltd::gate::selftest::set_linger_zero(s).context("SO_LINGER")
}
