//! Pause, ground, rewind, resume (spec 003, the intervention; issue 16 points 3 and 4).
//!
//! When the surprise detector runs in `intervene` mode and its rolling surprise breaches,
//! the turn is **parked** (like a token waiting for its score, `score.rs`: `pump` takes
//! nothing more from its source) and a grounding round runs on the worker's **grounding
//! thread** ([`GroundRunner`], started at the worker's first round): it calls the blocking
//! [`crate::grounding::Grounder::ground`] under the round's deadline, sends the answer back
//! on a channel and rings the worker's eventfd, as the ledger writer does for a record on
//! disk (`record.rs`). The worker serves its other streams meanwhile. On the wake-up
//! (`driver/wake.rs` `take_grounded`, after the trip scan, so a halt is always seen first) the
//! round's answer is applied:
//!
//! - evidence found: the held tokens are dropped from the window start (none of them was
//!   sent: `holdback.rs`), the exfiltration scanner starts over on the kept text it had not
//!   released, and the source continues from the kept prefix with the evidence in context
//!   (built-in: it reads the evidence, then samples on, `source/resume.rs`; an upstream with continuation: the request re-issued,
//!   `ground/continuation.rs`). The client's text is the kept prefix plus the resumed text.
//! - nothing found, or past the deadline: the turn goes on unmodified, held tokens and all.
//!
//! **A halt wins over grounding.** A trip (detector, admin, watchdog) while a round runs
//! halts the turn as any other (`driver/wake.rs` `scan_tripped`, `Step::halt`), within B: parked, the turn
//! sent nothing after the breach, and held text is never sent after a trip. The round is
//! cancelled (its flag is set, so a round not started yet never runs, and a late answer
//! finds no turn waiting for it) and recorded as `cancelled`. At most `max_rounds` rounds
//! per reply; each appends a convergence record to the turn's record (`record.rs`).
//!
//! Why a thread and not the ring: the arms block (a full-text index, an evaluator, DNS and
//! HTTP to a search endpoint), and the [`crate::grounding::Grounder`] trait is blocking by
//! design; one thread per worker that grounds keeps rounds of one worker in order and costs
//! nothing for workers that never ground.

pub(in crate::dataplane) mod continuation;
pub(in crate::dataplane) mod post_hoc;
pub(in crate::dataplane) mod state;

use std::{
    io,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    time::{Duration, Instant},
};

use serde_json::{json, Value};

use crate::dataplane::ground::state::Waiting;
use crate::dataplane::turn;
use crate::dataplane::turn::hold;
use crate::dataplane::Step;
use crate::dataplane::{turn::Turn, ConnTag, Io};
use crate::{
    detect::{pipeline::Gate, Trip},
    grounding::{
        plan::{GroundPlan, RoundOutcome, RoundRecord},
        ArmOutcome, Round, SpanQuery,
    },
    halt::HaltCore,
};

/// A round for the grounding thread.
struct Job {
    tag: ConnTag,
    query: SpanQuery,
    deadline: Instant,
    cancel: Arc<AtomicBool>,
}

/// A round's answer, back on the worker. `round` is `None` when it was cancelled first.
pub(in crate::dataplane) struct Done {
    tag: ConnTag,
    round: Option<Round>,
}

impl Done {
    /// The connection the round was for.
    pub(in crate::dataplane) fn tag(&self) -> ConnTag {
        self.tag
    }
}

impl Io {
    /// The rounds that answered since the last look (none before the first round).
    pub(in crate::dataplane) fn grounding_answers(&self) -> Vec<Done> {
        self.grounding
            .as_ref()
            .map(|r| r.done.try_iter().collect())
            .unwrap_or_default()
    }
}

/// A worker's grounding thread and the channels to it.
pub(in crate::dataplane) struct GroundRunner {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<Done>,
}

