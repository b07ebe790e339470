//! Turns through the pipeline's own steps, as an ordinary user: no ring, no BPF, no socket. A
//! real connection and turn (the built-in model's source, or a proxied one whose upstream's
//! SSE bytes arrive split into receives at random; the default detectors and exfiltration
//! scanner, the chunk encoder) go through the real phases: `next_phase` picks
//! what comes next, `observe` judges each token, `release_text` and `encode_pending` release
//! and encode it, the connection's frame window (`Conn::count_frame`) and emitter account and
//! send it, `end_of_text` ends the text. The harness is the driver: it hands each frame to a
//! pretend kernel that takes it whole or short (proptest decides), trips the stream at a
//! chosen token from another thread's side (the stream table), or closes the connection
//! mid-step, and checks the bytes the client got:
//!
//! - every token event in order, each exactly once: the client's text is a prefix of what
//!   the model says for the request (all of it when nothing tripped);
//! - post-trip token events ≤ B (none: the emitter's frame window refuses them), then exactly
//!   one terminal and nothing after it;
//! - the slot's delivered tokens equal the wire's, and none was delivered unaccounted;
//! - nothing is sent after the connection began to close.

use std::sync::{atomic::Ordering::SeqCst, Arc};

use proptest::prelude::*;

use super::{release_text, release_tool_delta, Released, ToolReleased};
use crate::dataplane::turn::encode::encode_pending;
use crate::{
    codes::FailureCode,
    config::{Config, ServeArgs},
    dataplane::{
        conn::{
            emit::Completion,
            emit::HaltStep,
            outbox::{frame, SendKind},
            Conn,
        },
        turn::{
            circuit::{judge_held, CircuitJudged},
            end::end_of_text,
            phase::{next_phase, Phase},
            score::{observe, Item, Observe},
            Turn, TurnSource,
        },
    },
    detect::pipeline::Detectors,
    ledger::RecordKind,
    modes::KeyId,
    source::{resume::BuiltinSource, Polled, TokenSource},
    stream::{SlotState, StreamTable},
    wire::{ChunkEncoder, ClientRequest, Endpoint},
};

#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

/// The default configuration and the detectors it builds, once for all cases (building the
/// scanner's patterns is the slow part of a case).
fn defaults() -> &'static (Config, Arc<Detectors>) {
    static DEFAULTS: std::sync::OnceLock<(Config, Arc<Detectors>)> = std::sync::OnceLock::new();
    DEFAULTS.get_or_init(|| {
        use clap::Parser as _;
        let cfg = Cli::try_parse_from(["haltd"])
            .expect("parses")
            .serve
            .validate()
            .expect("the defaults are valid");
        let detectors =
            Arc::new(Detectors::new(cfg.detectors.clone()).expect("the defaults build"));
        (cfg, detectors)
    })
}

pub(in crate::dataplane) const TERMINAL: &[u8] = b"<terminal>";
pub(in crate::dataplane) const FINAL: &[u8] = b"<final>";

/// What a schedule does to the turn.
#[derive(Debug, Clone)]
pub(in crate::dataplane) struct Schedule {
    /// Tokens the model generates (`max_tokens`).
    pub(in crate::dataplane) tokens: u32,
    /// How much of what is left each send takes, in eighths (cycled; 8: all of it).
    pub(in crate::dataplane) takes: Vec<u8>,
    /// Trip the stream when this many tokens were accounted.
    pub(in crate::dataplane) trip_at: Option<u64>,
    /// The trip lands in the middle of a step, between a token's encoding and its frame's
    /// accounting (the worker learns of it there), rather than between two steps (the
    /// worker's wake-up halts the stream at once).
    pub(in crate::dataplane) trip_mid_step: bool,
    /// Close the connection after this many steps of the driver.
    pub(in crate::dataplane) close_at: Option<u32>,
    /// Intervene mode's hold-back window of this many tokens: each token
    /// waits for this many newer ones, or the end, before it goes out.
    pub(in crate::dataplane) hold_back: Option<usize>,
    pub(in crate::dataplane) budget: u32,
}

