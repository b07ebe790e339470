//! The stream table: one slot per open client connection, shared by the data-plane workers,
//! the watchdog and the admin API, made of atomics so no thread ever waits on another to read
//! or trip a stream.
//!
//! # State machine and who moves it
//!
//! ```text
//!            alloc                 begin_frame (CAS, per frame)
//!  FREE ─────────────► STREAMING ◄──────────────► EMITTING
//!                        │   │ begin_final (CAS)
//!                        │   └──────────────► FINISHING ──► DONE ──► FREE
//!                        │ trip (CAS)
//!                        ▼
//!                     TRIPPING ──(kernel trip map written, τ fixed)──► TRIPPED
//!                                                                        │ claim_halt (CAS; emitter or watchdog)
//!                                                                        ▼
//!                                                       HALTING ──(terminal sent)──► HALTED ──► FREE
//! ```
//!
//! The per-frame CAS `STREAMING → EMITTING → STREAMING` around the frame counters is what makes
//! the kernel budget exact: a trip can only happen between two frames, so when the tripper
//! reads "frames handed to the kernel so far" (`F`) no frame is half-counted, and the kernel's
//! absolute limit `F + B` admits exactly B token frames after the trip point. The window is a
//! few atomic operations long; the tripper spins on it (see [`StreamTable::trip`]).
//!
//! Spec 000 §4 names four watchdog states; [`WatchdogState`] maps these onto them.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicU8, Ordering::SeqCst},
        Mutex,
    },
};

use serde::Serialize;

use crate::{
    codes::FailureCode,
    wire::{Endpoint, StreamId},
};

pub mod active;
pub mod initiator;
pub mod state;

use active::ActiveSlots;
pub use initiator::Initiator;
pub use state::{AtomicEnum, Halter, Mode, Outcome, SlotState, WatchdogState};

/// One stream's shared state. Every field is an atomic; see the module docs for the protocol.
#[derive(Debug, Default)]
pub struct Slot {
    pub generation: AtomicU32,
    pub state: AtomicEnum<SlotState>,
    /// Data-plane worker that owns the connection (whose eventfd to ring).
    pub worker: AtomicU32,
    pub fd: AtomicI32,
    pub mode: AtomicEnum<Mode>,
    pub endpoint: AtomicEnum<Endpoint>,
    /// 1 once the HTTP response head has been handed to the kernel.
    pub headers_sent: AtomicBool,
    /// Unix seconds the response was created (the OpenAI `created` field).
    pub created: AtomicU64,
    pub started_ns: AtomicU64,
    /// Wall-clock start (Unix ms), for records.
    pub started_unix_ms: AtomicU64,
    /// Frames handed to the kernel on this socket: the first send of each frame (terminal
    /// excluded). The gate's `SockState.frames` counts program runs, which can only be more
    /// (the rest of a short write may run the program again), never fewer, so a kernel limit
    /// computed from this count is exact or stricter.
    pub frames_submitted: AtomicU64,
    /// Bytes of the frames counted in `frames_submitted`, whole (the rest of a short write is
    /// part of its frame): where the stream's post-trip byte ceiling starts.
    pub bytes_submitted: AtomicU64,
    /// Token frames handed to the kernel.
    pub tokens_submitted: AtomicU64,
    /// A Responses stream's next `sequence_number` as of the last frame counted (stored
    /// before the frame's window, so a trip reads every event that can go out before it):
    /// the halted end's terminal event is numbered from it (`wire/responses/terminal.rs`).
    pub sse_events: AtomicU64,
    /// Token frames the kernel accepted in full.
    pub tokens_delivered: AtomicU64,
    /// Token frames with an index above the trip point that the kernel accepted.
    pub post_trip_delivered: AtomicU64,
    pub trip_cause: AtomicU32,
    /// Who tripped it ([`Initiator::as_u8`]; 0 before a trip).
    pub trip_initiator: AtomicU8,
    /// Whether the completed halt degrades the turn's scope (`HaltCore::halt_completed`):
    /// fixed with the trip, false when the operator opted out (`haltctl trip --no-degrade`)
    /// or the admin API already degraded the scope when it tripped.
    pub halt_degrades: AtomicBool,
    /// τ: tokens handed out before the trip; tokens numbered above it are post-trip.
    pub trip_token_index: AtomicU64,
    pub trip_ns: AtomicU64,
    pub nonce: AtomicU64,
    /// Whether the kernel trip map write succeeded; false makes the watchdog halt at once.
    pub kernel_tripped: AtomicBool,
    pub halted_by: AtomicEnum<Halter>,
    pub halt_ns: AtomicU64,
    /// Budget B in force for this stream (0 for batch).
    pub budget: AtomicU32,
    /// E: the largest token event this stream's encoder can write (0 before the turn starts).
    pub max_event_bytes: AtomicU32,
    /// The emitter has a send on this socket in flight; the watchdog does not write then.
    pub send_inflight: AtomicBool,
    /// The turn's conversation key (the credential's fingerprint, [`crate::modes::KeyId`]).
    pub key_id: AtomicU64,
    /// The turn's degraded scope (`scope.rs`): the scope a halt puts into degraded mode, and
    /// its kind ([`crate::scope::ScopeKind::as_u8`]).
    pub scope_id: AtomicU64,
    pub scope_kind: AtomicU8,
    /// The turn runs in degraded safe mode (FHR `runtime_mode`).
    pub degraded: AtomicBool,
    /// The client asked for `text/event-stream`, even if the turn is served as batch (degraded
    /// mode): a halt before the head answers in SSE then.
    pub client_sse: AtomicBool,
    /// The response goes out chunked, one chunk per frame (a kept connection's streaming
    /// response): the terminal frame is a chunk too.
    pub chunked: AtomicBool,
}

