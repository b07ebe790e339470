//! A turn: the state a connection keeps while it serves one completion, and opening it.
//!
//! Opening is the same for both sources ([`Step::open_turn`]): refuse while shutting down
//! or without a flight recorder, fix the stream's mode (stream or batch) and budget, start
//! the turn's detectors, give the kernel gate the turn's policy. Then the built-in turn sends
//! its head (streaming) and runs the pipeline; the proxied turn opens its upstream exchange
//! (`upstream_io.rs`) and the pipeline runs as the upstream's items arrive.

mod ask_first;
pub(in crate::dataplane) mod circuit;
pub(in crate::dataplane) mod circuit_record;
pub(in crate::dataplane) mod encode;
pub(in crate::dataplane) mod end;
pub(in crate::dataplane) mod halt;
pub(in crate::dataplane) mod hold;
pub(in crate::dataplane) mod holdback;
pub(in crate::dataplane) mod own_trip;
pub(in crate::dataplane) mod phase;
pub(in crate::dataplane) mod pipeline;
pub(in crate::dataplane) mod policy;
mod proxied;
pub(in crate::dataplane) mod record;
pub(in crate::dataplane) mod score;

use std::{collections::BTreeSet, io, sync::atomic::Ordering::SeqCst, sync::Arc};

use serde_json::Value;

use crate::dataplane::ground::state::{ResumeSeed, TurnGrounding};
use crate::dataplane::upstream_io;
use crate::dataplane::{
    conn::outbox::{frame, SendKind},
    turn::hold::Hold,
    upstream_io::Purpose,
};
use crate::dataplane::{Io, Step};
use crate::{
    clock::monotonic_ns,
    detect::{
        pipeline::{Detectors, TurnGovernor},
        Trip,
    },
    modes::KeyId,
    safety::{self, SafetyContext},
    scope::Identity,
    source::{
        builtin::{BuiltinModel, MODEL_NAME},
        resume::BuiltinSource,
        upstream::UpstreamSource,
        Polled, TokenSource,
    },
    stream::Mode,
    wire::{http, Ask, BuiltinTurn, Channel, ChunkEncoder, Endpoint, HttpError, RequestHead},
};
use proxied::{last_user_text, prepare_proxied, surface_headers, upstream_authorization};

/// Output text kept per turn for SafetyCheck's cited-source check; beyond it the citation
/// check reports the text as not fully known.
const MAX_SAFETY_TEXT: usize = 256 * 1024;

/// A token kept for a batch response.
#[derive(Debug)]
pub(in crate::dataplane) struct HeldToken {
    pub(in crate::dataplane) text: String,
    pub(in crate::dataplane) logprob: f32,
    pub(in crate::dataplane) top: Vec<(String, f32)>,
    pub(in crate::dataplane) offset: usize,
    pub(in crate::dataplane) channel: Channel,
}

/// What the request metrics need of a turn: its model label and inter-token histogram,
/// resolved once at its start ([`Step::observe_turn`]), and when its tokens reached the
/// client.
#[derive(Debug, Default)]
pub(in crate::dataplane) struct TurnObs {
    pub(in crate::dataplane) model_label: Option<Arc<str>>,
    pub(in crate::dataplane) inter_token: Option<crate::histogram::NsHistogram>,
    /// When the first token frame (a batch turn: its whole response) reached the client.
    pub(in crate::dataplane) first_token_ns: u64,
    /// When the last token frame did.
    pub(in crate::dataplane) last_sent_ns: u64,
}

impl TurnObs {
    /// A token frame was delivered at `now`: the gap since the last one is observed.
    /// Per token: one atomic add, no lookup, no lock.
    pub(in crate::dataplane) fn token_sent(&mut self, now: u64) {
        if self.last_sent_ns != 0 {
            if let Some(h) = &self.inter_token {
                h.observe_ns(now.saturating_sub(self.last_sent_ns));
            }
        }
        if self.first_token_ns == 0 {
            self.first_token_ns = now;
        }
        self.last_sent_ns = now;
    }
}

