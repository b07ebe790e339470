//! The send check (`halt_gate`): what passes before and after a trip, frame by frame and
//! byte by byte, the terminal frame and its nonce, and every send path (write, writev,
//! io_uring).

use std::{
    io::{self, Read},
    os::fd::{AsFd, AsRawFd},
    thread,
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use haltd_common::{
    trip_reason, verdict, SockPolicy, HTTP_TERMINAL_PREFIX, NONCE_LEN, NONCE_OFFSET,
    SSE_TERMINAL_PREFIX,
};

use super::{
    check_counters, check_egress_clean, conn, events, expect_dropped, expected, finish, live_gate,
    parse, send, send_verdicts, terminal, terminal_len, token, token_bytes, trip_policy, tripped,
    untripped, Conn, Received, CAUSE, E, NONCE, TAG, TERMINAL_PAD,
};

/// Token `i` padded with spaces to exactly `len` bytes.
fn token_of_len(i: usize, len: usize) -> Vec<u8> {
    let mut f = format!("data: {{\"t\":{i}}}").into_bytes();
    assert!(f.len() + 2 <= len, "token {i} does not fit {len} bytes");
    f.resize(len - 2, b' ');
    f.extend_from_slice(b"\n\n");
    f
}

#[test]
fn untripped_frames_pass() -> Result<()> {
    let gate = live_gate()?;
    let mut c = conn(&gate, &untripped(0))?;
    for i in 0..100 {
        send(&c.server, &token(i)).with_context(|| format!("frame {i}"))?;
    }
    // Everything arrives, and the egress check saw each byte at its stream offset.
    let n = token_bytes(0..100);
    let mut bytes = vec![0u8; usize::try_from(n)?];
    c.client.read_exact(&mut bytes)?;
    let view = gate.socket(c.server.as_fd())?;
    let st = view.state.context("no send-check state")?;
    assert_eq!((st.frames, st.adopted), (100, 0));
    assert_eq!(
        (
            st.trip_reason,
            st.dropped,
            st.post_trip_frames,
            st.stale_frame_limit
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(view.policy, Some(untripped(0)));
    let eg = view.egress.context("no egress state after 100 frames")?;
    assert_eq!(
        (eg.passed_end, eg.dropped_segments, eg.latched_ceiling),
        (n, 0, 0),
        "egress state {eg:?}"
    );
    let Conn { server, mut client } = c;
    drop(server);
    client.read_to_end(&mut bytes)?;
    assert_eq!(
        parse(bytes)?,
        Received {
            tokens: 100,
            ..Default::default()
        }
    );
    check_counters(&gate, &[(verdict::PASS, 100)], "untripped")?;
    let totals = gate.verdict_totals()?;
    ensure!(
        totals[verdict::EGRESS_PASS as usize] > 0,
        "no governed segment passed the egress check: {totals:?}"
    );
    assert_eq!(totals[verdict::ADOPTED as usize], 0);
    assert!(events(&gate)?.is_empty());
    // Loaded through the verifier and JIT-compiled.
    let stats = gate.program_stats()?;
    assert!(
        stats.verified_instructions.is_some_and(|n| n > 0),
        "{stats:?}"
    );
    assert!(stats.jited_bytes > 0, "{stats:?}");
    Ok(())
}

/// F frames, trip with budget B, B frames pass, the next token frame is dropped and so is
/// everything after it.
#[test]
fn trip_allows_exactly_budget_then_drops() -> Result<()> {
    for b in [0u32, 5] {
        let gate = live_gate()?;
        let f = 10usize;
        let bu = b as usize;
        let c = conn(&gate, &untripped(b))?;
        for i in 0..f {
            send(&c.server, &token(i))?;
        }
        gate.set_policy(c.server.as_fd(), &tripped(f as u64, token_bytes(0..f), b))?;
        for i in f..f + bu {
            send(&c.server, &token(i)).with_context(|| format!("B={b}: post-trip frame {i}"))?;
        }
        expect_dropped(send(&c.server, &token(f + bu)), "token beyond budget")?;
        // Drops are permanent, the nonce frame included.
        expect_dropped(send(&c.server, &token(0)), "token after a drop")?;
        expect_dropped(
            send(&c.server, &terminal(NONCE, TERMINAL_PAD)),
            "terminal after a drop",
        )?;

        let st = gate.socket(c.server.as_fd())?.state.context("state")?;
        assert_eq!(st.frames, (f + bu + 1) as u64, "B={b}");
        assert_eq!(
            (st.post_trip_frames, st.post_trip_bytes),
            (u64::from(b), token_bytes(f..f + bu)),
            "B={b}"
        );
        assert_eq!((st.dropped, st.trip_reason), (1, trip_reason::TRIPPED));
        assert_ne!(st.first_post_trip_ns, 0);

        let got = finish(c)?;
        assert_eq!(
            got,
            Received {
                tokens: f + bu,
                ..Default::default()
            },
            "B={b}"
        );
        // The kernel does not run the program again after a drop: one drop counted.
        check_counters(
            &gate,
            &[
                (verdict::PASS, f as u64),
                (verdict::PASS_POST_TRIP, u64::from(b)),
                (verdict::DROP_BUDGET, 1),
            ],
            &format!("B={b}"),
        )?;
        let ev = events(&gate)?;
        assert_eq!(ev.len(), 1, "B={b}: {ev:?}");
        let e = ev[0];
        assert_eq!(
            (
                e.stream_tag,
                e.verdict,
                e.trip_reason,
                e.frames,
                e.post_trip_frames,
                e.cause
            ),
            (
                TAG,
                verdict::DROP_BUDGET,
                trip_reason::TRIPPED,
                (f + bu + 1) as u64,
                u64::from(b),
                CAUSE
            ),
            "B={b}"
        );
        assert!(e.ts_ns >= st.first_post_trip_ns);
    }
    Ok(())
}

/// After the B post-trip frames, the terminal frame with the nonce passes; nothing after it.
#[test]
fn terminal_frame_passes_once_after_budget() -> Result<()> {
    for b in [0u32, 5] {
        let gate = live_gate()?;
        let f = 4usize;
        let bu = b as usize;
        let c = conn(&gate, &untripped(b))?;
        for i in 0..f {
            send(&c.server, &token(i))?;
        }
        gate.set_policy(c.server.as_fd(), &tripped(f as u64, token_bytes(0..f), b))?;
        for i in f..f + bu {
            send(&c.server, &token(i))?;
        }
        send(&c.server, &terminal(NONCE, TERMINAL_PAD))
            .with_context(|| format!("B={b}: terminal"))?;
        expect_dropped(send(&c.server, &token(99)), "token after terminal")?;
        expect_dropped(
            send(&c.server, &terminal(NONCE, TERMINAL_PAD)),
            "second terminal",
        )?;

        let st = gate.socket(c.server.as_fd())?.state.context("state")?;
        assert_eq!((st.terminal_sent, st.dropped), (1, 1));
        assert_eq!(st.post_trip_frames, u64::from(b), "terminal not counted");
        let got = finish(c)?;
        assert_eq!(
            got,
            Received {
                tokens: f + bu,
                terminals: 1,
                ..Default::default()
            },
            "B={b}"
        );
        check_counters(
            &gate,
            &[
                (verdict::PASS, f as u64),
                (verdict::PASS_POST_TRIP, u64::from(b)),
                (verdict::PASS_TERMINAL, 1),
                (verdict::DROP_AFTER_TERMINAL, 1),
            ],
            &format!("B={b}"),
        )?;
        let ev = events(&gate)?;
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!(ev[0].verdict, verdict::DROP_AFTER_TERMINAL);
    }
    Ok(())
}

/// A frame with a wrong nonce, a terminal one byte longer or shorter than the trip's
/// `terminal_len`, or a zero nonce counts as a token frame.
#[test]
fn fake_or_wrong_length_terminal_is_a_token() -> Result<()> {
    let gate = live_gate()?;
    let t = terminal_len();
    assert!(t <= E, "the fake terminals must fit E to pass as tokens");
    let wrong_nonce = terminal(b"fedcba9876543210", TERMINAL_PAD);

    // B = 1: a wrong-nonce "terminal" uses the one post-trip frame; the real one still passes.
    let c = conn(&gate, &untripped(1))?;
    send(&c.server, &token(0))?;
    gate.set_policy(c.server.as_fd(), &tripped(1, token_bytes(0..1), 1))?;
    send(&c.server, &wrong_nonce).context("wrong nonce within budget")?;
    send(&c.server, &terminal(NONCE, TERMINAL_PAD)).context("real terminal after a fake")?;
    let st = gate.socket(c.server.as_fd())?.state.context("state")?;
    assert_eq!((st.post_trip_frames, st.terminal_sent), (1, 1));
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 1,
            fake_terminals: 1,
            terminals: 1,
            bad: 0
        }
    );

    // B = 1: two wrong-nonce "terminals": the second is a token beyond the budget.
    let c = conn(&gate, &untripped(1))?;
    gate.set_policy(c.server.as_fd(), &tripped(0, 0, 1))?;
    send(&c.server, &wrong_nonce).context("wrong nonce within budget")?;
    expect_dropped(send(&c.server, &wrong_nonce), "wrong nonce beyond budget")?;
    let st = gate.socket(c.server.as_fd())?.state.context("state")?;
    assert_eq!((st.post_trip_frames, st.terminal_sent), (1, 0));
    drop(c);

    // B = 0: the right nonce in a frame one byte longer, or one byte shorter, than the trip's
    // terminal is a token beyond the budget.
    for (pad, what) in [
        (TERMINAL_PAD + 1, "terminal one byte too long"),
        (TERMINAL_PAD - 1, "terminal one byte too short"),
    ] {
        let c = conn(&gate, &untripped(0))?;
        send(&c.server, &token(0))?;
        gate.set_policy(c.server.as_fd(), &tripped(1, token_bytes(0..1), 0))?;
        let frame = terminal(NONCE, pad);
        assert_ne!(frame.len(), t as usize);
        expect_dropped(send(&c.server, &frame), what)?;
        let st = gate.socket(c.server.as_fd())?.state.context("state")?;
        assert_eq!((st.terminal_sent, st.dropped), (0, 1), "{what}");
        drop(c);
    }

    // B = 0, a trip with an all-zero nonce: a frame with zeros there is not a terminal.
    let c = conn(&gate, &untripped(0))?;
    gate.set_policy(
        c.server.as_fd(),
        &SockPolicy {
            nonce: [0; NONCE_LEN],
            ..tripped(0, 0, 0)
        },
    )?;
    let mut zeros = SSE_TERMINAL_PREFIX.to_vec();
    zeros.extend_from_slice(&[0; NONCE_LEN]);
    zeros.resize(t as usize - 2, b' ');
    zeros.extend_from_slice(b"\n\n");
    assert_eq!(zeros.len(), t as usize);
    expect_dropped(send(&c.server, &zeros), "zero nonce")?;
    drop(c);

    // B = 0 and the right nonce in a frame of exactly the terminal's length: passes.
    let c = conn(&gate, &untripped(0))?;
    gate.set_policy(c.server.as_fd(), &tripped(0, 0, 0))?;
    send(&c.server, &terminal(NONCE, TERMINAL_PAD)).context("real terminal")?;
    assert_eq!(
        finish(c)?,
        Received {
            terminals: 1,
            ..Default::default()
        }
    );

    check_counters(
        &gate,
        &[
            (verdict::PASS, 3),
            (verdict::PASS_POST_TRIP, 2),
            (verdict::PASS_TERMINAL, 2),
            (verdict::DROP_BUDGET, 4),
        ],
        "fake terminals",
    )?;
    Ok(())
}

/// io_uring `IORING_OP_SEND` goes through the gate exactly like `write`.
#[test]
fn io_uring_send_is_policed() -> Result<()> {
    let gate = live_gate()?;
    let mut ring = io_uring::IoUring::new(8)?;
    let c = conn(&gate, &untripped(2))?;
    let fd = io_uring::types::Fd(c.server.as_raw_fd());
    let mut uring_send = |frame: &[u8]| -> Result<i32> {
        let len = u32::try_from(frame.len())?;
        let sqe = io_uring::opcode::Send::new(fd, frame.as_ptr(), len)
            .build()
            .user_data(1);
        // SAFETY: `frame` and the socket outlive the operation: we wait for its completion
        // before returning.
        unsafe { ring.submission().push(&sqe)? };
        ring.submit_and_wait(1)?;
        let cqe = ring.completion().next().context("no completion")?;
        Ok(cqe.result())
    };
    for i in 0..3 {
        let f = token(i);
        ensure!(
            uring_send(&f)? == f.len() as i32,
            "untripped uring send {i}"
        );
    }
    gate.set_policy(c.server.as_fd(), &tripped(3, token_bytes(0..3), 2))?;
    for i in 3..5 {
        let f = token(i);
        ensure!(
            uring_send(&f)? == f.len() as i32,
            "post-trip uring send {i}"
        );
    }
    assert_eq!(
        uring_send(&token(5))?,
        -libc::EACCES,
        "uring send beyond budget"
    );
    expect_dropped(send(&c.server, &token(5)), "write after uring drop")?;
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 5,
            ..Default::default()
        }
    );
    check_counters(
        &gate,
        &[
            (verdict::PASS, 3),
            (verdict::PASS_POST_TRIP, 2),
            (verdict::DROP_BUDGET, 1),
        ],
        "io_uring",
    )?;
    Ok(())
}