impl GroundRunner {
    /// Starts the thread (`haltd-ground-N`), which wakes worker `id` with each answer.
    fn start(
        plan: &GroundPlan,
        id: u32,
        waker: Option<Arc<std::os::fd::OwnedFd>>,
    ) -> io::Result<Self> {
        let (jobs, jobs_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel();
        let grounder = Arc::clone(&plan.grounder);
        std::thread::Builder::new()
            .name(format!("haltd-ground-{id}"))
            .spawn(move || {
                for job in jobs_rx {
                    let round = (!job.cancel.load(Ordering::Acquire))
                        .then(|| grounder.ground(&job.query, job.deadline));
                    let answer = Done {
                        tag: job.tag,
                        round,
                    };
                    if done_tx.send(answer).is_err() {
                        return;
                    }
                    if let Some(w) = &waker {
                        crate::halt::wake_fd(w);
                    }
                }
            })?;
        Ok(GroundRunner { jobs, done })
    }
}

/// Text of the hold queue's content entries between byte offsets `from` and `to` of the
/// turn's scanned text; `None` when a tool call lies there (a span with a tool call in it is
/// not rewound).
pub(in crate::dataplane) fn queued_text(turn: &Turn, from: usize, to: usize) -> Option<String> {
    let mut out = String::new();
    for p in &turn.hold.queue {
        let start = p.end - (p.text.len() - p.pos);
        if p.end <= from || start >= to {
            continue;
        }
        if matches!(p.kind, hold::PendingKind::ToolCall { .. }) {
            return None;
        }
        let a = from.saturating_sub(start) + p.pos;
        let b = p.text.len() - p.end.saturating_sub(to);
        out.push_str(p.text.get(a..b)?);
    }
    Some(out)
}

/// Where a grounding round's rewind takes the turn back to: the start of its hold-back window
/// (a text offset), and how many queued tokens lie past it. `None` when it cannot be rewound:
/// no window, or a tool call in the text the window holds.
pub(in crate::dataplane) fn rewind_point(turn: &Turn) -> Option<(usize, usize)> {
    let keep = turn.hold.back.as_ref().map(|b| b.start())?;
    queued_text(turn, keep, turn.hold.scanned)?;
    let dropped = turn.hold.queue.iter().filter(|p| p.end > keep).count();
    Some((keep, dropped))
}

/// The turn taken back to `keep` (`rewind_point`) once its source resumed from there: the
/// queued entries past it dropped, its text length and token count taken back, the scanner
/// restarted on the kept text it had not released (it saw the dropped text too), the
/// detectors' window cleared. A trip of that rescan comes back as `Err`.
pub(in crate::dataplane) fn apply_rewind(turn: &mut Turn, keep: usize) -> Result<(), Trip> {
    let released = turn.hold.released.min(keep);
    let unreleased = queued_text(turn, released, keep).unwrap_or_default();
    if let Some(b) = turn.hold.back.as_mut() {
        b.rewind();
    }
    let dropped = turn.hold.rewind(keep);
    turn.text_len = dropped.first().map_or(turn.text_len, |p| p.offset);
    turn.trail.rewind(turn.text_len);
    turn.tokens_generated = turn.tokens_generated.saturating_sub(dropped.len() as u64);
    turn.hold.scanned = released;
    let rescan = turn.gov.rewound(&unreleased);
    turn.hold.scanned = keep;
    match rescan {
        Gate::Release(n) => {
            turn.hold.release(n);
            Ok(())
        }
        Gate::Trip(trip) => Err(trip),
    }
}

/// What a round's answer means for the turn.
fn outcome_of(round: &Round, took: Duration, deadline: Duration) -> RoundOutcome {
    if took > deadline
        || (!round.attempts.is_empty()
            && round.snippets.is_empty()
            && round
                .attempts
                .iter()
                .all(|a| matches!(a.outcome, ArmOutcome::Timeout | ArmOutcome::Skipped))
            && round
                .attempts
                .iter()
                .any(|a| a.outcome == ArmOutcome::Timeout))
    {
        RoundOutcome::Timeout
    } else if round.snippets.is_empty() {
        RoundOutcome::Empty
    } else {
        RoundOutcome::Rewound
    }
}

impl Step<'_> {
    /// One round's answer: applied to the turn still waiting for it, then the turn goes on.
    pub(in crate::dataplane) fn grounded(&mut self, done: Done) -> io::Result<()> {
        let Some(plan) = self.io.shared.grounding.clone() else {
            return Ok(());
        };
        let conn = &mut *self.conn;
        let slot = self.io.shared.table.slot(conn.id.slot);
        if conn.closing || slot.is_tripped() {
            return Ok(());
        }
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(());
        };
        let Some(g) = turn.grounding.as_mut() else {
            return Ok(());
        };
        let Some(w) = g.waiting.take() else {
            return Ok(());
        };
        let took = w.started.elapsed();
        let Some(round) = done.round else {
            g.records.push(RoundRecord::without_result(
                &w.span,
                took,
                RoundOutcome::Cancelled,
            ));
            return self.step();
        };
        let mut outcome = outcome_of(&round, took, plan.round_deadline);
        if g.post_hoc && outcome == RoundOutcome::Rewound {
            // Nothing to rewind: the evidence goes after the reply.
            outcome = RoundOutcome::Annotated;
            g.annotation = Some(post_hoc::annotation(&round));
        }
        let mut rec = RoundRecord::of(&w.span, &round, took, outcome);
        if outcome == RoundOutcome::Rewound {
            match self.rewind(&round)? {
                Some((dropped, kept)) => {
                    rec.rewound_tokens = dropped;
                    rec.kept_bytes = kept;
                }
                // A trip while rescanning, or a span that cannot be rewound.
                None => rec.outcome = RoundOutcome::Empty,
            }
        }
        if let Some(g) = self.conn.turn.as_mut().and_then(|t| t.grounding.as_mut()) {
            g.records.push(rec);
        }
        // A proxied turn's continuation goes out once its old socket is idle.
        self.maybe_reissue()?;
        self.step()
    }
}