impl Slot {
    pub fn state(&self) -> SlotState {
        self.state.load()
    }
    pub fn mode(&self) -> Mode {
        self.mode.load()
    }
    pub fn endpoint(&self) -> Endpoint {
        self.endpoint.load()
    }
    pub fn trip_cause(&self) -> Option<FailureCode> {
        FailureCode::from_u32(self.trip_cause.load(SeqCst))
    }
    pub fn trip_initiator(&self) -> Option<Initiator> {
        Initiator::from_u8(self.trip_initiator.load(SeqCst))
    }
    pub fn is_tripped(&self) -> bool {
        self.state().is_tripped()
    }

    /// Accounts one frame before it is handed to the kernel, carrying `tokens` token events
    /// (0 for a frame that is no token: a head, a final frame). Returns false (and counts
    /// nothing) when the stream is tripping or tripped: the caller must halt instead.
    ///
    /// `ignore_halt` is the `emitter-ignores-halt` fault: the frame is counted and sent anyway,
    /// so only the kernel gate stops it.
    /// `len` is the frame's length in bytes, all of it, however many sends it takes.
    pub fn begin_frame(&self, tokens: u64, ignore_halt: bool, len: usize) -> bool {
        loop {
            match self
                .state
                .compare_exchange_weak(SlotState::Streaming, SlotState::Emitting)
            {
                Ok(_) => {
                    self.count_frame(tokens, len);
                    self.state.store(SlotState::Streaming);
                    return true;
                }
                Err(SlotState::Streaming) => continue, // spurious failure of the weak CAS
                Err(SlotState::Tripped | SlotState::Halting) if ignore_halt && tokens > 0 => {
                    self.count_frame(tokens, len);
                    return true;
                }
                Err(_) => return false,
            }
        }
    }

    /// Accounts the last frame of a stream that ends normally (the `[DONE]` frame or a whole
    /// batch body). After it the stream can no longer be tripped.
    pub fn begin_final(&self, len: usize) -> bool {
        loop {
            match self
                .state
                .compare_exchange_weak(SlotState::Streaming, SlotState::Finishing)
            {
                Ok(_) => {
                    self.count_frame(0, len);
                    return true;
                }
                Err(SlotState::Streaming) => continue,
                Err(_) => return false,
            }
        }
    }

