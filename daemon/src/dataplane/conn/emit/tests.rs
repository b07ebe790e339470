//! The emitter driven by scripted schedules against a real stream slot, as an ordinary user:
//! no ring, no BPF, no socket. The harness does what the ring driver does with each answer
//! (`send.rs`, `halt.rs`, `pipeline.rs`), and checks what the halt bound rests on: nothing is
//! sent after a trip but the terminal, exactly one terminal, one send at a time, a short
//! write's rest before anything else, every delivered token counted once, nothing sent after
//! close.

use proptest::prelude::*;

use super::{Completion, Done, Emitter, FailedSend, HaltNow, HaltStep};
use crate::{
    codes::FailureCode,
    dataplane::conn::outbox::{SendKind, STAGE_MAX},
    stream::{SlotState, StreamTable},
    wire::StreamId,
};

/// One scripted event.
#[derive(Debug, Clone)]
enum Event {
    /// The source produced a token; `flush`: it is the last one ready (the frame goes).
    Token { flush: bool },
    /// The send in flight completes: `take` of every 8 bytes remaining (8: all of them), or
    /// fails.
    Complete { take: u8, fail: bool },
    /// Another thread trips the stream (the admin API, the watchdog).
    Trip,
    /// The connection closes in the middle of a step (its client went away).
    Close,
    /// The source ended: the final frame goes, and the kept connection's next turn begins on
    /// a new stream once it is out.
    EndTurn,
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        6 => any::<bool>().prop_map(|flush| Event::Token { flush }),
        6 => (1u8..=8, prop::bool::weighted(0.05)).prop_map(|(take, fail)| Event::Complete { take, fail }),
        1 => Just(Event::Trip),
        1 => Just(Event::Close),
        2 => Just(Event::EndTurn),
    ]
}

/// What the harness saw, for the checks.
#[derive(Debug, Default)]
struct Seen {
    /// Token frames the frame window took, and their tokens.
    frames: u64,
    tokens_accounted: u64,
    /// Tokens accounted after the trip (only `emitter-ignores-halt` accounts any).
    tokens_after_trip: u64,
    /// Tokens of token frames delivered whole.
    tokens_delivered: u64,
    terminals: u32,
    /// Sends handed to the kernel after the connection began to close.
    sends_after_close: u32,
    /// The terminal went out (its completion came back) and the halt completed.
    halt_done: bool,
    /// The connection began to close at some point (a close, or a send that failed).
    closed: bool,
    /// Turns that completed, each followed by the next on the kept connection.
    turns: u32,
}

/// The ring driver's part, without the ring: it turns the emitter's answers into the next
/// events as `send.rs` and `halt.rs` do.
struct Harness {
    table: StreamTable,
    id: StreamId,
    emit: Emitter,
    budget: u32,
    ignore_halt: bool,
    /// The frame in flight: its length and how far it went.
    inflight: Option<(usize, usize)>,
    /// Sends the frame in flight took so far.
    sends: u32,
    /// The frame's length the next token frame gets (varies with the tokens).
    next_len: usize,
    closing: bool,
    tripped_at_tokens: Option<u64>,
    seen: Seen,
}

impl Harness {
    fn new(budget: u32, ignore_halt: bool) -> Self {
        let table = StreamTable::new(2);
        let id = table.alloc(0, -1, budget, 1).expect("a free slot");
        Harness {
            table,
            id,
            emit: Emitter::default(),
            budget,
            ignore_halt,
            inflight: None,
            sends: 0,
            next_len: 40,
            closing: false,
            tripped_at_tokens: None,
            seen: Seen::default(),
        }
    }

    fn slot(&self) -> &crate::stream::Slot {
        self.table.slot(self.id.slot)
    }

    fn run(&mut self, e: &Event) {
        match *e {
            Event::Token { flush } => self.token(flush),
            Event::Complete { take, fail } => self.complete(take, fail),
            Event::Trip => self.trip(),
            Event::Close => {
                self.closing = true;
                self.seen.closed = true;
                if self.emit.idle() {
                    // `send_staged` on a closing connection: not accounted, never sent.
                    self.emit.drop_staged();
                }
            }
            Event::EndTurn => self.end_turn(),
        }
    }

