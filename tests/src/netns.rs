//! Network namespaces for the tests: a [`NetPair`] (server and client namespace joined by a
//! veth pair, deleted on drop) and running code inside a namespace ([`in_netns`],
//! [`spawn_in_netns`]). `setns` moves only the calling thread, so every call runs on a thread
//! of its own and the test thread never leaves its namespace.

use std::{
    fs, io,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    thread,
};

use anyhow::{ensure, Context, Result};

use crate::{checked, require_root};

fn ip(args: &[&str]) -> Result<String> {
    checked(Command::new("ip").args(args))
}

/// Path of a named network namespace (as `ip netns` keeps them).
pub fn netns_path(ns: &str) -> PathBuf {
    Path::new("/var/run/netns").join(ns)
}

/// Whether a named network namespace exists.
pub fn netns_exists(ns: &str) -> bool {
    netns_path(ns).exists()
}

static NEXT_PAIR: AtomicU32 = AtomicU32::new(1);

/// Two network namespaces joined by a veth pair: `srv` holds 198.18.n.1/30, `cli` holds
/// 198.18.n.2/30, loopback up in both. Dropping it deletes both namespaces (and with them
/// the veth pair and every socket bound in them).
#[derive(Debug)]
pub struct NetPair {
    /// Pair number: the third octet of both addresses.
    pub n: u8,
    /// Server namespace name.
    pub srv: String,
    /// Client namespace name.
    pub cli: String,
    pub srv_ip: Ipv4Addr,
    pub cli_ip: Ipv4Addr,
    /// Namespaces created so far (all of them once `new` returns).
    created: Vec<String>,
}

impl NetPair {
    pub fn new() -> Result<Self> {
        require_root()?;
        remove_stale_namespaces();
        let seq = NEXT_PAIR.fetch_add(1, Ordering::Relaxed);
        let n = u8::try_from(seq % 250 + 1).context("pair number fits an octet")?;
        let pid = std::process::id();
        let mut pair = NetPair {
            n,
            srv: format!("haltd-t-{pid}-{seq}-srv"),
            cli: format!("haltd-t-{pid}-{seq}-cli"),
            srv_ip: Ipv4Addr::new(198, 18, n, 1),
            cli_ip: Ipv4Addr::new(198, 18, n, 2),
            created: Vec::new(),
        };
        for ns in [pair.srv.clone(), pair.cli.clone()] {
            ip(&["netns", "add", &ns])?;
            pair.created.push(ns);
        }
        // Created directly inside the namespaces, so the short names never meet in the root one.
        ip(&[
            "link", "add", "hv-srv", "netns", &pair.srv, "type", "veth", "peer", "name", "hv-cli",
            "netns", &pair.cli,
        ])?;
        for (ns, dev, addr) in [
            (&pair.srv, "hv-srv", pair.srv_ip),
            (&pair.cli, "hv-cli", pair.cli_ip),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    /// `srv_ip:port`.
    pub fn srv_addr(&self, port: u16) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.srv_ip, port))
    }

    /// Gives the client namespace a second address, 198.18.n.`host`/32 (`host` ≥ 4, outside
    /// the pair's /30), routed from the server namespace: a second client machine.
    pub fn add_client_addr(&self, host: u8) -> Result<Ipv4Addr> {
        ensure!(host >= 4, "198.18.n.0/30 is the pair's own");
        let addr = Ipv4Addr::new(198, 18, self.n, host);
        ip(&[
            "-n",
            &self.cli,
            "addr",
            "add",
            &format!("{addr}/32"),
            "dev",
            "hv-cli",
        ])?;
        ip(&[
            "-n",
            &self.srv,
            "route",
            "add",
            &format!("{addr}/32"),
            "dev",
            "hv-srv",
        ])?;
        Ok(addr)
    }
}

/// A TCP connection to `dst` from the local address `src` (in the calling thread's namespace).
pub fn connect_from(src: Ipv4Addr, dst: SocketAddr) -> Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(dst) = dst else {
        anyhow::bail!("connect_from: IPv4 only");
    };
    let sin = |a: &SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket; `bind` and `connect` read a valid `sockaddr_in` of `len` bytes;
    // the descriptor is closed on every error path and otherwise owned by the stream.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let local = sin(&SocketAddrV4::new(src, 0));
        let remote = sin(&dst);
        if libc::bind(fd, (&raw const local).cast(), len) != 0
            || libc::connect(fd, (&raw const remote).cast(), len) != 0
        {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            anyhow::bail!("connecting {src} -> {dst}: {e}");
        }
        Ok(std::net::TcpStream::from_raw_fd(fd))
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        for ns in self.created.drain(..).rev() {
            if let Err(e) = ip(&["netns", "delete", &ns]) {
                eprintln!("NetPair: could not delete namespace {ns}: {e:#}");
            }
        }
    }
}

/// Deletes `haltd-t-<pid>-*` namespaces left by test processes that no longer run (a test
/// binary killed with SIGKILL cannot run its guards).
fn remove_stale_namespaces() {
    let Ok(entries) = fs::read_dir("/var/run/netns") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("haltd-t-")
            .and_then(|r| r.split('-').next())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            eprintln!("NetPair: deleting stale namespace {name}");
            let _ = ip(&["netns", "delete", &name]);
        }
    }
}

/// Runs `f` on a new thread that has joined the named network namespace (`setns` moves only
/// the calling thread), and returns its result. A panic in `f` propagates.
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let path = netns_path(ns);
    thread::scope(|s| {
        let handle = s.spawn(move || {
            enter_netns(&path).unwrap_or_else(|e| panic!("{e:#}"));
            f()
        });
        match handle.join() {
            Ok(v) => v,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Like [`in_netns`], but returns the thread's handle so that many clients run at once.
pub fn spawn_in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> thread::JoinHandle<T> {
    let path = netns_path(ns);
    thread::spawn(move || {
        enter_netns(&path).unwrap_or_else(|e| panic!("{e:#}"));
        f()
    })
}

fn enter_netns(path: &Path) -> Result<()> {
    let file = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: `file` is an open namespace file for the whole call; setns only changes this
    // thread's network namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("setns({})", path.display()));
    }
    Ok(())
}