/// Where a turn's tokens come from.
#[derive(Debug)]
pub(in crate::dataplane) enum TurnSource {
    Builtin(BuiltinSource),
    /// Degraded mode's "ask first" clarification, instead of the model (`ask_first.rs`).
    Fixed(crate::source::fixed::FixedSource),
    /// Proxied: what the upstream streamed; its socket is the connection's
    /// [`crate::dataplane::upstream_io::Upstream`].
    Upstream(UpstreamSource),
}

impl TurnSource {
    pub(in crate::dataplane) fn get(&mut self) -> &mut dyn TokenSource {
        match self {
            TurnSource::Builtin(b) => b,
            TurnSource::Fixed(f) => f,
            TurnSource::Upstream(u) => u,
        }
    }

    pub(in crate::dataplane) fn poll(&mut self) -> Polled {
        self.get().poll()
    }

    pub(in crate::dataplane) fn upstream(&self) -> Option<&UpstreamSource> {
        match self {
            TurnSource::Upstream(u) => Some(u),
            TurnSource::Builtin(_) | TurnSource::Fixed(_) => None,
        }
    }

    pub(in crate::dataplane) fn upstream_mut(&mut self) -> Option<&mut UpstreamSource> {
        match self {
            TurnSource::Upstream(u) => Some(u),
            TurnSource::Builtin(_) | TurnSource::Fixed(_) => None,
        }
    }
}

/// The turn a connection is running.
#[derive(Debug)]
pub(in crate::dataplane) struct Turn {
    pub(in crate::dataplane) source: TurnSource,
    /// What the client asked for.
    pub(in crate::dataplane) stream: bool,
    pub(in crate::dataplane) top_logprobs: u32,
    pub(in crate::dataplane) include_usage: bool,
    /// The conversation (API key) and whether its scope was degraded at turn start.
    pub(in crate::dataplane) key_id: KeyId,
    pub(in crate::dataplane) degraded: bool,
    /// Tokens the source produced (emitted or held).
    pub(in crate::dataplane) tokens_generated: u64,
    /// The turn's detectors and exfiltration scanner.
    pub(in crate::dataplane) gov: TurnGovernor,
    /// The detector and SafetyCheck configuration the turn started under (its route's): a
    /// SIGHUP reload or a runtime switch applies to later turns, never half-way through one.
    pub(in crate::dataplane) detectors: Arc<Detectors>,
    /// The profile and route the turn started under (`policy.rs`).
    pub(in crate::dataplane) policy: crate::policy::TurnPolicy,
    /// Frames the exfiltration scanner holds back.
    pub(in crate::dataplane) hold: Hold,
    /// A content or tool-call frame went out (the chat role goes in the first).
    pub(in crate::dataplane) first_frame_sent: bool,
    /// Emitted text, for SafetyCheck (bounded, [`MAX_SAFETY_TEXT`]).
    pub(in crate::dataplane) out_text: String,
    pub(in crate::dataplane) out_text_truncated: bool,
    /// The text the model produced against the text sent, for `no_silent_correction`.
    pub(in crate::dataplane) trail: safety::TextTrail,
    /// SafetyCheck inputs fixed at turn start.
    pub(in crate::dataplane) request_urls: BTreeSet<String>,
    pub(in crate::dataplane) identity_before: Option<safety::ModelIdentity>,
    pub(in crate::dataplane) identity_after: Option<safety::ModelIdentity>,
    /// SafetyCheck's verdict, once judged.
    /// In a cell so that the turn's record, built from `&Turn`, takes it instead of cloning it
    /// (the verdict with its inputs is the largest value a record carries).
    pub(in crate::dataplane) safety: std::cell::RefCell<Option<Value>>,
    pub(in crate::dataplane) enc: ChunkEncoder,
    /// Bytes of completion text so far (for `text_offset`).
    pub(in crate::dataplane) text_len: usize,
    /// Batch mode: the response held until the turn completes (the answer, and the
    /// reasoning that goes in `message.reasoning_content`).
    pub(in crate::dataplane) held_text: String,
    pub(in crate::dataplane) held_reasoning: String,
    pub(in crate::dataplane) held_tokens: Vec<HeldToken>,
    pub(in crate::dataplane) prompt_tokens: u64,
    /// The usage the final frame reported (prompt, completion): what the turn is charged
    /// against its scope's tokens per minute (`limits.rs`).
    pub(in crate::dataplane) usage: Option<(u64, u64)>,
    pub(in crate::dataplane) detector_refs: Vec<String>,
    pub(in crate::dataplane) last_token_ns: u64,
    pub(in crate::dataplane) token_gap_ns_sum: u64,
    /// Tool calls emitted to the client (streaming) or held (batch): `{index, id, name}`.
    pub(in crate::dataplane) tool_calls: Vec<Value>,
    /// Tool calls first seen in the frame in flight: dispatched once the kernel accepts it.
    pub(in crate::dataplane) tools_in_flight: Vec<Value>,
    /// What the source produced while a token of it waits for its score (`score.rs`).
    pub(in crate::dataplane) parked: Option<score::Parked>,
    /// Its record was written before its final frame (`record.rs`): none at the close.
    pub(in crate::dataplane) recorded: bool,
    /// Texts the turn released so far, counted only under the `close-during-step` fault.
    pub(in crate::dataplane) fault_texts: u64,
    /// What the request metrics need (`summary.rs`).
    pub(in crate::dataplane) obs: TurnObs,
    /// TokenCircuit (`circuit.rs`): proxied chat turns with `[tool_circuit] enabled`.
    pub(in crate::dataplane) circuit: Option<Box<circuit::TurnCircuit>>,
    /// Intervene mode with a grounder: the turn's grounding rounds (`ground.rs`).
    pub(in crate::dataplane) grounding: Option<Box<TurnGrounding>>,
}

