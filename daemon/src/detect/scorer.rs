//! Scorers: where the HaltMonitor's per-token score comes from (spec 001; issue 4).
//!
//! The [`HaltMonitor`](crate::monitor::HaltMonitor) compares one score per token with its
//! `hard_limit`. A [`Scorer`] produces that score on the data-plane worker that handles the
//! stream, before the token is accounted or sent:
//!
//! * [`ProbabilityScorer`] (`scorer = "probability"`, the default): the token's probability
//!   under the model, `exp(logprob)`, in `[0, 1]`. A token without a logprob is an error
//!   ([`ScorerError::NoLogprob`]), never a silent pass.
//! * [`UnixScorer`] (`scorer = { unix = "/run/haltd/scorer.sock", deadline_us = 2000 }`): an
//!   external process of the operator's, reached over a Unix stream socket, that must answer
//!   each token within `deadline_us` microseconds.
//!
//! A scorer that must wait for its socket does not block the worker: [`Scorer::start`] hands
//! the wait back ([`Scored::Wait`]: the connection, lent to the waiter, what to wait for, and
//! the deadline), the worker parks the token and polls the socket on its io_uring ring
//! (`dataplane/turn/score.rs`) while it serves its other streams, and [`Scorer::resume`] goes on
//! when the socket is ready or the deadline passed. [`Scorer::score`] is the same round trip
//! waiting on the calling thread (tests, tools).
//!
//! Any [`ScorerError`] means the token could not be judged; the caller turns it into a
//! `DETECTOR_FAILURE` trip in hard mode (fail closed, G3 in docs/spec.md). No scorer panics on any
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
//! microseconds may pass, else [`ScorerError::Deadline`]. The socket is non-blocking; on the
//! data plane the wait is an io_uring poll linked to a timeout at the deadline, so **a stuck
//! or slow scorer holds up only its own stream**, for at most the deadline per token (plus
//! scheduling jitter, tens of µs), and then trips it; the worker's other streams go on
//! meanwhile. A connection queued in the listener's backlog counts as connected: the
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

mod config;
mod score;
mod unix;

pub use config::ScorerConfig;
pub use score::{
    Interest, ProbabilityScorer, ScoreWait, Scored, Scorer, ScorerConfigError, ScorerError, Woke,
    DEFAULT_DEADLINE_US, MAX_DEADLINE_US, MAX_REPLY_BYTES, MAX_SOCKET_PATH_BYTES, NEG_INF_SENTINEL,
};
pub use unix::UnixScorer;

#[cfg(test)]
mod tests;
