use super::*;

const NONCE: [u8; NONCE_LEN] = *b"0123456789abcdef";

fn send(size: u64) -> SendView {
    SendView {
        size,
        now_ns: 1_000,
        heartbeat_lost: false,
        egress_latched: false,
    }
}

fn untripped(budget: u32, max_event: u32) -> SockPolicy {
    SockPolicy {
        budget,
        max_event_bytes: max_event,
        ..SockPolicy::default()
    }
}

fn tripped(budget: u32, max_event: u32, f: u64, ceiling: u64) -> SockPolicy {
    SockPolicy {
        tripped: 1,
        cause: 7,
        budget,
        max_event_bytes: max_event,
        pre_trip_frames: f,
        egress_ceiling: ceiling,
        terminal_len: 100,
        nonce: NONCE,
        ..SockPolicy::default()
    }
}

fn no_nonce(_: &[u8; NONCE_LEN]) -> bool {
    false
}

#[test]
fn untripped_frames_pass_and_count() {
    let mut st = SockState::default();
    let p = untripped(5, 300);
    for _ in 0..10 {
        assert_eq!(
            send_verdict(&mut st, Some(&p), send(10_000), no_nonce),
            verdict::PASS
        );
    }
    assert_eq!(st.frames, 10);
    assert_eq!(st.trip_reason, trip_reason::NONE);
}

#[test]
fn a_trip_allows_budget_frames_of_at_most_e_then_the_terminal() {
    let mut st = SockState::default();
    let p = tripped(2, 300, 3, 0);
    for _ in 0..3 {
        // Frames 1..=3 were handed over before the trip.
        assert_eq!(
            send_verdict(&mut st, Some(&p), send(5_000), no_nonce),
            verdict::PASS
        );
    }
    assert_eq!(
        send_verdict(&mut st, Some(&p), send(301), no_nonce),
        verdict::DROP_FRAME_SIZE,
        "a post-trip frame larger than E"
    );
    let mut st = SockState {
        frames: 3,
        ..SockState::default()
    };
    for _ in 0..2 {
        assert_eq!(
            send_verdict(&mut st, Some(&p), send(300), no_nonce),
            verdict::PASS_POST_TRIP
        );
    }
    assert_eq!(
        send_verdict(&mut st, Some(&p), send(300), no_nonce),
        verdict::DROP_BUDGET
    );
    assert_eq!(st.post_trip_frames, 2);
    assert_eq!(st.post_trip_bytes, 600);
    assert_eq!(st.trip_reason, trip_reason::TRIPPED);
}

#[test]
fn the_terminal_needs_its_exact_length_and_the_nonce() {
    let p = tripped(0, 300, 0, 0);
    let mut st = SockState::default();
    assert_eq!(
        send_verdict(&mut st, Some(&p), send(99), |n| *n == NONCE),
        verdict::DROP_BUDGET,
        "one byte short"
    );
    let mut st = SockState::default();
    assert_eq!(
        send_verdict(&mut st, Some(&p), send(100), no_nonce),
        verdict::DROP_BUDGET,
        "without the nonce"
    );
    let mut st = SockState::default();
    assert_eq!(
        send_verdict(&mut st, Some(&p), send(100), |n| *n == NONCE),
        verdict::PASS_TERMINAL
    );
    assert_eq!(
        send_verdict(&mut st, Some(&p), send(100), |n| *n == NONCE),
        verdict::DROP_AFTER_TERMINAL,
        "only once"
    );
}

#[test]
fn no_policy_is_tripped_with_nothing_allowed() {
    let mut st = SockState::default();
    assert_eq!(
        send_verdict(&mut st, None, send(1), no_nonce),
        verdict::DROP_BUDGET
    );
    assert_eq!(st.trip_reason, trip_reason::NO_POLICY);
}

#[test]
fn a_lost_heartbeat_gives_each_stream_its_own_budget_and_sticks() {
    let batch = untripped(0, 300);
    let streaming = untripped(2, 300);
    let lost = SendView {
        heartbeat_lost: true,
        ..send(100)
    };
    let mut st = SockState {
        frames: 4,
        ..SockState::default()
    };
    assert_eq!(
        send_verdict(&mut st, Some(&batch), lost, no_nonce),
        verdict::DROP_BUDGET,
        "a batch stream has 0 in the kernel too"
    );
    let mut st = SockState {
        frames: 4,
        ..SockState::default()
    };
    for _ in 0..2 {
        assert_eq!(
            send_verdict(&mut st, Some(&streaming), lost, no_nonce),
            verdict::PASS_POST_TRIP
        );
    }
    // The heartbeat comes back: the socket stays tripped.
    assert_eq!(
        send_verdict(&mut st, Some(&streaming), send(100), no_nonce),
        verdict::DROP_BUDGET
    );
    assert_eq!(st.trip_reason, trip_reason::HEARTBEAT);
}

fn seg(sent: u64, end: u64, lost: bool) -> SegmentView {
    SegmentView {
        now_ns: 5,
        heartbeat_lost: lost,
        send_latched: false,
        offsets: Some((sent, end)),
    }
}

