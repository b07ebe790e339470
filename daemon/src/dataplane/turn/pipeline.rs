//! The turn pipeline: the one per-token path, for every [`crate::source::TokenSource`].
//!
//! [`Step::step`] runs whenever a turn can make progress (its pacing timer fired, its last
//! frame was sent, its upstream delivered): the heartbeat and trip checks, then
//! [`Step::pump`], which takes what the source produced through the named phases:
//!
//! 1. **observe**: the detectors judge every token before any of its text is accounted or
//!    sent ([`observe`]); a failing token is never emitted (spec 001).
//! 2. **release**: the exfiltration scanner sees the text and says how much of the turn's
//!    text may go out; what it holds waits in the hold queue (`hold.rs`), and a frame it
//!    released earlier goes out before anything new. While it holds text, a source that
//!    already has its next token ([`crate::source::TokenSource::peek`]: the built-in model)
//!    lets the scanner look at it ([`look_ahead`]): held text that the next token rules out
//!    goes out with this token instead of one token later.
//! 3. **encode**: one SSE event per token (`encode.rs`), straight from the source when
//!    nothing is held; a batch turn keeps the tokens for its one final frame. Tokens the
//!    upstream delivered together are staged: their events share one frame ([`may_stage`]).
//! 4. **account**: the slot counts the frame and its tokens before it is sent
//!    (`Slot::begin_frame`, in the trip's frame window: a trip that came first stops it); the
//!    kernel gate counts the same frames.
//! 5. **send**: one send per frame (`send.rs`).
//!
//! At the end of the text the detectors and the scanner have their last word, the held frames
//! drain, SafetyCheck judges the turn, and the final frame goes out ([`Step::finish_with`]).

use std::{io, sync::atomic::Ordering::SeqCst, sync::Arc};

use serde_json::Value;

use crate::dataplane::turn::own_trip;
use crate::dataplane::Step;
use crate::dataplane::{
    conn::KeepAlive,
    conn::{
        outbox::{frame, SendKind, STAGE_MAX},
        Conn,
    },
    driver::op::{OpBuf, OpKind},
    timespec,
    turn::encode::{encode_pending, encode_token, hold_for_batch, owned_top},
    turn::hold::Pending,
    turn::phase::{next_phase, Next, Phase},
    turn::score::{Item, Judged},
    turn::Turn,
};
use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    config::Faults,
    detect::{exfil::Ahead, pipeline::Gate, DetectorId, Trip, TripKind},
    source::{upstream::count_suppressed, Peek, Polled, Produced, SourceFailure, Tokens},
    stream::{Mode, Slot, SlotState},
    upstream::{framing, framing::Split, UpToken, UpstreamFailureKind},
    wire::http,
};

/// What releasing observed text asks of the driver.
enum Released {
    /// Nothing to send yet (held, staged or kept for a batch): take the next.
    Poll,
    /// The frame buffer holds the text's event: account and send it.
    Send,
    /// The exfiltration scanner tripped: the staged events go first, then the halt.
    Trip(Trip),
    /// There is no turn any more.
    Stop,
}

/// What the release phase did with a tool-call delta (`release_tool_delta`).
#[derive(Debug)]
pub(in crate::dataplane) enum ToolReleased {
    /// Framed through the hold queue, or kept for the batch response: take the next.
    Poll,
    /// Degraded safe mode blocks new tool dispatch: not emitted, only counted.
    Suppressed,
    /// Held by TokenCircuit until its call is complete and judged (`circuit.rs` `judge_held`).
    Held,
    /// Not a delta haltd can frame: the upstream failed.
    Malformed(String),
    /// The exfiltration scanner tripped on its name or arguments.
    Trip(Trip),
}