    /// `end.rs`: the final frame, counted by `Slot::begin_final` (after which no trip can
    /// take), once the staged events are out; a trip that came first halts instead.
    fn end_turn(&mut self) {
        if self.closing || !self.emit.idle() || self.emit.staged() > 0 {
            return;
        }
        let len = 30;
        if !self.slot().begin_final(len) {
            return self.halt();
        }
        self.seen.frames += 1;
        self.begin_send(SendKind::Final, len);
    }

    /// `keepalive.rs` `next_turn`: the turn that ended is checked, its slot released, and the
    /// next one takes a new slot whose frame count starts at the socket's.
    fn next_turn(&mut self) {
        use std::sync::atomic::Ordering::SeqCst;
        check(self, self.budget);
        let slot = self.slot();
        let before = crate::stream::SentBefore {
            frames: slot.frames_submitted.load(SeqCst),
            bytes: slot.bytes_submitted.load(SeqCst),
        };
        self.table.release(self.id);
        self.id = self
            .table
            .alloc_after(0, -1, self.budget, 3, before)
            .expect("the slot just released");
        self.emit.reset_for_next_turn();
        self.tripped_at_tokens = None;
        let s = &mut self.seen;
        (s.tokens_accounted, s.tokens_after_trip, s.tokens_delivered) = (0, 0, 0);
        (s.terminals, s.halt_done) = (0, false);
        s.turns += 1;
    }

    fn begin_send(&mut self, kind: SendKind, len: usize) {
        assert!(self.emit.idle(), "a second send while one is in flight");
        if self.closing {
            self.seen.sends_after_close += 1;
        }
        self.emit.begin_send(kind);
        self.inflight = Some((len, 0));
        self.sends = 0;
    }

    /// `pipeline.rs`: a token is encoded and staged; the frame goes when the source has no
    /// more ready, or the stage is full, or the stream is tripped (one token per frame).
    fn token(&mut self, flush: bool) {
        if self.closing || !self.emit.idle() || self.slot().is_tripped() && !self.ignore_halt {
            return;
        }
        self.emit.stage(0);
        let full = self.emit.staged() == STAGE_MAX;
        if flush || full || self.slot().is_tripped() {
            self.account_and_send();
        }
    }

    /// `pipeline.rs` `account_and_send`.
    fn account_and_send(&mut self) {
        let slot = self.table.slot(self.id.slot);
        let before = slot
            .tokens_submitted
            .load(std::sync::atomic::Ordering::SeqCst);
        let tokens = self.emit.frame_tokens();
        let len = self.next_len;
        let counted = slot.begin_frame(tokens, self.ignore_halt, len);
        if !self.emit.accounted(before, counted) {
            assert_eq!(
                self.emit.staged(),
                0,
                "a refused frame's events are dropped"
            );
            return self.halt();
        }
        self.seen.frames += 1;
        self.seen.tokens_accounted += tokens;
        if self.tripped_at_tokens.is_some() {
            self.seen.tokens_after_trip += tokens;
        }
        self.next_len = 17 + (self.next_len * 7) % 90;
        self.begin_send(SendKind::Token, len);
    }

    fn trip(&mut self) {
        let now = 2;
        if self
            .table
            .trip(self.id, FailureCode::OperatorTrip, None, now)
            .is_ok()
        {
            self.tripped_at_tokens = Some(self.seen.tokens_accounted);
            // The tripper wakes the worker, which halts (`driver/wake.rs` `scan_tripped`).
            if !self.closing {
                self.halt();
            }
        }
    }

    /// `halt.rs` `halt`, without the record's wait (the terminal goes at once).
    fn halt(&mut self) {
        let slot = self.table.slot(self.id.slot);
        match self.emit.halt_step(slot) {
            HaltStep::Claimed => {}
            HaltStep::Halted | HaltStep::NotTripped => {
                self.closing = true;
                self.seen.closed = true;
                return;
            }
            HaltStep::Wait | HaltStep::AfterSend => return,
        }
        if self.closing {
            // `send_terminal` on a closing connection: the halt completes without it.
            self.slot().publish_halted();
            self.seen.halt_done = true;
            return;
        }
        self.seen.terminals += 1;
        self.begin_send(SendKind::Terminal, 60);
    }

