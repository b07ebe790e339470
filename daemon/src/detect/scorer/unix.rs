//! The external scorer: a process on a Unix stream socket, one connection per turn, one
//! request and reply line per token within the deadline (protocol in the module docs above).

use std::{
    fmt, io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::detect::{
    scorer::score::{
        check_socket_path, Interest, ScoreWait, Scored, Scorer, ScorerConfigError, ScorerError,
        Woke, MAX_DEADLINE_US, MAX_REPLY_BYTES, NEG_INF_SENTINEL,
    },
    TokenObs,
};

// ---------------------------------------------------------------------------------------------
// UnixScorer
// ---------------------------------------------------------------------------------------------

/// Scores tokens with an external process over a Unix stream socket, one connection per turn,
/// each token's round trip bounded by the deadline (protocol in the module docs).
pub struct UnixScorer {
    path: PathBuf,
    deadline: Duration,
    deadline_us: u64,
    turn_id: String,
    /// The connection of the turn; `None` before it, after an error, and while a waiter holds
    /// it ([`ScoreWait`]).
    conn: Option<OwnedFd>,
    /// The token whose round trip is under way.
    inflight: Option<InFlight>,
    /// The request line being sent; reused across tokens.
    wbuf: Vec<u8>,
    /// The reply line being read.
    rbuf: Box<[u8]>,
}

impl fmt::Debug for UnixScorer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnixScorer")
            .field("path", &self.path)
            .field("deadline_us", &self.deadline_us)
            .field("turn_id", &self.turn_id)
            .field("connected", &self.conn.is_some())
            .finish()
    }
}

/// A token's round trip under way: how far it got, and until when it may take.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    index: u64,
    deadline: Instant,
    /// Bytes of the request line sent.
    sent: usize,
    /// Bytes of the reply line read.
    rlen: usize,
}

/// One request line (`{"turn_id","index","text","logprob"}`).
#[derive(Serialize)]
struct Request<'a> {
    turn_id: &'a str,
    index: u64,
    text: &'a str,
    logprob: Option<f64>,
}

/// The one reply line the scorer sends per request.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Reply {
    score: f64,
}

/// What went wrong on the wire, before the path and token index are attached.
#[derive(Debug)]
pub(super) enum Wire {
    Connect(io::Error),
    Deadline,
    Closed,
    Malformed(String),
    NonFinite(f64),
    Io(io::Error),
}