/// A post-trip send larger than the stream's largest event E is dropped whole, even with
/// frames to spare; before the trip the size does not matter.
#[test]
fn post_trip_frame_larger_than_e_drops() -> Result<()> {
    const SMALL_E: u32 = 32;
    let gate = live_gate()?;
    let c = conn(
        &gate,
        &SockPolicy {
            max_event_bytes: SMALL_E,
            ..untripped(5)
        },
    )?;
    send(&c.server, &token(0))?;
    let mut batch = Vec::new();
    for i in 1..200 {
        batch.extend_from_slice(&token(i));
    }
    assert!(batch.len() > 1000);
    send(&c.server, &batch).context("a large untripped send")?;
    let pre_bytes = token_bytes(0..200);
    gate.set_policy(
        c.server.as_fd(),
        &trip_policy(2, pre_bytes, 5, SMALL_E, terminal_len()),
    )?;
    send(&c.server, &token_of_len(200, SMALL_E as usize)).context("a post-trip frame of E")?;
    let mut two = token(201);
    two.extend_from_slice(&token(202));
    assert!(two.len() > SMALL_E as usize);
    expect_dropped(send(&c.server, &two), "post-trip frame of more than E")?;
    expect_dropped(send(&c.server, &token(201)), "a small frame after the drop")?;
    let st = gate.socket(c.server.as_fd())?.state.context("state")?;
    assert_eq!(
        (st.post_trip_frames, st.post_trip_bytes, st.dropped),
        (1, u64::from(SMALL_E), 1)
    );
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 201,
            ..Default::default()
        }
    );
    check_counters(
        &gate,
        &[
            (verdict::PASS, 2),
            (verdict::PASS_POST_TRIP, 1),
            (verdict::DROP_FRAME_SIZE, 1),
        ],
        "frame size",
    )?;
    let ev = events(&gate)?;
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(
        (ev[0].verdict, ev[0].post_trip_frames),
        (verdict::DROP_FRAME_SIZE, 1)
    );
    Ok(())
}