impl Turn {
    /// A turn with nothing produced yet; the caller sets its SafetyCheck inputs.
    pub(in crate::dataplane) fn new(
        source: TurnSource,
        ask: &Ask,
        key_id: KeyId,
        degraded: bool,
        enc: ChunkEncoder,
        (gov, detector_refs): (TurnGovernor, Vec<String>),
        policy: crate::policy::TurnPolicy,
    ) -> Self {
        Turn {
            detectors: policy.detectors(),
            policy,
            source,
            stream: ask.stream,
            top_logprobs: ask.top_logprobs,
            include_usage: ask.include_usage,
            key_id,
            degraded,
            tokens_generated: 0,
            gov,
            hold: Hold::default(),
            first_frame_sent: false,
            out_text: String::new(),
            out_text_truncated: false,
            trail: safety::TextTrail::default(),
            request_urls: BTreeSet::new(),
            identity_before: None,
            identity_after: None,
            safety: std::cell::RefCell::new(None),
            enc,
            text_len: 0,
            held_text: String::new(),
            held_reasoning: String::new(),
            held_tokens: Vec::new(),
            prompt_tokens: 0,
            usage: None,
            detector_refs,
            last_token_ns: 0,
            token_gap_ns_sum: 0,
            tool_calls: Vec::new(),
            tools_in_flight: Vec::new(),
            parked: None,
            recorded: false,
            fault_texts: 0,
            obs: TurnObs::default(),
            circuit: None,
            grounding: None,
        }
    }

    /// Whether the turn waits for a grounding round: nothing goes past it.
    pub(in crate::dataplane) fn grounding_wait(&self) -> bool {
        self.grounding.as_ref().is_some_and(|g| g.waiting.is_some())
    }

    /// Keeps emitted text for SafetyCheck (bounded).
    pub(in crate::dataplane) fn note_output(&mut self, text: &str) {
        if self.out_text.len() + text.len() <= MAX_SAFETY_TEXT {
            self.out_text.push_str(text);
        } else {
            self.out_text_truncated = true;
        }
    }

