//! The cgroup leaves earlier haltd processes left behind, and which of them a start removes.
//!
//! A leaf is named `haltd.<pid>.<start>.<n>`: the pid of the haltd that made it, that
//! process's start time (field 22 of `/proc/<pid>/stat`, clock ticks since boot), and a
//! counter for the gates one process loads (the tests load several). A pid alone does not
//! name a process for long: once a killed haltd is reaped, the kernel hands its pid to the next
//! process that asks, and a leaf judged by its pid alone would then look alive forever (or,
//! the other way round, a start could take a live haltd's fresh leaf for a dead one's). The
//! pair (pid, start time) names one process for the kernel's lifetime, and cgroups do not
//! outlive a boot.
//!
//! The owner of a leaf is **gone** when `/proc/<pid>` does not exist, when the process is a
//! zombie (`Z`) or dead (`X`) (killed but not yet reaped by its parent: it holds no socket,
//! no fd and no place in any cgroup any more, so an unreaped haltd is as gone as a reaped
//! one), or when the pid now belongs to a process that started at another time (**pid
//! reused**). A leaf named the old way, `haltd.<pid>.<n>` (haltd before the start time was in
//! the name), is judged by its pid, and a live process that is not in that leaf counts as a
//! reused pid.
//!
//! Removing a leaf (`rmdir`) is safe for the sockets still charged to it. A socket keeps a
//! reference to the cgroup it was created in, and with it to that cgroup's effective BPF
//! programs: since Linux 5.3 ("bpf: decouple the lifetime of cgroup_bpf from cgroup itself",
//! `cgroup_bpf_offline` and `cgroup_bpf_release` in `kernel/bpf/cgroup.c`) the programs of a
//! removed cgroup are released only once the last socket that references it is freed. So the
//! egress check keeps policing a tripped stream's queued bytes after its leaf is gone
//! (`kernel_gate::egress::egress_holds_after_its_leaf_is_removed` shows it), and removing the
//! leaf only lets the kernel free the programs sooner. The kernel also refuses to remove a
//! leaf that still holds a live process (`EBUSY`), whatever the check above concluded: such a
//! leaf is left alone.

use std::{
    fmt, fs, io,
    path::{Path, PathBuf},
};

/// A leaf's name, parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LeafName {
    pub pid: u32,
    /// The owner's start time (clock ticks since boot); `None` in a name of the old form.
    pub start: Option<u64>,
    pub n: u32,
}

impl LeafName {
    /// The name of this process's `n`th leaf.
    pub fn mine(n: u32) -> io::Result<Self> {
        let pid = std::process::id();
        let stat = fs::read_to_string("/proc/self/stat")?;
        let start = parse_stat(&stat)
            .map(|s| s.start)
            .ok_or_else(|| io::Error::other("/proc/self/stat has no start time"))?;
        Ok(LeafName {
            pid,
            start: Some(start),
            n,
        })
    }

    /// `haltd.<pid>.<start>.<n>`, or `haltd.<pid>.<n>` (old form), or `None`.
    pub fn parse(name: &str) -> Option<Self> {
        let rest = name.strip_prefix("haltd.")?;
        let parts: Vec<&str> = rest.split('.').collect();
        match parts[..] {
            [pid, n] => Some(LeafName {
                pid: pid.parse().ok()?,
                start: None,
                n: n.parse().ok()?,
            }),
            [pid, start, n] => Some(LeafName {
                pid: pid.parse().ok()?,
                start: Some(start.parse().ok()?),
                n: n.parse().ok()?,
            }),
            _ => None,
        }
    }
}

impl fmt::Display for LeafName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.start {
            Some(start) => write!(f, "haltd.{}.{start}.{}", self.pid, self.n),
            None => write!(f, "haltd.{}.{}", self.pid, self.n),
        }
    }
}

/// What became of a leaf's owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// It runs: the leaf stays.
    Running,
    /// This very process, an earlier gate it loaded (the leaf it sits in cannot be removed).
    ThisProcess,
    /// `/proc/<pid>` does not exist.
    Exited,
    /// A zombie (`Z`) or dead (`X`) process: ended, not yet reaped by its parent.
    Zombie,
    /// The pid names a process that started at another time (or, for an old-form name, one
    /// that is not in the leaf).
    PidReused,
}

impl Owner {
    /// Whether the leaf's owner is gone, so that the leaf is a leftover.
    pub fn is_gone(self) -> bool {
        !matches!(self, Owner::Running)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Owner::Running => "running",
            Owner::ThisProcess => "an earlier gate of this process",
            Owner::Exited => "exited",
            Owner::Zombie => "a zombie (ended, not reaped)",
            Owner::PidReused => "pid reused by another process",
        }
    }
}

/// A leftover leaf a start removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemovedLeaf {
    pub path: PathBuf,
    /// The leaf's directory name.
    pub name: String,
    pub owner_pid: u32,
    pub owner: Owner,
}

impl fmt::Display for RemovedLeaf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (owner {})", self.name, self.owner.as_str())
    }
}

/// What `/proc/<pid>/stat` says of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stat {
    state: char,
    start: u64,
}

/// The state (field 3) and start time (field 22) of a `/proc/<pid>/stat` line. The command
/// name (field 2) is in parentheses and may itself hold spaces and parentheses: the fields
/// are counted from the last `)`.
fn parse_stat(line: &str) -> Option<Stat> {
    let (_, rest) = line.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 was the state; the start time is field 22, 19 further on.
    let start = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start })
}