#[test]
fn egress_passes_untripped_and_drops_beyond_the_ceiling() {
    let mut eg = EgressState::default();
    let p = untripped(5, 300);
    assert_eq!(
        segment_verdict(&mut eg, Some(&p), seg(0, 1 << 30, false)),
        verdict::EGRESS_PASS
    );
    let p = tripped(5, 300, 10, 2_000);
    assert_eq!(
        segment_verdict(&mut eg, Some(&p), seg(1_000, 2_000, false)),
        verdict::EGRESS_PASS
    );
    assert_eq!(
        segment_verdict(&mut eg, Some(&p), seg(2_000, 2_001, false)),
        verdict::EGRESS_DROP_CEILING
    );
    // A retransmission of allowed bytes still passes; the dropped one is dropped again.
    assert_eq!(
        segment_verdict(&mut eg, Some(&p), seg(2_000, 1_500, false)),
        verdict::EGRESS_PASS
    );
    assert_eq!(
        segment_verdict(&mut eg, Some(&p), seg(2_000, 2_001, false)),
        verdict::EGRESS_DROP_CEILING
    );
    assert_eq!(eg.dropped_segments, 2);
    assert_eq!(eg.dropped_end, 2_001);
}

#[test]
fn egress_latches_its_own_ceiling_on_a_lost_heartbeat() {
    let mut eg = EgressState::default();
    let p = untripped(2, 300);
    assert_eq!(
        segment_verdict(&mut eg, Some(&p), seg(1_000, 1_600, true)),
        verdict::EGRESS_PASS
    );
    assert_eq!(eg.latched_ceiling, 1_000 + 600 + 1);
    assert_eq!(
        segment_verdict(&mut eg, Some(&p), seg(1_600, 1_601, false)),
        verdict::EGRESS_DROP_CEILING,
        "sticky after the heartbeat came back"
    );
    // A trip written later keeps the tighter ceiling but lets its terminal out.
    let p = tripped(2, 300, 0, 10_000);
    assert_eq!(egress_ceiling(&eg, Some(&p)), 1_600 + 100);
}

#[test]
fn egress_without_policy_or_offsets_fails_closed() {
    let mut eg = EgressState::default();
    assert_eq!(
        segment_verdict(&mut eg, None, seg(500, 501, false)),
        verdict::EGRESS_DROP_CEILING
    );
    let mut eg = EgressState::default();
    let p = tripped(0, 300, 0, 100);
    let unparsed = SegmentView {
        now_ns: 1,
        heartbeat_lost: false,
        send_latched: false,
        offsets: None,
    };
    assert_eq!(
        segment_verdict(&mut eg, Some(&p), unparsed),
        verdict::EGRESS_DROP_UNPARSED
    );
    let mut eg = EgressState::default();
    assert_eq!(
        segment_verdict(&mut eg, Some(&untripped(0, 0)), unparsed),
        verdict::EGRESS_PASS,
        "an untripped stream's segment passes even unread"
    );
}

#[test]
fn stream_offsets_survive_sequence_wraparound() {
    assert_eq!(stream_offset(1_000, 1_000, 0), 0);
    assert_eq!(stream_offset(1_500, 1_000, 0), 500);
    assert_eq!(stream_offset(10, u32::MAX - 9, 5 << 32), (5 << 32) + 20);
    // A retransmission that starts before snd_una.
    assert_eq!(stream_offset(900, 1_000, 4_000), 3_900);
}

#[test]
fn heartbeat_is_lost_when_missing_unset_or_old() {
    assert!(heartbeat_lost(None, 10));
    let hb = Heartbeat {
        last_ns: 0,
        deadline_ns: 100,
        read_ns: 0,
    };
    assert!(heartbeat_lost(Some(&hb), 10));
    let hb = Heartbeat { last_ns: 50, ..hb };
    assert!(!heartbeat_lost(Some(&hb), 150));
    assert!(heartbeat_lost(Some(&hb), 151));
}

#[test]
fn each_check_latches_when_the_other_did_even_with_the_heartbeat_back() {
    // The egress check saw the gap; the heartbeat is back by the next send: that send is
    // still past the trip point, even though the policy calls it pre-trip.
    let mut st = SockState {
        frames: 1,
        ..SockState::default()
    };
    let p = tripped(0, 300, 2, 10_000);
    let after_egress_latch = SendView {
        egress_latched: true,
        ..send(100)
    };
    assert_eq!(
        send_verdict(&mut st, Some(&p), after_egress_latch, no_nonce),
        verdict::DROP_BUDGET
    );
    // Frame 2 saw it: limit n - 1 + budget = 1, stored plus one.
    assert_eq!(st.stale_frame_limit, 2);

    // The send check saw the gap; the egress check latches at its next segment.
    let mut eg = EgressState::default();
    let p = untripped(1, 300);
    let v = segment_verdict(
        &mut eg,
        Some(&p),
        SegmentView {
            send_latched: true,
            ..seg(500, 900, false)
        },
    );
    assert_eq!(v, verdict::EGRESS_DROP_CEILING);
    assert_eq!(eg.latched_ceiling, 500 + 300 + 1);
}