impl Step<'_> {
    /// After a text item went into the hold queue: an intervene-mode breach pauses the turn
    /// for a grounding round (`Next::Stop`), unless it had its rounds already.
    pub(in crate::dataplane) fn maybe_ground(&mut self) -> io::Result<bool> {
        let conn = &mut *self.conn;
        if conn.closing {
            // The release phase closed it (a trip, a failed send): no round for it.
            return Ok(false);
        }
        // Per token: two branches unless a breach asks for a round.
        let Some(turn) = conn.turn.as_mut().filter(|t| t.grounding.is_some()) else {
            return Ok(false);
        };
        let Some(intervention) = turn.gov.set.take_intervention() else {
            return Ok(false);
        };
        let Some(max_rounds) = self.io.shared.grounding.as_ref().map(|p| p.max_rounds) else {
            return Ok(false);
        };
        let (Some(g), Some(back)) = (turn.grounding.as_mut(), turn.hold.back.as_ref()) else {
            return Ok(false);
        };
        if g.post_hoc {
            // No continuation: the span is grounded after the reply (`ground/post_hoc.rs`).
            post_hoc::note_span(turn);
            return Ok(false);
        }
        if g.rounds >= max_rounds || g.waiting.is_some() || back.held() == 0 {
            return Ok(false);
        }
        let start = back.start();
        let (Some(span), Some(kept)) = (
            queued_text(turn, start, turn.hold.scanned),
            queued_text(turn, 0, start),
        ) else {
            return Ok(false);
        };
        let mut context = turn.out_text.clone();
        context.push_str(&kept);
        tracing::debug!(stream = %conn.id, detail = %intervention.detail, "grounding round");
        self.start_round(span, context)?;
        Ok(true)
    }

    /// Parks the turn and hands a round about `span` to the worker's grounding thread.
    pub(in crate::dataplane) fn start_round(
        &mut self,
        span: String,
        context: String,
    ) -> io::Result<()> {
        let Some(plan) = self.io.shared.grounding.clone() else {
            return Ok(());
        };
        let tag = self.tag();
        let conn = &mut *self.conn;
        let Some(g) = conn.turn.as_mut().and_then(|t| t.grounding.as_mut()) else {
            return Ok(());
        };
        let cancel = Arc::new(AtomicBool::new(false));
        g.rounds += 1;
        let query = SpanQuery {
            span: span.clone(),
            context,
            prompt: g.prompt.clone(),
        };
        g.waiting = Some(Waiting {
            cancel: Arc::clone(&cancel),
            span,
            started: Instant::now(),
        });
        if self.io.grounding.is_none() {
            let waker = self.io.shared.waker(self.io.id);
            self.io.grounding = Some(GroundRunner::start(&plan, self.io.id, waker)?);
        }
        let job = Job {
            tag,
            query,
            deadline: Instant::now() + plan.round_deadline,
            cancel,
        };
        if let Some(r) = &self.io.grounding {
            // The thread only ends with the worker: a send cannot fail while it runs.
            let _ = r.jobs.send(job);
        }
        Ok(())
    }

    /// Drops the held tokens from the window start and resumes the source from the kept
    /// prefix with the round's evidence: `(tokens dropped, bytes kept)`, or `None` when the
    /// turn cannot be rewound (it stays as it was) or tripped.
    fn rewind(&mut self, round: &Round) -> io::Result<Option<(usize, usize)>> {
        let Some((keep, dropped)) = self.conn.turn.as_deref().and_then(rewind_point) else {
            return Ok(None);
        };
        if !self.resume_source(dropped, round) {
            return Ok(None);
        }
        let Some(turn) = self.conn.turn.as_mut() else {
            return Ok(None);
        };
        match apply_rewind(turn, keep) {
            Ok(()) => Ok(Some((dropped, keep))),
            Err(trip) => {
                self.detector_trip(trip)?;
                Ok(None)
            }
        }
    }

    /// The source continues from the kept prefix with `round`'s evidence in context.
    fn resume_source(&mut self, dropped: usize, round: &Round) -> bool {
        let Some(turn) = self.conn.turn.as_mut() else {
            return false;
        };
        match &mut turn.source {
            turn::TurnSource::Builtin(b) => b.resume(dropped, &round.snippets),
            turn::TurnSource::Upstream(_) => self.resume_upstream(dropped, round),
            // A fixed answer has nothing to resume (and is never grounded: `ask_first.rs`).
            turn::TurnSource::Fixed(_) => false,
        }
    }
}

