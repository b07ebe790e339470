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
        check_socket_path, Scorer, ScorerConfigError, ScorerError, MAX_DEADLINE_US,
        MAX_REPLY_BYTES, NEG_INF_SENTINEL,
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
    conn: Option<OwnedFd>,
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

    fn round_trip(&mut self, tok: &TokenObs<'_>, deadline: Instant) -> Result<f64, Wire> {
        let conn = match &self.conn {
            Some(c) => c,
            None => self.conn.insert(self.connect().map_err(Wire::Connect)?),
        };
        let fd = conn.as_raw_fd();
        self.wbuf.clear();
        let req = Request {
            turn_id: &self.turn_id,
            index: tok.index,
            text: tok.text,
            logprob: tok.logprob.map(wire_logprob),
        };
        serde_json::to_writer(&mut self.wbuf, &req).map_err(|e| Wire::Io(io::Error::other(e)))?;
        self.wbuf.push(b'\n');
        send_all(fd, &self.wbuf, deadline)?;
        let n = recv_line(fd, &mut self.rbuf, deadline)?;
        parse_reply(&self.rbuf[..n])
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
    fn score(&mut self, tok: &TokenObs<'_>) -> Result<f64, ScorerError> {
        let deadline = Instant::now() + self.deadline;
        match self.round_trip(tok, deadline) {
            Ok(score) => Ok(score),
            Err(wire) => {
                // The connection may hold a late reply or half a line: never reuse it.
                self.conn = None;
                let path = self.path.clone();
                let index = tok.index;
                Err(match wire {
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
                })
            }
        }
    }

    fn begin_turn(&mut self, turn_id: &str) -> Result<(), ScorerError> {
        self.conn = None;
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
    }
}

/// Sends all of `buf`, waiting for room until `deadline`.
fn send_all(fd: RawFd, mut buf: &[u8], deadline: Instant) -> Result<(), Wire> {
    while !buf.is_empty() {
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
            buf = buf.get(n..).unwrap_or_default();
            continue;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) => wait(fd, libc::POLLOUT, deadline)?,
            Some(libc::EINTR) => {}
            Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN) => return Err(Wire::Closed),
            _ => return Err(Wire::Io(e)),
        }
    }
    Ok(())
}

/// Reads one reply line into `buf` until `deadline`; returns its length without the newline.
fn recv_line(fd: RawFd, buf: &mut [u8], deadline: Instant) -> Result<usize, Wire> {
    let mut len = 0;
    loop {
        wait(fd, libc::POLLIN, deadline)?;
        loop {
            let Some(room) = buf.get_mut(len..).filter(|r| !r.is_empty()) else {
                return Err(Wire::Malformed(format!(
                    "no newline within {MAX_REPLY_BYTES} bytes"
                )));
            };
            // SAFETY: `room` is valid for writes of `room.len()` bytes; `fd` is open.
            let n =
                unsafe { libc::recv(fd, room.as_mut_ptr().cast(), room.len(), libc::MSG_DONTWAIT) };
            match usize::try_from(n) {
                Ok(0) => return Err(Wire::Closed),
                Ok(n) => {
                    let start = len;
                    len += n;
                    if let Some(pos) = buf[start..len].iter().position(|&b| b == b'\n') {
                        let end = start + pos;
                        if end + 1 != len {
                            return Err(Wire::Malformed(
                                "more than one line in reply to one token".to_owned(),
                            ));
                        }
                        return Ok(end);
                    }
                }
                Err(_) => {
                    let e = io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EAGAIN) => break,
                        Some(libc::EINTR) => {}
                        Some(libc::ECONNRESET) => return Err(Wire::Closed),
                        _ => return Err(Wire::Io(e)),
                    }
                }
            }
        }
    }
}

/// Waits until `fd` is ready for `events` (or hung up / in error: the next syscall says
/// which), or fails with `Deadline` once `deadline` has passed.
fn wait(fd: RawFd, events: libc::c_short, deadline: Instant) -> Result<(), Wire> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Wire::Deadline);
        }
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(left.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: left.subsec_nanos().into(),
        };
        let mut pfd = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: one valid pollfd, a valid timespec, no signal mask.
        let rc = unsafe { libc::ppoll(&raw mut pfd, 1, &raw const ts, std::ptr::null()) };
        match rc {
            0 => return Err(Wire::Deadline),
            rc if rc > 0 => return Ok(()),
            _ => {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Err(Wire::Io(e));
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