/// The post-trip bytes are bounded by B × E of the policy in force: B frames of exactly E use
/// the whole byte budget, and when the policy is rewritten with a smaller E after post-trip
/// bytes passed, a frame within the frame limit and within the new E is still dropped once the
/// bytes would exceed B × E.
#[test]
fn post_trip_bytes_are_bounded_by_budget_times_e() -> Result<()> {
    const B: u32 = 3;
    const BIG_E: u32 = 64;
    let t = terminal_len();
    let gate = live_gate()?;

    // B frames of exactly E: the byte budget B × E is used up exactly, and passes.
    let c = conn(&gate, &untripped(B))?;
    send(&c.server, &token(0))?;
    let f_bytes = token_bytes(0..1);
    gate.set_policy(c.server.as_fd(), &trip_policy(1, f_bytes, B, BIG_E, t))?;
    for i in 1..=B as usize {
        send(&c.server, &token_of_len(i, BIG_E as usize))
            .with_context(|| format!("post-trip frame {i} of exactly E"))?;
    }
    let st = gate.socket(c.server.as_fd())?.state.context("state")?;
    assert_eq!(
        (st.post_trip_frames, st.post_trip_bytes),
        (u64::from(B), u64::from(B * BIG_E))
    );
    expect_dropped(send(&c.server, &token(4)), "a frame beyond B")?;
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 1 + B as usize,
            ..Default::default()
        }
    );

    // Two frames of 64 under E = 64, then the policy says E = 40: 128 + 40 > 3 × 40.
    let small_e = 40u32;
    let c = conn(&gate, &untripped(B))?;
    send(&c.server, &token(0))?;
    gate.set_policy(c.server.as_fd(), &trip_policy(1, f_bytes, B, BIG_E, t))?;
    for i in 1..=2 {
        send(&c.server, &token_of_len(i, BIG_E as usize))?;
    }
    gate.set_policy(c.server.as_fd(), &trip_policy(1, f_bytes, B, small_e, t))?;
    expect_dropped(
        send(&c.server, &token_of_len(3, small_e as usize)),
        "the third frame, within the frame limit and E, beyond B × E",
    )?;
    let st = gate.socket(c.server.as_fd())?.state.context("state")?;
    assert_eq!(
        (st.post_trip_frames, st.post_trip_bytes, st.dropped),
        (2, 2 * u64::from(BIG_E), 1)
    );
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 3,
            ..Default::default()
        }
    );

    check_counters(
        &gate,
        &[
            (verdict::PASS, 2),
            (verdict::PASS_POST_TRIP, u64::from(B) + 2),
            (verdict::DROP_BUDGET, 1),
            (verdict::DROP_BYTES, 1),
        ],
        "byte budget",
    )?;
    let ev = events(&gate)?;
    let verdicts: Vec<u32> = ev.iter().map(|e| e.verdict).collect();
    assert_eq!(verdicts, [verdict::DROP_BUDGET, verdict::DROP_BYTES]);
    Ok(())
}

