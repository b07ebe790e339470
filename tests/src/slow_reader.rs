//! A client that reads slowly, as a phone on a weak network does: a small receive buffer
//! (`SO_RCVBUF` set before connecting, so the window it advertises stays small) and a fixed
//! pace, a few bytes per tick, whatever is waiting. Over plain HTTP or TLS (rustls, fed the
//! ciphertext at the same pace). It records when each byte came and how the connection ended,
//! so a test can ask whether the client got the end of its stream, and when.

use std::{
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    os::fd::AsRawFd,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::sse::{classify, SseEvent, SseParser, StreamOutcome};

/// How the slow reader reads.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// `SO_RCVBUF`, set before connecting.
    pub rcvbuf: usize,
    /// Bytes read off the socket per tick, at most.
    pub chunk: usize,
    /// Time between two reads.
    pub every: Duration,
    /// The reader gives up after this long without a byte or an end (the connection did not
    /// end: a hang).
    pub give_up: Duration,
}

impl Pace {
    /// 4 KiB receive buffer, 1 KiB every 100 ms (10 KiB/s), giving up after 15 s of silence.
    pub const PHONE: Pace = Pace {
        rcvbuf: 4096,
        chunk: 1024,
        every: Duration::from_millis(100),
        give_up: Duration::from_secs(15),
    };

    /// Bytes per second.
    pub fn rate(&self) -> f64 {
        self.chunk as f64 / self.every.as_secs_f64()
    }
}

/// How the connection ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// A TCP FIN (plain HTTP), or under TLS `close_notify` and then the FIN.
    Closed,
    /// Under TLS: the FIN came without `close_notify` before it.
    ClosedWithoutNotify,
    /// A TCP reset.
    Reset,
    /// Nothing for [`Pace::give_up`]: the connection did not end.
    Hung,
    /// Something else went wrong (a TLS error, an unexpected read error).
    Error(String),
}

/// What one slow stream got.
#[derive(Debug)]
pub struct SlowRead {
    /// The response as parsed (events, tokens, the terminal error, `[DONE]`).
    pub outcome: StreamOutcome,
    /// Bytes read off the TCP socket (ciphertext under TLS).
    pub wire_bytes: u64,
    /// When the last byte arrived, from the request's write.
    pub last_byte: Duration,
    pub end: End,
    /// When the end was seen, from the request's write.
    pub end_at: Duration,
}

impl SlowRead {
    /// The time the pace itself takes to read what came: the bytes at the pace's rate.
    pub fn reading_time(&self, pace: &Pace) -> Duration {
        Duration::from_secs_f64(self.wire_bytes as f64 / pace.rate())
    }
}

/// What runs over the socket: plain HTTP, or TLS (and whether `close_notify` came).
enum Link {
    Plain,
    Tls {
        conn: Box<rustls::ClientConnection>,
        notified: bool,
    },
}

/// Connects to `addr` (in the current thread's namespace) with `pace`'s receive buffer,
/// over TLS when `tls` is given (the handshake at full speed), sends `body` as a streaming
/// chat request with `authorization: auth` and `connection: close`, and reads the response at
/// `pace`. `on_head` gets the stream id once the response head is read.
pub fn slow_stream(
    addr: SocketAddr,
    tls: Option<&Arc<rustls::ClientConfig>>,
    body: &Value,
    auth: &str,
    pace: Pace,
    mut on_head: impl FnMut(&str),
) -> Result<SlowRead> {
    let json = serde_json::to_string(body)?;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: haltd\r\n{}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{json}",
        crate::sse::auth_lines(auth),
        json.len()
    );
    let (mut s, mut link) = open(addr, tls, req.as_bytes(), pace)?;
    let t0 = Instant::now();
    s.set_nonblocking(true)?;
    let mut reader = Reader {
        t0,
        head: Vec::new(),
        in_body: false,
        parser: SseParser::default(),
        outcome: StreamOutcome::new(0, String::new(), None, None, t0),
    };
    let mut wire_bytes = 0u64;
    let mut last_byte = Duration::ZERO;
    let mut chunk = vec![0u8; pace.chunk];
    let mut next = t0;
    let mut quiet_since = t0;
    let end = loop {
        next += pace.every;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let n = match s.read(&mut chunk) {
            Ok(0) => break link.eof(),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if quiet_since.elapsed() > pace.give_up {
                    break End::Hung;
                }
                continue;
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break End::Reset,
            Err(e) => break End::Error(e.to_string()),
        };
        wire_bytes += n as u64;
        last_byte = t0.elapsed();
        quiet_since = Instant::now();
        link.feed(&chunk[..n], &mut reader, &mut on_head)?;
    };
    let end_at = t0.elapsed();
    let mut outcome = reader.outcome;
    outcome.ended = t0 + end_at;
    Ok(SlowRead {
        outcome,
        wire_bytes,
        last_byte,
        end,
        end_at,
    })
}

