//! A connection's client sends as a state machine without I/O: the frame being staged, the
//! one send in flight, a short write's rest, a terminal frame that waits for the send in
//! flight, and what each completion means.
//!
//! The driver feeds it events (a token event staged, a frame accounted, a send completed, a
//! halt asked for) and does what it answers ([`Completion`]: send the rest, halt, go on with
//! the turn, fail the send). It touches no socket, no ring and no connection key: everything
//! it knows is here and in the stream's slot, whose frame window ([`Slot::begin_frame`]) is
//! the accounting step and whose trip point τ decides which delivered tokens were post-trip.
//! Its unit and property tests (`emit/tests.rs`) drive it with scripted schedules, as an
//! ordinary user.
//!
//! Per token it does a few stores and, at accounting and delivery, the slot's atomics: no
//! allocation, no lock.

use std::sync::atomic::Ordering::SeqCst;

use crate::dataplane::conn::{
    outbox::{frame_len, SendKind, STAGE_MAX},
    Conn,
};
use crate::{
    client_tls::lock,
    stream::{Slot, SlotState},
    wire::Endpoint,
};

/// The client side of one connection's sends.
#[derive(Debug)]
pub(in crate::dataplane) struct Emitter {
    /// What the send in flight carries; `None` when no send is in flight.
    sending: Option<SendKind>,
    /// The frame in flight went out in more than one send.
    short_write: bool,
    /// The stream was halted while a send was in flight: the terminal frame goes once that
    /// send completes.
    pending_terminal: bool,
    /// The token events in the frame buffer: staged (encoded, not yet accounted) or in the
    /// token frame in flight; 0 otherwise. At most [`STAGE_MAX`].
    tokens: usize,
    /// When each of those tokens reached haltd (the send's completion observes
    /// `haltd_token_overhead_seconds` once per token).
    arrivals: [u64; STAGE_MAX],
    /// The 1-based index of the last token of the token frame in flight: its tokens are
    /// `last - n + 1 ..= last`, which τ splits into pre- and post-trip.
    last_token: u64,
}

impl Default for Emitter {
    fn default() -> Self {
        Emitter {
            sending: None,
            short_write: false,
            pending_terminal: false,
            tokens: 0,
            arrivals: [0; STAGE_MAX],
            last_token: 0,
        }
    }
}

/// What a send's completion means, for the driver to carry out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) enum Completion {
    /// No send was in flight (a completion for a connection that moved on): only its buffer
    /// is taken back.
    Stray,
    /// A short write: send the frame's bytes from `off` before anything else. The rest is
    /// deliberately not counted as a frame (`send.rs`).
    Rest { off: usize },
    /// The send is over.
    Done(Done),
}

/// A send that is over: what it carried and what comes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) struct Done {
    pub(in crate::dataplane) kind: SendKind,
    /// The kernel took the whole frame.
    pub(in crate::dataplane) ok: bool,
    /// The frame went out in several sends: the slot's frame count is brought up to the
    /// gate's own (`send.rs` `resync_frames`).
    pub(in crate::dataplane) resync: bool,
    /// A halt waited for this send: the driver halts now instead of going on.
    pub(in crate::dataplane) then_halt: bool,
}

/// What a halt does about the send in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) enum HaltNow {
    /// No send is in flight: the halt goes on now.
    Proceed,
    /// A send is in flight: the terminal waits for its completion ([`Done::then_halt`]).
    AfterSend,
}

/// Where a halt stands, for the emitter's side of it (`turn/halt.rs` `halt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) enum HaltStep {
    /// The watchdog halted the stream already: nothing is sent; the connection closes.
    Halted,
    /// A trip or the watchdog's halt is under way (TRIPPING, HALTING, or another halter
    /// claimed it first): whoever holds it wakes the worker when done.
    Wait,
    /// Not tripped at all (a trip that came too late to take, e.g. after the final frame was
    /// committed): nothing to halt; the connection ends as it stands rather than wait for a
    /// wake-up that never comes.
    NotTripped,
    /// A send is in flight: the terminal goes when it completes ([`Done::then_halt`]).
    AfterSend,
    /// The emitter claimed the halt (HALTING): the stream is stopped now; it records the halt
    /// and sends the terminal frame.
    Claimed,
}

/// What a failed send means (`conn/send.rs` `send_failed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) enum FailedSend {
    /// The stream is tripped (the kernel gate dropped the send, or the watchdog shut the
    /// socket): the halt path.
    Halt,
    /// The kernel gate dropped a send of a stream userspace had not tripped (it saw the
    /// heartbeat lost, or a stale slot): the halt it is gets recorded; no terminal can follow.
    KernelDrop,
    /// The client went away (or stalled and was cut): the stream was made untrippable
    /// (STREAMING → DONE) and the connection closes.
    ClientGone,
}