impl UnixScorer {
    /// A scorer for the socket at `path`; it connects at [`Scorer::begin_turn`] (or at the
    /// first token, if no turn was begun). Checks the path and the deadline like
    /// [`super::ScorerConfig::validate`].
    pub fn new(path: PathBuf, deadline_us: u64) -> Result<Self, ScorerConfigError> {
        check_socket_path(&path)?;
        if !(1..=MAX_DEADLINE_US).contains(&deadline_us) {
            return Err(ScorerConfigError::DeadlineOutOfRange {
                value: deadline_us,
                max: MAX_DEADLINE_US,
            });
        }
        Ok(Self {
            path,
            deadline: Duration::from_micros(deadline_us),
            deadline_us,
            turn_id: String::new(),
            conn: None,
            inflight: None,
            wbuf: Vec::with_capacity(256),
            rbuf: vec![0; MAX_REPLY_BYTES].into_boxed_slice(),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The per-token deadline in microseconds.
    pub fn deadline_us(&self) -> u64 {
        self.deadline_us
    }

    /// True while a connection to the scorer is open.
    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// Opens a non-blocking connection. AF_UNIX connects complete (or fail) at once on Linux:
    /// a full backlog is `EAGAIN`, not a wait.
    fn connect(&self) -> io::Result<OwnedFd> {
        // SAFETY: plain syscall with constant arguments.
        let raw = unsafe {
            libc::socket(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a socket just created by this thread and owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };

        // SAFETY: sockaddr_un is plain old data; all-zero bytes are a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = self.path.as_os_str().as_bytes();
        // `new` checked the length (< sun_path's 108) and the absence of NUL bytes, so the
        // zeroed tail terminates the path.
        for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
            *dst = *src as libc::c_char;
        }
        let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + bytes.len() + 1;
        let len = libc::socklen_t::try_from(len).unwrap_or(libc::socklen_t::MAX);
        // SAFETY: `addr` is an initialized sockaddr_un of at least `len` bytes; `fd` is open.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&raw const addr).cast::<libc::sockaddr>(),
                len,
            )
        };
        // A non-blocking AF_UNIX connect neither sleeps nor returns EINTR/EINPROGRESS.
        if rc == 0 {
            Ok(fd)
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Starts a token's round trip: connects if need be, writes the request line and goes
    /// as far as the socket lets it without waiting.
    fn begin(&mut self, tok: &TokenObs<'_>) -> Scored {
        let index = tok.index;
        let deadline = Instant::now() + self.deadline;
        self.inflight = Some(InFlight {
            index,
            deadline,
            sent: 0,
            rlen: 0,
        });
        if self.conn.is_none() {
            match self.connect() {
                Ok(fd) => self.conn = Some(fd),
                Err(e) => return self.finish(Err(Wire::Connect(e))),
            }
        }
        self.wbuf.clear();
        let req = Request {
            turn_id: &self.turn_id,
            index,
            text: tok.text,
            logprob: tok.logprob.map(wire_logprob),
        };
        if let Err(e) = serde_json::to_writer(&mut self.wbuf, &req) {
            return self.finish(Err(Wire::Io(io::Error::other(e))));
        }
        self.wbuf.push(b'\n');
        self.advance()
    }

    /// Sends what is left of the request, then reads what there is of the reply, without
    /// waiting: the score, a failure, or the wait that comes next.
    fn advance(&mut self) -> Scored {
        let (Some(f), Some(conn)) = (self.inflight.as_mut(), self.conn.as_ref()) else {
            return self.finish(Err(Wire::Io(io::Error::other("no connection"))));
        };
        let fd = conn.as_raw_fd();
        let step = (|| {
            if f.sent < self.wbuf.len() {
                f.sent += try_send(fd, &self.wbuf[f.sent..])?;
                if f.sent < self.wbuf.len() {
                    return Ok(Err(Interest::Writable));
                }
            }
            match try_recv_line(fd, &mut self.rbuf, &mut f.rlen)? {
                Some(end) => parse_reply(&self.rbuf[..end]).map(Ok),
                None => Ok(Err(Interest::Readable)),
            }
        })();
        let deadline = f.deadline;
        match step {
            Ok(Ok(score)) => self.finish(Ok(score)),
            Ok(Err(_)) if Instant::now() >= deadline => self.finish(Err(Wire::Deadline)),
            Ok(Err(interest)) => match self.conn.take() {
                Some(fd) => Scored::Wait(ScoreWait {
                    fd,
                    interest,
                    deadline,
                }),
                None => self.finish(Err(Wire::Io(io::Error::other("no connection")))),
            },
            Err(wire) => self.finish(Err(wire)),
        }
    }

    /// The token's round trip is over: its score, or its error with the path and the token.
    fn finish(&mut self, result: Result<f64, Wire>) -> Scored {
        let index = self.inflight.take().map_or(0, |f| f.index);
        let wire = match result {
            Ok(score) => return Scored::Done(Ok(score)),
            Err(wire) => wire,
        };
        // The connection may hold a late reply or half a line: never reuse it.
        self.conn = None;
        let path = self.path.clone();
        Scored::Done(Err(match wire {
            Wire::Connect(source) => ScorerError::Connect { path, source },
            Wire::Deadline => ScorerError::Deadline {
                path,
                index,
                deadline_us: self.deadline_us,
            },
            Wire::Closed => ScorerError::Closed { path, index },
            Wire::Malformed(detail) => ScorerError::Malformed {
                path,
                index,
                detail,
            },
            Wire::NonFinite(value) => ScorerError::NonFiniteScore { path, index, value },
            Wire::Io(source) => ScorerError::Io {
                path,
                index,
                source,
            },
        }))
    }
}

/// A logprob as sent on the wire: −∞ becomes [`NEG_INF_SENTINEL`]; NaN (which no source
/// passes on) becomes `null`, as serde_json writes it.
fn wire_logprob(lp: f32) -> f64 {
    if lp == f32::NEG_INFINITY {
        NEG_INF_SENTINEL
    } else {
        f64::from(lp)
    }
}

impl Scorer for UnixScorer {
    /// The round trip on this thread: every wait is a `ppoll(2)` bounded by the time left.
    fn score(&mut self, tok: &TokenObs<'_>) -> Result<f64, ScorerError> {
        let mut scored = self.begin(tok);
        loop {
            match scored {
                Scored::Done(result) => return result,
                Scored::Wait(w) => scored = self.resume(block_on(w)),
            }
        }
    }

    fn start(&mut self, tok: &TokenObs<'_>) -> Scored {
        self.begin(tok)
    }

    fn resume(&mut self, woke: Woke) -> Scored {
        if self.inflight.is_none() {
            return Scored::Done(Err(ScorerError::NotWaiting));
        }
        match woke {
            Woke::Ready(fd) => {
                self.conn = Some(fd);
                self.advance()
            }
            Woke::TimedOut(fd) => {
                self.conn = Some(fd);
                self.finish(Err(Wire::Deadline))
            }
            Woke::Failed(fd, e) => {
                self.conn = Some(fd);
                self.finish(Err(Wire::Io(e)))
            }
        }
    }

    fn begin_turn(&mut self, turn_id: &str) -> Result<(), ScorerError> {
        self.conn = None;
        self.inflight = None;
        turn_id.clone_into(&mut self.turn_id);
        match self.connect() {
            Ok(fd) => {
                self.conn = Some(fd);
                Ok(())
            }
            Err(source) => Err(ScorerError::Connect {
                path: self.path.clone(),
                source,
            }),
        }
    }

    fn end_turn(&mut self) {
        self.conn = None;
        self.inflight = None;
    }
}

/// Sends as much of `buf` as the socket takes now; how many bytes (0 when it is full).
fn try_send(fd: RawFd, buf: &[u8]) -> Result<usize, Wire> {
    loop {
        // SAFETY: `buf` is valid for `buf.len()` bytes; `fd` is an open socket owned by the caller.
        let n = unsafe {
            libc::send(
                fd,
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if let Ok(n) = usize::try_from(n) {
            return Ok(n);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) => return Ok(0),
            Some(libc::EINTR) => {}
            Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN) => return Err(Wire::Closed),
            _ => return Err(Wire::Io(e)),
        }
    }
}

/// Reads what the socket has of the reply line into `buf[*len..]`, without waiting: the
/// line's length without the newline once it is complete, `None` while it is not.
fn try_recv_line(fd: RawFd, buf: &mut [u8], len: &mut usize) -> Result<Option<usize>, Wire> {
    loop {
        let Some(room) = buf.get_mut(*len..).filter(|r| !r.is_empty()) else {
            return Err(Wire::Malformed(format!(
                "no newline within {MAX_REPLY_BYTES} bytes"
            )));
        };
        // SAFETY: `room` is valid for writes of `room.len()` bytes; `fd` is open.
        let n = unsafe { libc::recv(fd, room.as_mut_ptr().cast(), room.len(), libc::MSG_DONTWAIT) };
        match usize::try_from(n) {
            Ok(0) => return Err(Wire::Closed),
            Ok(n) => {
                let start = *len;
                *len += n;
                if let Some(pos) = buf[start..*len].iter().position(|&b| b == b'\n') {
                    let end = start + pos;
                    if end + 1 != *len {
                        return Err(Wire::Malformed(
                            "more than one line in reply to one token".to_owned(),
                        ));
                    }
                    return Ok(Some(end));
                }
            }
            Err(_) => {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) => return Ok(None),
                    Some(libc::EINTR) => {}
                    Some(libc::ECONNRESET) => return Err(Wire::Closed),
                    _ => return Err(Wire::Io(e)),
                }
            }
        }
    }
}

/// Waits on this thread until `w`'s socket is ready (or hung up / in error: the next call
/// says which) or its deadline passes.
fn block_on(w: ScoreWait) -> Woke {
    let fd = w.fd.as_raw_fd();
    loop {
        let left = w.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Woke::TimedOut(w.fd);
        }
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(left.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: left.subsec_nanos().into(),
        };
        let mut pfd = libc::pollfd {
            fd,
            events: w.interest.poll_mask(),
            revents: 0,
        };
        // SAFETY: one valid pollfd, a valid timespec, no signal mask.
        let rc = unsafe { libc::ppoll(&raw mut pfd, 1, &raw const ts, std::ptr::null()) };
        match rc {
            0 => return Woke::TimedOut(w.fd),
            rc if rc > 0 => return Woke::Ready(w.fd),
            _ => {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Woke::Failed(w.fd, e);
                }
            }
        }
    }
}

