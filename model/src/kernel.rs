//! The kernel's side of one step: `tcp_bpf`'s send path around the send check, and TCP's
//! transmission around the egress check. The checks themselves are the real
//! `haltd_common::decide` functions; an injected [`Mistake`] wraps them, never replaces them
//! (except [`Mistake::NoEgressCheck`], which removes the egress program).

use haltd_common::decide::{self, SegmentView, SendView};
use haltd_common::{verdict, EgressState, Heartbeat, SockPolicy, NONCE_LEN};

use crate::config::{Config, Mistake};
use crate::state::{Eval, State, TripMark};

/// The kernel clock at every step. Time is abstracted to "heartbeat fresh or stale": the
/// checks use the clock only for that and for timestamps they record.
pub const NOW_NS: u64 = 1_000;
/// The heartbeat deadline.
pub const DEADLINE_NS: u64 = 100;
/// The trip's nonce, as userspace writes it into the policy and the terminal frame carries it.
pub const NONCE: [u8; NONCE_LEN] = *b"00c0ffee00c0ffee";

/// TLS: the first 16 ciphertext bytes of the record sealed with sequence number `seq` (a
/// stand-in for AEAD output: distinct for distinct sequence numbers, never all zero).
pub fn record_prefix(seq: u8) -> [u8; NONCE_LEN] {
    let mut p = [0x5a; NONCE_LEN];
    p[0] = seq;
    p
}

/// What a message carries where the send check looks for the nonce: the terminal frame the
/// trip's nonce (plain) or its record's prefix (TLS); a token frame its record's prefix (TLS)
/// or nothing like a nonce (plain, or bytes no frame declared).
pub fn message_prefix(cfg: &Config, s: &State, terminal: bool) -> [u8; NONCE_LEN] {
    match (cfg.tls, terminal) {
        (false, true) => NONCE,
        (false, false) => [0; NONCE_LEN],
        (true, true) => record_prefix(s.terminal_seq),
        (true, false) if s.pending > 0 => record_prefix(s.cur_seq),
        (true, false) => [0; NONCE_LEN],
    }
}

/// The `HEARTBEAT` map value for a fresh or a stale heartbeat.
pub fn heartbeat_value(fresh: bool) -> Heartbeat {
    Heartbeat {
        last_ns: if fresh {
            NOW_NS
        } else {
            NOW_NS - DEADLINE_NS - 1
        },
        deadline_ns: DEADLINE_NS,
        read_ns: 0,
    }
}

/// The policy userspace writes when the turn starts: untripped, with the stream's budget.
pub fn turn_start_policy(cfg: &Config) -> SockPolicy {
    SockPolicy {
        budget: u32::from(cfg.budget),
        max_event_bytes: u32::from(cfg.max_event),
        stream_tag: 1,
        ..SockPolicy::default()
    }
}

/// The policy userspace writes at the trip: `F` and the ceiling from its own counters. Under
/// TLS the terminal record is sealed first (the next sequence number) and its prefix is the
/// nonce.
pub fn trip_policy(cfg: &Config, s: &mut State) -> SockPolicy {
    let (nonce, framing) = if cfg.tls {
        s.sealed += 1;
        s.terminal_seq = s.sealed;
        (record_prefix(s.terminal_seq), haltd_common::framing::TLS)
    } else {
        (NONCE, haltd_common::framing::PLAIN)
    };
    // The bytes of every frame handed to the kernel, the whole frame in progress included
    // (userspace counts a frame before its first send). The mistake counts only what the
    // kernel accepted so far.
    let handed = if cfg.has(Mistake::CeilingWithoutFrameInProgress) {
        s.accepted
    } else {
        s.bytes_counted
    };
    SockPolicy {
        tripped: 1,
        cause: 1,
        pre_trip_frames: u64::from(s.frames_counted),
        egress_ceiling: u64::from(handed)
            + u64::from(cfg.token_allowance())
            + u64::from(cfg.terminal_len),
        terminal_len: u32::from(cfg.terminal_len),
        framing,
        nonce,
        ..turn_start_policy(cfg)
    }
}

/// Whether the kernel finds the heartbeat lost now (the real `heartbeat_lost`).
fn heartbeat_lost(s: &State) -> bool {
    decide::heartbeat_lost(Some(&heartbeat_value(s.hb_fresh)), NOW_NS)
}

/// A program ran and saw the heartbeat lost: the first such run may be the trip point.
fn observe_heartbeat_lost(s: &mut State) {
    s.hb_seen = true;
    if s.trip.is_none() {
        s.trip = Some(TripMark {
            accepted: s.accepted,
            pending: s.pending,
            by_user: false,
        });
    }
}

/// A check dropped something: note it for the no-false-drop properties.
fn note_drop(cfg: &Config, s: &mut State) {
    if s.trip.is_none() {
        s.drop_before_trip = true;
    }
    if cfg.emitter == crate::Emitter::Honest && !s.hb_seen {
        s.honest_drop = true;
    }
}