/// A trip written while the emitter keeps sending: exactly `F + B` frames reach the client,
/// where `F` is what had been handed to the kernel when the trip was decided. Frames racing the
/// write are still within the absolute limit, and the program never reads a half-written
/// policy as "tripped with limit 0" (that would drop early).
#[test]
fn trip_while_sending_is_exact() -> Result<()> {
    use std::sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    };
    let gate = live_gate()?;
    const B: u32 = 2000;
    let mut total_passed = 0;
    for round in 0..10u32 {
        let c = conn(
            &gate,
            &SockPolicy {
                stream_tag: u64::from(round),
                ..untripped(B)
            },
        )?;
        let Conn { server, mut client } = c;
        let server_fd = server.try_clone()?;
        let reader = thread::spawn(move || -> io::Result<Vec<u8>> {
            let mut bytes = Vec::new();
            client.read_to_end(&mut bytes)?;
            Ok(bytes)
        });
        let handed = Arc::new(AtomicU64::new(0));
        let sender = {
            let handed = Arc::clone(&handed);
            thread::spawn(move || -> io::Result<u64> {
                for i in 0.. {
                    match send(&server, &token(i)) {
                        Ok(()) => handed.store(i as u64 + 1, Ordering::SeqCst),
                        Err(e) if e.raw_os_error() == Some(libc::EACCES) => return Ok(i as u64),
                        Err(e) => return Err(e),
                    }
                }
                unreachable!("the gate stops the loop")
            })
        };
        thread::sleep(Duration::from_millis(2));
        let f = handed.load(Ordering::SeqCst);
        gate.set_policy(
            server_fd.as_fd(),
            &SockPolicy {
                stream_tag: u64::from(round),
                ..tripped(f, token_bytes(0..usize::try_from(f)?), B)
            },
        )?;
        let passed = sender
            .join()
            .map_err(|_| anyhow::anyhow!("sender panicked"))??;
        let st = gate.socket(server_fd.as_fd())?.state.context("state")?;
        drop(server_fd);
        ensure!(
            passed == f + u64::from(B),
            "round {round}: F={f}, {passed} frames passed, want F+B (gate state {st:?})"
        );
        let bytes = reader
            .join()
            .map_err(|_| anyhow::anyhow!("reader panicked"))??;
        let tokens = String::from_utf8(bytes)?.split_terminator("\n\n").count() as u64;
        ensure!(
            tokens == f + u64::from(B),
            "round {round}: client got {tokens} frames, want {}",
            f + u64::from(B)
        );
        total_passed += passed;
    }
    // Frames that raced the trip were judged before or after it; either way every passed frame
    // was counted once, and each round ended with one drop.
    let v = send_verdicts(&gate)?;
    let passed = v[verdict::PASS as usize] + v[verdict::PASS_POST_TRIP as usize];
    ensure!(
        passed == total_passed
            && v[verdict::PASS_POST_TRIP as usize] <= 10 * u64::from(B)
            && v[verdict::DROP_BUDGET as usize] == 10
            && v.iter().sum::<u64>() == total_passed + 10,
        "send-check counters {v:?}, want {total_passed} passed in all, at most {} post-trip, 10 budget drops",
        10 * u64::from(B)
    );
    check_egress_clean(&gate, "trip while sending")?;
    Ok(())
}

