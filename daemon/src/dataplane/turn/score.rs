//! The observe phase, and a token parked while a detector waits for its score.
//!
//! The detectors judge every token before any of it is released. Most answer at once; the
//! HaltMonitor with an external scorer (`detect/scorer/unix.rs`) needs a round trip over a
//! Unix socket, which may take up to its `deadline_us`. That wait must not hold up the
//! worker's other streams, so it is not a blocking call here: the scorer writes its request,
//! finds no reply yet, and hands back the wait ([`ScoreWait`]: its connection, what to wait
//! for, and the deadline). The token, with what the source produced around it, is parked in
//! the turn ([`Parked`]) and the worker's ring watches the socket: a `POLL_ADD` linked to a
//! `LINK_TIMEOUT` at the deadline. The poll owns the scorer's connection while the kernel has
//! it (`OpBuf::Fd`), so the descriptor cannot be closed under it, as any operation owns its
//! buffer (`op.rs`). Meanwhile the worker serves its other streams; the parked turn takes
//! nothing more from its source. At the completion the connection goes back to the scorer,
//! which reads the reply (or waits again, or fails: a poll cancelled by its timeout is a
//! missed deadline, `DETECTOR_FAILURE` in hard mode as before), the detectors after the
//! HaltMonitor judge the same token in their order, the chunk's next tokens follow, and only
//! then does the pipeline go on to release, encode, account and send.
//!
//! Why the ring and not a scorer thread per worker: the ring already waits on everything
//! else the worker does, so parking a token costs two submissions and no thread, lock,
//! channel or wake-up; and the request is written at once from the worker, where the token
//! is, without a copy to another thread.

use std::{io, os::fd::AsRawFd, os::fd::OwnedFd, time::Instant};

use io_uring::{opcode, squeue, types};
use serde_json::Value;

use crate::dataplane::Step;
use crate::dataplane::{
    driver::op::{OpBuf, OpKind},
    timespec,
    turn::phase::Next,
    turn::Turn,
};
use crate::{
    clock::monotonic_ns,
    detect::{scorer::ScoreWait, scorer::Woke, Step as DetectStep, TokenObs, Trip},
    source::{Produced, Tokens},
    stream::SlotState,
    upstream::UpToken,
};

/// What the source produced, held while its tokens are judged.
#[derive(Debug)]
#[expect(
    clippy::large_enum_variant,
    reason = "a built-in token stays inline, as in `Polled`, so that taking it never allocates; parking moves it into the boxed turn"
)]
pub(in crate::dataplane) enum Item {
    Text(Produced),
    ToolCalls {
        delta: Value,
        tokens: Vec<UpToken>,
        arrived_ns: u64,
    },
}

impl Item {
    /// The `pos`-th observation of the item: its text and logprob. Text without tokens (an
    /// upstream that sent no logprobs) is one observation without a logprob; a tool call
    /// without tokens is none.
    fn observation(&self, pos: usize) -> Option<(&str, Option<f32>)> {
        match self {
            Item::Text(t) => match &t.tokens {
                Tokens::Builtin { logprob, .. } => (pos == 0).then_some((&*t.text, Some(*logprob))),
                Tokens::Upstream(toks) if toks.is_empty() => (pos == 0).then_some((&*t.text, None)),
                Tokens::Upstream(toks) => toks.get(pos).map(|k| (k.text.as_str(), k.logprob)),
            },
            Item::ToolCalls { tokens, .. } => tokens.get(pos).map(|k| (k.text.as_str(), k.logprob)),
        }
    }
}

/// A token waiting for its score: the item it belongs to, its position there, and when the
/// item was taken from the source (the detectors' `now_ns`).
#[derive(Debug)]
pub(in crate::dataplane) struct Parked {
    pub(in crate::dataplane) item: Item,
    pos: usize,
    now: u64,
    /// The scorer's answer, when it came while a send of the connection was in flight:
    /// nothing may be staged then, so the item goes on once that send completed
    /// (`Step::step`, through `resume_answered`).
    answered: Option<Woke>,
}

/// What the detectors say about an item.
#[expect(
    clippy::large_enum_variant,
    reason = "a built-in token stays inline, as in `Polled`, so that taking it never allocates; parking moves it into the boxed turn"
)]
pub(in crate::dataplane) enum Judged {
    /// Every token passed: the item goes on to release.
    Clear(Item),
    Trip(Trip),
    /// A detector waits on its socket and the item is parked in the turn (or there is no
    /// turn to judge it for): nothing goes on now.
    Later,
}

/// What [`observe`] ended with.
#[expect(
    clippy::large_enum_variant,
    reason = "a built-in token stays inline, as in `Polled`, so that taking it never allocates; parking moves it into the boxed turn"
)]
pub(in crate::dataplane) enum Observe {
    Clear(Item),
    Trip(Trip),
    Wait(ScoreWait),
}

/// Observe: the detectors judge the item's tokens from `pos` on (going on after `woke` when
/// one of them waited), until one trips, one waits (the item is parked), or all passed.
pub(in crate::dataplane) fn observe(
    turn: &mut Turn,
    item: Item,
    mut pos: usize,
    mut woke: Option<Woke>,
    now: u64,
) -> Observe {
    let base = turn.tokens_generated;
    let set = &mut turn.gov.set;
    while let Some((text, logprob)) = item.observation(pos) {
        let obs = TokenObs {
            index: base + pos as u64,
            text,
            logprob,
            now_ns: now,
        };
        let step = match woke.take() {
            Some(w) => set.resume(&obs, w, monotonic_ns),
            None => set.begin(&obs, monotonic_ns),
        };
        match step {
            DetectStep::Done(Some(trip)) => return Observe::Trip(trip),
            DetectStep::Done(None) => pos += 1,
            DetectStep::Wait(w) => {
                turn.parked = Some(Parked {
                    item,
                    pos,
                    now,
                    answered: None,
                });
                return Observe::Wait(w);
            }
        }
    }
    Observe::Clear(item)
}