/// The send check on one send, with the injected mistakes wrapped around it.
fn send_check(cfg: &Config, s: &mut State, size: u8, terminal: bool, lost: bool) -> u32 {
    let prefix = message_prefix(cfg, s, terminal);
    let mut policy = s.policy;
    if cfg.has(Mistake::PreTripOffByOne) && policy.tripped != 0 {
        policy.pre_trip_frames += 1;
    }
    let view = SendView {
        size: u64::from(size),
        now_ns: NOW_NS,
        heartbeat_lost: lost,
        egress_latched: s.egress.latched_ceiling != 0 && !cfg.has(Mistake::UnsharedLatches),
    };
    if cfg.has(Mistake::LatchNotSticky) && !lost {
        s.sock.stale_frame_limit = 0;
    }
    let without_nonce = cfg.has(Mistake::TerminalWithoutNonce);
    decide::send_verdict(&mut s.sock, Some(&policy), view, |nonce| {
        without_nonce || *nonce == prefix
    })
}

/// One send call of `size` bytes (`terminal`: it is the halter's terminal frame), of which the
/// kernel accepts `accept` if it passes (backpressure decides how many). Returns the bytes
/// accepted, or `None` when the send fails with `EACCES`.
pub fn send(cfg: &Config, s: &mut State, size: u8, terminal: bool, accept: u8) -> Option<u8> {
    match s.eval {
        Eval::Drop => return None,
        Eval::Pass => {}
        Eval::None => {
            let lost = heartbeat_lost(s);
            if lost {
                observe_heartbeat_lost(s);
            }
            let v = send_check(cfg, s, size, terminal, lost);
            if v == verdict::PASS_POST_TRIP {
                s.post_trip_passes = s.post_trip_passes.saturating_add(1).min(15);
            }
            if !verdict::passes(v) {
                s.eval = Eval::Drop;
                note_drop(cfg, s);
                return None;
            }
            s.eval = Eval::Pass;
        }
    }
    debug_assert!(accept >= 1 && accept <= size);
    s.accepted += accept;
    if accept == size {
        // The push completed: the next send runs the program again.
        s.eval = Eval::None;
    }
    Some(accept)
}

/// Where a segment starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Segment {
    /// New data, from `snd_nxt`.
    New,
    /// A retransmission from the first byte the peer has not acknowledged.
    Retransmit,
}

/// One payload segment of `len` bytes. `alt` picks the other outcome: for a segment that
/// passes, the network loses it; for a new segment that is dropped, TCP counts it as sent
/// anyway (`snd_nxt` moves on and the bytes are retransmitted later), as it does when the
/// drop is reported as congestion rather than an error. Returns whether the segment passed.
pub fn segment(cfg: &Config, s: &mut State, kind: Segment, len: u8, alt: bool) -> bool {
    let start = match kind {
        Segment::New => s.snd_nxt,
        Segment::Retransmit => s.delivered(),
    };
    let end = start + len;
    let passed = if cfg.has(Mistake::NoEgressCheck) {
        // The program is not attached: it neither judges nor observes anything.
        true
    } else {
        let lost = heartbeat_lost(s);
        if lost {
            observe_heartbeat_lost(s);
        }
        let seg = SegmentView {
            now_ns: NOW_NS,
            heartbeat_lost: lost,
            send_latched: s.sock.stale_frame_limit != 0 && !cfg.has(Mistake::UnsharedLatches),
            offsets: Some((u64::from(s.snd_nxt), u64::from(end))),
        };
        if cfg.has(Mistake::LatchNotSticky) && !lost {
            s.egress.latched_ceiling = 0;
            s.egress.latch_reason = 0;
        }
        let v = decide::segment_verdict(&mut s.egress, Some(&s.policy), seg);
        forget_statistics(&mut s.egress);
        v == verdict::EGRESS_PASS
    };
    if passed {
        s.left = s.left.max(end);
        if kind == Segment::New {
            s.snd_nxt = end;
        }
        if !alt {
            s.rcv |= bits(start, end);
        }
    } else {
        note_drop(cfg, s);
        if kind == Segment::New && alt {
            s.snd_nxt = end;
        }
    }
    passed
}

/// Clears what the egress check records only for metrics and halt events: no decision reads
/// these fields (`segment_verdict` and `egress_ceiling` read only `latched_ceiling`), and
/// keeping them would make every retransmission a new state (the drop counter grows).
fn forget_statistics(eg: &mut EgressState) {
    eg.dropped_segments = 0;
    eg.dropped_end = 0;
    eg.passed_end = 0;
    eg.first_drop_ns = 0;
}

/// Bits `start..end` of a byte mask.
fn bits(start: u8, end: u8) -> u16 {
    let upto = |n: u8| -> u16 {
        if n >= 16 {
            u16::MAX
        } else {
            (1u16 << n) - 1
        }
    };
    upto(end) & !upto(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_cover_the_range() {
        assert_eq!(bits(0, 0), 0);
        assert_eq!(bits(0, 3), 0b111);
        assert_eq!(bits(2, 4), 0b1100);
        assert_eq!(bits(15, 16), 0x8000);
    }

    #[test]
    fn heartbeat_values_read_as_intended() {
        assert!(!decide::heartbeat_lost(
            Some(&heartbeat_value(true)),
            NOW_NS
        ));
        assert!(decide::heartbeat_lost(
            Some(&heartbeat_value(false)),
            NOW_NS
        ));
    }
}