    /// SafetyCheck's verdict on this turn (spec 004), as the record stores it. `completed`:
    /// the turn ends with its final frame (everything it produced must have been sent), not
    /// with a typed halt or error.
    pub(in crate::dataplane) fn safety_verdict(&self, completed: bool) -> safety::SafetyVerdict {
        let ctx = SafetyContext {
            request_source_urls: Some(safety::url_keys(&self.request_urls)),
            cited_urls: (!self.out_text_truncated)
                .then(|| safety::url_keys(safety::extract_urls(&self.out_text))),
            text_delivery: self.trail.delivery(completed),
            identity_before: self.identity_before.clone(),
            identity_after: self.identity_after.clone(),
            versor_condition: None,
        };
        self.detectors
            .safety
            .check(&ctx, &self.detectors.safety_pack)
    }
}

impl Io {
    /// Intervene mode for a proxied turn: held back `w` tokens and resumed as a continuation,
    /// or, without continuation, the post-hoc fallback (nothing held).
    /// A passed-through turn (`chat_shaped` false) is never resumed: a continuation is a
    /// chat request, which its backend's surface is not.
    fn ground_proxied(&self, turn: &mut Turn, w: usize, seed: ResumeSeed, chat_shaped: bool) {
        let resumable = self
            .shared
            .grounding
            .as_ref()
            .is_some_and(|p| p.continuation.resumes(chat_shaped));
        let mut back = holdback::HoldBack::new(w, 0);
        if !resumable {
            // The post-hoc fallback: token ends are kept for the span, nothing is held.
            back.open();
        }
        turn.hold.back = Some(back);
        turn.grounding = Some(Box::new(TurnGrounding {
            post_hoc: !resumable,
            prompt: last_user_text(&seed.body),
            seed: Some(seed),
            ..Default::default()
        }));
    }

    /// The hold-back window of a streamed turn whose surprise detector intervenes and that
    /// a grounder can serve (`holdback.rs`); `None`: nothing is held back.
    fn intervene_window(&self, turn: &Turn, mode: Mode) -> Option<usize> {
        let on = self.shared.grounding.is_some() && mode == Mode::Stream;
        (on && turn.gov.set.intervenes())
            .then(|| turn.detectors.cfg.surprise.cfg.effective_hold_back())
    }
}