/// Frames userspace handed to the kernel before the trip but that reach the gate after it (in
/// flight) pass as pre-trip frames and leave the whole byte budget B × E to the B post-trip
/// frames.
#[test]
fn in_flight_pre_trip_frames_do_not_use_the_byte_budget() -> Result<()> {
    let gate = live_gate()?;
    // Every token below 10 has this length; E is exactly one token.
    let per = token(5).len() as u32;
    let b = 2u32;
    let c = conn(
        &gate,
        &SockPolicy {
            max_event_bytes: per,
            ..untripped(b)
        },
    )?;
    send(&c.server, &token(0))?;
    send(&c.server, &token(1))?;
    // F = 5 frames handed to the kernel at the trip, 3 of them not through the gate yet.
    gate.set_policy(
        c.server.as_fd(),
        &trip_policy(5, token_bytes(0..5), b, per, terminal_len()),
    )?;
    for i in 2..5 {
        send(&c.server, &token(i)).with_context(|| format!("in-flight pre-trip frame {i}"))?;
    }
    for i in 5..7 {
        send(&c.server, &token(i)).with_context(|| format!("post-trip frame {i}"))?;
    }
    expect_dropped(send(&c.server, &token(7)), "frame beyond F + B")?;
    let st = gate.socket(c.server.as_fd())?.state.context("state")?;
    assert_eq!(
        (st.post_trip_frames, st.post_trip_bytes),
        (u64::from(b), u64::from(b * per))
    );
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 7,
            ..Default::default()
        }
    );
    check_counters(
        &gate,
        &[
            (verdict::PASS, 5),
            (verdict::PASS_POST_TRIP, 2),
            (verdict::DROP_BUDGET, 1),
        ],
        "in flight",
    )?;
    Ok(())
}