pub(in crate::dataplane) fn schedule() -> impl Strategy<Value = Schedule> {
    (
        1u32..40,
        prop::collection::vec(1u8..=8, 1..8),
        (prop::option::weighted(0.5, 0u64..40), any::<bool>()),
        prop::option::weighted(0.15, 0u32..80),
        (0u32..6, prop::option::weighted(0.3, 1usize..6)),
    )
        .prop_map(
            |(tokens, takes, (trip_at, trip_mid_step), close_at, (budget, hold_back))| Schedule {
                tokens,
                takes,
                trip_at,
                trip_mid_step,
                close_at,
                hold_back,
                budget,
            },
        )
}

/// The driver, without the ring.
pub(in crate::dataplane) struct Driver {
    pub(in crate::dataplane) table: StreamTable,
    pub(in crate::dataplane) conn: Conn,
    pub(in crate::dataplane) wire: Vec<u8>,
    /// The frame in flight: its bytes and how far the kernel took them.
    pub(in crate::dataplane) inflight: Option<(Vec<u8>, usize)>,
    pub(in crate::dataplane) sends: usize,
    pub(in crate::dataplane) takes: Vec<u8>,
    pub(in crate::dataplane) trip_at: Option<u64>,
    pub(in crate::dataplane) trip_mid_step: bool,
    pub(in crate::dataplane) tripped_tokens: Option<u64>,
    pub(in crate::dataplane) terminals: u32,
    pub(in crate::dataplane) finals: u32,
    pub(in crate::dataplane) sends_after_close: u32,
    pub(in crate::dataplane) done: bool,
    /// The conversations TokenCircuit judges a turn's tool calls in, when it has a circuit.
    pub(in crate::dataplane) circuits: Option<crate::circuit::store::ConversationStore>,
    /// Text items the turn's source gave (a built-in turn: its tokens).
    pub(in crate::dataplane) texts_polled: u64,
    /// A proxied turn: the upstream's SSE bytes still to arrive, one receive each, and the
    /// parser they go through.
    pub(in crate::dataplane) feed: std::collections::VecDeque<Vec<u8>>,
    pub(in crate::dataplane) sse: crate::upstream::SseParser,
}

pub(in crate::dataplane) fn body(tokens: u32) -> String {
    format!(
        r#"{{"model":"builtin","stream":true,"logprobs":true,"max_tokens":{tokens},"seed":7,"messages":[{{"role":"user","content":"Tell me about the tides."}}]}}"#
    )
}

impl Driver {
    /// A streaming chat turn of `source` for `ask` on a connection of its own, as
    /// `start_builtin_turn` and `start_proxy_turn` open it (no kernel policy, no head: the
    /// wire holds the token events only); `feed` is a proxied turn's upstream receives.
    pub(in crate::dataplane) fn open(
        s: &Schedule,
        source: TurnSource,
        ask: &crate::wire::Ask,
        feed: std::collections::VecDeque<Vec<u8>>,
    ) -> Self {
        let (cfg, detectors) = defaults();
        let table = StreamTable::new(1);
        let id = table.alloc(0, -1, s.budget, 1).expect("a slot");
        let gov = detectors.turn("t", 0).expect("no detector fails at start");
        let enc = ChunkEncoder {
            endpoint: Endpoint::Chat,
            stream_id: id,
            created: 0,
            model: "m".into(),
            logprobs: ask.logprobs,
            top_logprobs: ask.top_logprobs,
            tool_calls: false,
            reasoning: false,
            blocks: std::cell::Cell::default(),
            output: std::cell::RefCell::default(),
        };
        let gov = (gov, Vec::new());
        let mut turn = Turn::new(
            source,
            ask,
            KeyId(0),
            false,
            enc,
            gov,
            crate::policy::TurnPolicy::default_with(Arc::clone(detectors), 5),
        );
        if let Some(w) = s.hold_back {
            turn.hold.back = Some(crate::dataplane::turn::holdback::HoldBack::new(w, 0));
        }
        let mut conn = Conn::new(-1, id, 1, None, 0, cfg, None);
        conn.turn = Some(Box::new(turn));
        Driver {
            table,
            conn,
            wire: Vec::new(),
            inflight: None,
            sends: 0,
            takes: s.takes.clone(),
            trip_at: s.trip_at,
            trip_mid_step: s.trip_mid_step,
            tripped_tokens: None,
            terminals: 0,
            finals: 0,
            sends_after_close: 0,
            done: false,
            texts_polled: 0,
            circuits: None,
            feed,
            sse: crate::upstream::SseParser::new(64 * 1024),
        }
    }
}

