//! Scorers: where the HaltMonitor's per-token score comes from (spec 001; issue 4).
//!
//! The [`HaltMonitor`](crate::monitor::HaltMonitor) compares one score per token with its
//! `hard_limit`. A [`Scorer`] produces that score, synchronously, on the data-plane worker
//! that handles the stream, before the token is accounted or sent:
//!
//! * [`ProbabilityScorer`] (`scorer = "probability"`, the default): the token's probability
//!   under the model, `exp(logprob)`, in `[0, 1]`. A token without a logprob is an error
//!   ([`ScorerError::NoLogprob`]), never a silent pass.
//! * [`UnixScorer`] (`scorer = { unix = "/run/haltd/scorer.sock", deadline_us = 2000 }`): an
//!   external process of the operator's, reached over a Unix stream socket, that must answer
//!   each token within `deadline_us` microseconds.
//!
//! Any [`ScorerError`] means the token could not be judged; the caller turns it into a
//! `DETECTOR_FAILURE` trip in hard mode (fail closed, DESIGN G3). No scorer panics on any
//! input or on anything a scorer process sends.
//!
//! # Configuration
//!
//! [`ScorerConfig`] has a hand-written serde representation, the same in every format (TOML
//! shown; JSON is `"probability"` or `{"unix": "/run/haltd/scorer.sock", "deadline_us": 2000}`):
//!
//! ```toml
//! scorer = "probability"
//! # or
//! scorer = { unix = "/run/haltd/scorer.sock" }                     # deadline_us = 2000
//! scorer = { unix = "/run/haltd/scorer.sock", deadline_us = 500 }
//! ```
//!
//! Unknown keys, a missing `unix`, or any other string are errors that name the key or the
//! value. [`ScorerConfig::validate`] then checks what serde cannot: the socket path is
//! absolute, has no NUL byte and fits `sun_path` (at most 107 bytes), and `deadline_us` is
//! within `1..=1_000_000`.
//!
//! # Wire protocol of the external scorer
//!
//! Transport: a Unix-domain `SOCK_STREAM` socket at the configured path, created and listened
//! on by the scorer process. Messages are newline-delimited JSON (one UTF-8 JSON object per
//! line, terminated by `\n`), so a scorer is a few lines of Python (below).
//!
//! Connections: **one connection per turn.** haltd connects when a turn begins
//! ([`Scorer::begin_turn`]) and closes the connection when the turn ends
//! ([`Scorer::end_turn`]) or the scorer is dropped; the scorer sees end-of-file then. After
//! any error (a missed deadline, a bad reply, ...) haltd drops the connection, so a late or
//! stray reply can never be taken as the answer to a later token; if the stream goes on (an
//! observe-only detector) the next token opens a new connection, within its own deadline.
//! A scorer should therefore treat every connection independently and key any per-turn
//! state on `turn_id`. Serve connections concurrently (a thread or task per connection):
//! every data-plane worker may have a turn open at the same time.
//!
//! Per token, haltd sends one request line and reads exactly one reply line:
//!
//! ```text
//! → {"turn_id":"hs_0000000100000007","index":0,"text":"The","logprob":-0.105}
//! ← {"score":0.93}
//! ```
//!
//! * `turn_id` (string): the turn's id, the same on every line of a connection.
//! * `index` (integer): 0-based position of the token in the turn.
//! * `text` (string): the token's text, JSON-escaped.
//! * `logprob` (number or `null`): natural-log probability from the token source; `null`
//!   when the source gave none; a logprob of −∞ (probability 0) is sent as `-9999.0`
//!   (vLLM's sentinel, [`NEG_INF_SENTINEL`]) because JSON has no infinity.
//! * Reply: exactly one key, `score`, a finite JSON number. The HaltMonitor emits the token
//!   when `score >= hard_limit` and halts the stream otherwise. The reply line must be at
//!   most [`MAX_REPLY_BYTES`] bytes including the newline, and nothing may follow it before
//!   the next request.
//!
//! Deadline: from the moment haltd starts scoring a token (including a reconnect, if one is
//! needed) to the moment the whole reply line has arrived, at most `deadline_us`
//! microseconds may pass, else [`ScorerError::Deadline`]. The socket is non-blocking and
//! every wait is a `ppoll(2)` bounded by the time left, so **a stuck or slow scorer blocks the
//! data-plane worker for at most the deadline per token** (plus scheduling jitter, tens of
//! µs), and then trips the stream. Other streams on that worker wait too, so keep the
//! deadline small. A connection queued in the listener's backlog counts as connected: the
//! first token of each turn also pays for the scorer's `accept` and whatever it does per
//! connection (starting a thread), which is the slowest round trip of a turn (measured on a
//! loaded 2-core machine: per-token p50 4 µs / p99 12 µs against an in-process Rust server,
//! 10 µs / 25 µs against the Python scorer below; first token p50 20–120 µs, p99 about 4 ms).
//! A full backlog fails the connect at once (`EAGAIN`) rather than blocking.
//!
//! Errors, each naming the socket path: cannot connect ([`ScorerError::Connect`]: no socket,
//! nobody listening, backlog full, permission), no complete reply in time
//! ([`ScorerError::Deadline`]), connection closed by the scorer ([`ScorerError::Closed`]), a
//! reply that is not `{"score": <number>}` or breaks the framing
//! ([`ScorerError::Malformed`]), a NaN or infinite score ([`ScorerError::NonFiniteScore`];
//! Python's `json.dumps` writes `NaN`/`Infinity`, which haltd recognizes in order to say so),
//! any other socket error ([`ScorerError::Io`]).
//!
//! A minimal scorer in Python (threads per connection):
//!
//! ```python
//! import json, os, socketserver
//!
//! class Turn(socketserver.StreamRequestHandler):
//!     def handle(self):
//!         for line in self.rfile:                    # one connection per turn
//!             tok = json.loads(line)
//!             score = 0.0 if "forbidden" in tok["text"] else 1.0
//!             self.wfile.write(json.dumps({"score": score}).encode() + b"\n")
//!             self.wfile.flush()
//!
//! path = "/run/haltd/scorer.sock"
//! if os.path.exists(path):
//!     os.unlink(path)
//! socketserver.ThreadingUnixStreamServer(path, Turn).serve_forever()
//! ```
//!
//! (`tests/src/bin/test-scorer.rs` is the same in Rust, with fault options for the tests.)