    fn count_frame(&self, tokens: u64, len: usize) {
        // Order matters: tokens before frames here, frames before tokens in `trip`, so τ can
        // only be read too high relative to the frame limit (stricter), never too low. The
        // bytes are counted inside the same EMITTING window as the frame, so a trip never
        // reads a frame without its bytes.
        if tokens > 0 {
            self.tokens_submitted.fetch_add(tokens, SeqCst);
        }
        self.bytes_submitted.fetch_add(len as u64, SeqCst);
        self.frames_submitted.fetch_add(1, SeqCst);
    }

    /// Runs `f` inside the frame window (STREAMING → EMITTING → STREAMING), where no trip can
    /// happen: for kernel policy writes that must not overwrite a trip. Returns false, without
    /// running `f`, once the stream is tripping or tripped (or over).
    pub fn while_untripped(&self, f: impl FnOnce()) -> bool {
        loop {
            match self
                .state
                .compare_exchange_weak(SlotState::Streaming, SlotState::Emitting)
            {
                Ok(_) => {
                    f();
                    self.state.store(SlotState::Streaming);
                    return true;
                }
                Err(SlotState::Streaming) => continue,
                Err(_) => return false,
            }
        }
    }

    /// Takes a stream that is not tripped out of reach of trips before its connection
    /// closes: STREAMING → DONE. Returns false while a trip is in progress or the stream is
    /// tripped (the caller waits for the halt), true otherwise.
    pub fn settle_for_close(&self) -> bool {
        loop {
            match self
                .state
                .compare_exchange_weak(SlotState::Streaming, SlotState::Done)
            {
                Ok(_) => return true,
                Err(SlotState::Streaming | SlotState::Emitting) => std::hint::spin_loop(),
                Err(SlotState::Tripping | SlotState::Tripped | SlotState::Halting) => return false,
                Err(_) => return true,
            }
        }
    }

    /// Moves TRIPPED → HALTING for the caller; only one of emitter and watchdog wins.
    pub fn claim_halt(&self) -> bool {
        self.state
            .compare_exchange(SlotState::Tripped, SlotState::Halting)
            .is_ok()
    }

    /// Records who completed the halt and when, still in HALTING (the socket stays the
    /// halter's until [`Slot::publish_halted`]).
    pub fn note_halt(&self, by: Halter, now_ns: u64) {
        self.halted_by.store(by);
        self.halt_ns.store(now_ns, SeqCst);
    }

    /// HALTING → HALTED: from here the owning worker may close the socket.
    pub fn publish_halted(&self) {
        self.state.store(SlotState::Halted);
    }

    /// Records a completed halt (HALTING → HALTED).
    pub fn finish_halt(&self, by: Halter, now_ns: u64) {
        self.note_halt(by, now_ns);
        self.publish_halted();
    }

    /// A consistent-enough copy for records, admin listings and the terminal frame.
    pub fn snapshot(&self, slot: u32) -> SlotSnapshot {
        let state = self.state();
        SlotSnapshot {
            id: StreamId {
                slot,
                generation: self.generation.load(SeqCst),
            },
            slot_state: state,
            state: WatchdogState::from(state),
            mode: self.mode(),
            endpoint: self.endpoint(),
            headers_sent: self.headers_sent.load(SeqCst),
            created: self.created.load(SeqCst),
            tokens_submitted: self.tokens_submitted.load(SeqCst),
            sse_events: self.sse_events.load(SeqCst),
            tokens_delivered: self.tokens_delivered.load(SeqCst),
            post_trip_delivered: self.post_trip_delivered.load(SeqCst),
            trip_cause: self.trip_cause(),
            trip_initiator: self.trip_initiator(),
            halt_degrades: self.halt_degrades.load(SeqCst),
            trip_token_index: self.trip_token_index.load(SeqCst),
            trip_ns: self.trip_ns.load(SeqCst),
            nonce: self.nonce.load(SeqCst),
            halted_by: self.halted_by.load(),
            halt_ns: self.halt_ns.load(SeqCst),
            started_ns: self.started_ns.load(SeqCst),
            started_unix_ms: self.started_unix_ms.load(SeqCst),
            budget: self.budget.load(SeqCst),
            key_id: self.key_id.load(SeqCst),
            scope_id: self.scope_id.load(SeqCst),
            scope_kind: self.scope_kind.load(SeqCst),
            degraded: self.degraded.load(SeqCst),
            client_sse: self.client_sse.load(SeqCst),
            chunked: self.chunked.load(SeqCst),
        }
    }
}

