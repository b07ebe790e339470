//! The cgroup v2 leaf the egress and adoption programs are attached to.
//!
//! `halt_egress` and `halt_adopt` see the sockets of one cgroup (and its descendants). haltd
//! makes a leaf of its own under the cgroup it was started in (`haltd.<pid>.<n>`), moves the
//! whole process into it before it opens any socket, and attaches both programs there with a
//! plain `BPF_PROG_ATTACH`, not a link: an attachment outlives the daemon, so a segment still
//! queued on a tripped stream's socket when haltd dies is judged like any other, and the
//! gate's maps (held by the attached programs) keep policing sockets that outlive the process.
//!
//! Nothing is left behind: a start removes the leaves of earlier haltd processes that are
//! gone, zombies included, and logs each ([`leftovers`]: how a gone owner is told from a live
//! one, pid reuse included, and why the removal is safe for the sockets still charged to a
//! leaf: the kernel releases its programs once the last of them closes). A clean stop moves
//! haltd back to the parent cgroup and removes its own leaf on the way out ([`Leaf::leave`]);
//! where that is not allowed (the parent is not writable without the capabilities haltd
//! dropped), the next start removes it.
//!
//! Under systemd the unit is started in its own cgroup (`Delegate=yes` lets it make the leaf);
//! in a shell it is the shell's cgroup. The kernel must have cgroup v2 (pure v2, or the hybrid
//! layout's `/sys/fs/cgroup/unified`); a mount namespace without a cgroup2 mount gets one of
//! haltd's own (see [`cgroup2_mount`]).

use std::{
    fs,
    io::{self, BufRead},
    os::fd::{AsRawFd, BorrowedFd, OwnedFd},
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
};

mod leftovers;

use leftovers::LeafName;
pub use leftovers::{Owner, RemovedLeaf};

/// Where haltd mounts the cgroup v2 hierarchy itself when its mount namespace has none (as
/// under `ip netns exec`, which mounts a fresh `/sys` without the cgroup file systems).
const OWN_MOUNT: &str = "/run/haltd/cgroup2";

/// Where the cgroup v2 hierarchy is mounted: from `/proc/self/mountinfo`, or mounted by haltd
/// at [`OWN_MOUNT`] if this mount namespace has none. There is one cgroup v2 hierarchy per
/// machine; a second mount is another view of the same tree.
pub fn cgroup2_mount() -> io::Result<PathBuf> {
    if let Some(found) = find_cgroup2_mount()? {
        return Ok(found);
    }
    std::fs::create_dir_all(OWN_MOUNT)?;
    let target = std::ffi::CString::new(OWN_MOUNT).map_err(io::Error::other)?;
    // SAFETY: mount(2) with valid NUL-terminated strings and no data.
    let rc = unsafe {
        libc::mount(
            c"cgroup2".as_ptr(),
            target.as_ptr(),
            c"cgroup2".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("no cgroup2 file system is mounted, and mounting one at {OWN_MOUNT} failed: {e} (the egress check needs cgroup v2)"),
        ));
    }
    tracing::info!(
        mount = OWN_MOUNT,
        "no cgroup2 mount in this mount namespace; mounted one for the kernel gate"
    );
    Ok(PathBuf::from(OWN_MOUNT))
}

fn find_cgroup2_mount() -> io::Result<Option<PathBuf>> {
    let f = fs::File::open("/proc/self/mountinfo")?;
    for line in io::BufReader::new(f).lines() {
        let line = line?;
        // "<id> <parent> <maj:min> <root> <mount point> <opts> [optional...] - <fstype> ..."
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        if right.split_whitespace().next() == Some("cgroup2") {
            if let Some(mount) = left.split_whitespace().nth(4) {
                return Ok(Some(PathBuf::from(unescape_mount(mount))));
            }
        }
    }
    Ok(None)
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mount(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(char::from(v));
            i += 4;
        } else {
            out.push(char::from(b[i]));
            i += 1;
        }
    }
    out
}

/// This process's cgroup v2 path (`0::/path` in `/proc/self/cgroup`).
fn current_cgroup() -> io::Result<String> {
    let text = fs::read_to_string("/proc/self/cgroup")?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_owned)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "/proc/self/cgroup has no cgroup v2 entry",
            )
        })
}