/// Parses one reply line (without its newline).
pub(super) fn parse_reply(line: &[u8]) -> Result<f64, Wire> {
    match serde_json::from_slice::<Reply>(line) {
        Ok(Reply { score }) => {
            let score = exact_number(line).unwrap_or(score);
            if score.is_finite() {
                Ok(score)
            } else {
                Err(Wire::NonFinite(score))
            }
        }
        Err(e) => Err(match python_non_finite(line) {
            Some(value) => Wire::NonFinite(value),
            None => Wire::Malformed(format!(
                "expected one line of {{\"score\": <number>}} ({} bytes): {e}",
                line.len()
            )),
        }),
    }
}

/// The score of a line that serde_json accepted as `{"score": <number>}`, correctly rounded.
///
/// serde_json (without its `float_roundtrip` feature) may be one ULP off on long decimals,
/// which could move a score that a scorer wrote exactly at `hard_limit` across it; Rust's
/// `str::parse::<f64>` is correctly rounded. The line is known to be one object with the one
/// key `score`, whose name cannot contain `:`, so the number lies between the first `:` and
/// the last `}`.
fn exact_number(line: &[u8]) -> Option<f64> {
    let colon = line.iter().position(|&b| b == b':')?;
    let close = line.iter().rposition(|&b| b == b'}')?;
    let number = line.get(colon + 1..close)?.trim_ascii();
    std::str::from_utf8(number).ok()?.parse().ok()
}

/// Python's `json.dumps` writes NaN and the infinities as bare `NaN`, `Infinity` and
/// `-Infinity`, which are not JSON; recognized so the error says what the scorer meant.
fn python_non_finite(line: &[u8]) -> Option<f64> {
    let compact: Vec<u8> = line
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    let value = compact.strip_prefix(br#"{"score":"#)?.strip_suffix(b"}")?;
    match value {
        b"NaN" => Some(f64::NAN),
        b"Infinity" => Some(f64::INFINITY),
        b"-Infinity" => Some(f64::NEG_INFINITY),
        _ => None,
    }
}