    /// `send.rs` `on_send`, with the kernel taking `take`/8 of what is left.
    fn complete(&mut self, take: u8, fail: bool) {
        let Some((len, off)) = self.inflight else {
            assert_eq!(self.emit.complete(1, 0, 1), Completion::Stray);
            return;
        };
        let left = len - off;
        let res = if fail {
            -libc::EPIPE
        } else {
            (left * usize::from(take)).div_ceil(8).max(1) as i32
        };
        self.sends += 1;
        match self.emit.complete(res, off, len) {
            Completion::Stray => panic!("a send in flight completed as stray"),
            Completion::Rest { off: next } => {
                assert!(!fail && next < len && next == off + res as usize);
                self.inflight = Some((len, next));
            }
            Completion::Done(done) => self.done(done, res, len, off),
        }
    }

    fn done(&mut self, done: Done, res: i32, len: usize, off: usize) {
        self.inflight = None;
        assert_eq!(done.ok, res > 0 && off + res as usize == len);
        assert_eq!(
            done.resync,
            self.sends > 1,
            "resync exactly after a short write"
        );
        if done.kind == SendKind::Terminal {
            assert!(!done.then_halt);
            self.slot().publish_halted();
            self.seen.halt_done = true;
            return;
        }
        if !done.ok {
            // `send_failed`, without a kernel gate (so no kernel drop).
            match Emitter::failed_send(self.slot(), res, false) {
                FailedSend::Halt => self.halt(),
                FailedSend::KernelDrop => panic!("a kernel drop without a gate"),
                FailedSend::ClientGone => {
                    assert_ne!(
                        self.slot().state(),
                        SlotState::Streaming,
                        "made untrippable"
                    );
                    self.closing = true;
                    self.seen.closed = true;
                }
            }
            return;
        }
        if done.kind == SendKind::Token {
            let d = self.emit.delivered(self.table.slot(self.id.slot), |_| {});
            self.seen.tokens_delivered += d.tokens as u64;
        }
        if done.then_halt {
            return self.halt();
        }
        if done.kind == SendKind::Final {
            // `send.rs` `sent`: the stream is over (no trip can take it now), then the kept
            // connection's next turn.
            self.slot().state.store(SlotState::Done);
            assert!(
                self.table
                    .trip(self.id, FailureCode::OperatorTrip, None, 4)
                    .is_err(),
                "a completed stream cannot be tripped"
            );
            self.next_turn();
        }
    }

    /// The client reads everything that is left: every send in flight completes whole.
    fn settle(&mut self) {
        while self.inflight.is_some() {
            self.complete(8, false);
        }
    }
}

