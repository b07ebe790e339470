//! The heartbeat: none yet, a stale one, and the kernel's own clock.

use std::{os::fd::AsFd, thread, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_common::{trip_reason, verdict, SockPolicy};

use super::{
    check_counters, conn, events, expect_dropped, finish, load_gate, send, token, token_bytes,
    untripped, Received, E, TAG,
};

/// No heartbeat yet: the gate trips every stream itself, each with its own policy's budget.
#[test]
fn no_heartbeat_yet_trips_with_the_sockets_own_budget() -> Result<()> {
    let gate = load_gate(Duration::from_secs(600))?;
    let streams = [(3u32, TAG), (1, TAG + 1)];
    let mut tags = Vec::new();
    for (budget, tag) in streams {
        let bu = budget as usize;
        let c = conn(
            &gate,
            &SockPolicy {
                stream_tag: tag,
                ..untripped(budget)
            },
        )?;
        for i in 0..bu {
            send(&c.server, &token(i))
                .with_context(|| format!("B={budget}: frame {i} within the budget"))?;
        }
        expect_dropped(
            send(&c.server, &token(bu)),
            "first frame beyond the socket's budget",
        )?;
        let view = gate.socket(c.server.as_fd())?;
        let st = view.state.context("state")?;
        assert_eq!(
            (
                st.trip_reason,
                st.post_trip_frames,
                st.stale_frame_limit,
                st.dropped
            ),
            (
                trip_reason::HEARTBEAT,
                u64::from(budget),
                u64::from(budget) + 1,
                1
            ),
            "B={budget}"
        );
        // The egress check latched its own ceiling at the first segment: nothing sent yet, plus
        // B × E.
        let eg = view.egress.context("egress state")?;
        assert_eq!(
            (eg.latch_reason, eg.latched_ceiling, eg.dropped_segments),
            (
                trip_reason::HEARTBEAT,
                u64::from(budget) * u64::from(E) + 1,
                0
            ),
            "B={budget}: egress state {eg:?}"
        );
        assert_eq!(
            finish(c)?,
            Received {
                tokens: bu,
                ..Default::default()
            },
            "B={budget}"
        );
        tags.push(tag);
    }
    check_counters(
        &gate,
        &[(verdict::PASS_POST_TRIP, 4), (verdict::DROP_BUDGET, 2)],
        "no heartbeat",
    )?;
    let ev = events(&gate)?;
    assert_eq!(ev.len(), 2, "{ev:?}");
    for (e, tag) in ev.iter().zip(tags) {
        assert_eq!(
            (e.stream_tag, e.trip_reason, e.verdict, e.cause),
            (tag, trip_reason::HEARTBEAT, verdict::DROP_BUDGET, 0),
            "{e:?}"
        );
    }
    Ok(())
}

/// Fresh heartbeat passes; a stale one trips with the socket's budget, counted from the frame
/// that saw it stale, and the trip sticks after the heartbeat comes back.
#[test]
fn stale_heartbeat_trips_and_sticks() -> Result<()> {
    let deadline = Duration::from_millis(100);
    let gate = load_gate(deadline)?;
    let c = conn(&gate, &untripped(3))?;
    gate.beat()?;
    for i in 0..5 {
        send(&c.server, &token(i)).context("fresh heartbeat")?;
    }
    thread::sleep(deadline * 2);
    // Frame 6 sees the beat lost: frames 6, 7, 8 pass (limit 5 + 3).
    send(&c.server, &token(5)).context("frame 6")?;
    gate.beat()?;
    send(&c.server, &token(6)).context("frame 7")?;
    send(&c.server, &token(7)).context("frame 8")?;
    expect_dropped(
        send(&c.server, &token(8)),
        "frame 9, heartbeat back but trip sticky",
    )?;
    let view = gate.socket(c.server.as_fd())?;
    let st = view.state.context("state")?;
    assert_eq!(st.trip_reason, trip_reason::HEARTBEAT);
    assert_eq!(st.stale_frame_limit, 8 + 1, "stored as limit + 1");
    assert_eq!(st.post_trip_frames, 3);
    // The egress check latched at frame 6's segment: the 5 frames before it, plus B × E.
    let eg = view.egress.context("egress state")?;
    assert_eq!(
        (eg.latch_reason, eg.latched_ceiling),
        (
            trip_reason::HEARTBEAT,
            token_bytes(0..5) + 3 * u64::from(E) + 1
        ),
        "egress state {eg:?}"
    );
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 8,
            ..Default::default()
        }
    );

    // A new connection under a fresh heartbeat is untripped.
    let c = conn(&gate, &untripped(3))?;
    gate.beat()?;
    send(&c.server, &token(0)).context("fresh heartbeat, new stream")?;
    let view = gate.socket(c.server.as_fd())?;
    assert_eq!(view.state.context("state")?.stale_frame_limit, 0);
    drop(c);
    check_counters(
        &gate,
        &[
            (verdict::PASS, 6),
            (verdict::PASS_POST_TRIP, 3),
            (verdict::DROP_BUDGET, 1),
        ],
        "stale heartbeat",
    )?;
    Ok(())
}

/// The kernel's clock as the gate sees it: no heartbeat before the first beat (lost), a fresh
/// one right after a beat, lost again once older than the deadline.
#[test]
fn kernel_clock_and_heartbeat() -> Result<()> {
    let deadline = Duration::from_millis(100);
    let gate = load_gate(deadline)?;
    let c0 = gate.clock()?;
    ensure!(
        c0.heartbeat_age().is_none() && c0.heartbeat_lost() && c0.heartbeat_ns == 0,
        "before the first beat: {c0:?}"
    );
    ensure!(
        c0.deadline_ns == 100_000_000,
        "deadline {} ns, want 100 ms",
        c0.deadline_ns
    );
    ensure!(c0.now_ns > 0, "the kernel's clock reads 0: {c0:?}");

    gate.beat()?;
    let c1 = gate.clock()?;
    let age = c1.heartbeat_age().context("no heartbeat after a beat")?;
    ensure!(
        age < Duration::from_millis(50),
        "heartbeat age {age:?} right after a beat: {c1:?}"
    );
    ensure!(!c1.heartbeat_lost(), "lost right after a beat: {c1:?}");
    ensure!(
        c0.now_ns <= c1.heartbeat_ns && c1.heartbeat_ns <= c1.now_ns,
        "the beat is not between the two clock reads: {c0:?} {c1:?}"
    );

    thread::sleep(deadline + Duration::from_millis(50));
    let c2 = gate.clock()?;
    ensure!(c2.heartbeat_lost(), "not lost past the deadline: {c2:?}");
    let age = c2.heartbeat_age().context("heartbeat gone")?;
    ensure!(
        age > deadline && c2.heartbeat_ns == c1.heartbeat_ns,
        "past the deadline: age {age:?}, {c2:?}"
    );

    gate.beat()?;
    let c3 = gate.clock()?;
    ensure!(!c3.heartbeat_lost(), "lost after a new beat: {c3:?}");
    Ok(())
}
