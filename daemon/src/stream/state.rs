//! The typed states a slot holds in its atomics: [`SlotState`] (the state machine of the
//! module above), [`Halter`] (who completed a halt), [`Mode`] and the endpoint. Each is a
//! `#[repr(u8)]` enum stored in an [`AtomicEnum`], which only ever writes the enum's own values,
//! so a load always reads one of them; loads, stores and compare-exchanges are `SeqCst`, exactly
//! the operations the protocol used on the raw `AtomicU8`s.

use std::{
    fmt,
    marker::PhantomData,
    sync::atomic::{AtomicU8, Ordering::SeqCst},
};

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use serde::Serialize;

use crate::wire::Endpoint;

/// A `#[repr(u8)]` enum that an [`AtomicEnum`] can hold.
pub trait AtomicRepr: Copy {
    /// The enum's discriminant.
    fn to_raw(self) -> u8;
    /// The value whose discriminant is `raw`. An [`AtomicEnum`] only stores discriminants of
    /// the enum, so only they come back; any other byte maps to the enum's initial value.
    fn from_raw(raw: u8) -> Self;
}

/// An enum in an `AtomicU8`.
pub struct AtomicEnum<T> {
    raw: AtomicU8,
    _t: PhantomData<T>,
}

impl<T: AtomicRepr> AtomicEnum<T> {
    pub fn new(v: T) -> Self {
        AtomicEnum {
            raw: AtomicU8::new(v.to_raw()),
            _t: PhantomData,
        }
    }

    pub fn load(&self) -> T {
        T::from_raw(self.raw.load(SeqCst))
    }

    pub fn store(&self, v: T) {
        self.raw.store(v.to_raw(), SeqCst);
    }

    /// `AtomicU8::compare_exchange` (`SeqCst` both ways): `Err` carries the value found.
    pub fn compare_exchange(&self, current: T, new: T) -> Result<T, T> {
        self.raw
            .compare_exchange(current.to_raw(), new.to_raw(), SeqCst, SeqCst)
            .map(T::from_raw)
            .map_err(T::from_raw)
    }

    /// `AtomicU8::compare_exchange_weak` (`SeqCst` both ways): may fail spuriously, with the
    /// value found being `current`.
    pub fn compare_exchange_weak(&self, current: T, new: T) -> Result<T, T> {
        self.raw
            .compare_exchange_weak(current.to_raw(), new.to_raw(), SeqCst, SeqCst)
            .map(T::from_raw)
            .map_err(T::from_raw)
    }
}

impl<T: AtomicRepr + Default> Default for AtomicEnum<T> {
    fn default() -> Self {
        Self::new(T::default())
    }
}

impl<T: AtomicRepr + fmt::Debug> fmt::Debug for AtomicEnum<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.load(), f)
    }
}

/// Slot states; see the module docs above for the transitions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum SlotState {
    /// Slot unused.
    #[default]
    Free = 0,
    /// Live, untripped, between frames.
    Streaming = 1,
    /// Inside the per-frame accounting window (a few atomic operations).
    Emitting = 2,
    /// A tripper owns the stream and is writing the kernel trip map.
    Tripping = 3,
    /// Trip published; τ, cause, nonce fixed; budget countdown running.
    Tripped = 4,
    /// Emitter or watchdog won `claim_halt` and is sending the terminal frame.
    Halting = 5,
    /// Halt complete (`halted_by`, `halt_ns` set).
    Halted = 6,
    /// Final frame accounted; can no longer trip.
    Finishing = 7,
    /// Ended normally, or the client went away (made untrippable first).
    Done = 8,
}

impl AtomicRepr for SlotState {
    fn to_raw(self) -> u8 {
        self as u8
    }
    fn from_raw(raw: u8) -> Self {
        match raw {
            1 => SlotState::Streaming,
            2 => SlotState::Emitting,
            3 => SlotState::Tripping,
            4 => SlotState::Tripped,
            5 => SlotState::Halting,
            6 => SlotState::Halted,
            7 => SlotState::Finishing,
            8 => SlotState::Done,
            _ => SlotState::Free,
        }
    }
}

impl SlotState {
    /// Tripping, tripped, halting or halted: the stream was tripped.
    pub fn is_tripped(self) -> bool {
        matches!(
            self,
            SlotState::Tripping | SlotState::Tripped | SlotState::Halting | SlotState::Halted
        )
    }
}

/// The watchdog states of spec 000 §4.1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum WatchdogState {
    #[serde(rename = "W_IDLE")]
    Idle,
    #[serde(rename = "W_STREAMING")]
    Streaming,
    #[serde(rename = "W_TRIPPED")]
    Tripped,
    #[serde(rename = "W_HALTED")]
    Halted,
}