use std::{
    fmt, io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use serde::{
    de::{self, Unexpected},
    ser::SerializeMap,
    Deserialize, Deserializer, Serialize, Serializer,
};

use super::{FailureKind, TokenObs};
pub use crate::upstream::chunk::NEG_INF_SENTINEL;

/// Default per-token deadline of the external scorer, in microseconds.
pub const DEFAULT_DEADLINE_US: u64 = 2_000;
/// Largest accepted `deadline_us` (1 s): the deadline is time a data-plane worker may block.
pub const MAX_DEADLINE_US: u64 = 1_000_000;
/// Longest reply line accepted from the external scorer, newline included.
pub const MAX_REPLY_BYTES: usize = 4096;
/// Longest socket path: `sun_path` is 108 bytes on Linux, one of them the terminating NUL.
pub const MAX_SOCKET_PATH_BYTES: usize = 107;

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

/// Which scorer feeds the HaltMonitor. Serialized as `"probability"` or
/// `{ unix = PATH, deadline_us = N }` (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ScorerConfig {
    /// The token's probability, `exp(logprob)`.
    #[default]
    Probability,
    /// An external scorer process on a Unix stream socket.
    Unix {
        /// The scorer's listening socket (absolute path).
        path: PathBuf,
        /// Per-token round-trip deadline in microseconds (default [`DEFAULT_DEADLINE_US`]).
        deadline_us: u64,
    },
}

/// A [`ScorerConfig`] that cannot be used. Messages name the config key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScorerConfigError {
    #[error("scorer.deadline_us must be between 1 and {max}, got {value}")]
    DeadlineOutOfRange { value: u64, max: u64 },
    #[error("scorer.unix: socket path {} is not absolute", path.display())]
    RelativePath { path: PathBuf },
    #[error("scorer.unix: socket path {} contains a NUL byte", path.display())]
    NulInPath { path: PathBuf },
    #[error("scorer.unix: socket path {} is {len} bytes long, the limit is {max}", path.display())]
    PathTooLong {
        path: PathBuf,
        len: usize,
        max: usize,
    },
}

impl ScorerConfig {
    /// Checks what the serde representation cannot (see the module docs).
    pub fn validate(self) -> Result<Self, ScorerConfigError> {
        if let ScorerConfig::Unix { path, deadline_us } = &self {
            check_socket_path(path)?;
            if !(1..=MAX_DEADLINE_US).contains(deadline_us) {
                return Err(ScorerConfigError::DeadlineOutOfRange {
                    value: *deadline_us,
                    max: MAX_DEADLINE_US,
                });
            }
        }
        Ok(self)
    }