/// The grounding part of an intervene-mode turn's record (spec 003: "Threshold, window, and
/// arm-order live in config, logged in every receipt"): what was in force, one convergence
/// record per round, and, for a stream without logprobs, that nothing was changed. The
/// claims (span text) only with `--record-token-text`.
pub(in crate::dataplane) fn receipt(
    shared: &HaltCore,
    turn: &Turn,
    record_text: bool,
) -> Option<Value> {
    if !turn.gov.set.intervenes() {
        return None;
    }
    let s = &turn.detectors.cfg.surprise;
    let summary = turn.gov.summary();
    let scored = summary
        .pointer("/surprise/summary/tokens_scored")
        .and_then(Value::as_u64);
    let unscored = summary
        .pointer("/surprise/summary/unscored")
        .and_then(Value::as_u64);
    let no_logprobs = scored == Some(0) && unscored.unwrap_or(0) > 0;
    let rounds: Vec<Value> = turn
        .grounding
        .iter()
        .flat_map(|g| &g.records)
        .map(|r| {
            let mut r = r.clone();
            if !record_text {
                r.claim = None;
            }
            serde_json::to_value(r).unwrap_or(Value::Null)
        })
        .collect();
    let plan = shared.grounding.as_ref();
    let mut v = json!({
        "threshold_bits": s.cfg.threshold_bits,
        "statistic": s.cfg.statistic.as_str(),
        "window": s.cfg.window,
        "hold_back": turn.hold.back.as_ref().map(|_| s.cfg.effective_hold_back()),
        "debounce": s.policy.debounce,
        "arm_order": plan.map(|p| json!({
            "computable": p.order_computable,
            "entity_shaped": p.order_other,
            "other": p.order_other,
        })),
        "max_rounds": plan.map(|p| p.max_rounds),
        "round_deadline_ms": plan.map(|p| p.round_deadline.as_millis() as u64),
        "continuation": plan.map(|p| p.continuation.as_str()),
        "rounds": rounds,
    });
    if no_logprobs {
        v["no_logprobs"] = json!(true);
        v["note"] = json!("the stream has no logprobs: surprise cannot be scored, nothing was held or grounded (spec 003 no-op)");
    } else if plan.is_none() {
        v["note"] = json!("no grounder configured: breaches are recorded only");
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grounding::{ArmKind, Attempt, Snippet, SpanClass};

    fn round(outcomes: &[ArmOutcome], snippets: usize) -> Round {
        Round {
            class: SpanClass::Other,
            attempts: outcomes
                .iter()
                .map(|&outcome| Attempt {
                    arm: ArmKind::Memory,
                    outcome,
                    took_ms: 1,
                    detail: String::new(),
                })
                .collect(),
            snippets: (0..snippets)
                .map(|_| Snippet {
                    claim: "c".into(),
                    evidence: "e".into(),
                    confidence: 0.5,
                    source: "s".into(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_round_rewinds_only_with_evidence_in_time() {
        let ms = Duration::from_millis;
        let grounded = round(&[ArmOutcome::Empty, ArmOutcome::Grounded], 1);
        assert_eq!(outcome_of(&grounded, ms(5), ms(100)), RoundOutcome::Rewound);
        assert_eq!(
            outcome_of(&grounded, ms(101), ms(100)),
            RoundOutcome::Timeout,
            "an answer past the round's deadline is not used"
        );
        let nothing = round(&[ArmOutcome::Empty, ArmOutcome::Failed], 0);
        assert_eq!(outcome_of(&nothing, ms(5), ms(100)), RoundOutcome::Empty);
        let timed_out = round(&[ArmOutcome::Skipped, ArmOutcome::Timeout], 0);
        assert_eq!(
            outcome_of(&timed_out, ms(5), ms(100)),
            RoundOutcome::Timeout
        );
        let skipped = round(&[ArmOutcome::Skipped], 0);
        assert_eq!(outcome_of(&skipped, ms(5), ms(100)), RoundOutcome::Empty);
    }
}

#[cfg(test)]
mod rewind_tests;