/// The nonce is found when the terminal frame comes as one `writev` of many small iovecs
/// (one program run; the kernel copies them into its own message pages), and in the HTTP form
/// used before the response headers went out.
#[test]
fn terminal_frame_scattered_or_http_form_is_recognised() -> Result<()> {
    let gate = live_gate()?;

    let c = conn(&gate, &untripped(0))?;
    send(&c.server, &token(0))?;
    gate.set_policy(c.server.as_fd(), &tripped(1, token_bytes(0..1), 0))?;
    let frame = terminal(NONCE, TERMINAL_PAD);
    let iov: Vec<libc::iovec> = frame
        .chunks(7)
        .map(|piece| libc::iovec {
            iov_base: piece.as_ptr().cast_mut().cast(),
            iov_len: piece.len(),
        })
        .collect();
    // SAFETY: every iovec points into `frame`, which outlives the call; the kernel only reads.
    let n = unsafe {
        libc::writev(
            c.server.as_raw_fd(),
            iov.as_ptr(),
            i32::try_from(iov.len())?,
        )
    };
    ensure!(
        n == frame.len() as isize,
        "scattered terminal: writev returned {n}: {}",
        io::Error::last_os_error()
    );
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 1,
            terminals: 1,
            ..Default::default()
        }
    );

    let mut http = HTTP_TERMINAL_PREFIX.to_vec();
    http.extend_from_slice(NONCE);
    http.extend_from_slice(b"\r\ncontent-type: text/event-stream\r\n\r\n");
    assert_eq!(&http[NONCE_OFFSET..NONCE_OFFSET + NONCE_LEN], NONCE);
    let c = conn(&gate, &untripped(0))?;
    gate.set_policy(
        c.server.as_fd(),
        &trip_policy(0, 0, 0, E, u32::try_from(http.len())?),
    )?;
    send(&c.server, &http).context("HTTP-form terminal")?;
    expect_dropped(
        send(&c.server, &token(0)),
        "token after the HTTP-form terminal",
    )?;
    assert_eq!(
        finish(c)?,
        Received {
            terminals: 1,
            ..Default::default()
        }
    );

    check_counters(
        &gate,
        &[
            (verdict::PASS, 1),
            (verdict::PASS_TERMINAL, 2),
            (verdict::DROP_AFTER_TERMINAL, 1),
        ],
        "scattered and HTTP terminals",
    )?;
    Ok(())
}

