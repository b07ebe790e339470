//! `--fault panic-after-tokens=N[,thread=worker|watchdog]` (test builds): a real, uncontained
//! panic in a data-plane worker or in the watchdog, to show that the process fails closed.
//!
//! - `thread=worker` (the default): the worker whose stream has handed out its Nth token panics
//!   at that stream's next step (`dataplane/turn/pipeline.rs` `step`, which both the built-in source and
//!   the proxy go through), so the client has at most N tokens.
//! - `thread=watchdog`: the watchdog panics at its first pass after any stream handed out N
//!   tokens (it looks every `--heartbeat-interval-ms`), so a stream has N plus the tokens of at
//!   most one heartbeat interval.
//!
//! "Handed out" is the stream's `tokens_submitted`: token frames given to the kernel (streaming)
//! or tokens held for the body (batch).

use std::sync::atomic::Ordering::SeqCst;

use crate::stream::StreamTable;

/// Which thread the fault panics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PanicThread {
    Worker,
    Watchdog,
}

/// A parsed `panic-after-tokens` fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PanicFault {
    /// N ≥ 1.
    pub after_tokens: u64,
    pub thread: PanicThread,
}

impl PanicFault {
    /// Parses what follows `panic-after-tokens=`: `N` or `N,thread=worker|watchdog`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (n, rest) = spec
            .split_once(',')
            .map_or((spec, None), |(n, r)| (n, Some(r)));
        let after_tokens: u64 = n
            .parse()
            .map_err(|_| format!("N must be a whole number of tokens, not {n:?}"))?;
        if after_tokens == 0 {
            return Err("N must be at least 1".to_owned());
        }
        let thread = match rest {
            None | Some("thread=worker") => PanicThread::Worker,
            Some("thread=watchdog") => PanicThread::Watchdog,
            Some(other) => {
                return Err(format!(
                    "unknown option {other:?} (known: thread=worker, thread=watchdog)"
                ))
            }
        };
        Ok(PanicFault {
            after_tokens,
            thread,
        })
    }
}

/// Worker fault point: panics once the stream being stepped has handed out N tokens
/// (`fault`: the configured `--fault panic-after-tokens`, if any).
#[track_caller]
pub fn worker_step(fault: Option<PanicFault>, tokens_submitted: u64) {
    if let Some(f) = fault {
        if f.thread == PanicThread::Worker && tokens_submitted >= f.after_tokens {
            panic!(
                "fault injection: data-plane worker panics after {tokens_submitted} tokens of a stream (panic-after-tokens={})",
                f.after_tokens
            );
        }
    }
}

/// Watchdog fault point: panics once any open stream of `table` has handed out N tokens.
#[track_caller]
pub fn watchdog_pass(fault: Option<PanicFault>, table: &StreamTable) {
    let Some(f) = fault else {
        return;
    };
    if f.thread != PanicThread::Watchdog {
        return;
    }
    let most = table
        .live()
        .map(|(_, s)| s.tokens_submitted.load(SeqCst))
        .max()
        .unwrap_or(0);
    if most >= f.after_tokens {
        panic!(
            "fault injection: the watchdog panics, a stream has {most} tokens (panic-after-tokens={},thread=watchdog)",
            f.after_tokens
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_n_and_the_thread() {
        let w = |n, thread| {
            Ok(PanicFault {
                after_tokens: n,
                thread,
            })
        };
        assert_eq!(PanicFault::parse("7"), w(7, PanicThread::Worker));
        assert_eq!(
            PanicFault::parse("7,thread=worker"),
            w(7, PanicThread::Worker)
        );
        assert_eq!(
            PanicFault::parse("30,thread=watchdog"),
            w(30, PanicThread::Watchdog)
        );
        for bad in [
            "",
            "0",
            "-1",
            "x",
            "5,thread=admin",
            "5,",
            "5,thread=watchdog,x",
        ] {
            assert!(PanicFault::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_worker_point_panics_at_n_and_not_before() {
        let fault = Some(PanicFault {
            after_tokens: 3,
            thread: PanicThread::Worker,
        });
        worker_step(fault, 2);
        worker_step(None, 1000);
        let watchdog_only = Some(PanicFault {
            after_tokens: 3,
            thread: PanicThread::Watchdog,
        });
        worker_step(watchdog_only, 1000);
        let r = crate::crash::containment::contain(|| worker_step(fault, 3));
        let msg = r.expect_err("panics at N");
        let msg = msg.downcast_ref::<String>().expect("a formatted message");
        assert!(msg.contains("after 3 tokens"), "{msg}");
    }
}
