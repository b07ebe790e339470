//! The worker's pool of idle upstream connections (HTTP/1.1 keep-alive).
//!
//! A proxied turn used to open a connection to the upstream for every request, which cost a
//! TCP handshake (and the upstream's accept) before the first byte. Each data-plane worker
//! now keeps up to `--upstream-pool-idle` idle connections to the one upstream, owned by the
//! worker's thread alone, so taking and returning one needs no lock.
//!
//! What goes in: only a connection whose response ended cleanly by its own framing (the
//! chunked terminator, or `content-length` met), that the upstream did not mark
//! `connection: close`, of a turn that completed (`upstream_io.rs` decides; a tripped,
//! failed, cancelled or cut-short turn closes its connection, since a generation may still
//! run there). What comes out: the most recently returned connection (the others age out),
//! after a non-blocking peek that finds neither EOF nor stray bytes; one idle past
//! `--upstream-pool-idle-timeout-ms` is closed. The peek cannot see a close that is still on
//! its way, so a reused connection that fails before any response byte is retried once on a
//! new one (`Step::up_retry`).
//!
//! A connection to an `https://` upstream is kept with its TLS session (`upstream_io/tls.rs`), so
//! that reusing it costs no handshake; one closed by the pool sends `close_notify` first. A
//! TLS record that arrives while it is idle (the upstream's `close_notify`, or anything else)
//! counts as stray bytes: the connection is not reused.

use std::{os::fd::RawFd, time::Duration};

use crate::{
    upstream::metrics::{DiscardReason, PoolMetrics},
    upstream::TlsLink,
};