/// Connects with `pace`'s receive buffer, shakes hands under `tls`, and sends `req`.
fn open(
    addr: SocketAddr,
    tls: Option<&Arc<rustls::ClientConfig>>,
    req: &[u8],
    pace: Pace,
) -> Result<(TcpStream, Link)> {
    let mut s = connect_with_rcvbuf(None, addr, pace.rcvbuf)?;
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let link = match tls {
        None => {
            s.write_all(req)?;
            Link::Plain
        }
        Some(cfg) => {
            let mut c = rustls::ClientConnection::new(Arc::clone(cfg), "localhost".try_into()?)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            while c.is_handshaking() {
                c.complete_io(&mut s).context("the TLS handshake")?;
            }
            c.writer().write_all(req)?;
            while c.wants_write() {
                c.write_tls(&mut s)?;
            }
            Link::Tls {
                conn: Box::new(c),
                notified: false,
            }
        }
    };
    Ok((s, link))
}

impl Link {
    /// The bytes `wire` read off the socket, into `reader` (opened first under TLS).
    fn feed(
        &mut self,
        wire: &[u8],
        reader: &mut Reader,
        on_head: &mut impl FnMut(&str),
    ) -> Result<()> {
        let Link::Tls { conn, notified } = self else {
            return reader.feed(wire, on_head);
        };
        let mut plain = [0u8; 16 * 1024];
        let mut cipher = wire;
        while !cipher.is_empty() {
            conn.read_tls(&mut cipher)?;
            if let Err(e) = conn.process_new_packets() {
                bail!("TLS: {e}");
            }
            loop {
                match conn.reader().read(&mut plain) {
                    Ok(0) => {
                        *notified = true;
                        break;
                    }
                    Ok(m) => reader.feed(&plain[..m], on_head)?,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => bail!("TLS: {e}"),
                }
            }
        }
        Ok(())
    }

    /// How a TCP EOF ends this link.
    fn eof(&self) -> End {
        match self {
            Link::Tls {
                notified: false, ..
            } => End::ClosedWithoutNotify,
            _ => End::Closed,
        }
    }
}

/// A TCP connection to `dst` (from `src` if given, in the calling thread's namespace) whose
/// receive buffer is set to `rcvbuf` bytes before the connection is made, so the window it
/// advertises is small from the first segment on.
pub fn connect_with_rcvbuf(
    src: Option<std::net::Ipv4Addr>,
    dst: SocketAddr,
    rcvbuf: usize,
) -> Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(dst) = dst else {
        bail!("connect_with_rcvbuf: IPv4 only");
    };
    let sin = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket; `setsockopt` reads a live int, `bind` and `connect` a valid
    // `sockaddr_in` of `len` bytes; the descriptor is closed on every error path and otherwise
    // owned by the stream.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        anyhow::ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let s = TcpStream::from_raw_fd(fd);
        crate::gate::set_int(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            i32::try_from(rcvbuf)?,
        )?;
        if let Some(src) = src {
            let local = sin(src, 0);
            if libc::bind(fd, (&raw const local).cast(), len) != 0 {
                bail!("binding {src}: {}", std::io::Error::last_os_error());
            }
        }
        let remote = sin(*dst.ip(), dst.port());
        if libc::connect(fd, (&raw const remote).cast(), len) != 0 {
            bail!("connecting to {dst}: {}", std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

/// The response as it comes: the head, then SSE events.
struct Reader {
    t0: Instant,
    head: Vec<u8>,
    in_body: bool,
    parser: SseParser,
    outcome: StreamOutcome,
}

impl Reader {
    fn feed(&mut self, mut bytes: &[u8], on_head: &mut impl FnMut(&str)) -> Result<()> {
        if !self.in_body {
            self.head.extend_from_slice(bytes);
            let Some(end) = self.head.windows(4).position(|w| w == b"\r\n\r\n") else {
                return Ok(());
            };
            let head = String::from_utf8_lossy(&self.head[..end]).into_owned();
            let rest = self.head[end + 4..].to_vec();
            self.in_body = true;
            let mut lines = head.lines();
            let status: u16 = lines
                .next()
                .and_then(|l| l.split(' ').nth(1))
                .and_then(|s| s.parse().ok())
                .context("the status line")?;
            let header = |name: &str| {
                head.lines().skip(1).find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim()
                        .eq_ignore_ascii_case(name)
                        .then(|| v.trim().to_owned())
                })
            };
            let id = header("x-haltd-stream-id").unwrap_or_default();
            self.outcome = StreamOutcome::new(
                status,
                id.clone(),
                header("content-type"),
                header("x-haltd-mode"),
                self.t0,
            );
            on_head(&id);
            self.head.clear();
            return self.body(&rest);
        }
        self.body(std::mem::take(&mut bytes))
    }

    fn body(&mut self, bytes: &[u8]) -> Result<()> {
        for (event, data) in self.parser.feed(bytes) {
            let ev = SseEvent {
                event,
                kind: classify(&data),
                data,
                at: Instant::now(),
            };
            self.outcome.count(&ev);
            self.outcome.events.push(ev);
        }
        Ok(())
    }
}