fn check(h: &Harness, budget: u32) {
    use std::sync::atomic::Ordering::SeqCst;
    let slot = h.slot();
    let s = &h.seen;
    assert_eq!(s.sends_after_close, 0, "a send after close: {s:?}");
    assert_eq!(
        slot.frames_submitted.load(SeqCst),
        s.frames,
        "frames counted once"
    );
    assert_eq!(slot.tokens_submitted.load(SeqCst), s.tokens_accounted);
    assert_eq!(
        slot.tokens_delivered.load(SeqCst),
        s.tokens_delivered,
        "delivered once"
    );
    let post = slot.post_trip_delivered.load(SeqCst);
    if h.ignore_halt {
        // The fault's frames are exactly the post-trip ones the slot counts (the kernel gate
        // is what stops them: not here).
        assert!(
            post <= s.tokens_after_trip,
            "{post} > {}",
            s.tokens_after_trip
        );
    } else {
        assert_eq!(
            s.tokens_after_trip, 0,
            "a token frame accounted after the trip"
        );
        assert!(
            post <= u64::from(budget),
            "{post} post-trip tokens, budget {budget}"
        );
        assert_eq!(post, 0);
    }
    assert!(s.terminals <= 1, "{} terminals", s.terminals);
    if let Some(at) = h.tripped_at_tokens {
        assert_eq!(
            slot.trip_token_index.load(SeqCst),
            at,
            "τ is the tokens accounted"
        );
        assert!(s.halt_done, "a trip that never completed its halt: {s:?}");
        if !s.closed {
            assert_eq!(
                s.terminals, 1,
                "a tripped open stream sends exactly one terminal"
            );
        }
    }
    assert!(h.emit.idle());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Trips at every point of random schedules of tokens, short and failed sends and
    /// closes: the halt bound, one terminal, exact counts, nothing after close.
    #[test]
    fn schedules_keep_the_halt_bound(
        events in prop::collection::vec(event(), 1..120),
        budget in 0u32..6,
    ) {
        let mut h = Harness::new(budget, false);
        for e in &events {
            h.run(e);
        }
        h.settle();
        // A trip that came while closing still completes its halt (`conn.rs`
        // `Step::finish_close` claims it); the harness does the same at the end.
        if h.slot().state() == SlotState::Tripped && h.slot().claim_halt() {
            h.slot().publish_halted();
            h.seen.halt_done = true;
        }
        check(&h, budget);
    }

    /// The `emitter-ignores-halt` fault: frames go on after the trip, and the slot counts
    /// every one of their tokens as post-trip (what the kernel gate then has to stop).
    #[test]
    fn ignoring_the_halt_counts_post_trip_tokens(
        events in prop::collection::vec(event(), 1..80),
    ) {
        let mut h = Harness::new(2, true);
        for e in &events {
            h.run(e);
        }
        h.settle();
        let s = &h.seen;
        let post = h.slot().post_trip_delivered.load(std::sync::atomic::Ordering::SeqCst);
        prop_assert!(post <= s.tokens_after_trip);
        prop_assert_eq!(s.sends_after_close, 0);
    }
}

#[test]
fn a_halt_during_a_send_waits_for_it_then_sends_one_terminal() {
    let mut h = Harness::new(5, false);
    h.run(&Event::Token { flush: true });
    assert_eq!(h.emit.sending(), Some(SendKind::Token));
    h.run(&Event::Trip);
    // The send in flight was accounted before the trip: it goes out whole, then the terminal.
    assert_eq!(
        h.seen.terminals, 0,
        "the terminal waits for the send in flight"
    );
    h.run(&Event::Complete {
        take: 8,
        fail: false,
    });
    assert_eq!(h.seen.terminals, 1);
    assert_eq!(h.emit.sending(), Some(SendKind::Terminal));
    h.run(&Event::Token { flush: true });
    h.settle();
    assert_eq!(h.seen.tokens_delivered, 1);
    check(&h, 5);
}

#[test]
fn a_short_write_sends_its_rest_first_and_counts_one_frame() {
    let mut e = Emitter::default();
    e.stage(7);
    e.stage(9);
    assert!(e.accounted(10, true));
    e.begin_send(SendKind::Token);
    assert_eq!(e.complete(5, 0, 20), Completion::Rest { off: 5 });
    assert_eq!(e.complete(10, 5, 20), Completion::Rest { off: 15 });
    assert_eq!(e.halt(), HaltNow::AfterSend);
    let Completion::Done(done) = e.complete(5, 15, 20) else {
        panic!("the frame is out");
    };
    assert!(done.ok && done.resync && done.then_halt);
    let table = StreamTable::new(1);
    let id = table.alloc(0, -1, 5, 1).expect("a slot");
    let mut arrivals = Vec::new();
    let d = e.delivered(table.slot(id.slot), |a| arrivals.push(a));
    assert_eq!((d.tokens, d.post_trip, arrivals), (2, 0, vec![7, 9]));
    assert_eq!(e.complete(1, 0, 1), Completion::Stray, "nothing in flight");
}

#[test]
fn a_failed_token_send_drops_its_events_and_keeps_the_halt_waiting() {
    let mut e = Emitter::default();
    e.stage(1);
    assert!(e.accounted(0, true));
    e.begin_send(SendKind::Token);
    assert_eq!(e.halt(), HaltNow::AfterSend);
    let Completion::Done(done) = e.complete(-libc::EPIPE, 0, 10) else {
        panic!("failed sends are over");
    };
    assert!(
        !done.ok && !done.then_halt,
        "a failed send goes to send_failed, not on"
    );
    assert_eq!(e.staged(), 0);
    assert_eq!(e.halt(), HaltNow::Proceed, "nothing in flight any more");
}