    /// A scorer for one stream (or one worker: scorers are reusable across turns). The Unix
    /// scorer does not connect here but at [`Scorer::begin_turn`].
    pub fn build(&self) -> Result<Box<dyn Scorer>, ScorerConfigError> {
        Ok(match self {
            ScorerConfig::Probability => Box::new(ProbabilityScorer),
            ScorerConfig::Unix { path, deadline_us } => {
                Box::new(UnixScorer::new(path.clone(), *deadline_us)?)
            }
        })
    }
}

fn check_socket_path(path: &Path) -> Result<(), ScorerConfigError> {
    let bytes = path.as_os_str().as_bytes();
    if !path.is_absolute() {
        return Err(ScorerConfigError::RelativePath { path: path.into() });
    }
    if bytes.contains(&0) {
        return Err(ScorerConfigError::NulInPath { path: path.into() });
    }
    if bytes.len() > MAX_SOCKET_PATH_BYTES {
        return Err(ScorerConfigError::PathTooLong {
            path: path.into(),
            len: bytes.len(),
            max: MAX_SOCKET_PATH_BYTES,
        });
    }
    Ok(())
}

const PROBABILITY: &str = "probability";
const KEY_UNIX: &str = "unix";
const KEY_DEADLINE: &str = "deadline_us";

impl Serialize for ScorerConfig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ScorerConfig::Probability => s.serialize_str(PROBABILITY),
            ScorerConfig::Unix { path, deadline_us } => {
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry(KEY_UNIX, path)?;
                m.serialize_entry(KEY_DEADLINE, deadline_us)?;
                m.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for ScorerConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ConfigVisitor)
    }
}

/// The keys of the `{ unix = .., deadline_us = .. }` form; anything else is refused.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum UnixKey {
    Unix,
    DeadlineUs,
}

struct ConfigVisitor;