/// A copy of one slot's fields at one moment.
#[derive(Clone, Copy, Debug)]
pub struct SlotSnapshot {
    pub id: StreamId,
    pub slot_state: SlotState,
    pub state: WatchdogState,
    pub mode: Mode,
    pub endpoint: Endpoint,
    pub headers_sent: bool,
    pub created: u64,
    pub tokens_submitted: u64,
    pub sse_events: u64,
    pub tokens_delivered: u64,
    pub post_trip_delivered: u64,
    pub trip_cause: Option<FailureCode>,
    pub trip_initiator: Option<Initiator>,
    pub halt_degrades: bool,
    pub trip_token_index: u64,
    pub trip_ns: u64,
    pub nonce: u64,
    pub halted_by: Halter,
    pub halt_ns: u64,
    pub started_ns: u64,
    pub started_unix_ms: u64,
    pub budget: u32,
    pub key_id: u64,
    pub scope_id: u64,
    pub scope_kind: u8,
    pub degraded: bool,
    pub client_sse: bool,
    pub chunked: bool,
}

impl SlotSnapshot {
    /// The turn's degraded scope (`scope.rs`).
    pub fn scope(&self) -> crate::scope::Scope {
        crate::scope::Scope {
            kind: crate::scope::ScopeKind::from_u8(self.scope_kind),
            id: crate::identity::KeyId(self.scope_id),
        }
    }
}

impl SlotSnapshot {
    /// Time from the trip to the completed halt, in milliseconds (0 before the halt).
    pub fn halt_latency_ms(&self) -> f64 {
        self.halt_ns.saturating_sub(self.trip_ns) as f64 / 1e6
    }
}

/// What a successful trip fixed.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct TripInfo {
    #[serde(serialize_with = "ser_display")]
    pub stream_id: StreamId,
    pub cause: FailureCode,
    pub trip_token_index: u64,
    pub budget: u32,
    /// Whether the kernel gate holds the trip (false with `--no-kernel-gate`, or if the map
    /// write failed, in which case the watchdog closes the stream at once).
    pub kernel_enforced: bool,
}

fn ser_display<S: serde::Serializer>(v: &StreamId, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Why a trip request did nothing.
#[derive(Debug, thiserror::Error)]
pub enum TripError {
    #[error("no stream {0}")]
    Unknown(StreamId),
    #[error("stream {id} already tripped (cause {cause}, trip token index {trip_token_index})")]
    AlreadyTripped {
        id: StreamId,
        cause: FailureCode,
        trip_token_index: u64,
    },
    #[error("stream {0} already finished: its last frame was committed before the trip, or it has ended")]
    Finished(StreamId),
}

/// What the table needs from the kernel gate when a stream trips. Implemented by the gate
/// glue in the daemon; absent with `--no-kernel-gate`.
pub trait KernelTrip: Send + Sync {
    /// Writes the trip into the gate.
    fn trip(&self, id: StreamId, trip: &KernelTripPoint) -> bool;
}

/// What a trip fixed that the kernel gate needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelTripPoint {
    pub cause: FailureCode,
    /// `F`: frames handed to the kernel before the trip.
    pub frames: u64,
    /// Bytes of those frames, whole.
    pub bytes: u64,
    /// B of this stream.
    pub budget: u32,
    pub nonce: u64,
}

/// What a connection sent before this stream began, for a stream that continues a kept
/// connection: the gate counts frames and bytes per socket, over all its turns, so the
/// stream's counters start where the socket's stand and `F` and `S(F)` stay absolute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SentBefore {
    pub frames: u64,
    pub bytes: u64,
}