/// The release phase of an observed tool-call delta (chat, upstream): its name and
/// arguments scanned like any text, then framed through the hold queue, or held by
/// TokenCircuit. No I/O.
pub(in crate::dataplane) fn release_tool_delta(
    turn: &mut Turn,
    slot: &Slot,
    delta: &Value,
    tokens: Vec<UpToken>,
    arrived_ns: u64,
) -> ToolReleased {
    if turn.degraded {
        turn.tokens_generated += tokens.len() as u64;
        return ToolReleased::Suppressed;
    }
    let parts = match framing::tool_call_parts(delta) {
        Ok(p) => p,
        Err(e) => return ToolReleased::Malformed(format!("malformed upstream tool call: {e}")),
    };
    // A tool call's name and arguments are output like any text: scanned for secrets, held
    // back the same way.
    let args: String = parts
        .iter()
        .flat_map(|p| [p.name.as_deref().unwrap_or(""), p.arguments.as_str()])
        .collect();
    if let Err(trip) = scan(turn, &args) {
        return ToolReleased::Trip(trip);
    }
    let frames = framing::tool_call_frames(&parts, &tokens);
    turn.tokens_generated += frames.max(tokens.len() as u64);
    let started = turn
        .source
        .upstream_mut()
        .map(|s| s.merge_tool_calls(delta))
        .unwrap_or_default();
    if slot.mode() == Mode::Batch {
        slot.tokens_submitted.fetch_add(frames, SeqCst);
        return ToolReleased::Poll;
    }
    if let Some(circuit) = turn.circuit.as_mut() {
        circuit.hold(parts, tokens, started, arrived_ns, turn.hold.scanned);
        return ToolReleased::Held;
    }
    // Emitted through the queue (in order behind any held frame).
    turn.hold
        .push_tool_calls(parts, tokens, &started, arrived_ns);
    ToolReleased::Poll
}

/// Release: the exfiltration scanner takes `text`; how much of the turn's text it lets go.
fn scan(turn: &mut Turn, text: &str) -> Result<(), Trip> {
    match turn.gov.scan(text) {
        Gate::Trip(t) => Err(t),
        Gate::Release(n) => {
            turn.hold.scanned += text.len();
            turn.hold.release(n);
            Ok(())
        }
    }
}

/// Release, ahead: while the scanner holds text, the source's next text (when it has it
/// already) may rule the held candidates out now. Nothing is judged: the next text is observed
/// and scanned when its token comes, and the source's next poll returns exactly it.
fn look_ahead(turn: &mut Turn) {
    if turn.hold.released >= turn.hold.scanned {
        return;
    }
    let next = match turn.source.get().peek() {
        Peek::Text(text) => Ahead::Text(text),
        Peek::End => Ahead::End,
        Peek::Unknown => return,
    };
    let n = turn.gov.look_ahead(next);
    turn.hold.release(n);
}

/// Whether the token event just encoded (the `n`th in the frame buffer) may wait there for
/// the source's next ones, so that tokens the upstream delivered in one receive go out in one
/// send, as a relay would send them. Only for a source paced by its upstream (the built-in's
/// tokens come one per timer), below [`STAGE_MAX`] events, with nothing held back (intervene)
/// and no TokenCircuit (its judgements answer between tokens), on a stream not tripped: after
/// a trip every frame carries one token (the `emitter-ignores-halt` fault), so the kernel's
/// per-frame budget stays a token budget. Staged events are not counted yet: the frame is
/// accounted (`Slot::begin_frame`, all its tokens) when it goes, so a trip before that sends
/// none of them. Not with a fault that counts tokens (`panic-after-tokens`, whose panic comes
/// after exactly N) or sends after a trip (`emitter-ignores-halt`: a trip that lands between
/// staging and sending would otherwise send several tokens in one post-trip frame).
fn may_stage(turn: &mut Turn, n: usize, slot: &Slot, faults: &Faults) -> bool {
    n < STAGE_MAX
        && faults.panic.is_none()
        && !faults.emitter_ignores_halt
        && turn.hold.back.is_none()
        && turn.circuit.is_none()
        && !slot.is_tripped()
        && !turn.source.get().paced()
}

/// The `silent-rewrite=FROM>TO` fault: a repair of the model's text on the hot path that
/// nothing announces. One branch per text without the fault; allocates only under it.
fn silent_rewrite(faults: &Faults, mut t: Produced) -> Produced {
    if let Some((from, to)) = faults.silent_rewrite {
        if t.text.contains(from) {
            t.text = std::borrow::Cow::Owned(t.text.replace(from, to));
        }
    }
    t
}