/// A leaf cgroup this process made and moved itself into.
#[derive(Debug)]
pub struct Leaf {
    pub path: PathBuf,
    pub fd: OwnedFd,
    /// The cgroup it was made under: where [`Leaf::leave`] moves the process back.
    parent: PathBuf,
    /// The leftover leaves of earlier haltd processes removed before this one was made.
    pub removed: Vec<RemovedLeaf>,
}

static LEAVES: AtomicU32 = AtomicU32::new(0);

/// Makes `haltd.<pid>.<start>.<n>` under this process's cgroup, moves the whole process into
/// it, and removes the leaves of haltd processes that are gone ([`leftovers`]).
pub fn make_leaf() -> io::Result<Leaf> {
    let mount = cgroup2_mount()?;
    let current = current_cgroup()?;
    // The process may already sit in a leaf of an earlier load (tests load several gates):
    // make the new one beside it, not inside it.
    let mut parent = mount.join(current.trim_start_matches('/'));
    if parent
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| LeafName::parse(n).is_some())
    {
        parent.pop();
    }
    let removed = leftovers::remove_stale(&parent);
    let name = LeafName::mine(LEAVES.fetch_add(1, Ordering::Relaxed))?;
    let path = parent.join(name.to_string());
    match fs::create_dir(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("creating the cgroup {}: {e}", path.display()),
            ))
        }
    }
    fs::write(path.join("cgroup.procs"), name.pid.to_string()).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("moving haltd into the cgroup {}: {e}", path.display()),
        )
    })?;
    let fd = fs::File::open(&path)?.into();
    Ok(Leaf {
        path,
        fd,
        parent,
        removed,
    })
}

impl Leaf {
    /// The clean stop's last step: moves the whole process back to the cgroup the leaf was
    /// made under (a cgroup with a process in it cannot be removed), then removes the leaf.
    /// Its programs stay with the sockets still charged to it until they close
    /// ([`leftovers`]); a socket made after this call is no longer under them, so call it
    /// only once haltd opens none. Fails, leaving the leaf to the next start, where the user
    /// haltd runs as may not write the parent cgroup without the capabilities it dropped (a
    /// delegated cgroup, as systemd's `Delegate=yes` makes the unit's, allows it).
    pub fn leave(&self) -> io::Result<()> {
        let procs = self.parent.join("cgroup.procs");
        fs::write(&procs, std::process::id().to_string()).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("moving haltd back to {}: {e}", procs.display()),
            )
        })?;
        fs::remove_dir(&self.path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("removing the cgroup {}: {e}", self.path.display()),
            )
        })
    }
}

/// `BPF_PROG_ATTACH` with `BPF_F_ALLOW_MULTI`: the attachment stays after the program's fd
/// closes and lives as long as the cgroup. aya attaches cgroup programs through links, which
/// the kernel detaches when the daemon exits; the gate must outlive it.
pub fn prog_attach(
    cgroup: BorrowedFd<'_>,
    prog: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<()> {
    const BPF_PROG_ATTACH: libc::c_long = 8;
    const BPF_F_ALLOW_MULTI: u32 = 2;
    /// The `BPF_PROG_ATTACH` part of `union bpf_attr`.
    #[repr(C)]
    #[derive(Default)]
    struct AttachAttr {
        target_fd: u32,
        attach_bpf_fd: u32,
        attach_type: u32,
        attach_flags: u32,
        replace_bpf_fd: u32,
        relative_fd: u32,
        expected_revision: u64,
    }
    let attr = AttachAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type,
        attach_flags: BPF_F_ALLOW_MULTI,
        ..AttachAttr::default()
    };
    // SAFETY: bpf(2) reads `size_of::<AttachAttr>()` bytes of a live, initialised attribute
    // block whose layout is the kernel's (all fields after `attach_flags` zero = unused).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_ATTACH,
            &raw const attr,
            size_of::<AttachAttr>() as libc::c_uint,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_unescape() {
        assert_eq!(
            unescape_mount("/sys/fs/cgroup/unified"),
            "/sys/fs/cgroup/unified"
        );
        assert_eq!(unescape_mount("/a\\040b"), "/a b");
    }
}