/// Fixed-capacity table of stream slots.
#[derive(Debug)]
pub struct StreamTable {
    slots: Box<[Slot]>,
    /// Free slot indices, oldest-freed first. Taken once per connection (accept) and given
    /// back once per close, never per token, so a mutex is fine here. FIFO reuse keeps a
    /// finished stream's trip fields (and so its answer to a late trip) for as long as
    /// possible: a slot comes back only after every other free slot was used.
    free: Mutex<VecDeque<u32>>,
    /// The slots taken and not yet given back: what [`StreamTable::live`] walks.
    active: ActiveSlots,
}

impl StreamTable {
    pub fn new(capacity: u32) -> Self {
        let slots: Box<[Slot]> = (0..capacity).map(|_| Slot::default()).collect();
        let free = (0..capacity).collect();
        StreamTable {
            slots,
            free: Mutex::new(free),
            active: ActiveSlots::new(capacity),
        }
    }

    pub fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Takes a free slot for a new connection; `None` when the table is full (the caller
    /// refuses the connection: a stream that cannot be governed is never served).
    pub fn alloc(&self, worker: u32, fd: i32, budget: u32, now_ns: u64) -> Option<StreamId> {
        self.alloc_after(worker, fd, budget, now_ns, SentBefore::default())
    }

    /// [`StreamTable::alloc`] for the next turn of a kept connection, whose socket already
    /// carried `before`: the counters start there, before the stream is live, so a trip
    /// never reads counts below the socket's.
    pub fn alloc_after(
        &self,
        worker: u32,
        fd: i32,
        budget: u32,
        now_ns: u64,
        before: SentBefore,
    ) -> Option<StreamId> {
        let idx = self
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()?;
        let s = &self.slots[idx as usize];
        let generation = s.generation.load(SeqCst).wrapping_add(1);
        s.generation.store(generation, SeqCst);
        s.worker.store(worker, SeqCst);
        s.fd.store(fd, SeqCst);
        s.mode.store(Mode::Pending);
        s.endpoint.store(Endpoint::Chat);
        s.headers_sent.store(false, SeqCst);
        s.degraded.store(false, SeqCst);
        s.client_sse.store(false, SeqCst);
        s.key_id.store(0, SeqCst);
        s.scope_id.store(0, SeqCst);
        s.scope_kind.store(0, SeqCst);
        s.created.store(0, SeqCst);
        s.started_ns.store(now_ns, SeqCst);
        s.started_unix_ms.store(crate::clock::unix_ms_now(), SeqCst);
        for c in [
            &s.frames_submitted,
            &s.bytes_submitted,
            &s.tokens_submitted,
            &s.sse_events,
            &s.tokens_delivered,
            &s.post_trip_delivered,
            &s.trip_token_index,
            &s.trip_ns,
            &s.nonce,
            &s.halt_ns,
        ] {
            c.store(0, SeqCst);
        }
        s.frames_submitted.store(before.frames, SeqCst);
        s.bytes_submitted.store(before.bytes, SeqCst);
        s.chunked.store(false, SeqCst);
        s.trip_cause.store(0, SeqCst);
        s.trip_initiator.store(0, SeqCst);
        s.halt_degrades.store(true, SeqCst);
        s.kernel_tripped.store(false, SeqCst);
        s.send_inflight.store(false, SeqCst);
        s.halted_by.store(Halter::None);
        s.budget.store(budget, SeqCst);
        s.max_event_bytes.store(0, SeqCst);
        // In the active set before it is live, so a walk never misses a live slot.
        self.active.insert(idx);
        s.state.store(SlotState::Streaming);
        Some(StreamId {
            slot: idx,
            generation,
        })
    }

    /// Gives a slot back once its connection is closed and its records are written.
    pub fn release(&self, id: StreamId) {
        let s = &self.slots[id.slot as usize];
        s.fd.store(-1, SeqCst);
        s.state.store(SlotState::Free);
        // Out of the active set before it is free to take: a later `alloc` of this slot
        // inserts it again after this.
        self.active.remove(id.slot);
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(id.slot);
    }

    pub fn slot(&self, idx: u32) -> &Slot {
        &self.slots[idx as usize]
    }

    /// The slot of a live stream with this id.
    pub fn get(&self, id: StreamId) -> Option<&Slot> {
        let s = self.slots.get(id.slot as usize)?;
        (s.generation.load(SeqCst) == id.generation && s.state() != SlotState::Free).then_some(s)
    }

    /// Why `id` names no live stream: it ended (its slot moved on to a later generation, or
    /// is free after it), or it never existed.
    fn why_not_live(&self, id: StreamId) -> TripError {
        match self.slots.get(id.slot as usize) {
            Some(s) if id.generation != 0 && id.generation == s.generation.load(SeqCst) => {
                ended(id, s)
            }
            // Generations start at 1 and only grow (wrapping after 2^32 streams on one slot).
            Some(s) if id.generation != 0 && id.generation < s.generation.load(SeqCst) => {
                TripError::Finished(id)
            }
            _ => TripError::Unknown(id),
        }
    }

    /// Iterates over slots that are not free; costs the open streams plus one word per 64
    /// slots, whatever the table's capacity.
    pub fn live(&self) -> impl Iterator<Item = (u32, &Slot)> {
        self.active
            .iter()
            .map(|i| (i, &self.slots[i as usize]))
            .filter(|(_, s)| s.state() != SlotState::Free)
    }

    /// Whether any slot is taken (a set bit of the active-slot bitmap; a slot being taken or
    /// given back counts): what keeps the watchdog out of idle mode.
    pub fn any_live(&self) -> bool {
        self.active.any()
    }

    pub fn active_count(&self) -> usize {
        self.live().count()
    }

    /// Trips a stream: fixes the trip point τ, writes the kernel gate, then publishes TRIPPED.
    ///
    /// Called by the admin API (operator trips), the emitter (detector trips) and the
    /// watchdog, each on its own thread. The caller wakes the owning worker afterwards.
    pub fn trip(
        &self,
        id: StreamId,
        cause: FailureCode,
        kernel: Option<&dyn KernelTrip>,
        now_ns: u64,
    ) -> Result<TripInfo, TripError> {
        self.trip_by(id, (cause, Initiator::of(cause), true), kernel, now_ns)
    }

    /// [`StreamTable::trip`], saying who trips and whether the halt degrades the turn's
    /// scope: both are fixed with the cause, before the stream is TRIPPED, so the halt that
    /// follows reads them.
    pub fn trip_by(
        &self,
        id: StreamId,
        (cause, initiator, halt_degrades): (FailureCode, Initiator, bool),
        kernel: Option<&dyn KernelTrip>,
        now_ns: u64,
    ) -> Result<TripInfo, TripError> {
        let Some(s) = self.get(id) else {
            return Err(self.why_not_live(id));
        };
        // Take the stream out of STREAMING. EMITTING lasts a few atomic operations, so spin
        // on it (yielding, in case the emitter was preempted inside the window).
        let mut spins = 0u32;
        loop {
            match s
                .state
                .compare_exchange_weak(SlotState::Streaming, SlotState::Tripping)
            {
                Ok(_) => break,
                Err(SlotState::Streaming | SlotState::Emitting) => {
                    spins += 1;
                    if spins > 64 {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                Err(SlotState::Finishing | SlotState::Done | SlotState::Free) => {
                    return Err(ended(id, s))
                }
                Err(_) => {
                    // Spin until a concurrent trip has published its result.
                    while s.state() == SlotState::Tripping {
                        std::hint::spin_loop();
                    }
                    return Err(TripError::AlreadyTripped {
                        id,
                        cause: s.trip_cause().unwrap_or(cause),
                        trip_token_index: s.trip_token_index.load(SeqCst),
                    });
                }
            }
        }
        // Frames first, then tokens (the reverse of `count_frame`).
        let frames = s.frames_submitted.load(SeqCst);
        let bytes = s.bytes_submitted.load(SeqCst);
        let tau = s.tokens_submitted.load(SeqCst);
        let budget = s.budget.load(SeqCst);
        let nonce = loop {
            let n: u64 = rand::random();
            if n != 0 {
                break n;
            }
        };
        s.trip_cause.store(cause.as_u32(), SeqCst);
        s.trip_initiator.store(initiator.as_u8(), SeqCst);
        s.halt_degrades.store(halt_degrades, SeqCst);
        s.trip_token_index.store(tau, SeqCst);
        s.nonce.store(nonce, SeqCst);
        s.trip_ns.store(now_ns, SeqCst);
        let point = KernelTripPoint {
            cause,
            frames,
            bytes,
            budget,
            nonce,
        };
        let kernel_enforced = kernel.is_some_and(|k| k.trip(id, &point));
        s.kernel_tripped.store(kernel_enforced, SeqCst);
        s.state.store(SlotState::Tripped);
        Ok(TripInfo {
            stream_id: id,
            cause,
            trip_token_index: tau,
            budget,
            kernel_enforced,
        })
    }
}

/// Why a stream that is over cannot trip: it was halted (then say how, as a second trip
/// would), or it finished normally. Trip fields stay in the slot until it is reused.
fn ended(id: StreamId, s: &Slot) -> TripError {
    match s.trip_cause() {
        Some(cause) if s.generation.load(SeqCst) == id.generation => TripError::AlreadyTripped {
            id,
            cause,
            trip_token_index: s.trip_token_index.load(SeqCst),
        },
        _ => TripError::Finished(id),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{atomic::AtomicU64, Arc};

    use super::*;

    struct RecordingKernel(AtomicU64);
    impl KernelTrip for RecordingKernel {
        fn trip(&self, _: StreamId, p: &KernelTripPoint) -> bool {
            self.0.store(p.frames + u64::from(p.budget), SeqCst);
            true
        }
    }

    #[test]
    fn trip_fixes_tau_and_an_exact_frame_limit_and_stops_frames() {
        let t = StreamTable::new(4);
        let id = t.alloc(0, -1, 5, 1).expect("free slot");
        let s = t.get(id).expect("live");
        assert!(s.begin_frame(0, false, 100)); // response head
        for _ in 0..3 {
            assert!(s.begin_frame(1, false, 10));
        }
        let k = RecordingKernel(AtomicU64::new(0));
        let info = t
            .trip(id, FailureCode::OperatorTrip, Some(&k), 2)
            .expect("trips");
        assert_eq!(info.trip_token_index, 3);
        assert_eq!(k.0.load(SeqCst), 4 + 5);
        assert!(!s.begin_frame(1, false, 10), "no frame after a trip");
        assert!(s.begin_frame(1, true, 10), "the fault keeps sending");
        assert!(matches!(
            t.trip(id, FailureCode::ExfilAlert, Some(&k), 3),
            Err(TripError::AlreadyTripped {
                trip_token_index: 3,
                ..
            })
        ));
        assert!(s.claim_halt());
        assert!(!s.claim_halt(), "only one halter");
        s.finish_halt(Halter::Emitter, 3);
        t.release(id);
        assert!(
            matches!(
                t.trip(id, FailureCode::ExfilAlert, Some(&k), 4),
                Err(TripError::AlreadyTripped {
                    trip_token_index: 3,
                    cause: FailureCode::OperatorTrip,
                    ..
                })
            ),
            "a halted, closed stream still says how it was tripped"
        );
    }

    struct PointKernel(Mutex<Option<KernelTripPoint>>);
    impl KernelTrip for PointKernel {
        fn trip(&self, _: StreamId, p: &KernelTripPoint) -> bool {
            *self.0.lock().expect("not poisoned") = Some(*p);
            true
        }
    }

    #[test]
    fn a_continued_stream_trips_at_the_sockets_absolute_counts() {
        let t = StreamTable::new(2);
        let first = t.alloc(0, 7, 5, 1).expect("free slot");
        let s = t.get(first).expect("live");
        assert!(s.begin_frame(0, false, 100));
        assert!(s.begin_frame(1, false, 10));
        assert!(s.begin_final(50));
        let before = SentBefore {
            frames: s.frames_submitted.load(SeqCst),
            bytes: s.bytes_submitted.load(SeqCst),
        };
        assert_eq!(
            before,
            SentBefore {
                frames: 3,
                bytes: 160
            }
        );
        t.release(first);
        let next = t.alloc_after(0, 7, 5, 2, before).expect("free slot");
        assert_ne!(next, first, "a new stream id for the next turn");
        let s = t.get(next).expect("live");
        assert_eq!(s.tokens_submitted.load(SeqCst), 0, "tokens count per turn");
        assert!(s.begin_frame(0, false, 100));
        assert!(s.begin_frame(1, false, 10));
        let k = PointKernel(Mutex::new(None));
        let info = t
            .trip(next, FailureCode::OperatorTrip, Some(&k), 3)
            .expect("trips");
        assert_eq!(info.trip_token_index, 1);
        let p =
            k.0.lock()
                .expect("not poisoned")
                .expect("the kernel was written");
        assert_eq!(
            (p.frames, p.bytes),
            (5, 270),
            "F and S(F) count the whole socket"
        );
    }

    #[test]
    fn finished_streams_cannot_trip_and_released_ids_go_stale() {
        let t = StreamTable::new(1);
        let id = t.alloc(0, -1, 5, 1).expect("free slot");
        assert!(t.get(id).expect("live").begin_final(10));
        assert!(matches!(
            t.trip(id, FailureCode::OperatorTrip, None, 2),
            Err(TripError::Finished(_))
        ));
        t.release(id);
        assert!(t.get(id).is_none());
        assert!(matches!(
            t.trip(id, FailureCode::OperatorTrip, None, 2),
            Err(TripError::Finished(_))
        ));
        let never = StreamId {
            slot: id.slot,
            generation: id.generation + 5,
        };
        assert!(matches!(
            t.trip(never, FailureCode::OperatorTrip, None, 2),
            Err(TripError::Unknown(_))
        ));
        let id2 = t.alloc(0, -1, 5, 1).expect("slot reused");
        assert_eq!(id2.slot, id.slot);
        assert_ne!(id2, id);
        assert!(t.alloc(0, -1, 5, 1).is_none(), "full table refuses");
    }

    #[test]
    fn live_lists_the_claimed_slots_until_they_are_released() {
        let t = StreamTable::new(200);
        assert_eq!(t.live().count(), 0);
        let ids: Vec<StreamId> = (0..130)
            .map(|_| t.alloc(0, -1, 5, 1).expect("slot"))
            .collect();
        for id in ids.iter().step_by(2) {
            t.release(*id);
        }
        let live: Vec<u32> = t.live().map(|(i, _)| i).collect();
        let kept: Vec<u32> = ids.iter().skip(1).step_by(2).map(|id| id.slot).collect();
        assert_eq!(live, kept);
        assert_eq!(t.active_count(), 65);
        // Released slots come back (FIFO) and are listed again.
        let again: Vec<StreamId> = (0..135)
            .map(|_| t.alloc(0, -1, 5, 1).expect("slot"))
            .collect();
        assert_eq!(t.active_count(), 200);
        assert!(again.iter().all(|id| t.live().any(|(i, _)| i == id.slot)));
    }

    /// Many emitters and trippers at once: the kernel limit always equals frames counted
    /// before the trip plus B, and τ never exceeds the tokens counted within that limit.
    #[test]
    fn concurrent_trips_never_split_a_frame() {
        for round in 0..200u64 {
            let t = Arc::new(StreamTable::new(1));
            let id = t.alloc(0, -1, 0, 1).expect("slot");
            let t2 = Arc::clone(&t);
            let emitter = std::thread::spawn(move || {
                let s = t2.get(id).expect("live");
                let mut sent = 0u64;
                while s.begin_frame(1, false, 1) {
                    sent += 1;
                }
                sent
            });
            for _ in 0..(round % 50) {
                std::hint::spin_loop();
            }
            let k = RecordingKernel(AtomicU64::new(0));
            let info = t
                .trip(id, FailureCode::OperatorTrip, Some(&k), 1)
                .expect("trips");
            let sent = emitter.join().expect("emitter");
            assert_eq!(
                sent, info.trip_token_index,
                "with B = 0 exactly τ frames went out"
            );
            assert_eq!(k.0.load(SeqCst), sent);
        }
    }
}