/// Sends `close_notify` without waiting (a non-blocking send of one small record on an idle
/// socket; failure only means the peer is gone) and closes the socket.
pub(in crate::dataplane) fn close_kept(kept: Kept) {
    if let Some(bytes) = kept.tls.and_then(|mut t| t.close_notify()) {
        // SAFETY: a send from a live buffer on a socket the caller owns, never blocking.
        unsafe {
            libc::send(
                kept.fd,
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
    }
    // SAFETY: no operation is in flight on the socket and nothing else holds its descriptor
    // (the caller's contract).
    unsafe { libc::close(kept.fd) };
}

/// An upstream connection out of a turn: its socket and, for an `https://` upstream, its TLS
/// session.
#[derive(Debug)]
pub(in crate::dataplane) struct Kept {
    pub(in crate::dataplane) fd: RawFd,
    pub(in crate::dataplane) tls: Option<Box<TlsLink>>,
}

/// One idle connection.
#[derive(Debug)]
struct Idle {
    conn: Kept,
    /// When it went idle (monotonic ns).
    since_ns: u64,
}

/// Idle upstream connections of one worker, oldest first.
#[derive(Debug)]
pub(in crate::dataplane) struct UpstreamPool {
    idle: Vec<Idle>,
    cap: usize,
    timeout_ns: u64,
}

/// Whether an idle connection still looks usable: no EOF, no error, and nothing unasked-for
/// waiting to be read.
fn looks_alive(fd: RawFd) -> bool {
    let mut byte = 0u8;
    // SAFETY: a one-byte peek into a local on a socket the pool owns.
    let n = unsafe {
        libc::recv(
            fd,
            (&raw mut byte).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

impl UpstreamPool {
    pub(in crate::dataplane) fn new(cap: usize, timeout: Duration) -> Self {
        UpstreamPool {
            idle: Vec::with_capacity(cap),
            cap,
            timeout_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// Closes the connections idle past the timeout (the oldest come first).
    fn expire(&mut self, now_ns: u64, m: &PoolMetrics) {
        let stale = self
            .idle
            .iter()
            .take_while(|c| now_ns.saturating_sub(c.since_ns) > self.timeout_ns)
            .count();
        for c in self.idle.drain(..stale) {
            // An idle pooled socket: nothing is in flight on it, nothing else holds it.
            close_kept(c.conn);
            m.discarded(DiscardReason::IdleTimeout);
        }
    }

    /// An idle connection that looks usable, the most recently returned first; `None` if
    /// there is none (the caller opens one).
    pub(in crate::dataplane) fn take(&mut self, now_ns: u64, m: &PoolMetrics) -> Option<Kept> {
        self.expire(now_ns, m);
        while let Some(c) = self.idle.pop() {
            if looks_alive(c.conn.fd) {
                return Some(c.conn);
            }
            close_kept(c.conn);
            m.discarded(DiscardReason::UpstreamClosed);
        }
        None
    }

    /// Takes `conn` back for later requests, or closes it when the pool is full.
    pub(in crate::dataplane) fn put(&mut self, conn: Kept, now_ns: u64, m: &PoolMetrics) {
        self.expire(now_ns, m);
        if self.idle.len() >= self.cap {
            close_kept(conn);
            m.discarded(DiscardReason::PoolFull);
            return;
        }
        // Within capacity: no allocation.
        self.idle.push(Idle {
            conn,
            since_ns: now_ns,
        });
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.idle.len()
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::Write as _,
        net::{TcpListener, TcpStream},
        os::fd::IntoRawFd,
    };

    use prometheus_client::registry::Registry;

    use super::*;
    use crate::upstream::metrics::UpstreamMetrics;

    fn metrics() -> UpstreamMetrics {
        UpstreamMetrics::register(&mut Registry::default())
    }

    fn discarded(m: &PoolMetrics, reason: DiscardReason) -> u64 {
        m.discarded
            .get_or_create(&crate::upstream::metrics::DiscardLabels { reason })
            .get()
    }

    fn plain(fd: RawFd) -> Kept {
        Kept { fd, tls: None }
    }

    /// A connected pair: the pool's end (a raw fd) and the peer's.
    fn pair(l: &TcpListener) -> (RawFd, TcpStream) {
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        (c.into_raw_fd(), s)
    }

    #[test]
    fn reuses_the_latest_and_closes_what_the_peer_closed_or_wrote_to() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let m = metrics();
        let mut pool = UpstreamPool::new(4, Duration::from_secs(60));
        let (a, _pa) = pair(&l);
        let (b, pb) = pair(&l);
        let (c, mut pc) = pair(&l);
        pool.put(plain(a), 1, &m.pool);
        pool.put(plain(b), 2, &m.pool);
        pool.put(plain(c), 3, &m.pool);
        drop(pb);
        pc.write_all(b"x").expect("write");
        std::thread::sleep(Duration::from_millis(50));
        // c has a stray byte, b saw EOF: both closed; a is the one left.
        assert_eq!(pool.take(4, &m.pool).map(|k| k.fd), Some(a));
        assert_eq!(discarded(&m.pool, DiscardReason::UpstreamClosed), 2);
        assert!(pool.take(5, &m.pool).is_none());
        close_kept(plain(a));
    }

    #[test]
    fn caps_and_expires_idle_connections() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let m = metrics();
        let mut pool = UpstreamPool::new(2, Duration::from_nanos(100));
        let peers: Vec<_> = (0..3).map(|_| pair(&l)).collect();
        for (i, (fd, _)) in peers.iter().enumerate() {
            pool.put(plain(*fd), 10 + i as u64, &m.pool);
        }
        assert_eq!(pool.len(), 2);
        assert_eq!(discarded(&m.pool, DiscardReason::PoolFull), 1);
        // Past the timeout, both idle ones are closed instead of handed out.
        assert!(pool.take(1_000, &m.pool).is_none());
        assert_eq!(discarded(&m.pool, DiscardReason::IdleTimeout), 2);
        let mut none = UpstreamPool::new(0, Duration::from_secs(1));
        let (fd, _peer) = pair(&l);
        none.put(plain(fd), 1, &m.pool);
        assert_eq!(none.len(), 0, "--upstream-pool-idle 0 pools nothing");
    }
}