/// Whether the first token of a produced text came with a logprob.
fn has_logprob(tokens: &Tokens) -> bool {
    match tokens {
        Tokens::Builtin { .. } => true,
        Tokens::Upstream(toks) => toks.first().is_some_and(|t| t.logprob.is_some()),
    }
}

/// Release and encode for observed text, on the connection alone: what the driver does next
/// ([`Released`]).
fn release_text(conn: &mut Conn, slot: &Slot, faults: &Faults, t: Produced, now: u64) -> Released {
    let Some(turn) = conn.turn.as_mut() else {
        return Released::Stop;
    };
    if let Err(trip) = scan(turn, &t.text) {
        return Released::Trip(trip);
    }
    if let Some(back) = turn.hold.back.as_mut() {
        // Intervene mode: the token joins the hold-back window (one store, no
        // allocation); it goes out once W newer tokens came, or at the end. A stream
        // without logprobs can never breach: nothing is held (spec 003's no-op).
        back.push(turn.hold.scanned);
        if turn.tokens_generated == 0 && !has_logprob(&t.tokens) {
            back.open();
        }
    }
    if turn.last_token_ns != 0 {
        turn.token_gap_ns_sum += now.saturating_sub(turn.last_token_ns);
    }
    turn.last_token_ns = now;
    // One token per frame by the rule; a chunk with more upstream tokens than frames
    // (byte tokens of one character) counts those, so that detector indices stay
    // distinct.
    let frames = t.split.frames(&t.text).max(t.tokens.len() as u64);
    turn.tokens_generated += frames;
    let offset = turn.text_len;
    turn.text_len += t.text.len();
    turn.trail.produced(&t.text);
    let t = silent_rewrite(faults, t);
    if slot.mode() == Mode::Batch {
        // Held, not sent: batch responses are committed whole.
        hold_for_batch(turn, t, offset);
        slot.tokens_submitted.fetch_add(frames, SeqCst);
        return Released::Poll;
    }
    look_ahead(turn);
    if t.split == Split::Token && frames == 1 && turn.hold.passes(turn.hold.scanned) {
        // The common case: nothing held, one event, encoded from the source's text (after
        // the events staged before it, if any).
        let out = if conn.emit.staged() == 0 {
            frame(&mut conn.wbuf)
        } else {
            conn.wbuf.get_or_insert_with(Vec::new)
        };
        encode_token(turn, out, &t, offset);
        turn.first_frame_sent = true;
        turn.note_output(&t.text);
        turn.trail.sent(&t.text);
        conn.emit.stage(t.arrived_ns);
        // Encoded: the source may reuse the text's buffers for its next token.
        turn.source.get().recycle(t);
        if may_stage(turn, conn.emit.staged(), slot, faults) {
            // The source may hold more tokens already: they join this frame (the pump
            // sends it as soon as the source has nothing ready, or anything else comes).
            return Released::Poll;
        }
        return Released::Send;
    }
    // The scanner holds text, or the text makes several frames: they go out through
    // the hold queue, one per step, in order (an upstream's text moves in, no copy).
    let (text, arrived) = (t.text.into_owned(), t.arrived_ns);
    let how = (t.split, t.channel);
    match t.tokens {
        Tokens::Builtin { logprob, top } => {
            let first = (logprob, owned_top(top.as_slice()));
            turn.hold.push_content(text, how, first, offset, arrived);
        }
        Tokens::Upstream(toks) => {
            let token = toks.into_iter().next();
            turn.hold.push_text(text, how, token, offset, arrived);
        }
    }
    Released::Poll
}