impl From<SlotState> for WatchdogState {
    fn from(s: SlotState) -> Self {
        match s {
            SlotState::Streaming | SlotState::Emitting | SlotState::Finishing => {
                WatchdogState::Streaming
            }
            SlotState::Tripping | SlotState::Tripped | SlotState::Halting => WatchdogState::Tripped,
            SlotState::Halted => WatchdogState::Halted,
            SlotState::Free | SlotState::Done => WatchdogState::Idle,
        }
    }
}

/// Who completed a halt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Halter {
    /// Not halted (yet).
    #[default]
    None = 0,
    Emitter = 1,
    Watchdog = 2,
}

impl Halter {
    /// Both halters, in the order metrics list them.
    pub const ALL: [Halter; 2] = [Halter::Emitter, Halter::Watchdog];

    /// The name records, logs and the `halted_by` metric label use.
    pub fn as_str(self) -> &'static str {
        match self {
            Halter::None => "none",
            Halter::Emitter => "emitter",
            Halter::Watchdog => "watchdog",
        }
    }
}

impl EncodeLabelValue for Halter {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

impl AtomicRepr for Halter {
    fn to_raw(self) -> u8 {
        self as u8
    }
    fn from_raw(raw: u8) -> Self {
        match raw {
            1 => Halter::Emitter,
            2 => Halter::Watchdog,
            _ => Halter::None,
        }
    }
}

/// How a stream (a connection) ended: the turn record's `outcome` and the `outcome` label of
/// `haltd_streams_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Not ended (yet).
    Open,
    /// Its final frame was accepted: the turn ended cleanly.
    Completed,
    Halted,
    /// The client went away.
    ClientGone,
    /// Answered with an error status (the request, or haltd's state, refused it).
    Rejected,
    /// The upstream failed before the client's response began (answered 502/504 or the
    /// upstream's own error status).
    UpstreamFailed,
    /// The client stopped reading (`--send-stall-timeout-ms`): its connection was reset.
    ClientStalled,
}

impl Outcome {
    /// How a turn ended, from its trip cause (if it tripped) and its connection's outcome: a
    /// tripped turn halted, with `CLIENT_STALLED` as the `client_stalled` it is.
    pub fn of_turn(trip_cause: Option<crate::codes::FailureCode>, conn: Outcome) -> Outcome {
        match trip_cause {
            Some(crate::codes::FailureCode::ClientStalled) => Outcome::ClientStalled,
            Some(_) => Outcome::Halted,
            None => conn,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Open => "open",
            Outcome::Completed => "completed",
            Outcome::Halted => "halted",
            Outcome::ClientGone => "client_gone",
            Outcome::Rejected => "rejected",
            Outcome::UpstreamFailed => "upstream_failed",
            Outcome::ClientStalled => "client_stalled",
        }
    }
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

/// Response shape of a stream, kept in the slot so the watchdog can write the terminal frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Mode {
    /// Not yet known (request still being read).
    #[default]
    Pending = 0,
    /// `stream: true`: SSE, one token per event.
    Stream = 1,
    /// `stream: false`: one JSON body, held until the turn completes.
    Batch = 2,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Pending => "pending",
            Mode::Stream => "stream",
            Mode::Batch => "batch",
        }
    }
}

impl AtomicRepr for Mode {
    fn to_raw(self) -> u8 {
        self as u8
    }
    fn from_raw(raw: u8) -> Self {
        match raw {
            1 => Mode::Stream,
            2 => Mode::Batch,
            _ => Mode::Pending,
        }
    }
}

impl AtomicRepr for Endpoint {
    fn to_raw(self) -> u8 {
        self as u8
    }
    fn from_raw(raw: u8) -> Self {
        match raw {
            1 => Endpoint::Completion,
            2 => Endpoint::Messages,
            3 => Endpoint::Responses,
            _ => Endpoint::Chat,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_round_trips_through_its_byte() {
        for raw in 0..=8u8 {
            assert_eq!(SlotState::from_raw(raw).to_raw(), raw);
        }
        for h in [Halter::None, Halter::Emitter, Halter::Watchdog] {
            assert_eq!(Halter::from_raw(h.to_raw()), h);
        }
        for m in [Mode::Pending, Mode::Stream, Mode::Batch] {
            assert_eq!(Mode::from_raw(m.to_raw()), m);
        }
        for e in [
            Endpoint::Chat,
            Endpoint::Completion,
            Endpoint::Messages,
            Endpoint::Responses,
        ] {
            assert_eq!(Endpoint::from_raw(e.to_raw()), e);
        }
    }

    #[test]
    fn compare_exchange_reports_what_it_found() {
        let s = AtomicEnum::new(SlotState::Streaming);
        assert_eq!(
            s.compare_exchange(SlotState::Tripped, SlotState::Halting),
            Err(SlotState::Streaming)
        );
        assert_eq!(
            s.compare_exchange(SlotState::Streaming, SlotState::Done),
            Ok(SlotState::Streaming)
        );
        assert_eq!(s.load(), SlotState::Done);
        assert_eq!(AtomicEnum::<Halter>::default().load(), Halter::None);
    }
}