#[test]
fn a_failed_send_is_a_halt_a_kernel_drop_or_a_client_gone() {
    let table = StreamTable::new(1);
    let id = table.alloc(0, -1, 5, 1).expect("a slot");
    let slot = table.slot(id.slot);
    assert_eq!(
        Emitter::failed_send(slot, -libc::EACCES, true),
        FailedSend::KernelDrop,
        "the gate dropped a send of a stream nobody tripped"
    );
    assert_eq!(
        slot.state(),
        SlotState::Streaming,
        "a kernel drop is tripped by the caller"
    );
    assert_eq!(
        Emitter::failed_send(slot, -libc::EACCES, false),
        FailedSend::ClientGone
    );
    assert_eq!(
        slot.state(),
        SlotState::Done,
        "a client gone is made untrippable"
    );
    let table = StreamTable::new(1);
    let id = table.alloc(0, -1, 5, 1).expect("a slot");
    table
        .trip(id, FailureCode::OperatorTrip, None, 2)
        .expect("trips");
    assert_eq!(
        Emitter::failed_send(table.slot(id.slot), -libc::EPIPE, true),
        FailedSend::Halt
    );
}

#[test]
fn the_halt_step_follows_the_slot() {
    let table = StreamTable::new(1);
    let id = table.alloc(0, -1, 5, 1).expect("a slot");
    let slot = table.slot(id.slot);
    let mut e = Emitter::default();
    assert_eq!(e.halt_step(slot), HaltStep::NotTripped);
    table
        .trip(id, FailureCode::OperatorTrip, None, 2)
        .expect("trips");
    e.begin_send(SendKind::Token);
    assert_eq!(e.halt_step(slot), HaltStep::AfterSend);
    assert_eq!(
        slot.state(),
        SlotState::Tripped,
        "not claimed while a send is in flight"
    );
    e.abandon_send();
    assert_eq!(e.halt_step(slot), HaltStep::Claimed);
    assert_eq!(slot.state(), SlotState::Halting);
    assert_eq!(
        e.halt_step(slot),
        HaltStep::Wait,
        "the holder of the halt wakes us"
    );
    slot.publish_halted();
    assert_eq!(e.halt_step(slot), HaltStep::Halted);
}

#[test]
fn a_refused_frame_is_dropped_and_counts_nothing() {
    let mut e = Emitter::default();
    e.stage(1);
    e.stage(2);
    assert_eq!(e.frame_tokens(), 2);
    assert!(!e.accounted(4, false));
    assert_eq!(e.staged(), 0);
    assert_eq!(
        e.frame_tokens(),
        1,
        "an empty frame still counts as a token frame"
    );
}

#[test]
fn a_kept_connection_starts_its_next_turn_clean_and_counts_frames_on() {
    use std::sync::atomic::Ordering::SeqCst;
    let mut h = Harness::new(5, false);
    for e in [
        Event::Token { flush: true },
        Event::Complete {
            take: 3,
            fail: false,
        },
        Event::Complete {
            take: 8,
            fail: false,
        },
        Event::EndTurn,
    ] {
        h.run(&e);
    }
    let first = h.id;
    h.settle();
    assert_eq!(
        h.seen.turns, 1,
        "the final frame went out and the next turn began"
    );
    assert_ne!(h.id, first, "a new stream for the next turn");
    assert_eq!(
        h.slot().frames_submitted.load(SeqCst),
        2,
        "the socket's frames go on"
    );
    assert_eq!(
        h.slot().tokens_submitted.load(SeqCst),
        0,
        "the new stream's tokens start at 0"
    );
    h.run(&Event::Token { flush: true });
    h.run(&Event::Trip);
    h.settle();
    assert_eq!((h.seen.terminals, h.seen.tokens_delivered), (1, 1));
    check(&h, 5);
}
