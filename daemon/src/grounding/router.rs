//! The router: classifies the span, tries the arms in the class's order, stops at the first
//! that grounds it, and records every attempt (spec 003, "Arbitration").
//!
//! Deadlines. Each arm runs on a thread of its own and the router waits for its answer on a
//! channel with a timeout: the arm's deadline, or the round's if that comes first. When it
//! fires the attempt is a [`ArmOutcome::Timeout`] and the router moves on; the arm's thread is
//! left to finish and its late answer is dropped (the channel's receiver is gone, so its send
//! fails and nothing reads it). Waiting rather than asking the arm to stop is what makes the
//! deadline hard: an arm blocked in the kernel (a read, a connect, or name resolution in
//! `getaddrinfo`, which no socket timeout covers and which cannot be cancelled) cannot be
//! stopped from outside, only stopped waiting for. Arms set their own I/O timeouts from the
//! same deadline, so a late thread ends soon after it; at most [`MAX_LATE_ARMS`] may still
//! be running at once, past that an arm fails at once instead of starting another thread.
//!
//! A round's deadline is the earlier of the caller's and `round_deadline_ms` from its
//! start; arms the order still lists once it has passed are recorded as timeouts that took
//! no time.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        mpsc, Arc,
    },
    time::{Duration, Instant},
};

use super::arm::{Arm, ArmError};
use super::classify::{classify, focus};
use super::{ArmKind, ArmOutcome, Attempt, Grounder, Round, Snippet, SpanClass, SpanQuery};
use crate::grounding::metrics::GroundingMetrics;

/// Most arm threads still running past their deadline at once.
pub const MAX_LATE_ARMS: usize = 8;

/// The arms, by kind (`None`: not configured, skipped).
#[derive(Default)]
pub struct Arms {
    pub memory: Option<Arc<dyn Arm>>,
    pub tool: Option<Arc<dyn Arm>>,
    pub web: Option<Arc<dyn Arm>>,
}

impl std::fmt::Debug for Arms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arms")
            .field("memory", &self.memory.is_some())
            .field("tool", &self.tool.is_some())
            .field("web", &self.web.is_some())
            .finish()
    }
}

impl Arms {
    fn get(&self, kind: ArmKind) -> Option<&Arc<dyn Arm>> {
        match kind {
            ArmKind::Memory => self.memory.as_ref(),
            ArmKind::Tool => self.tool.as_ref(),
            ArmKind::Web => self.web.as_ref(),
        }
    }
}

/// The router's settings.
#[derive(Debug, Clone)]
pub struct Policy {
    pub arm_deadline: Duration,
    pub round_deadline: Duration,
    pub order_computable: Vec<ArmKind>,
    pub order_other: Vec<ArmKind>,
}

impl Policy {
    /// The arm order for a class.
    pub fn order(&self, class: SpanClass) -> &[ArmKind] {
        match class {
            SpanClass::Computable => &self.order_computable,
            SpanClass::EntityShaped | SpanClass::Other => &self.order_other,
        }
    }
}