/// A streaming built-in chat turn, and what the model says for it, token by token.
pub(in crate::dataplane) fn open(s: &Schedule) -> (Driver, Vec<String>) {
    let req = ClientRequest::parse(Endpoint::Chat, body(s.tokens).as_bytes())
        .and_then(|r| r.builtin_turn("builtin"))
        .expect("a valid request");
    let mut expected = Vec::new();
    let mut reference = BuiltinSource::for_turn(&req, false);
    while let Polled::Text(t) = reference.poll() {
        expected.push(t.text.into_owned());
    }
    let source = TurnSource::Builtin(BuiltinSource::for_turn(&req, false));
    let d = Driver::open(s, source, &req.ask, std::collections::VecDeque::new());
    (d, expected)
}

impl Driver {
    pub(in crate::dataplane) fn slot(&self) -> &crate::stream::Slot {
        self.table.slot(self.conn.id.slot)
    }

    fn send(&mut self, kind: SendKind) {
        if self.conn.closing {
            self.sends_after_close += 1;
        }
        let buf = self.conn.wbuf.take().unwrap_or_default();
        self.conn.emit.begin_send(kind);
        self.inflight = Some((buf, 0));
    }

    /// `account_and_send`: the frame window takes the token frame, or the driver halts. A
    /// trip due in the middle of a step lands here, between the encoding and the accounting.
    fn account_and_send(&mut self) {
        self.maybe_trip(true);
        let slot = self.table.slot(self.conn.id.slot);
        let before = slot.tokens_submitted.load(SeqCst);
        let counted = self
            .conn
            .count_frame(slot, self.conn.emit.frame_tokens(), false);
        if !self.conn.emit.accounted(before, counted) {
            return self.halt();
        }
        self.send(SendKind::Token);
    }

    /// `halt.rs` `halt`, the terminal going at once (its record's wait is not modelled).
    fn halt(&mut self) {
        let slot = self.table.slot(self.conn.id.slot);
        match self.conn.emit.halt_step(slot) {
            HaltStep::Claimed if !self.conn.closing => {
                self.terminals += 1;
                frame(&mut self.conn.wbuf).extend_from_slice(TERMINAL);
                self.send(SendKind::Terminal);
            }
            HaltStep::Claimed | HaltStep::Halted | HaltStep::NotTripped => {
                slot.publish_halted();
                self.done = true;
            }
            HaltStep::Wait | HaltStep::AfterSend => {}
        }
    }

    /// The pretend kernel takes part or all of the frame in flight.
    fn complete(&mut self) {
        let Some((buf, off)) = self.inflight.take() else {
            return;
        };
        let take = self.takes[self.sends % self.takes.len()];
        self.sends += 1;
        let left = buf.len() - off;
        let n = (left * usize::from(take)).div_ceil(8).max(1);
        self.wire.extend_from_slice(&buf[off..off + n]);
        match self.conn.emit.complete(n as i32, off, buf.len()) {
            Completion::Rest { off } => self.inflight = Some((buf, off)),
            Completion::Stray => panic!("a send in flight completed as stray"),
            Completion::Done(done) => {
                self.conn.wbuf = Some(buf);
                match done.kind {
                    SendKind::Token => {
                        let slot = self.table.slot(self.conn.id.slot);
                        self.conn.emit.delivered(slot, |_| {});
                    }
                    SendKind::Terminal | SendKind::Final => {
                        self.slot().publish_halted();
                        self.done = true;
                        return;
                    }
                    _ => {}
                }
                if done.then_halt {
                    self.halt();
                }
            }
        }
    }

