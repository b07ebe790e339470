//! haltd's TCP listeners, and the `SO_REUSEPORT` group two of them form during a hand-over
//! (docs/operations.md "Upgrading").
//!
//! Every TCP listener haltd binds (`--listen`, `--metrics`, a TCP `--admin`) sets
//! `SO_REUSEPORT`, so that a successor started with `--take-over` can bind the same address
//! beside it. The kernel admits a socket into a group only from the same effective uid, so no
//! other user's process can join. A start *without* `--take-over` first binds the address
//! without the option ([`Sharing::Alone`]): a port already in use, by another haltd or anything
//! else, fails that start as it always did, instead of silently sharing the port.
//!
//! The client listener is bound at start (before the privileges go: a port below 1024, and
//! inside the gate's cgroup leaf, so that every connection accepted on it is charged to that
//! leaf and policed by this process's gate) but listens only just before the workers accept
//! ([`listen`]): until then it is in no group, and a successor that fails its start never held
//! a connection.
//!
//! During a hand-over the successor steers every new connection of the group to itself
//! ([`steer_to_newest`], a one-instruction classic BPF program: no capability needed), so the
//! old listener's accept queue empties and stays empty before the old process shuts it down
//! ([`shut_down`]). A connection whose handshake completed on the old listener is charged to
//! the old process's cgroup and in its gate's socket map, where the successor's gate cannot
//! take it: the old process must accept it itself. What is still half-open on the old listener
//! when it shuts down moves to the successor (`net.ipv4.tcp_migrate_req = 1`, which the
//! successor sets), and completes there, under the successor's gate.

use std::{
    io,
    net::{SocketAddr, TcpListener},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd},
};

use socket2::{Domain, Socket, Type};

/// Whether the address may already be in use by a haltd this start takes over from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// A port in use fails the bind (a start without `--take-over`).
    Alone,
    /// Join the `SO_REUSEPORT` group of the haltd being taken over, if there is one.
    TakeOver,
}

/// `SO_ATTACH_REUSEPORT_CBPF`, `SO_DETACH_REUSEPORT_BPF` (asm-generic/socket.h).
const SO_ATTACH_REUSEPORT_CBPF: libc::c_int = 51;
const SO_DETACH_REUSEPORT_BPF: libc::c_int = 68;

/// The sysctl that moves half-open and queued connections of a closing listener to another
/// listener of its group instead of resetting them (Linux 5.14).
pub const MIGRATE_SYSCTL: &str = "/proc/sys/net/ipv4/tcp_migrate_req";

/// A TCP socket bound to `addr` with `SO_REUSEADDR` and `SO_REUSEPORT`, not listening yet.
pub fn bind(addr: SocketAddr, sharing: Sharing) -> io::Result<Socket> {
    if sharing == Sharing::Alone {
        // Bound without SO_REUSEPORT, this fails with EADDRINUSE wherever anything listens.
        drop(new_socket(addr, false)?);
    }
    new_socket(addr, true)
}

fn new_socket(addr: SocketAddr, reuse_port: bool) -> io::Result<Socket> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM.cloexec(), None)?;
    // As std's TcpListener::bind: a restart binds while old connections sit in TIME_WAIT.
    sock.set_reuse_address(true)?;
    if reuse_port {
        sock.set_reuse_port(true)?;
    }
    sock.bind(&addr.into())?;
    Ok(sock)
}

/// Starts listening with room for `backlog` connections (the kernel caps it at
/// `net.core.somaxconn`); the socket joins its address's group now.
pub fn listen(sock: Socket, backlog: i32) -> io::Result<TcpListener> {
    sock.listen(backlog)?;
    // SAFETY: the descriptor comes out of the socket, which gives up its ownership.
    Ok(unsafe { TcpListener::from_raw_fd(sock.into_raw_fd()) })
}

/// Makes the group send every new connection to `listener`: the kernel picks the socket at
/// index 1 of the group, which is the one that joined last while two listen, and falls back to
/// its hash when the index is out of range (the old listener gone, or this one).
pub fn steer_to_newest(listener: BorrowedFd<'_>) -> io::Result<()> {
    // BPF_RET | BPF_K: return 1.
    let mut program = [libc::sock_filter {
        code: 0x06,
        jt: 0,
        jf: 0,
        k: 1,
    }];
    let fprog = libc::sock_fprog {
        len: 1,
        filter: program.as_mut_ptr(),
    };
    setsockopt(listener, SO_ATTACH_REUSEPORT_CBPF, &fprog)
}

/// Takes the steering program off the group (once the old listener is gone, so that the next
/// successor's listener is not steered to before it serves).
pub fn unsteer(listener: BorrowedFd<'_>) -> io::Result<()> {
    match setsockopt(listener, SO_DETACH_REUSEPORT_BPF, &0_i32) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        r => r,
    }
}

fn setsockopt<T>(fd: BorrowedFd<'_>, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` is a live T of the size given, and the kernel only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            std::ptr::from_ref(value).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Connections established and waiting in the listener's accept queue (`tcpi_unacked` of a
/// listening socket).
pub fn accept_queue_len(listener: BorrowedFd<'_>) -> io::Result<u32> {
    // SAFETY: tcp_info is plain data; zeroes are a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` has room for `len` bytes, which the kernel writes at most.
    let r = unsafe {
        libc::getsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(info.tcpi_unacked)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Stops the listener accepting, on every descriptor that refers to it (each worker holds
/// one): the kernel takes it out of its group, moves what is still queued or half-open to
/// another listener of the group (with `tcp_migrate_req`), and fails the accepts waiting on it.
pub fn shut_down(listener: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: shutdown(2) on a descriptor the caller keeps open.
    if unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RD) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sets `net.ipv4.tcp_migrate_req = 1` in haltd's network namespace (root, at start); says
/// whether it was already set.
pub fn enable_migration() -> io::Result<bool> {
    let was = std::fs::read_to_string(MIGRATE_SYSCTL)?;
    if was.trim() == "1" {
        return Ok(true);
    }
    std::fs::write(MIGRATE_SYSCTL, "1\n")?;
    Ok(false)
}

#[cfg(test)]
mod tests;
