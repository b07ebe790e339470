//! The scorer interface: what the HaltMonitor asks for each token ([`Scorer`]), how that can
//! fail ([`ScorerError`]), the probability scorer, and the limits every scorer setting keeps.

use std::{
    fmt, io,
    os::{fd::OwnedFd, unix::ffi::OsStrExt},
    path::{Path, PathBuf},
    time::Instant,
};

use crate::detect::{FailureKind, TokenObs};

pub use crate::upstream::chunk::NEG_INF_SENTINEL;

/// Default per-token deadline of the external scorer, in microseconds.
pub const DEFAULT_DEADLINE_US: u64 = 2_000;
/// Largest accepted `deadline_us` (1 s): the deadline is time a data-plane worker may block.
pub const MAX_DEADLINE_US: u64 = 1_000_000;
/// Longest reply line accepted from the external scorer, newline included.
pub const MAX_REPLY_BYTES: usize = 4096;
/// Longest socket path: `sun_path` is 108 bytes on Linux, one of them the terminating NUL.
pub const MAX_SOCKET_PATH_BYTES: usize = 107;

/// A [`super::ScorerConfig`] that cannot be used. Messages name the config key.
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

/// The socket path of a Unix scorer: absolute, no NUL, within `sun_path`.
pub(super) fn check_socket_path(path: &Path) -> Result<(), ScorerConfigError> {
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
    /// [`Scorer::resume`] without a wait in progress: a bug of the caller, failed closed.
    #[error("the scorer was resumed with no wait in progress")]
    NotWaiting,
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
            ScorerError::Io { .. } | ScorerError::NotWaiting => FailureKind::ScorerIo,
        }
    }
}

/// What a scorer's socket must become before the score can go on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interest {
    /// The reply (or more of it) can be read.
    Readable,
    /// The rest of the request can be written.
    Writable,
}

impl Interest {
    /// The `poll(2)` event mask.
    pub fn poll_mask(self) -> libc::c_short {
        match self {
            Interest::Readable => libc::POLLIN,
            Interest::Writable => libc::POLLOUT,
        }
    }
}

/// A score that waits on its socket: the scorer's connection, lent to the waiter (who owns
/// it until the wait ends and hands it back through [`Scorer::resume`], so that it stays open
/// for as long as anyone, the kernel included, waits on it), what to wait for, and until when.
#[derive(Debug)]
pub struct ScoreWait {
    pub fd: OwnedFd,
    pub interest: Interest,
    pub deadline: Instant,
}

/// How a [`ScoreWait`] ended; each hands the connection back.
#[derive(Debug)]
pub enum Woke {
    /// The socket is ready (or hung up / in error: the next call says which).
    Ready(OwnedFd),
    /// The deadline passed first.
    TimedOut(OwnedFd),
    /// The wait itself failed.
    Failed(OwnedFd, io::Error),
}

/// A score, or the wait it needs first.
#[derive(Debug)]
pub enum Scored {
    Done(Result<f64, ScorerError>),
    Wait(ScoreWait),
}

/// Produces the HaltMonitor's score for each token. Runs on the data plane, per token.
///
/// Two ways to ask: [`score`](Self::score) blocks until the score is known (tests, tools);
/// the data plane uses [`start`](Self::start) and [`resume`](Self::resume), which never block:
/// a scorer that waits on a socket hands the wait to the caller ([`Scored::Wait`]), whose
/// worker serves its other streams meanwhile and resumes the scorer when the wait ends.
pub trait Scorer: Send + fmt::Debug {
    /// The score of the next token of the current turn, waiting for it if need be.
    fn score(&mut self, tok: &TokenObs<'_>) -> Result<f64, ScorerError>;
    /// Starts scoring the next token without blocking. Scorers that never wait keep the
    /// default, which is [`score`](Self::score).
    fn start(&mut self, tok: &TokenObs<'_>) -> Scored {
        Scored::Done(self.score(tok))
    }
    /// Goes on with the token [`start`](Self::start) began, after its wait ended.
    fn resume(&mut self, woke: Woke) -> Scored {
        drop(woke);
        Scored::Done(Err(ScorerError::NotWaiting))
    }
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