/// The tokens of a delivered token frame, counted in the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) struct Delivered {
    /// Tokens the frame carried.
    pub(in crate::dataplane) tokens: usize,
    /// Of those, after the trip point τ (0 unless the stream was tripped and the frame was
    /// accounted after τ, which only the `emitter-ignores-halt` fault does).
    pub(in crate::dataplane) post_trip: u64,
}

impl Emitter {
    /// No send is in flight: a new frame may be sent.
    pub(in crate::dataplane) fn idle(&self) -> bool {
        self.sending.is_none()
    }

    /// What the send in flight carries.
    #[cfg(test)]
    pub(in crate::dataplane) fn sending(&self) -> Option<SendKind> {
        self.sending
    }

    /// Token events in the frame buffer.
    pub(in crate::dataplane) fn staged(&self) -> usize {
        self.tokens
    }

    /// A token event was encoded into the frame buffer, its token having reached haltd at
    /// `arrived_ns`. Only with no send in flight and below [`STAGE_MAX`] (the pipeline's
    /// staging rule).
    pub(in crate::dataplane) fn stage(&mut self, arrived_ns: u64) {
        debug_assert!(self.sending.is_none(), "staged while a send is in flight");
        debug_assert!(self.tokens < STAGE_MAX, "more than STAGE_MAX staged events");
        let i = self.tokens.min(STAGE_MAX - 1);
        self.arrivals[i] = arrived_ns;
        self.tokens = i + 1;
    }

    /// The staged events are dropped unsent (the connection closes, or the frame window
    /// refused the frame).
    pub(in crate::dataplane) fn drop_staged(&mut self) {
        self.tokens = 0;
    }

    /// The tokens the frame in the buffer counts as in the slot's frame window: its staged
    /// token events, at least one (a token frame).
    pub(in crate::dataplane) fn frame_tokens(&self) -> u64 {
        self.tokens.max(1) as u64
    }

    /// Account: the frame window ([`Conn::count_frame`]) took the token frame (`counted`),
    /// the slot having counted `before` tokens until then, or refused it (the stream tripped
    /// first: nothing was counted, the events are dropped, and the caller halts instead).
    /// On success the frame's last token index is kept for its delivery.
    pub(in crate::dataplane) fn accounted(&mut self, before: u64, counted: bool) -> bool {
        if !counted {
            self.tokens = 0;
            return false;
        }
        self.tokens = self.tokens.max(1);
        self.last_token = before + self.tokens as u64;
        true
    }

    /// A send of `kind` was handed to the kernel: nothing else is sent until it completes.
    pub(in crate::dataplane) fn begin_send(&mut self, kind: SendKind) {
        debug_assert!(self.sending.is_none(), "second send while one is in flight");
        self.sending = Some(kind);
    }

    /// A send handed out was never submitted (its submission failed): as if none were in
    /// flight.
    pub(in crate::dataplane) fn abandon_send(&mut self) {
        self.sending = None;
    }

    /// A send of the frame's bytes from `off` (of `len` in all) completed with `res`.
    pub(in crate::dataplane) fn complete(
        &mut self,
        res: i32,
        off: usize,
        len: usize,
    ) -> Completion {
        let Some(kind) = self.sending else {
            return Completion::Stray;
        };
        if res > 0 && off + (res as usize) < len {
            self.short_write = true;
            return Completion::Rest {
                off: off + res as usize,
            };
        }
        self.sending = None;
        let resync = std::mem::take(&mut self.short_write);
        let ok = res > 0;
        if kind == SendKind::Token && !ok {
            self.tokens = 0;
        }
        // A terminal or a `close_notify` ends the stream: nothing waits for them.
        let ends = matches!(kind, SendKind::Terminal | SendKind::CloseNotify);
        let then_halt = ok && !ends && std::mem::take(&mut self.pending_terminal);
        Completion::Done(Done {
            kind,
            ok,
            resync,
            then_halt,
        })
    }

    /// A halt wants to send the terminal frame.
    pub(in crate::dataplane) fn halt(&mut self) -> HaltNow {
        if self.sending.is_some() {
            self.pending_terminal = true;
            return HaltNow::AfterSend;
        }
        HaltNow::Proceed
    }

    /// The emitter's side of a halt, from the slot's state: whether to wait, close, wait for
    /// the send in flight, or claim the halt (TRIPPED → HALTING) and send the terminal.
    pub(in crate::dataplane) fn halt_step(&mut self, slot: &Slot) -> HaltStep {
        match slot.state() {
            SlotState::Halted => return HaltStep::Halted,
            SlotState::Tripped => {}
            // TRIPPING: the tripper wakes us once it is TRIPPED. HALTING: the watchdog wakes
            // us once it is HALTED.
            SlotState::Tripping | SlotState::Halting => return HaltStep::Wait,
            _ => return HaltStep::NotTripped,
        }
        if self.halt() == HaltNow::AfterSend {
            return HaltStep::AfterSend;
        }
        if slot.claim_halt() {
            HaltStep::Claimed
        } else {
            HaltStep::Wait
        }
    }