/// What became of the owner of the leaf `name` at `path`.
pub(super) fn owner(name: LeafName, path: &Path) -> Owner {
    if name.pid == std::process::id() {
        return Owner::ThisProcess;
    }
    let stat = match fs::read_to_string(format!("/proc/{}/stat", name.pid)) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Owner::Exited,
        // Unreadable for another reason: not proven gone, so the leaf stays.
        Err(_) => return Owner::Running,
    };
    let Some(stat) = parse_stat(&stat) else {
        return Owner::Running;
    };
    if matches!(stat.state, 'Z' | 'X') {
        return Owner::Zombie;
    }
    match name.start {
        Some(start) if start != stat.start => Owner::PidReused,
        Some(_) => Owner::Running,
        None if in_leaf(name.pid, path) == Some(false) => Owner::PidReused,
        None => Owner::Running,
    }
}

/// Whether process `pid` sits in the leaf at `path` (its `/proc/<pid>/cgroup` path ends with
/// the leaf's name); `None` when that cannot be read.
fn in_leaf(pid: u32, path: &Path) -> Option<bool> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let cgroup = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let leaf = path.file_name()?.to_str()?;
    Some(Path::new(cgroup).file_name().and_then(|n| n.to_str()) == Some(leaf))
}

/// Removes the leaves under `parent` whose owner is gone (the module doc), logging each, and
/// returns them. A leaf the kernel will not remove (a process still in it) is left alone.
pub(super) fn remove_stale(parent: &Path) -> Vec<RemovedLeaf> {
    let Ok(entries) = fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let file_name = e.file_name();
        let Some(name) = file_name.to_str().and_then(LeafName::parse) else {
            continue;
        };
        let path = e.path();
        let owner = owner(name, &path);
        if !owner.is_gone() {
            continue;
        }
        match fs::remove_dir(&path) {
            Ok(()) => {
                tracing::info!(
                    leaf = %path.display(),
                    owner_pid = name.pid,
                    owner = owner.as_str(),
                    "removed the cgroup leaf of a haltd that is gone; its gate programs stay with the sockets still charged to it until they close"
                );
                removed.push(RemovedLeaf {
                    name: name.to_string(),
                    path,
                    owner_pid: name.pid,
                    owner,
                });
            }
            // Someone else removed it first (another start).
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            // The leaf this process sits in, or one with a process still in it.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                if owner != Owner::ThisProcess {
                    tracing::warn!(leaf = %path.display(), owner_pid = name.pid, owner = owner.as_str(), "a cgroup leaf of a haltd that is gone still holds a process: left in place");
                }
            }
            Err(e) => {
                tracing::warn!(leaf = %path.display(), owner_pid = name.pid, error = %e, "removing a cgroup leaf of a haltd that is gone failed: left in place");
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaf_names_parse_in_both_forms() {
        let new = LeafName::parse("haltd.123.4567.2").expect("new form");
        assert_eq!(
            new,
            LeafName {
                pid: 123,
                start: Some(4567),
                n: 2
            }
        );
        assert_eq!(new.to_string(), "haltd.123.4567.2");
        let old = LeafName::parse("haltd.123.4").expect("old form");
        assert_eq!((old.pid, old.start, old.n), (123, None, 4));
        assert_eq!(old.to_string(), "haltd.123.4");
        for other in [
            "haltd.123",
            "haltd.1.2.3.4",
            "haltd.x.1",
            "system.slice",
            "haltd-test",
        ] {
            assert_eq!(LeafName::parse(other), None, "{other}");
        }
    }

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        let line = "4242 (a (b) c) Z 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 9 0 987654 \
                    1000 10 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                state: 'Z',
                start: 987_654
            })
        );
        assert_eq!(parse_stat("4242 (cut"), None);
    }

    #[test]
    fn owners_are_judged_by_pid_state_and_start_time() {
        let me = LeafName::mine(0).expect("own name");
        let here = Path::new("/nonexistent/leaf");
        assert_eq!(owner(me, here), Owner::ThisProcess);
        // A child that exits and is not reaped is a zombie, then, once reaped, gone.
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let pid = child.id();
        let stat = || fs::read_to_string(format!("/proc/{pid}/stat")).ok();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let start = loop {
            let s = stat().and_then(|l| parse_stat(&l)).expect("unreaped child");
            if s.state == 'Z' {
                break s.start;
            }
            assert!(std::time::Instant::now() < deadline, "child never ended");
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        let name = LeafName {
            pid,
            start: Some(start),
            n: 0,
        };
        assert_eq!(owner(name, here), Owner::Zombie);
        child.wait().expect("reap");
        assert_eq!(owner(name, here), Owner::Exited);
        // A live process under a start time that is not its own: the pid was reused.
        let parent = std::os::unix::process::parent_id();
        let live = stat_of(parent);
        let reused = LeafName {
            pid: parent,
            start: Some(live.start + 1),
            n: 0,
        };
        assert_eq!(owner(reused, here), Owner::PidReused);
        let same = LeafName {
            start: Some(live.start),
            ..reused
        };
        assert_eq!(owner(same, here), Owner::Running);
        // Old form: a live process that is not in the leaf does not own it.
        let old = LeafName {
            start: None,
            ..reused
        };
        assert_eq!(owner(old, here), Owner::PidReused);
    }

    fn stat_of(pid: u32) -> Stat {
        let line = fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        parse_stat(&line).expect("parse")
    }
}
