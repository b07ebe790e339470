//! The upstream's TCP socket: creating it (no Nagle delay: one token per frame must leave at
//! once) and the address a connect hands to the kernel, which the connect operation owns
//! until it completes.

use std::{io, os::fd::RawFd};

use crate::dataplane::driver::op::SockAddr;
use crate::dataplane::set_nodelay;

/// A new TCP socket for the upstream at `addr` (no Nagle delay).
pub(in crate::dataplane) fn upstream_socket(addr: std::net::SocketAddr) -> io::Result<RawFd> {
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket creation; the descriptor is owned by the caller.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    set_nodelay(fd);
    Ok(fd)
}

pub(in crate::dataplane) fn sockaddr(addr: std::net::SocketAddr) -> Box<SockAddr> {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: Box<libc::sockaddr_storage> = Box::new(unsafe { std::mem::zeroed() });
    let len = match addr {
        std::net::SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&raw mut *ss).cast::<libc::sockaddr_in>(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        std::net::SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&raw mut *ss).cast::<libc::sockaddr_in6>(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    Box::new(SockAddr {
        storage: *ss,
        len: len as libc::socklen_t,
    })
}
