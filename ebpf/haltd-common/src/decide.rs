//! The gate's decisions, as pure functions of the map values and what the program sees.
//!
//! The BPF programs in `ebpf/haltd-ebpf` read their maps and the packet, call these, and act on
//! the verdict; the `stateright` model of emitter × watchdog × kernel (`model/`) calls the
//! very same functions in its kernel steps, so what the model proves is about this code. Every
//! function is `#[inline(always)]` and free of loops over data: the BPF verifier sees one
//! straight program.
//!
//! # What is bounded
//!
//! Let the trip point be the first of: userspace writing the trip into the socket's policy,
//! the send check first seeing the heartbeat lost, the egress check first seeing it lost.
//! Then, for every sequence of send calls on the socket:
//!
//! * the send check passes at most `budget` post-trip frames, each at most `max_event_bytes`,
//!   then at most one terminal frame of exactly `terminal_len` bytes carrying the trip's nonce
//!   ([`send_verdict`]);
//! * the egress check lets no segment end beyond the ceiling ([`egress_ceiling`]): the bytes
//!   handed to the kernel before the trip, plus `budget × max_event_bytes`, plus the terminal's
//!   length — whatever the send check could not see because the kernel kept an earlier verdict
//!   ([`segment_verdict`]).

use crate::{trip_reason, verdict, EgressState, Heartbeat, SockPolicy, SockState, NONCE_LEN};

/// Whether the watchdog's heartbeat counts as lost at `now_ns` (kernel clock): never written,
/// or older than its deadline. A missing heartbeat entry counts as lost (fail closed).
#[inline(always)]
pub fn heartbeat_lost(hb: Option<&Heartbeat>, now_ns: u64) -> bool {
    match hb {
        Some(hb) => hb.last_ns == 0 || now_ns > hb.last_ns.saturating_add(hb.deadline_ns),
        None => true,
    }
}

/// One send call as the send check sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendView {
    /// Bytes of the send (one program run: the kernel splits sends over about 544 KiB).
    pub size: u64,
    /// `bpf_ktime_get_ns` now.
    pub now_ns: u64,
    /// [`heartbeat_lost`] now.
    pub heartbeat_lost: bool,
    /// The egress check has latched a ceiling on this socket
    /// ([`EgressState::latched_ceiling`] is set): it saw the heartbeat lost (or no policy)
    /// first, so this send is past the trip point too, whatever the heartbeat says now.
    pub egress_latched: bool,
}

/// The send check (`halt_gate`): the verdict on one send, one of the send verdicts of
/// [`verdict`], updating the socket's state.
///
/// `carries_nonce` tells whether the message has the given nonce at
/// [`crate::NONCE_OFFSET`]; it is asked only for a send of exactly the terminal's length on a
/// stream userspace tripped.
#[inline(always)]
pub fn send_verdict(
    st: &mut SockState,
    policy: Option<&SockPolicy>,
    send: SendView,
    carries_nonce: impl FnOnce(&[u8; NONCE_LEN]) -> bool,
) -> u32 {
    if st.terminal_sent != 0 {
        return verdict::DROP_AFTER_TERMINAL;
    }
    st.frames += 1;
    let n = st.frames;
    let (budget, max_event) = match policy {
        Some(p) => (u64::from(p.budget), u64::from(p.max_event_bytes)),
        None => (0, 0),
    };
    if st.stale_frame_limit == 0 && (send.heartbeat_lost || send.egress_latched) {
        // The first send that sees the heartbeat lost (or follows the egress check's latch)
        // fixes this socket's own limit: the frames before it, plus the stream's budget
        // (stored plus one, see `SockState`). Sharing the latch matters when the heartbeat
        // comes back: a check that did not see the gap must not treat later frames as
        // pre-trip, and a userspace trip written after the gap cannot reclassify them.
        st.stale_frame_limit = n - 1 + budget + 1;
    }
    let user_tripped = policy.is_some_and(|p| p.tripped != 0 && n > p.pre_trip_frames);
    // Untripped, or a frame userspace handed to the kernel before the trip (in flight when
    // the trip was written): it passes as it would have before the trip.
    let pre_trip = policy.is_some_and(|p| p.tripped == 0 || n <= p.pre_trip_frames);
    if pre_trip && st.stale_frame_limit == 0 {
        return verdict::PASS;
    }

    if st.first_post_trip_ns == 0 {
        st.first_post_trip_ns = if send.now_ns == 0 { 1 } else { send.now_ns };
        st.trip_reason = if user_tripped {
            trip_reason::TRIPPED
        } else if policy.is_none() {
            trip_reason::NO_POLICY
        } else {
            trip_reason::HEARTBEAT
        };
    }

    // The terminal allowance: only a trip from userspace has a nonce, and only a frame of the
    // terminal's exact length that carries it (which token frames never do) passes once more.
    if let Some(p) = policy {
        if p.tripped != 0 && send.size == u64::from(p.terminal_len) && carries_nonce(&p.nonce) {
            st.terminal_sent = 1;
            return verdict::PASS_TERMINAL;
        }
    }

    // Effective budget: the tightest of every reason the stream is tripped for.
    let mut frame_limit = u64::MAX;
    match policy {
        None => frame_limit = 0,
        Some(p) if user_tripped => frame_limit = p.pre_trip_frames.saturating_add(budget),
        Some(_) => {}
    }
    if st.stale_frame_limit != 0 {
        frame_limit = min(frame_limit, st.stale_frame_limit - 1);
    }
    if n > frame_limit {
        return verdict::DROP_BUDGET;
    }
    if send.size > max_event {
        return verdict::DROP_FRAME_SIZE;
    }
    if st.post_trip_bytes.saturating_add(send.size) > budget.saturating_mul(max_event) {
        return verdict::DROP_BYTES;
    }
    st.post_trip_frames += 1;
    st.post_trip_bytes += send.size;
    verdict::PASS_POST_TRIP
}