impl Step<'_> {
    /// Produces the next frame of a turn: heartbeat and trip checks, then [`Self::pump`].
    pub(in crate::dataplane) fn step(&mut self) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let ignore_halt = shared.cfg.faults.emitter_ignores_halt;
        let conn = &mut *self.conn;
        let id = conn.id;
        let slot = shared.table.slot(id.slot);
        if !shared.heartbeat_fresh(monotonic_ns()) && !slot.is_tripped() {
            // Fail closed: without a watchdog nobody could enforce a later halt.
            // The slot's own state decides what follows (halt below, or nothing to halt).
            own_trip::trip_own(
                &shared,
                id,
                FailureCode::HeartbeatLost,
                crate::stream::Initiator::of(FailureCode::HeartbeatLost),
            );
        }
        if slot.is_tripped() && !(ignore_halt && slot.state() == SlotState::Tripped) {
            return self.halt();
        }
        if conn.turn.is_none() {
            return Ok(());
        }
        crate::crash::worker_step(shared.cfg.faults.panic, slot.tokens_submitted.load(SeqCst));
        if self.resume_answered()? {
            return Ok(());
        }
        self.pump()
    }

    /// Takes what the source produced through the phases until one frame is on its way, the
    /// source has nothing (its I/O calls again), or a paced source waits for its timer.
    /// Token events staged on the way ([`may_stage`]) never outlive it: they go out as one
    /// frame before anything else would use the frame buffer, and at the latest here.
    pub(in crate::dataplane) fn pump(&mut self) -> io::Result<()> {
        self.pump_phases()?;
        self.send_staged()
    }

    /// Sends the staged token events, if any, as one frame (no send is in flight: staging
    /// happens only then); the turn goes on when the send completes.
    pub(in crate::dataplane) fn send_staged(&mut self) -> io::Result<()> {
        let conn = &mut *self.conn;
        if conn.emit.staged() == 0 || !conn.emit.idle() {
            return Ok(());
        }
        if conn.closing {
            // Not accounted, never sent.
            conn.emit.drop_staged();
            return Ok(());
        }
        self.account_and_send()
    }

    fn pump_phases(&mut self) -> io::Result<()> {
        loop {
            let conn = &mut *self.conn;
            let Some(turn) = conn.turn.as_mut() else {
                return Ok(());
            };
            // A token waiting for its score (`score.rs`), or the turn for a grounding round
            // (`ground.rs`): nothing goes past it.
            let waiting = turn.parked.is_some() || turn.grounding_wait();
            match next_phase(&conn.emit, conn.closing, waiting, &mut turn.hold) {
                Phase::Wait => return Ok(()),
                Phase::SendStaged => return self.send_staged(),
                Phase::Released(p) => return self.send_pending(p),
                Phase::End => {
                    if self.post_hoc_round()? {
                        return Ok(());
                    }
                    return self.finish();
                }
                Phase::Poll => {}
            }
            let paced = turn.source.get().paced();
            let polled = turn.source.poll();
            if !matches!(polled, Polled::Text(_)) {
                // Only text joins staged events: they go out before anything else.
                self.send_staged()?;
            }
            let next = match polled {
                Polled::Text(t) => self.take_text(t)?,
                Polled::ToolCalls {
                    delta,
                    tokens,
                    arrived_ns,
                } => self.take_tool_calls(delta, tokens, arrived_ns)?,
                Polled::Pending => return self.up_arm_recv(),
                Polled::End => {
                    self.source_ended();
                    if !self.circuit_at_end()? || !self.govern_end()? {
                        return Ok(());
                    }
                    // Drain what the scanner released, then finish (at once, paced or not).
                    continue;
                }
                Polled::Failed(f) => return self.source_failed(f),
            };
            match next {
                Next::Stop => return Ok(()),
                Next::Poll if paced => return self.paced_next(),
                Next::Poll => {}
            }
        }
    }

    /// A paced source took a token without sending it (held back, or kept for a batch): a
    /// frame the scanner released goes out now, else the next token waits for the timer.
    pub(in crate::dataplane) fn paced_next(&mut self) -> io::Result<()> {
        let released = self.conn.turn.as_mut().and_then(|t| t.hold.pop_released());
        match released {
            Some(p) => self.send_pending(p),
            None => self.schedule_next(),
        }
    }

    /// The phases for text a source produced: observe (which may park it until a score
    /// comes, `score.rs`), then the rest.
    fn take_text(&mut self, t: Produced) -> io::Result<Next> {
        let now = monotonic_ns();
        let judged = self.judge(Item::Text(t), 0, None, now)?;
        self.judged(judged, now)
    }

    /// After observe: a trip halts, a parked item waits, a clear one goes on to release.
    pub(in crate::dataplane) fn judged(&mut self, judged: Judged, now: u64) -> io::Result<Next> {
        match judged {
            Judged::Later => self.send_staged().map(|()| Next::Stop),
            Judged::Trip(trip) => {
                // Staged events were judged before this token: they go out as frames
                // accounted before the trip.
                self.send_staged()?;
                self.observed_trip(trip).map(|()| Next::Stop)
            }
            Judged::Clear(Item::Text(t)) => {
                let (conn, shared) = (&mut *self.conn, &self.io.shared);
                let slot = shared.table.slot(conn.id.slot);
                let next = match release_text(conn, slot, &shared.cfg.faults, t, now) {
                    Released::Poll => Next::Poll,
                    Released::Stop => Next::Stop,
                    Released::Send => self.account_and_send().map(|()| Next::Stop)?,
                    Released::Trip(trip) => {
                        // Staged events were released before this text: accounted before
                        // the trip.
                        self.send_staged()?;
                        self.detector_trip(trip).map(|()| Next::Stop)?
                    }
                };
                self.fault_close_during_step();
                if self.maybe_ground()? {
                    // Parked until the round answers (`ground.rs`).
                    self.send_staged()?;
                    return Ok(Next::Stop);
                }
                Ok(next)
            }
            Judged::Clear(Item::ToolCalls {
                delta,
                tokens,
                arrived_ns,
            }) => self.release_tool_calls(&delta, tokens, arrived_ns),
        }
    }

    /// The `close-during-step=N` fault: after the release phase of the turn's Nth text, the
    /// client socket is shut down and the connection closed, as a trip, a failed send or a
    /// gone client can close it there. Whatever the pipeline does next with the connection
    /// must see it closing, never a removed key.
    fn fault_close_during_step(&mut self) {
        let Some(n) = self.io.shared.cfg.faults.close_during_step else {
            return;
        };
        let conn = &mut *self.conn;
        let nth = conn.turn.as_mut().is_some_and(|t| {
            t.fault_texts += 1;
            t.fault_texts == n
        });
        if !nth || conn.closing {
            return;
        }
        tracing::warn!(stream_id = %conn.id, "fault injection: closing the client connection during a step");
        conn.outcome = crate::stream::Outcome::ClientGone;
        // SAFETY: the connection's open socket; it is closed only once the close finishes.
        unsafe { libc::shutdown(conn.fd, libc::SHUT_RDWR) };
        self.begin_close();
    }

    /// The phases for a tool-call delta (chat, upstream): observed like content (and parked
    /// the same way), then [`Self::release_tool_calls`].
    fn take_tool_calls(
        &mut self,
        delta: Value,
        tokens: Vec<UpToken>,
        arrived_ns: u64,
    ) -> io::Result<Next> {
        let now = monotonic_ns();
        let item = Item::ToolCalls {
            delta,
            tokens,
            arrived_ns,
        };
        let judged = self.judge(item, 0, None, now)?;
        self.judged(judged, now)
    }

    /// An observed tool-call delta through its release phase (`release_tool_delta`); held by
    /// TokenCircuit, the calls it shows complete are judged next.
    fn release_tool_calls(
        &mut self,
        delta: &Value,
        tokens: Vec<UpToken>,
        arrived_ns: u64,
    ) -> io::Result<Next> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let slot = shared.table.slot(conn.id.slot);
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(Next::Stop);
        };
        match release_tool_delta(turn, slot, delta, tokens, arrived_ns) {
            ToolReleased::Poll => Ok(Next::Poll),
            ToolReleased::Suppressed => {
                count_suppressed(&shared.metrics.upstream, delta);
                Ok(Next::Poll)
            }
            ToolReleased::Held => Ok(if self.circuit_release()? {
                Next::Poll
            } else {
                Next::Stop
            }),
            ToolReleased::Malformed(msg) => {
                self.up_fail(UpstreamFailureKind::Malformed, msg, Some(200))?;
                Ok(Next::Stop)
            }
            ToolReleased::Trip(trip) => self.detector_trip(trip).map(|()| Next::Stop),
        }
    }

    /// A detector tripped on an observed token. A HaltMonitor that cannot score what the
    /// upstream sends says why in the terminal event, the record and the failure metric.
    pub(in crate::dataplane) fn observed_trip(&mut self, trip: Trip) -> io::Result<()> {
        if trip.detector == DetectorId::HaltMonitor && trip.kind == TripKind::Unscorable {
            let conn = &mut *self.conn;
            if let Some(up) = conn.up.as_mut() {
                up.note_missing_logprobs(&self.io.shared, conn.id.slot);
            }
        }
        self.detector_trip(trip)
    }

    /// Encodes one released frame and sends it.
    fn send_pending(&mut self, p: Pending) -> io::Result<()> {
        if encode_pending(&mut *self.conn, p) {
            return self.account_and_send();
        }
        Ok(())
    }

    /// Account, then send: the frame in `wbuf`, with its staged token events, is counted in
    /// the slot's frame window (a trip that came first halts instead, and none of them goes
    /// out) and goes out.
    pub(in crate::dataplane) fn account_and_send(&mut self) -> io::Result<()> {
        let ignore_halt = self.io.shared.cfg.faults.emitter_ignores_halt;
        let conn = &mut *self.conn;
        let slot = self.io.shared.table.slot(conn.id.slot);
        if conn.keep == KeepAlive::Keep {
            // One chunk per frame: a move within the frame buffer, no allocation once the
            // buffer has grown to the turn's largest frame.
            if let Some(buf) = conn.wbuf.as_mut() {
                http::chunk_in_place(buf, 0);
            }
        }
        let before = slot.tokens_submitted.load(SeqCst);
        let counted = conn.count_frame(slot, conn.emit.frame_tokens(), ignore_halt);
        if !conn.emit.accounted(before, counted) {
            return self.halt();
        }
        self.send(SendKind::Token)
    }

    /// The next step of a turn whose frame went out: after the pacing interval for a paced
    /// source, at once for one paced by its upstream.
    pub(in crate::dataplane) fn schedule_next(&mut self) -> io::Result<()> {
        let paced = self
            .conn
            .turn
            .as_mut()
            .is_some_and(|t| t.source.get().paced());
        if !paced || self.io.shared.cfg.token_interval.is_zero() {
            return self.step();
        }
        let interval = self.io.shared.cfg.token_interval;
        let conn = &mut *self.conn;
        let ts = conn
            .timer_ts
            .take()
            .unwrap_or_else(|| Box::new(timespec(interval)));
        let e = io_uring::opcode::Timeout::new(&raw const *ts).build();
        let timer = self.submit(OpKind::Timer, OpBuf::Time(ts), e)?;
        self.conn.timer_op = Some(timer);
        Ok(())
    }

    /// The source's text is complete: an upstream exchange is over (its connection kept for
    /// the pool or shut down at once), and the model it answered with is SafetyCheck's
    /// identity after the turn.
    pub(in crate::dataplane) fn source_ended(&mut self) {
        let conn = &mut *self.conn;
        let (Some(turn), Some(up)) = (conn.turn.as_mut(), conn.up.as_mut()) else {
            return;
        };
        up.finish_exchange();
        if let Some(m) = turn.source.upstream().and_then(|s| s.model()) {
            turn.identity_after = Some(crate::safety::ModelIdentity::new(m, &up.system_prompt));
        }
        self.up_stop_reading();
    }

    pub(in crate::dataplane) fn source_failed(&mut self, f: SourceFailure) -> io::Result<()> {
        if let Some(up) = self.conn.up.as_mut() {
            if f.quote.is_some() {
                up.failure_quote = f.quote;
            }
        }
        self.up_fail(f.kind, f.message, f.status)
    }
}

#[cfg(test)]
pub(in crate::dataplane) mod tests;

#[cfg(test)]
mod proxied_tests;