impl Step<'_> {
    /// The checks and slot set-up every turn starts with: refuse while shutting down or
    /// without a flight recorder, look up degraded mode for the conversation, and fix the
    /// stream's mode and budget. `None`: the turn was refused (the reply is on its way).
    pub(in crate::dataplane) fn open_turn(
        &mut self,
        endpoint: Endpoint,
        client_stream: bool,
        who: &Identity,
        model: Arc<str>,
        policy: &crate::policy::TurnPolicy,
    ) -> io::Result<Option<(bool, Mode)>> {
        let shared = Arc::clone(&self.io.shared);
        // A hand-over's drain serves the turns of the connections it has (none is kept).
        let refusing = shared.draining.load(SeqCst) && !shared.handover.handing_over.load(SeqCst);
        if refusing || shared.shutting_down.load(SeqCst) {
            self.reply_error(
                &HttpError::new(503, "server_error", "haltd is shutting down")
                    .with_code("shutting_down")
                    .with_retry_after("1"),
            )?;
            return Ok(None);
        }
        if shared.recorder_failed.load(SeqCst) {
            // Fail closed: a turn that cannot be recorded is not served.
            self.reply_error(
                &HttpError::new(
                    503,
                    "server_error",
                    "the flight recorder is unavailable; haltd serves no turns until it is restarted with a writable ledger",
                )
                .with_code("recorder_failed"),
            )?;
            return Ok(None);
        }
        // A lock per turn start (degraded-mode registry), never per token.
        shared.expire_degraded();
        let in_doubt = shared.adopt_peer_degradations();
        let (degraded, migrated) = shared.modes.admit(who);
        let degraded = degraded || in_doubt;
        if let Some(ch) = migrated {
            shared.record_mode_change(&ch);
        }
        let conn = &mut *self.conn;
        let slot = shared.table.slot(conn.id.slot);
        slot.created.store(crate::clock::unix_secs(), SeqCst);
        slot.endpoint.store(endpoint);
        slot.key_id.store(who.conversation.0, SeqCst);
        slot.scope_id.store(who.scope.id.0, SeqCst);
        slot.scope_kind.store(who.scope.kind.as_u8(), SeqCst);
        slot.degraded.store(degraded, SeqCst);
        slot.client_sse.store(client_stream, SeqCst);
        // The route's B; a new turn never inherits a looser one (each turn stores its own).
        slot.budget.store(policy.route.budget, SeqCst);
        // Degraded safe mode, and a batch-only route, serve streaming requests as batch:
        // held until complete.
        let mode = if client_stream && !degraded && !policy.route.batch_only {
            Mode::Stream
        } else {
            Mode::Batch
        };
        if mode == Mode::Batch || degraded {
            // A batch response is all or nothing, and degraded mode runs with B = 0: no
            // token may follow a trip.
            slot.budget.store(0, SeqCst);
        }
        slot.mode.store(mode);
        // A turn's response is 200 once it starts, a halted one too (its terminal is a 200
        // response, or ends one); a refusal or a failure before the head says otherwise.
        conn.status = 200;
        {
            let mut meta = shared.meta(conn.id.slot);
            meta.model = Some(model);
            meta.policy = Some((policy.profile, Arc::clone(&policy.route.name)));
            meta.upstream_failure = None;
            meta.detector_trip = None;
            meta.timing = None;
            meta.tool_circuit = None;
            meta.request_id.clone_from(&conn.request_id);
        }
        Ok(Some((degraded, mode)))
    }

    /// The turn's model label and inter-token histogram, resolved once, at its start.
    pub(in crate::dataplane) fn observe_turn(&mut self) {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let route = conn.route;
        let Some(turn) = conn.turn.as_mut() else {
            return;
        };
        let requests = &shared.metrics.requests;
        let label = requests.models.label(Some(&turn.enc.model));
        turn.obs.inter_token = Some(requests.inter_token_handle(route, &label));
        turn.obs.model_label = Some(label);
        self.publish_timing();
    }

    /// Hands the turn's timing fields to its incident record ([`crate::halt::TurnMeta`]) when
    /// they may have changed: at the turn's start and after a breach. A lock then, never per
    /// token.
    pub(in crate::dataplane) fn publish_timing(&mut self) {
        let Some(turn) = self.conn.turn.as_mut() else {
            return;
        };
        if let Some(t) = turn.gov.set.timing_if_changed() {
            self.io.shared.meta(self.conn.id.slot).timing = Some(t);
        }
    }

    /// The detectors of a new turn and their references for records. A detector that cannot
    /// start (an external scorer that cannot be reached) trips the stream at once.
    pub(in crate::dataplane) fn turn_governor(
        &mut self,
        detectors: &Detectors,
    ) -> ((TurnGovernor, Vec<String>), Option<Trip>) {
        let id = self.conn.id;
        match detectors.turn(&id.to_string(), monotonic_ns()) {
            Ok(mut gov) => {
                gov.set.hang_on(self.io.shared.cfg.faults.detector_hang);
                let mut refs = vec!["operator".to_owned(), "watchdog:heartbeat".to_owned()];
                refs.extend(gov.refs());
                refs.push(match detectors.cfg.safety.mode {
                    crate::safety::SafetyMode::Enforce => "safety:enforce".to_owned(),
                    crate::safety::SafetyMode::Observe => "safety:observe".to_owned(),
                });
                ((gov, refs), None)
            }
            Err(trip) => (
                (
                    TurnGovernor::empty(),
                    vec![format!("{}:hard", trip.detector)],
                ),
                Some(trip),
            ),
        }
    }

    /// The turn's encoder: what every frame of it is written with. `tool_calls` and
    /// `reasoning`: the frames it may carry besides content (a proxied chat turn).
    pub(in crate::dataplane) fn encoder(
        &self,
        ask: &Ask,
        model: Arc<str>,
        (tool_calls, reasoning): (bool, bool),
    ) -> ChunkEncoder {
        let id = self.conn.id;
        ChunkEncoder {
            endpoint: ask.endpoint,
            stream_id: id,
            created: self.io.shared.table.slot(id.slot).created.load(SeqCst),
            model,
            logprobs: ask.logprobs,
            top_logprobs: ask.top_logprobs,
            tool_calls,
            reasoning,
            blocks: std::cell::Cell::default(),
            output: std::cell::RefCell::default(),
        }
    }

    /// The response head of a streaming turn, sent before its first token.
    pub(in crate::dataplane) fn send_stream_head(&mut self) -> io::Result<()> {
        let conn = &mut *self.conn;
        let out = frame(&mut conn.wbuf);
        let persist = conn.keep.persist();
        let rid = conn.request_id.as_deref().unwrap_or_default();
        http::write_head_persist(
            out,
            200,
            "text/event-stream",
            None,
            Some(conn.id),
            &[("x-request-id", rid)],
            persist,
        );
        if let Some(turn) = conn.turn.as_ref() {
            // `message_start` of a Messages stream goes out with the head, so that a halt
            // that follows (whose terminal knows nothing of the encoder) ends a started
            // message.
            let body = out.len();
            turn.enc.stream_start(out);
            if persist == http::Persist::KeepAlive && out.len() > body {
                http::chunk_in_place(out, body);
            }
        }
        let slot = self.io.shared.table.slot(conn.id.slot);
        if conn.count_frame(slot, 0, false) {
            slot.headers_sent.store(true, SeqCst);
            return self.send(SendKind::Head);
        }
        self.halt()
    }

    /// A turn of the built-in model.
    pub(in crate::dataplane) fn start_builtin_turn(
        &mut self,
        req: BuiltinTurn,
        who: Identity,
    ) -> io::Result<()> {
        let ask = &req.ask;
        let policy = self
            .io
            .shared
            .policy
            .load()
            .for_turn(&crate::policy::TurnKey {
                endpoint: ask.endpoint,
                model: MODEL_NAME,
                key: who.conversation,
            });
        let Some((degraded, mode)) =
            self.open_turn(ask.endpoint, ask.stream, &who, MODEL_NAME.into(), &policy)?
        else {
            return Ok(());
        };
        if self.asks_first(&who, degraded) {
            return self.start_asking(ask, MODEL_NAME.into(), &who, (mode, policy));
        }
        let (gov, failed) = self.turn_governor(&policy.route.detectors);
        let model = BuiltinModel::get();
        let restate = self.io.shared.cfg.args.builtin_restate_prompt;
        let source = TurnSource::Builtin(BuiltinSource::for_turn(&req, restate));
        let enc = self.encoder(ask, MODEL_NAME.into(), (false, false));
        let mut turn = Turn::new(source, ask, who.conversation, degraded, enc, gov, policy);
        turn.prompt_tokens = model.count_tokens(&req.prompt) as u64;
        turn.request_urls = crate::safety::extract_urls(&req.prompt);
        // The built-in model's identity cannot change within a turn: before and after are
        // the model the request named (checked equal to it) with no system prompt.
        let identity = crate::safety::ModelIdentity::new(MODEL_NAME, "");
        turn.identity_before = Some(identity.clone());
        turn.identity_after = Some(identity);
        if let Some(w) = self.io.intervene_window(&turn, mode) {
            if let TurnSource::Builtin(b) = &mut turn.source {
                b.history = crate::source::resume::History::with_capacity(w + 1);
            }
            turn.hold.back = Some(holdback::HoldBack::new(w, 0));
            turn.grounding = Some(Box::new(TurnGrounding {
                prompt: req.prompt.clone(),
                ..Default::default()
            }));
        }
        self.run_local_turn(turn, failed, mode)
    }

    /// Starts a turn whose source needs no upstream exchange (the built-in model, a fixed
    /// answer): governed and armed like any, then its head (streaming) and the pipeline.
    pub(in crate::dataplane) fn run_local_turn(
        &mut self,
        turn: Turn,
        failed: Option<Trip>,
        mode: Mode,
    ) -> io::Result<()> {
        self.conn.turn = Some(Box::new(turn));
        self.observe_turn();
        if !self.arm_turn_policy() {
            return self.halt();
        }
        if let Some(trip) = failed {
            return self.detector_trip(trip);
        }
        if mode == Mode::Stream {
            return self.send_stream_head();
        }
        self.step()
    }

    /// `POST /v1/chat/completions` or `/v1/completions` with `--source openai`.
    pub(in crate::dataplane) fn start_proxy_turn(
        &mut self,
        endpoint: Endpoint,
        head: &RequestHead,
        body: &[u8],
        who: Identity,
    ) -> io::Result<()> {
        let native = self.io.shared.cfg.upstream_surfaces.passes(endpoint);
        let auth = upstream_authorization(head, endpoint, native);
        self.conn.surface_headers = surface_headers(head, native);
        let degraded = self.io.degraded_now(&who);
        let arrival = circuit::Arrival {
            store: &self.io.shared.circuits,
            header: head.conversation_id.as_deref(),
            key: who.conversation,
            now: std::time::Instant::now(),
        };
        let routes = self.io.shared.policy.load();
        let ((up, request_urls, system_prompt, circuit), policy) = match prepare_proxied(
            (endpoint, native.is_some()),
            body,
            degraded.then(|| self.io.degraded_shape()),
            (&routes, arrival),
        ) {
            Ok(v) => v,
            Err(r) => {
                let e = (*r).settle(&self.io.shared, self.conn.id.to_string());
                return self.reply_error(&e);
            }
        };
        let model: Arc<str> = up.model.as_str().into();
        let Some((degraded, mode)) =
            self.open_turn(endpoint, up.ask.stream, &who, Arc::clone(&model), &policy)?
        else {
            return Ok(());
        };
        if self.asks_first(&who, degraded) {
            return self.start_asking(&up.ask, model, &who, (mode, policy));
        }
        let ((gov, mut detector_refs), failed) = self.turn_governor(&policy.route.detectors);
        detector_refs.push("upstream:integrity".to_owned());
        // Degraded mode emits no tool calls (a degraded stream is batch anyway).
        let chat = endpoint.is_chat_shaped();
        // Reasoning is forwarded in degraded mode too (it is text); tool calls are not.
        let enc = self.encoder(&up.ask, model, (chat && !degraded, chat));
        let source = TurnSource::Upstream(UpstreamSource::native(degraded, up.native));
        let mut turn = Turn::new(
            source,
            &up.ask,
            who.conversation,
            degraded,
            enc,
            (gov, detector_refs),
            policy,
        );
        turn.request_urls = request_urls;
        turn.circuit = circuit;
        let path = up.api_path();
        let mode = self.io.shared.table.slot(self.conn.id.slot).mode();
        if let Some(w) = self.io.intervene_window(&turn, mode) {
            let seed = ResumeSeed {
                body: up.body.clone(),
                endpoint,
                api_path: path,
                authorization: auth.clone(),
                system_prompt: system_prompt.clone(),
            };
            self.io
                .ground_proxied(&mut turn, w, seed, up.native.is_none());
        }
        turn.identity_before = Some(crate::safety::ModelIdentity::new(&up.model, &system_prompt));
        self.conn.turn = Some(Box::new(turn));
        self.observe_turn();
        if !self.arm_turn_policy() {
            return self.halt();
        }
        if let Some(trip) = failed {
            return self.detector_trip(trip);
        }
        let request = upstream_io::UpstreamRequest {
            purpose: Purpose::Turn,
            api_path: path,
            method: "POST",
            authorization: auth.as_deref(),
            body: Some(&up.body),
        };
        self.open_upstream(&request, system_prompt)
    }
}