impl Step<'_> {
    /// Observe for an item the source produced (at `now`), or for a parked one whose wait
    /// ended (`woke`). A wait is armed here.
    pub(in crate::dataplane) fn judge(
        &mut self,
        item: Item,
        pos: usize,
        woke: Option<Woke>,
        now: u64,
    ) -> io::Result<Judged> {
        let Some(turn) = self.conn.turn.as_mut() else {
            // No turn (it ended meanwhile): the item is dropped, never released.
            return Ok(Judged::Later);
        };
        let observed = observe(turn, item, pos, woke, now);
        self.publish_timing();
        match observed {
            Observe::Clear(item) => Ok(Judged::Clear(item)),
            Observe::Trip(trip) => Ok(Judged::Trip(trip)),
            Observe::Wait(w) => self.arm_score(w).map(|()| Judged::Later),
        }
    }

    /// Watches the scorer's socket on the ring: a poll for what the scorer waits for, which
    /// owns the connection until it completes, linked to a timeout at the scorer's deadline.
    fn arm_score(&mut self, w: ScoreWait) -> io::Result<()> {
        let left = w.deadline.saturating_duration_since(Instant::now());
        let conn = &mut *self.conn;
        // The deadline's timespec, reused: one comes back with each timeout's completion,
        // which may come after the next token's poll is armed, so two are kept. (A third
        // is allocated only if the kernel is slow to complete both.)
        let mut ts = conn
            .score_ts
            .iter_mut()
            .find_map(Option::take)
            .unwrap_or_else(|| Box::new(timespec(left)));
        *ts = timespec(left);
        let poll = opcode::PollAdd::new(types::Fd(w.fd.as_raw_fd()), w.interest.poll_mask() as u32)
            .build()
            .flags(squeue::Flags::IO_LINK);
        let link = opcode::LinkTimeout::new(&raw const *ts).build();
        let op = self.submit(OpKind::Score, OpBuf::Fd(w.fd), poll)?;
        self.submit(OpKind::ScoreDeadline, OpBuf::Time(ts), link)?;
        self.conn.score_op = Some(op);
        Ok(())
    }

    /// The deadline of a scorer wait completed (it fired, or its poll completed first): its
    /// timespec comes back for the next wait.
    pub(in crate::dataplane) fn on_score_deadline(&mut self, ts: Box<types::Timespec>) {
        let conn = &mut *self.conn;
        if let Some(free) = conn.score_ts.iter_mut().find(|t| t.is_none()) {
            *free = Some(ts);
        }
    }

    /// The scorer's socket is ready, or its deadline passed: the parked token's detectors
    /// go on, and then the pipeline (unless the stream was halted or closed meanwhile, which
    /// drops the token unreleased, and the scorer's connection with it).
    pub(in crate::dataplane) fn on_score(&mut self, res: i32, fd: OwnedFd) -> io::Result<()> {
        let ignore_halt = self.io.shared.cfg.faults.emitter_ignores_halt;
        let conn = &mut *self.conn;
        conn.score_op = None;
        let slot = self.io.shared.table.slot(conn.id.slot);
        if conn.closing
            || (slot.is_tripped() && !(ignore_halt && slot.state() == SlotState::Tripped))
        {
            // The halt (or the close) is under way; the token is never released.
            return Ok(());
        }
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(());
        };
        let Some(parked) = turn.parked.take() else {
            return Ok(());
        };
        let woke = match res {
            0.. => Woke::Ready(fd),
            // Cancelled by its linked timeout: the deadline passed. (A cancellation on close
            // finds the connection closing, above.)
            r if r == -libc::ECANCELED => Woke::TimedOut(fd),
            r => Woke::Failed(fd, io::Error::from_raw_os_error(-r)),
        };
        if !conn.emit.idle() {
            // The token before it is still on its way: the answer waits with the item.
            turn.parked = Some(Parked {
                answered: Some(woke),
                ..parked
            });
            return Ok(());
        }
        self.resume_parked(parked, woke)
    }

    /// A parked item whose scorer answered while a send was in flight goes on, once nothing
    /// is in flight; `false` when there is none to resume.
    pub(in crate::dataplane) fn resume_answered(&mut self) -> io::Result<bool> {
        let conn = &mut *self.conn;
        if !conn.emit.idle() {
            return Ok(false);
        }
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(false);
        };
        if turn.parked.as_ref().is_none_or(|p| p.answered.is_none()) {
            return Ok(false);
        }
        let Some(mut parked) = turn.parked.take() else {
            return Ok(false);
        };
        let Some(woke) = parked.answered.take() else {
            return Ok(false);
        };
        self.resume_parked(parked, woke).map(|()| true)
    }

    /// The parked item's judgment with the scorer's answer, then the rest of its phases.
    fn resume_parked(&mut self, parked: Parked, woke: Woke) -> io::Result<()> {
        let paced = self
            .conn
            .turn
            .as_mut()
            .is_some_and(|t| t.source.get().paced());
        let judged = self.judge(parked.item, parked.pos, Some(woke), parked.now)?;
        match self.judged(judged, parked.now)? {
            Next::Stop => Ok(()),
            Next::Poll if paced => self.paced_next(),
            Next::Poll => self.pump(),
        }
    }
}