/// One TCP segment as the egress check sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentView {
    /// `bpf_ktime_get_ns` now.
    pub now_ns: u64,
    /// [`heartbeat_lost`] now.
    pub heartbeat_lost: bool,
    /// The send check saw the heartbeat lost on this socket ([`SockState::stale_frame_limit`]
    /// is set): the egress check latches at this segment even if the heartbeat is back.
    pub send_latched: bool,
    /// `(sent, end)`: the stream offset of the next byte never sent before (`snd_nxt`) and the
    /// stream offset this segment's payload ends at; `None` when the program could not read
    /// the TCP header or the socket.
    pub offsets: Option<(u64, u64)>,
}

/// The ceiling in force for a socket: no segment may end beyond this stream offset.
/// `u64::MAX` while the stream is untripped.
#[inline(always)]
pub fn egress_ceiling(eg: &EgressState, policy: Option<&SockPolicy>) -> u64 {
    let mut ceiling = u64::MAX;
    let mut terminal = 0;
    if let Some(p) = policy {
        if p.tripped != 0 {
            ceiling = p.egress_ceiling;
            terminal = u64::from(p.terminal_len);
        }
    }
    if eg.latched_ceiling != 0 {
        // A trip userspace wrote after the latch still gets its terminal frame out.
        ceiling = min(ceiling, (eg.latched_ceiling - 1).saturating_add(terminal));
    }
    ceiling
}

/// The egress check (`halt_egress`): the verdict on one segment carrying payload of a governed
/// socket, [`verdict::EGRESS_PASS`] or a drop, updating the socket's egress state.
///
/// It caches no verdict: every segment, retransmissions included, is judged by its end offset.
/// The first segment that sees the heartbeat lost (or follows the send check's own latch, or
/// finds the socket without a policy) latches a ceiling of its own: the next unsent byte plus
/// the stream's budget of token events. Every byte below `snd_nxt` was sent before that
/// segment, so before the trip point: the two checks serialise on the socket lock, and this is
/// the first segment judged after either saw the heartbeat lost.
#[inline(always)]
pub fn segment_verdict(eg: &mut EgressState, policy: Option<&SockPolicy>, seg: SegmentView) -> u32 {
    if eg.latched_ceiling == 0 && (seg.heartbeat_lost || seg.send_latched || policy.is_none()) {
        let allowance = match policy {
            Some(p) => u64::from(p.budget).saturating_mul(u64::from(p.max_event_bytes)),
            None => 0,
        };
        // Without offsets the ceiling is 0: nothing more leaves (fail closed).
        let sent = match seg.offsets {
            Some((sent, _)) => sent,
            None => 0,
        };
        eg.latched_ceiling = sent.saturating_add(allowance).saturating_add(1);
        eg.latch_reason = if policy.is_none() {
            trip_reason::NO_POLICY
        } else {
            trip_reason::HEARTBEAT
        };
    }
    let ceiling = egress_ceiling(eg, policy);
    let v = match seg.offsets {
        Some((_, end)) if end <= ceiling => verdict::EGRESS_PASS,
        Some(_) => verdict::EGRESS_DROP_CEILING,
        None if ceiling == u64::MAX => verdict::EGRESS_PASS,
        None => verdict::EGRESS_DROP_UNPARSED,
    };
    // Both fields are written on every path, with values chosen per path: stores to a field
    // chosen per path compile to a store at a variable offset, which the verifier refuses to
    // an unprivileged loader (CAP_BPF without CAP_PERFMON).
    let end = match seg.offsets {
        Some((_, end)) => end,
        None => 0,
    };
    let passed = v == verdict::EGRESS_PASS;
    let (passed_end, dropped_end) = (eg.passed_end, eg.dropped_end);
    eg.passed_end = if passed {
        max(passed_end, end)
    } else {
        passed_end
    };
    eg.dropped_end = if passed {
        dropped_end
    } else {
        max(dropped_end, end)
    };
    if !passed {
        eg.dropped_segments += 1;
        if eg.first_drop_ns == 0 {
            eg.first_drop_ns = if seg.now_ns == 0 { 1 } else { seg.now_ns };
        }
    }
    v
}

/// The stream offset of a segment's first payload byte, from its 32-bit sequence number and
/// the socket's `snd_una` and `bytes_acked` (both from `bpf_tcp_sock`): `snd_una` is the
/// sequence number of stream offset `bytes_acked`, and a segment lies within 2^31 of it.
#[inline(always)]
pub fn stream_offset(seq: u32, snd_una: u32, bytes_acked: u64) -> u64 {
    let delta = seq.wrapping_sub(snd_una) as i32;
    if delta >= 0 {
        bytes_acked.saturating_add(delta as u64)
    } else {
        bytes_acked.saturating_sub(u64::from(delta.unsigned_abs()))
    }
}

#[inline(always)]
fn min(a: u64, b: u64) -> u64 {
    if a < b {
        a
    } else {
        b
    }
}

#[inline(always)]
fn max(a: u64, b: u64) -> u64 {
    if a > b {
        a
    } else {
        b
    }
}

#[cfg(test)]
mod tests;