    /// A send failed with `res` (< 0, or 0 for a peer that closed): what it means, from the
    /// slot's state, the error, and whether a kernel gate runs (`gate`). A client gone makes
    /// the stream untrippable here (STREAMING → DONE), unless a trip came first.
    pub(in crate::dataplane) fn failed_send(slot: &Slot, res: i32, gate: bool) -> FailedSend {
        if slot.is_tripped() {
            return FailedSend::Halt;
        }
        if res == -libc::EACCES && gate {
            return FailedSend::KernelDrop;
        }
        if slot
            .state
            .compare_exchange(SlotState::Streaming, SlotState::Done)
            .is_err()
            && slot.is_tripped()
        {
            // A trip won the race: it is halted like any other.
            return FailedSend::Halt;
        }
        FailedSend::ClientGone
    }

    /// A token frame was delivered: its tokens are counted in the slot (delivered, and
    /// post-trip when the slot says so), and handed to `each_arrival` with when they
    /// reached haltd (0: unknown), for the per-token overhead.
    pub(in crate::dataplane) fn delivered(
        &mut self,
        slot: &Slot,
        mut each_arrival: impl FnMut(u64),
    ) -> Delivered {
        // A token frame carries at least one token (an old frame counted as one).
        let n = std::mem::take(&mut self.tokens).clamp(1, STAGE_MAX);
        slot.tokens_delivered.fetch_add(n as u64, SeqCst);
        for arrived in &mut self.arrivals[..n] {
            each_arrival(std::mem::take(arrived));
        }
        let post_trip = post_trip_tokens(slot, self.last_token, n);
        if post_trip > 0 {
            slot.post_trip_delivered.fetch_add(post_trip, SeqCst);
        }
        Delivered {
            tokens: n,
            post_trip,
        }
    }

    /// The connection's next turn starts with nothing staged or waiting (no send is in
    /// flight: a kept connection moves on only once its last send completed).
    pub(in crate::dataplane) fn reset_for_next_turn(&mut self) {
        debug_assert!(
            self.sending.is_none(),
            "next turn while a send is in flight"
        );
        self.short_write = false;
        self.pending_terminal = false;
        self.tokens = 0;
        self.last_token = 0;
    }
}

/// Of the `n` tokens ending at index `last` (1-based), those after the trip point τ. τ is
/// published before TRIPPED: a token completing while the trip is still TRIPPING was handed
/// out before the trip, so it is not post-trip.
fn post_trip_tokens(slot: &Slot, last: u64, n: usize) -> u64 {
    let published = matches!(
        slot.state(),
        SlotState::Tripped | SlotState::Halting | SlotState::Halted
    );
    if !published {
        return 0;
    }
    let tau = slot.trip_token_index.load(SeqCst);
    let first = last.saturating_sub(n as u64 - 1);
    (first..=last).filter(|&i| i > tau).count() as u64
}

impl Conn {
    /// The accounting step: counts the frame in the frame buffer, carrying `tokens` token
    /// events (0 for a head or an interim answer), in the slot's frame window
    /// ([`Slot::begin_frame`]) at its length on the wire, and on a TLS connection seals it in
    /// the same hold of the session's lock. Returns false when the stream is tripped (nothing
    /// sealed, nothing counted). One uncontended lock per frame on a TLS connection: the
    /// tripper of another thread must seal the terminal after exactly the records counted
    /// before the trip (`client_tls.rs`).
    pub(in crate::dataplane) fn count_frame(
        &mut self,
        slot: &Slot,
        tokens: u64,
        ignore_halt: bool,
    ) -> bool {
        if let Some(turn) = self.turn.as_ref() {
            if turn.enc.endpoint == Endpoint::Responses {
                // Before the frame's window: a trip after it numbers its terminal after every
                // event this frame carries.
                slot.sse_events.store(turn.enc.next_sequence(), SeqCst);
            }
        }
        let plain = frame_len(&self.wbuf);
        let Some(tls) = self.tls.as_ref() else {
            return slot.begin_frame(tokens, ignore_halt, plain);
        };
        let mut session = lock(tls);
        if !slot.begin_frame(tokens, ignore_halt, session.sealed_len(plain)) {
            return false;
        }
        let mut out = self.tls_out.take().unwrap_or_default();
        session.seal(self.wbuf.as_deref().unwrap_or_default(), &mut out);
        self.sealed = Some(out);
        true
    }

    /// The length the frame buffer's frame has on the wire (sealed, on a TLS connection).
    pub(in crate::dataplane) fn wire_len(&self) -> usize {
        let plain = frame_len(&self.wbuf);
        self.tls
            .as_ref()
            .map_or(plain, |t| lock(t).sealed_len(plain))
    }
}

#[cfg(test)]
mod tests;