    /// Another thread trips the stream once the chosen number of tokens was accounted:
    /// between steps (`in_step` false; the worker's wake-up halts it at once) or in the middle
    /// of one (the frame window refuses the next frame, and the pipeline halts).
    fn maybe_trip(&mut self, in_step: bool) {
        let accounted = self.slot().tokens_submitted.load(SeqCst);
        let due = self.trip_at.is_some_and(|k| accounted >= k) && self.tripped_tokens.is_none();
        if !due || in_step != self.trip_mid_step {
            return;
        }
        if self.trip_with(FailureCode::OperatorTrip) && !in_step && !self.conn.closing {
            self.halt();
        }
    }

    /// Trips the stream with `code`; whether this trip was the first.
    pub(in crate::dataplane) fn trip_with(&mut self, code: FailureCode) -> bool {
        let accounted = self.slot().tokens_submitted.load(SeqCst);
        let first = self.table.trip(self.conn.id, code, None, 2).is_ok();
        if first {
            self.tripped_tokens = Some(accounted);
        }
        first
    }

    /// TokenCircuit (`circuit.rs` `judge_held`), when the turn has a circuit: the calls its
    /// held deltas show complete (`at_end`: all) are judged; a denial trips the stream with
    /// `TOOL_CIRCUIT_OPEN` and halts it, as `circuit_trip` does. Whether the turn goes on.
    fn judge_calls(&mut self, at_end: bool) -> bool {
        let turn = self.conn.turn.as_mut().expect("a turn");
        let Some(store) = self.circuits.as_ref() else {
            return true;
        };
        match judge_held(turn, store, at_end, std::time::Instant::now()) {
            CircuitJudged::Pass => true,
            CircuitJudged::Denied(_) => {
                self.trip_with(FailureCode::ToolCircuitOpen);
                self.halt();
                false
            }
        }
    }

    /// One step of `pump_phases`: the phase `next_phase` picks, done.
    pub(in crate::dataplane) fn step(&mut self) {
        let Some(turn) = self.conn.turn.as_mut() else {
            self.done = true;
            return;
        };
        match next_phase(&self.conn.emit, self.conn.closing, false, &mut turn.hold) {
            Phase::Wait if self.inflight.is_some() => self.complete(),
            Phase::Wait => self.done = true,
            Phase::SendStaged => self.account_and_send(),
            Phase::Released(p) => {
                assert!(encode_pending(&mut self.conn, p));
                self.account_and_send();
            }
            Phase::End => self.finish(),
            Phase::Poll => self.poll(),
        }
    }

    /// The source's next item through observe and release.
    fn poll(&mut self) {
        let turn = self.conn.turn.as_mut().expect("a turn");
        let polled = turn.source.poll();
        if matches!(polled, Polled::Text(_)) {
            self.texts_polled += 1;
        }
        match polled {
            Polled::Text(t) => match observe(turn, Item::Text(t), 0, None, 3) {
                Observe::Clear(Item::Text(t)) => {
                    let slot = self.table.slot(self.conn.id.slot);
                    let faults = crate::config::Faults::default();
                    match release_text(&mut self.conn, slot, &faults, t, 4) {
                        Released::Send => self.account_and_send(),
                        Released::Poll | Released::Stop => {}
                        Released::Trip(t) => {
                            panic!("the scanner tripped on the model's text: {t:?}")
                        }
                    }
                }
                Observe::Trip(t) => panic!("a detector tripped on the model's text: {t:?}"),
                _ => panic!("no item waits without an external scorer"),
            },
            Polled::ToolCalls {
                delta,
                tokens,
                arrived_ns,
            } => {
                let item = Item::ToolCalls {
                    delta,
                    tokens,
                    arrived_ns,
                };
                let Observe::Clear(Item::ToolCalls {
                    delta,
                    tokens,
                    arrived_ns,
                }) = observe(turn, item, 0, None, 3)
                else {
                    panic!("the detectors let a model's tool call through");
                };
                let slot = self.table.slot(self.conn.id.slot);
                match release_tool_delta(turn, slot, &delta, tokens, arrived_ns) {
                    ToolReleased::Held => {
                        self.judge_calls(false);
                    }
                    ToolReleased::Poll => {}
                    other => panic!("a well-formed tool call was released as {other:?}"),
                }
            }
            Polled::End => {
                if !self.judge_calls(true) {
                    return;
                }
                let turn = self.conn.turn.as_mut().expect("a turn");
                end_of_text(turn, 5).expect("the model's text passes at its end");
            }
            Polled::Pending => self.receive(),
            other => panic!("a built-in source polled {other:?}"),
        }
    }