impl<'de> de::Visitor<'de> for ConfigVisitor {
    type Value = ScorerConfig;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(r#""probability" or { unix = "/path/to/scorer.sock", deadline_us = N }"#)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<ScorerConfig, E> {
        if v == PROBABILITY {
            Ok(ScorerConfig::Probability)
        } else {
            Err(E::invalid_value(Unexpected::Str(v), &self))
        }
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<ScorerConfig, A::Error> {
        let mut path: Option<PathBuf> = None;
        let mut deadline_us: Option<u64> = None;
        while let Some(key) = map.next_key::<UnixKey>()? {
            match key {
                UnixKey::Unix if path.is_some() => {
                    return Err(de::Error::duplicate_field(KEY_UNIX))
                }
                UnixKey::Unix => path = Some(map.next_value()?),
                UnixKey::DeadlineUs if deadline_us.is_some() => {
                    return Err(de::Error::duplicate_field(KEY_DEADLINE))
                }
                UnixKey::DeadlineUs => deadline_us = Some(map.next_value()?),
            }
        }
        Ok(ScorerConfig::Unix {
            path: path.ok_or_else(|| de::Error::missing_field(KEY_UNIX))?,
            deadline_us: deadline_us.unwrap_or(DEFAULT_DEADLINE_US),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The trait and its errors
// ---------------------------------------------------------------------------------------------

/// Why a token could not be scored. Every variant means "not judged": fail closed.
#[derive(Debug, thiserror::Error)]
pub enum ScorerError {
    /// The probability scorer needs the token's logprob and the source gave none.
    #[error("token {index} has no logprob; the probability scorer needs one")]
    NoLogprob { index: u64 },
    /// The logprob is NaN or positive: not a log-probability.
    #[error("token {index} has logprob {value}, which is not a log-probability")]
    BadLogprob { index: u64, value: f32 },
    /// The external scorer's socket could not be connected (missing, nobody listening,
    /// backlog full, permission).
    #[error("scorer socket {}: cannot connect: {source}", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// No complete reply within the per-token deadline.
    #[error("scorer socket {}: no reply to token {index} within {deadline_us} µs", path.display())]
    Deadline {
        path: PathBuf,
        index: u64,
        deadline_us: u64,
    },
    /// The scorer closed (or reset) the connection.
    #[error("scorer socket {}: connection closed by the scorer at token {index}", path.display())]
    Closed { path: PathBuf, index: u64 },
    /// The reply is not one line of `{"score": <number>}`.
    #[error("scorer socket {}: malformed reply to token {index}: {detail}", path.display())]
    Malformed {
        path: PathBuf,
        index: u64,
        detail: String,
    },
    /// The reply's score is NaN or infinite.
    #[error("scorer socket {}: score {value} for token {index} is not a finite number", path.display())]
    NonFiniteScore {
        path: PathBuf,
        index: u64,
        value: f64,
    },
    /// Any other socket error.
    #[error("scorer socket {}: I/O error at token {index}: {source}", path.display())]
    Io {
        path: PathBuf,
        index: u64,
        #[source]
        source: io::Error,
    },
}

impl ScorerError {
    /// The kind of failure, for code that acts on it (never on the message).
    pub fn kind(&self) -> FailureKind {
        match self {
            ScorerError::NoLogprob { .. } | ScorerError::BadLogprob { .. } => {
                FailureKind::Unscorable
            }
            ScorerError::Connect { .. } | ScorerError::Closed { .. } => {
                FailureKind::ScorerUnreachable
            }
            ScorerError::Deadline { .. } => FailureKind::ScorerTimeout,
            ScorerError::Malformed { .. } | ScorerError::NonFiniteScore { .. } => {
                FailureKind::ScorerBadReply
            }
            ScorerError::Io { .. } => FailureKind::ScorerIo,
        }
    }
}

/// Produces the HaltMonitor's score for each token. Runs on the data plane, per token.
pub trait Scorer: Send + fmt::Debug {
    /// The score of the next token of the current turn.
    fn score(&mut self, tok: &TokenObs<'_>) -> Result<f64, ScorerError>;
    /// A new turn begins (before its first token). The Unix scorer connects here.
    fn begin_turn(&mut self, _turn_id: &str) -> Result<(), ScorerError> {
        Ok(())
    }
    /// The turn is over (however it ended). The Unix scorer closes its connection here;
    /// dropping the scorer does the same.
    fn end_turn(&mut self) {}
}

// ---------------------------------------------------------------------------------------------
// ProbabilityScorer
// ---------------------------------------------------------------------------------------------

/// Scores a token with its probability, `exp(logprob)`, in `[0, 1]` (a logprob of −∞ scores 0).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ProbabilityScorer;

impl Scorer for ProbabilityScorer {
    #[inline]
    fn score(&mut self, tok: &TokenObs<'_>) -> Result<f64, ScorerError> {
        match tok.logprob {
            None => Err(ScorerError::NoLogprob { index: tok.index }),
            Some(lp) if lp.is_nan() || lp > 0.0 => Err(ScorerError::BadLogprob {
                index: tok.index,
                value: lp,
            }),
            Some(lp) => Ok(f64::from(lp).exp()),
        }
    }
}

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
enum Wire {
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
    /// [`ScorerConfig::validate`].
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
fn parse_reply(line: &[u8]) -> Result<f64, Wire> {
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

#[cfg(test)]
mod tests {
    use std::{
        io::{BufRead, BufReader, Write},
        os::unix::net::{UnixListener, UnixStream},
        sync::{
            atomic::{AtomicU32, Ordering},
            mpsc, Arc,
        },
        thread,
    };

    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::*;

    fn tok(index: u64, text: &str, logprob: Option<f32>) -> TokenObs<'_> {
        TokenObs {
            index,
            text,
            logprob,
            now_ns: 0,
        }
    }

    /// A fresh socket path in the temp dir, removed on drop.
    struct SockPath(PathBuf);

    impl SockPath {
        fn new(tag: &str) -> Self {
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!(
                "haltd-scorer-{}-{n}-{tag}.sock",
                std::process::id()
            ));
            let _ = std::fs::remove_file(&p);
            Self(p)
        }
    }

    impl Drop for SockPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// Per request: the parsed request line and the connection; `false` closes it.
    type Handler = dyn Fn(&Value, &mut UnixStream) -> bool + Send + Sync;

    /// A std scorer server on `path`: a thread per connection, `handler` per request line.
    fn serve(path: &Path, handler: Arc<Handler>) {
        let listener = UnixListener::bind(path).expect("bind test socket");
        thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let handler = Arc::clone(&handler);
                thread::spawn(move || {
                    let mut reader = BufReader::new(conn.try_clone().expect("clone stream"));
                    let mut line = String::new();
                    loop {
                        line.clear();
                        match reader.read_line(&mut line) {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                        let req: Value = serde_json::from_str(&line).expect("request is JSON");
                        if !handler(&req, &mut conn) {
                            return;
                        }
                    }
                });
            }
        });
    }

    fn reply(conn: &mut UnixStream, line: &str) -> bool {
        conn.write_all(line.as_bytes()).is_ok()
    }

    fn unix(path: &Path, deadline_us: u64) -> UnixScorer {
        UnixScorer::new(path.to_owned(), deadline_us).expect("valid scorer config")
    }

    // --- ProbabilityScorer ------------------------------------------------------------------

    #[test]
    fn probability_is_exp_logprob() {
        let mut s = ProbabilityScorer;
        s.begin_turn("t").expect("no-op");
        let p = s.score(&tok(0, "a", Some(0.5f32.ln()))).expect("scored");
        assert!((p - 0.5).abs() < 1e-6, "{p}");
        assert_eq!(s.score(&tok(1, "a", Some(0.0))).expect("scored"), 1.0);
        assert_eq!(
            s.score(&tok(2, "a", Some(f32::NEG_INFINITY)))
                .expect("scored"),
            0.0
        );
        assert!(matches!(
            s.score(&tok(3, "a", None)),
            Err(ScorerError::NoLogprob { index: 3 })
        ));
        for bad in [f32::NAN, 0.1, f32::INFINITY] {
            let err = s.score(&tok(4, "a", Some(bad))).expect_err("not a logprob");
            assert!(
                matches!(err, ScorerError::BadLogprob { index: 4, .. }),
                "{err}"
            );
        }
    }

    // --- Configuration ----------------------------------------------------------------------

    #[test]
    fn config_representation() {
        let parse = |v: Value| serde_json::from_value::<ScorerConfig>(v);
        assert_eq!(
            parse(json!("probability")).expect("ok"),
            ScorerConfig::Probability
        );
        assert_eq!(ScorerConfig::default(), ScorerConfig::Probability);
        let unix = ScorerConfig::Unix {
            path: "/run/haltd/scorer.sock".into(),
            deadline_us: DEFAULT_DEADLINE_US,
        };
        assert_eq!(
            parse(json!({"unix": "/run/haltd/scorer.sock"})).expect("ok"),
            unix
        );
        let fast = parse(json!({"deadline_us": 500, "unix": "/s.sock"})).expect("ok");
        assert_eq!(
            fast,
            ScorerConfig::Unix {
                path: "/s.sock".into(),
                deadline_us: 500
            }
        );
        // Serializes to the same shape it reads.
        for c in [ScorerConfig::Probability, unix, fast] {
            let v = serde_json::to_value(&c).expect("serializes");
            assert_eq!(parse(v).expect("round trip"), c);
        }
        assert_eq!(
            serde_json::to_value(ScorerConfig::Unix {
                path: "/a".into(),
                deadline_us: 7
            })
            .expect("serializes"),
            json!({"unix": "/a", "deadline_us": 7})
        );

        let err = |v: Value| parse(v).expect_err("refused").to_string();
        assert!(err(json!("unix")).contains(r#""probability" or { unix"#));
        assert!(err(json!("Probability")).contains("invalid value"));
        assert!(err(json!({"unix": "/s", "deadline": 5})).contains("unknown field `deadline`"));
        assert!(err(json!({"deadline_us": 5})).contains("missing field `unix`"));
        assert!(err(json!({"unix": "/s", "deadline_us": -1})).contains("invalid value"));
        assert!(err(json!({"probability": {}})).contains("unknown field `probability`"));
        assert!(err(json!(3)).contains("expected \"probability\""));
        let dup = serde_json::from_str::<ScorerConfig>(r#"{"unix":"/a","unix":"/b"}"#);
        assert!(dup
            .expect_err("refused")
            .to_string()
            .contains("duplicate field `unix`"));
    }

    #[test]
    fn config_validation() {
        let u = |path: &str, deadline_us| ScorerConfig::Unix {
            path: path.into(),
            deadline_us,
        };
        assert!(ScorerConfig::Probability.validate().is_ok());
        assert!(u("/run/haltd/scorer.sock", 1).validate().is_ok());
        assert!(u("/run/haltd/scorer.sock", MAX_DEADLINE_US)
            .validate()
            .is_ok());
        let long_ok = format!("/{}", "a".repeat(MAX_SOCKET_PATH_BYTES - 1));
        assert!(u(&long_ok, 2000).validate().is_ok());
        let long = format!("/{}", "a".repeat(MAX_SOCKET_PATH_BYTES));

        let cases = [
            (
                u("/s", 0),
                "scorer.deadline_us must be between 1 and 1000000, got 0",
            ),
            (u("/s", MAX_DEADLINE_US + 1), "got 1000001"),
            (u("scorer.sock", 10), "not absolute"),
            (u("/a\0b", 10), "NUL byte"),
            (u(&long, 10), "is 108 bytes long, the limit is 107"),
        ];
        for (cfg, msg) in cases {
            let e = cfg.clone().validate().expect_err("invalid").to_string();
            assert!(e.contains(msg), "{cfg:?}: {e}");
            assert!(cfg.build().is_err());
        }
        let built = u("/run/haltd/scorer.sock", 2000).build().expect("builds");
        assert!(format!("{built:?}").contains("connected: false"));
    }

    // --- UnixScorer --------------------------------------------------------------------------

    #[test]
    fn unix_round_trip() {
        let sock = SockPath::new("rt");
        let (tx, rx) = mpsc::channel();
        serve(
            &sock.0,
            Arc::new(move |req, conn| {
                let _ = tx.send(req.clone());
                let text = req["text"].as_str().unwrap_or_default();
                let score = if text.contains("bad") { 0.0 } else { 0.75 };
                reply(conn, &format!("{{\"score\": {score}}}\r\n"))
            }),
        );
        let mut s = unix(&sock.0, MAX_DEADLINE_US);
        assert!(!s.is_connected());
        s.begin_turn("turn-1").expect("connects");
        assert!(s.is_connected());
        assert_eq!(s.score(&tok(0, "The", Some(-0.5))).expect("scored"), 0.75);
        let odd = " bad \"quoted\"\n\u{1F600}\\";
        assert_eq!(s.score(&tok(1, odd, None)).expect("scored"), 0.0);
        let ninf = tok(2, "x", Some(f32::NEG_INFINITY));
        assert_eq!(s.score(&ninf).expect("scored"), 0.75);
        let req = |turn: &str, index: u64, text: &str, logprob: Value| json!({"turn_id": turn, "index": index, "text": text, "logprob": logprob});
        assert_eq!(rx.recv().ok(), Some(req("turn-1", 0, "The", json!(-0.5))));
        assert_eq!(rx.recv().ok(), Some(req("turn-1", 1, odd, Value::Null)));
        assert_eq!(rx.recv().ok(), Some(req("turn-1", 2, "x", json!(-9999.0))));

        s.end_turn();
        assert!(!s.is_connected());
        s.begin_turn("turn-2").expect("connects");
        assert_eq!(s.score(&tok(0, "a", Some(-1.0))).expect("scored"), 0.75);
        assert_eq!(rx.recv().ok(), Some(req("turn-2", 0, "a", json!(-1.0))));

        // Without begin_turn the first token connects (turn id as last set).
        s.end_turn();
        assert_eq!(s.score(&tok(1, "b", None)).expect("scored"), 0.75);
        assert_eq!(rx.recv().ok(), Some(req("turn-2", 1, "b", Value::Null)));
    }

    #[test]
    fn unix_deadline_bounds_the_wait_and_drops_the_late_reply() {
        const DEADLINE_US: u64 = 20_000;
        const SLACK: Duration = Duration::from_millis(25);
        let sock = SockPath::new("deadline");
        serve(
            &sock.0,
            Arc::new(|req, conn| {
                let index = req["index"].as_u64().unwrap_or_default();
                if index == 0 {
                    thread::sleep(Duration::from_millis(300));
                }
                reply(conn, &format!("{{\"score\":{index}}}\n"))
            }),
        );
        let mut s = unix(&sock.0, DEADLINE_US);
        s.begin_turn("t").expect("connects");
        let start = Instant::now();
        let err = s
            .score(&tok(0, "slow", None))
            .expect_err("misses the deadline");
        let took = start.elapsed();
        assert!(
            matches!(
                err,
                ScorerError::Deadline {
                    index: 0,
                    deadline_us: DEADLINE_US,
                    ..
                }
            ),
            "{err}"
        );
        let deadline = Duration::from_micros(DEADLINE_US);
        assert!(took >= deadline && took < deadline + SLACK, "took {took:?}");
        assert!(
            err.to_string().contains(&*sock.0.to_string_lossy()),
            "{err}"
        );
        assert!(
            !s.is_connected(),
            "a connection that missed a deadline is dropped"
        );
        // The next token gets its own answer on a new connection, not the late one.
        assert_eq!(s.score(&tok(1, "fast", None)).expect("scored"), 1.0);
        assert_eq!(s.score(&tok(2, "fast", None)).expect("scored"), 2.0);
    }

    #[test]
    fn unix_bad_replies() {
        let sock = SockPath::new("bad");
        // The token text is the raw reply; "CLOSE:" sends the rest, then closes.
        serve(
            &sock.0,
            Arc::new(|req, conn| {
                let text = req["text"].as_str().unwrap_or_default();
                match text.strip_prefix("CLOSE:") {
                    Some(rest) => {
                        reply(conn, rest);
                        false
                    }
                    None => reply(conn, text),
                }
            }),
        );
        let mut s = unix(&sock.0, MAX_DEADLINE_US);
        s.begin_turn("t").expect("connects");
        let too_long = "a".repeat(MAX_REPLY_BYTES + 10);
        let cases: [(&str, &str); 14] = [
            ("this is not json\n", "malformed"),
            ("{\"score\":\"0.5\"}\n", "malformed"),
            ("{\"score\":0.5,\"extra\":1}\n", "malformed"),
            ("{}\n", "malformed"),
            ("{\"score\":null}\n", "malformed"),
            ("{\"score\":1e999}\n", "malformed"),
            ("\n", "malformed"),
            ("{\"score\":1}\n{\"score\":1}\n", "more than one line"),
            (&too_long, "no newline within 4096 bytes"),
            ("{\"score\": NaN}\n", "score NaN"),
            ("{\"score\":Infinity}\n", "score inf"),
            ("{ \"score\" : -Infinity }\n", "score -inf"),
            ("CLOSE:{\"score\":", "closed by the scorer"),
            ("CLOSE:", "closed by the scorer"),
        ];
        for (i, (raw, want)) in (0u64..).zip(cases) {
            let err = s.score(&tok(i, raw, None)).expect_err("bad reply");
            let msg = err.to_string();
            assert!(msg.contains(want), "{raw:?}: {msg}");
            assert!(msg.contains(&*sock.0.to_string_lossy()), "{msg}");
            assert!(!s.is_connected());
            // A good reply after a bad one: the scorer recovers on a new connection.
            assert_eq!(
                s.score(&tok(i, "{\"score\":0.5}\n", None)).expect("ok"),
                0.5
            );
        }
        let err = s.score(&tok(0, "CLOSE:", None)).expect_err("closed");
        assert!(matches!(err, ScorerError::Closed { index: 0, .. }), "{err}");
        let err = s
            .score(&tok(0, "{\"score\": NaN}\n", None))
            .expect_err("nan");
        assert!(matches!(err, ScorerError::NonFiniteScore { value, .. } if value.is_nan()));
        let err = s.score(&tok(0, "garbage\n", None)).expect_err("garbage");
        assert!(matches!(err, ScorerError::Malformed { .. }), "{err}");
    }

    #[test]
    fn unix_server_closes_after_one_token() {
        let sock = SockPath::new("close");
        serve(
            &sock.0,
            Arc::new(|req, conn| req["index"] == json!(0) && reply(conn, "{\"score\":1}\n")),
        );
        let mut s = unix(&sock.0, MAX_DEADLINE_US);
        s.begin_turn("t").expect("connects");
        assert_eq!(s.score(&tok(0, "a", None)).expect("scored"), 1.0);
        let err = s.score(&tok(1, "b", None)).expect_err("closed");
        assert!(matches!(err, ScorerError::Closed { index: 1, .. }), "{err}");
    }

    #[test]
    fn unix_connect_failures() {
        // No socket file at all.
        let missing = SockPath::new("missing");
        let mut s = unix(&missing.0, 2000);
        let err = s.begin_turn("t").expect_err("nothing there");
        assert!(
            matches!(&err, ScorerError::Connect { source, .. }
            if source.kind() == io::ErrorKind::NotFound),
            "{err}"
        );
        assert!(err.to_string().contains(&*missing.0.to_string_lossy()));
        assert!(!s.is_connected());

        // A socket file nobody listens on any more: connection refused.
        let stale = SockPath::new("stale");
        drop(UnixListener::bind(&stale.0).expect("bind"));
        let mut s = unix(&stale.0, 2000);
        let err = s.begin_turn("t").expect_err("refused");
        assert!(
            matches!(&err, ScorerError::Connect { source, .. }
            if source.kind() == io::ErrorKind::ConnectionRefused),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains("cannot connect") && msg.contains(&*stale.0.to_string_lossy()));
        // score() without a connection tries to connect and says the same.
        let err = s.score(&tok(0, "a", None)).expect_err("refused");
        assert!(matches!(err, ScorerError::Connect { .. }), "{err}");
    }

    #[test]
    fn errors_are_send_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<ScorerError>();
        check::<ScorerConfigError>();
        fn scorer<T: Scorer>() {}
        scorer::<UnixScorer>();
        scorer::<ProbabilityScorer>();
    }

    proptest! {
        /// Nothing a scorer sends makes parsing panic; what parses is a finite score.
        #[test]
        fn prop_parse_reply_never_panics(line in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(score) = parse_reply(&line) {
                prop_assert!(score.is_finite());
            }
        }

        /// Any finite score survives the wire format.
        #[test]
        fn prop_finite_scores_parse(x in proptest::num::f64::NORMAL | proptest::num::f64::ZERO
                                        | proptest::num::f64::SUBNORMAL) {
            let line = serde_json::to_vec(&json!({"score": x})).expect("serializes");
            let got = parse_reply(&line).map_err(|e| format!("{e:?}"));
            prop_assert_eq!(got, Ok(x));
        }
    }

    /// Per-token cost of a UnixScorer round trip against an immediate std server on this
    /// machine, and of a per-turn connect:
    /// `cargo test -p haltd --release --lib scorer::tests::bench -- --ignored --nocapture`.
    #[test]
    #[ignore = "measurement; run in release with --ignored --nocapture"]
    fn bench_unix_round_trip() {
        let sock = SockPath::new("bench");
        // HALTD_SCORER_SOCKET: measure against that scorer (e.g. the Python one of the module
        // docs) instead of the in-process std server.
        let (path, tokens, turns) = match std::env::var_os("HALTD_SCORER_SOCKET") {
            Some(p) => (PathBuf::from(p), 20_000, 500),
            None => {
                serve(
                    &sock.0,
                    Arc::new(|_, conn| reply(conn, "{\"score\":0.9}\n")),
                );
                (sock.0.clone(), 200_000, 2_000)
            }
        };
        println!("scorer at {}", path.display());
        let mut s = unix(&path, MAX_DEADLINE_US);
        s.begin_turn("chatcmpl-bench-0000000000000000")
            .expect("connects");
        let text = " token";
        for i in 0..1_000 {
            s.score(&tok(i, text, Some(-0.25))).expect("scored");
        }
        let mut ns = Vec::with_capacity(tokens);
        for i in 0..tokens as u64 {
            let t = Instant::now();
            let score = s.score(&tok(i, text, Some(-0.25))).expect("scored");
            ns.push(t.elapsed().as_nanos());
            assert!((0.0..=1.0).contains(&score), "{score}");
        }
        report("round trip per token", &mut ns);

        let mut ns = Vec::with_capacity(turns);
        let mut first = Vec::with_capacity(turns);
        for i in 0..turns {
            let t = Instant::now();
            s.begin_turn(&format!("turn-{i}")).expect("connects");
            ns.push(t.elapsed().as_nanos());
            let t = Instant::now();
            s.score(&tok(0, text, Some(-0.25))).expect("scored");
            first.push(t.elapsed().as_nanos());
        }
        report("begin_turn (connect)", &mut ns);
        report("first token of a turn (server accepts)", &mut first);
    }

    fn report(what: &str, ns: &mut [u128]) {
        ns.sort_unstable();
        let q = |p: f64| {
            let i = ((ns.len() as f64 - 1.0) * p).round() as usize;
            ns[i] as f64 / 1000.0
        };
        let mean = ns.iter().sum::<u128>() as f64 / ns.len() as f64 / 1000.0;
        println!(
            "{what}: n={} mean={mean:.2}µs p50={:.2}µs p90={:.2}µs p99={:.2}µs p99.9={:.2}µs max={:.2}µs",
            ns.len(),
            q(0.5),
            q(0.9),
            q(0.99),
            q(0.999),
            q(1.0)
        );
    }
}