/// The [`Grounder`] of haltd.
pub struct Router {
    arms: Arms,
    policy: Policy,
    metrics: Option<GroundingMetrics>,
    /// Arm threads running now (including ones past their deadline).
    running: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("arms", &self.arms)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// Decrements the running count when an arm's thread ends, however it ends.
struct RunningGuard(Arc<AtomicUsize>);

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One arm's answer, as the router reads it.
struct Answer {
    outcome: ArmOutcome,
    snippets: Vec<Snippet>,
    detail: String,
}

impl Answer {
    fn of(outcome: ArmOutcome, detail: impl Into<String>) -> Self {
        Answer {
            outcome,
            snippets: Vec::new(),
            detail: detail.into(),
        }
    }
}

impl Router {
    pub fn new(arms: Arms, policy: Policy, metrics: Option<GroundingMetrics>) -> Self {
        Router {
            arms,
            policy,
            metrics,
            running: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Arm threads running now (tests: a late one ends).
    pub fn running_arms(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }

    /// Runs `arm` on its own thread; its answer, or a timeout at `deadline`.
    fn run(
        &self,
        arm: &Arc<dyn Arm>,
        query: &Arc<SpanQuery>,
        class: SpanClass,
        deadline: Instant,
    ) -> Answer {
        if self.running.fetch_add(1, Ordering::AcqRel) >= MAX_LATE_ARMS {
            self.running.fetch_sub(1, Ordering::AcqRel);
            return Answer::of(
                ArmOutcome::Failed,
                format!("{MAX_LATE_ARMS} arms of earlier rounds are still running"),
            );
        }
        let guard = RunningGuard(Arc::clone(&self.running));
        let (tx, rx) = mpsc::sync_channel::<Result<Vec<Snippet>, ArmError>>(1);
        let (arm2, query2) = (Arc::clone(arm), Arc::clone(query));
        let spawned = std::thread::Builder::new()
            .name(format!("haltd-ground-{:?}", arm.kind()).to_lowercase())
            .spawn(move || {
                let _guard = guard;
                // The receiver is gone when the deadline fired first: the answer is dropped.
                let _ = tx.send(arm2.search(&query2, class, deadline));
            });
        if let Err(e) = spawned {
            return Answer::of(
                ArmOutcome::Failed,
                format!("starting the arm's thread: {e}"),
            );
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok(Ok(snippets)) if snippets.is_empty() => Answer::of(ArmOutcome::Empty, ""),
            Ok(Ok(snippets)) => Answer {
                outcome: ArmOutcome::Grounded,
                snippets,
                detail: String::new(),
            },
            Ok(Err(e)) => Answer::of(ArmOutcome::Failed, e.to_string()),
            Err(mpsc::RecvTimeoutError::Timeout) => Answer::of(
                ArmOutcome::Timeout,
                format!("no answer within {} ms", wait.as_millis()),
            ),
            Err(mpsc::RecvTimeoutError::Disconnected) => Answer::of(
                ArmOutcome::Failed,
                "the arm's thread ended without an answer",
            ),
        }
    }

    fn record(&self, attempt: &Attempt, took: Duration) {
        if let Some(m) = &self.metrics {
            m.attempt(attempt.arm, attempt.outcome, took);
        }
    }
}

impl Grounder for Router {
    fn ground(&self, query: &SpanQuery, deadline: Instant) -> Round {
        let start = Instant::now();
        let round_deadline = deadline.min(start + self.policy.round_deadline);
        let class = classify(&focus(query));
        let query = Arc::new(query.clone());
        let mut round = Round {
            class,
            attempts: Vec::new(),
            snippets: Vec::new(),
        };
        for &kind in self.policy.order(class) {
            let began = Instant::now();
            let answer = match self.arms.get(kind) {
                None => Answer::of(ArmOutcome::Skipped, "not configured"),
                Some(_) if began >= round_deadline => {
                    Answer::of(ArmOutcome::Timeout, "the round's deadline had passed")
                }
                Some(arm) => {
                    let arm_deadline = round_deadline.min(began + self.policy.arm_deadline);
                    self.run(arm, &query, class, arm_deadline)
                }
            };
            let took = began.elapsed();
            let attempt = Attempt {
                arm: kind,
                outcome: answer.outcome,
                took_ms: u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
                detail: answer.detail,
            };
            self.record(&attempt, took);
            round.attempts.push(attempt);
            if answer.outcome == ArmOutcome::Grounded {
                round.snippets = answer.snippets;
                break;
            }
        }
        let outcomes: Vec<(ArmKind, ArmOutcome)> =
            round.attempts.iter().map(|a| (a.arm, a.outcome)).collect();
        tracing::info!(
            class = ?round.class,
            order = ?self.policy.order(class),
            outcomes = ?outcomes,
            snippets = round.snippets.len(),
            took_ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
            "grounding round"
        );
        round
    }
}

#[cfg(test)]
mod tests;