    /// The upstream's next receive: its bytes through the SSE parser into the source, as
    /// `upstream_io/recv.rs` feeds them.
    fn receive(&mut self) {
        let bytes = self
            .feed
            .pop_front()
            .expect("the upstream's stream ends with [DONE]");
        self.sse.push(&bytes);
        let turn = self.conn.turn.as_mut().expect("a turn");
        let source = turn.source.upstream_mut().expect("a proxied turn");
        while let Some(ev) = self.sse.next_event_ref().expect("well-formed SSE") {
            assert!(
                source.push_event(Endpoint::Chat, ev, 6),
                "a well-formed chunk"
            );
        }
    }

    /// `end.rs` `finish`: the final frame, counted by `begin_final` (a trip that came first
    /// halts instead).
    fn finish(&mut self) {
        frame(&mut self.conn.wbuf).extend_from_slice(FINAL);
        if self.slot().begin_final(FINAL.len()) {
            self.finals += 1;
            self.send(SendKind::Final);
        } else {
            self.halt();
        }
    }
}

/// The token texts of the SSE events on the wire, and what followed the last event.
pub(in crate::dataplane) fn client_view(wire: &[u8]) -> (Vec<String>, Vec<u8>) {
    let mut texts = Vec::new();
    let mut rest = wire;
    while let Some(end) = rest.windows(2).position(|w| w == b"\n\n") {
        let event = std::str::from_utf8(&rest[..end]).expect("UTF-8 events");
        let json = event.strip_prefix("data: ").expect("an SSE data event");
        let v: serde_json::Value = serde_json::from_str(json).expect("a JSON chunk");
        let text = v["choices"][0]["delta"]["content"]
            .as_str()
            .expect("a content delta");
        texts.push(text.to_owned());
        rest = &rest[end + 2..];
    }
    (texts, rest.to_vec())
}

fn run(s: &Schedule) -> (Driver, Vec<String>) {
    let (mut d, expected) = open(s);
    drive_with(s, &mut d, |_| {});
    (d, expected)
}