/// The attack of issue 10, with haltd's own encoder: B = 1 and one send carrying 80 token
/// events after the trip. The stream's E is the built-in chat encoder's bound on one token
/// event; the send is far larger, so the send check drops it (`drop_frame_size`), the client
/// reads nothing of it, and a single event of the same stream would still have fitted.
#[test]
fn eighty_events_in_one_send_are_dropped() -> Result<()> {
    use haltd::wire::{Channel, ChunkEncoder, Endpoint, StreamId, Token};
    let enc = ChunkEncoder {
        endpoint: Endpoint::Chat,
        stream_id: StreamId {
            slot: 3,
            generation: 7,
        },
        created: 1_796_000_000,
        model: "builtin".into(),
        logprobs: false,
        top_logprobs: 0,
        tool_calls: false,
        reasoning: false,
        blocks: std::cell::Cell::default(),
        output: std::cell::RefCell::default(),
    };
    let e = enc.max_event_bytes();
    let event = |out: &mut Vec<u8>, i: usize| {
        let tok = Token {
            text: " river",
            logprob: -0.25,
            top: &[],
        };
        enc.token_event(out, tok, i * 6, i == 0, Channel::Content);
    };
    let mut one = Vec::new();
    event(&mut one, 3);
    let mut eighty = Vec::new();
    for i in 0..80 {
        event(&mut eighty, 3 + i);
    }
    ensure!(one.len() <= e as usize, "one event {} > E {e}", one.len());

    let gate = live_gate()?;
    let policy = SockPolicy {
        budget: 1,
        max_event_bytes: e,
        stream_tag: TAG,
        ..SockPolicy::default()
    };
    let c = conn(&gate, &policy)?;
    let mut pre = Vec::new();
    for i in 0..3 {
        let mut f = Vec::new();
        event(&mut f, i);
        send(&c.server, &f)?;
        pre.extend_from_slice(&f);
    }
    let t = terminal_len();
    gate.set_policy(c.server.as_fd(), &trip_policy(3, pre.len() as u64, 1, e, t))?;
    expect_dropped(
        send(&c.server, &eighty),
        "80 token events in one post-trip send",
    )?;
    let Conn { server, mut client } = c;
    drop(server);
    let mut got = Vec::new();
    client.read_to_end(&mut got)?;
    println!(
        "80 events in one send: {} bytes against E = {e} (one event {} bytes); the client read {} bytes, the 3 pre-trip events",
        eighty.len(),
        one.len(),
        got.len()
    );
    ensure!(
        got == pre,
        "the client read {} bytes, expected the {} pre-trip bytes",
        got.len(),
        pre.len()
    );
    let v = send_verdicts(&gate)?;
    ensure!(
        v == expected(&[(verdict::PASS, 3), (verdict::DROP_FRAME_SIZE, 1)]),
        "{v:?}"
    );
    Ok(())
}