pub(in crate::dataplane) fn check(s: &Schedule, d: &Driver, expected: &[String]) {
    let slot = d.slot();
    let (texts, tail) = client_view(&d.wire);
    assert_eq!(d.sends_after_close, 0, "a send after close");
    assert!(
        expected.starts_with(&texts),
        "the client's tokens are the model's, in order, once each: {texts:?} vs {expected:?}"
    );
    assert_eq!(slot.tokens_delivered.load(SeqCst), texts.len() as u64);
    // The stream's record, as the daemon builds it from the slot (`halt::base_record`).
    let rec = crate::halt::base_record(RecordKind::Incident, &slot.snapshot(d.conn.id.slot), "off");
    assert_eq!(
        rec.tokens_emitted,
        texts.len() as u64,
        "the record's tokens"
    );
    let trip = d.tripped_tokens.map(|tau| ("OPERATOR_TRIP", tau, 0));
    let recorded = rec.trip_cause.as_deref().zip(rec.trip_token_index);
    let recorded = recorded
        .zip(rec.halt_tokens_post_trip)
        .map(|((c, t), p)| (c, t, p));
    assert_eq!(recorded, trip, "the record's cause, τ and post-trip tokens");
    let accounted = slot.tokens_submitted.load(SeqCst);
    assert!(texts.len() as u64 <= accounted);
    if let Some(tau) = d.tripped_tokens {
        assert_eq!(slot.trip_token_index.load(SeqCst), tau);
        let post = (texts.len() as u64).saturating_sub(tau);
        assert!(
            post <= u64::from(s.budget),
            "{post} post-trip tokens, B = {}",
            s.budget
        );
        assert_eq!(
            post, 0,
            "the frame window refuses every token after the trip"
        );
        assert_eq!(d.finals, 0, "no final frame after a trip");
        if !d.conn.closing {
            assert_eq!(d.terminals, 1, "exactly one terminal");
            assert_eq!(
                tail, TERMINAL,
                "the terminal is the last thing the client gets"
            );
        }
        assert_eq!(slot.state(), SlotState::Halted);
    } else if !d.conn.closing {
        assert_eq!(
            texts, expected,
            "a turn that nothing stopped delivers all of it"
        );
        assert_eq!((d.finals, d.terminals), (1, 0));
        assert_eq!(tail, FINAL);
    }
    assert!(d.terminals <= 1 && d.finals <= 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A built-in turn under random send completions, trips at every token and closes in
    /// the middle of steps.
    #[test]
    fn a_turn_keeps_its_order_its_bound_and_one_ending(s in schedule()) {
        let (d, expected) = run(&s);
        check(&s, &d, &expected);
    }
}

#[test]
fn a_turn_with_whole_sends_delivers_every_token_then_the_final_frame() {
    let s = Schedule {
        tokens: 12,
        takes: vec![8],
        trip_at: None,
        trip_mid_step: false,
        close_at: None,
        hold_back: None,
        budget: 5,
    };
    let (d, expected) = run(&s);
    assert!(
        expected.len() >= 2,
        "the model says something: {expected:?}"
    );
    check(&s, &d, &expected);
    let (texts, _) = client_view(&d.wire);
    assert_eq!(texts.len(), expected.len());
}

#[test]
fn a_trip_mid_turn_ends_with_one_terminal_after_the_tokens_before_it() {
    let s = Schedule {
        tokens: 20,
        takes: vec![3, 8],
        trip_at: Some(4),
        trip_mid_step: true,
        close_at: None,
        hold_back: None,
        budget: 5,
    };
    let (d, expected) = run(&s);
    check(&s, &d, &expected);
    let (texts, tail) = client_view(&d.wire);
    assert_eq!((texts.len(), tail.as_slice()), (4, TERMINAL));
}

/// Drives the turn to its end, `between` called before each step (what happens to the turn
/// between two steps, such as a grounding round's answer).
pub(in crate::dataplane) fn drive_with(
    s: &Schedule,
    d: &mut Driver,
    mut between: impl FnMut(&mut Driver),
) {
    let mut steps = 0u32;
    while !d.done {
        steps += 1;
        assert!(steps < 100_000, "the turn does not end");
        if s.close_at == Some(steps) && !d.conn.closing {
            d.conn.closing = true;
            if d.conn.emit.idle() {
                d.conn.emit.drop_staged();
            }
        }
        d.maybe_trip(false);
        if d.conn.closing && d.inflight.is_none() {
            break;
        }
        if d.conn.closing {
            d.complete();
            continue;
        }
        between(d);
        d.step();
    }
    // A trip that came while the connection closed still completes its halt, without a
    // terminal (`conn.rs` `Step::finish_close` claims it once nothing is in flight).
    let slot = d.table.slot(d.conn.id.slot);
    if d.conn.closing && slot.state() == SlotState::Tripped && slot.claim_halt() {
        slot.publish_halted();
    }
}

#[test]
fn the_hold_back_window_keeps_w_tokens_back_until_the_end() {
    let s = Schedule {
        tokens: 12,
        takes: vec![8],
        trip_at: None,
        trip_mid_step: false,
        close_at: None,
        hold_back: Some(3),
        budget: 5,
    };
    let (mut d, expected) = open(&s);
    let mut least_lag_mid_text = u64::MAX;
    while !d.done {
        d.step();
        let turn = d.conn.turn.as_ref().expect("a turn");
        let delivered = d.slot().tokens_delivered.load(SeqCst);
        if !turn.hold.ending && turn.tokens_generated >= 3 && d.inflight.is_none() {
            least_lag_mid_text = least_lag_mid_text.min(turn.tokens_generated - delivered);
        }
    }
    assert!(expected.len() > 3, "{expected:?}");
    assert_eq!(
        least_lag_mid_text, 3,
        "a token waits for 3 newer ones before it goes"
    );
    check(&s, &d, &expected);
}
