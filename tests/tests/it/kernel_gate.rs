//! The halt gate on the real kernel: loads the gate's programs, governs real loopback TCP
//! sockets and checks what the client receives, what each send returns, the gate's per-socket
//! state, the verdict counters and the halt events.
//!
//! Needs root (CAP_BPF, CAP_NET_ADMIN, cgroup v2) and the BPF object:
//! `HALTD_BPF_OBJECT=$PWD/ebpf/haltd-ebpf/target/bpfel-unknown-none/release/haltd-ebpf \
//!  cargo test -p haltd-tests --test it -- --test-threads=1 kernel_gate::`
//! Without root the tests fail (CI runs as root; a skip would hide a missing gate).
//!
//! Each test loads its own gate (its own maps and counters, its own cgroup leaf), so tests do
//! not interfere. Loading moves the test process into the new gate's cgroup, so every socket is
//! created after the load: the egress and adoption programs see only sockets of that cgroup.
//! Dropping the gate moves the process back (`haltd_tests::gate::TestGate`).
//!
//! The send check (`halt_gate`) counts verdicts 0..=7; the egress check (`halt_egress`) and the
//! adoption program count on their own indices, and `EGRESS_PASS` moves with every governed
//! segment, so the tests compare the send-check counters exactly and the egress counters only
//! where they mean something (no egress drop when the ceilings are right).
use std::{
    io::{self, Read, Write},
    net::{Shutdown, TcpListener, TcpStream},
    os::fd::{AsFd, AsRawFd},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use haltd::gate::{GateError, Governed, KernelGate};

use haltd_common::{
    trip_reason, verdict, HaltEvent, SockPolicy, HTTP_TERMINAL_PREFIX, NONCE_LEN, NONCE_OFFSET,
    SSE_TERMINAL_PREFIX,
};
use haltd_tests::gate::{reset_on_close, set_int, TestGate};

const NONCE: &[u8; NONCE_LEN] = b"0123456789abcdef";
/// E: the largest token event of the test streams (every token frame and every terminal frame
/// below fits).
const E: u32 = 128;
/// Padding of the canonical terminal frame; one byte more or less gives a wrong-length one.
const TERMINAL_PAD: usize = 8;
/// The streams' tag (`generation << 32 | slot`), reported in halt events.
const TAG: u64 = (7 << 32) | 3;
const CAUSE: u32 = 42;
/// The send-check counters: `VERDICTS[0..SEND_VERDICTS]`.
const SEND_VERDICTS: usize = verdict::EGRESS_PASS as usize;

type SendVerdicts = [u64; SEND_VERDICTS];

/// A gate with no heartbeat yet (the test process needs root: it fails without).
fn load_gate(deadline: Duration) -> Result<TestGate> {
    TestGate::load(64, deadline)
}

/// A gate with a fresh heartbeat and a deadline no test reaches.
fn live_gate() -> Result<TestGate> {
    let gate = load_gate(Duration::from_secs(600))?;
    gate.beat().context("stamping the heartbeat")?;
    Ok(gate)
}

/// The policy of a stream before its trip: post-trip budget `budget` (what the gate allows if
/// it sees the heartbeat lost), largest event E.
fn untripped(budget: u32) -> SockPolicy {
    SockPolicy {
        budget,
        max_event_bytes: E,
        stream_tag: TAG,
        ..SockPolicy::default()
    }
}

/// The trip as haltd writes it: `f` frames of `f_bytes` bytes handed to the kernel before it,
/// `b` post-trip frames of at most `e` bytes, a terminal frame of exactly `t` bytes. The egress
/// ceiling is `f_bytes + b × e + t`.
fn trip_policy(f: u64, f_bytes: u64, b: u32, e: u32, t: u32) -> SockPolicy {
    SockPolicy {
        tripped: 1,
        cause: CAUSE,
        budget: b,
        max_event_bytes: e,
        pre_trip_frames: f,
        egress_ceiling: f_bytes + u64::from(b) * u64::from(e) + u64::from(t),
        terminal_len: t,
        _pad: 0,
        nonce: *NONCE,
        stream_tag: TAG,
    }
}

/// [`trip_policy`] with E and the canonical terminal frame.
fn tripped(f: u64, f_bytes: u64, b: u32) -> SockPolicy {
    trip_policy(f, f_bytes, b, E, terminal_len())
}

/// A loopback connection whose server side is governed.
struct Conn {
    server: TcpStream,
    client: TcpStream,
}

/// A connection governed by `govern` itself (its port is not a governed port).
fn conn(gate: &KernelGate, policy: &SockPolicy) -> Result<Conn> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    client.set_read_timeout(Some(Duration::from_secs(10)))?;
    let how = gate
        .govern(server.as_fd(), policy)
        .context("governing the server side")?;
    ensure!(
        how == Governed::Inserted,
        "a connection on a port that is not governed came under the gate as {how:?}"
    );
    Ok(Conn { server, client })
}

fn token(i: usize) -> Vec<u8> {
    format!("data: {{\"t\":{i}}}\n\n").into_bytes()
}

/// Token `i` padded with spaces to exactly `len` bytes.
fn token_of_len(i: usize, len: usize) -> Vec<u8> {
    let mut f = format!("data: {{\"t\":{i}}}").into_bytes();
    assert!(f.len() + 2 <= len, "token {i} does not fit {len} bytes");
    f.resize(len - 2, b' ');
    f.extend_from_slice(b"\n\n");
    f
}

/// Bytes of tokens `range`, as [`token`] writes them.
fn token_bytes(range: std::ops::Range<usize>) -> u64 {
    range.map(|i| token(i).len() as u64).sum()
}

fn terminal(nonce: &[u8; NONCE_LEN], pad: usize) -> Vec<u8> {
    let mut f = SSE_TERMINAL_PREFIX.to_vec();
    f.extend_from_slice(nonce);
    f.extend_from_slice(b"\nevent: halt\ndata: {\"code\":\"halted\"");
    f.extend(std::iter::repeat_n(b' ', pad));
    f.extend_from_slice(b"}\n\n");
    f
}

/// T: the exact length of the canonical terminal frame.
fn terminal_len() -> u32 {
    terminal(NONCE, TERMINAL_PAD).len() as u32
}

/// One `write` of the whole frame; `Err` is the kernel's answer (EACCES when the gate drops).
fn send(s: &TcpStream, frame: &[u8]) -> io::Result<()> {
    let n = (&*s).write(frame)?;
    if n != frame.len() {
        return Err(io::Error::other(format!(
            "short write {n} of {}",
            frame.len()
        )));
    }
    Ok(())
}

fn expect_dropped(r: io::Result<()>, what: &str) -> Result<()> {
    match r {
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => Ok(()),
        Err(e) => bail!("{what}: expected EACCES, got {e}"),
        Ok(()) => bail!("{what}: expected the gate to drop it, but it was sent"),
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Received {
    /// Token frames, in order from token 0.
    tokens: usize,
    /// Frames that look like a terminal but do not carry the trip's nonce.
    fake_terminals: usize,
    /// Terminal frames with the nonce (SSE or HTTP form).
    terminals: usize,
    /// A token after the terminal frame, or anything unrecognised.
    bad: usize,
}

fn parse(bytes: Vec<u8>) -> Result<Received> {
    let text = String::from_utf8(bytes)?;
    let sse_terminal = format!(
        "{}{}",
        std::str::from_utf8(SSE_TERMINAL_PREFIX)?,
        std::str::from_utf8(NONCE)?
    );
    let http_terminal = format!(
        "{}{}",
        std::str::from_utf8(HTTP_TERMINAL_PREFIX)?,
        std::str::from_utf8(NONCE)?
    );
    let mut r = Received::default();
    for frame in text.split_terminator("\n\n") {
        if (frame.starts_with(&sse_terminal) || frame.starts_with(&http_terminal))
            && r.terminals == 0
        {
            r.terminals += 1;
        } else if r.terminals == 0 && frame.starts_with(": haltd-halt") {
            r.fake_terminals += 1;
        } else if r.terminals == 0
            && frame.trim_end_matches(' ') == format!("data: {{\"t\":{}}}", r.tokens)
        {
            r.tokens += 1;
        } else {
            r.bad += 1;
        }
    }
    Ok(r)
}

/// Closes the server side and reads everything the client got.
fn finish(c: Conn) -> Result<Received> {
    let Conn { server, mut client } = c;
    drop(server);
    let mut bytes = Vec::new();
    client.read_to_end(&mut bytes)?;
    parse(bytes)
}

fn expected(pairs: &[(u32, u64)]) -> SendVerdicts {
    let mut v = [0; SEND_VERDICTS];
    for &(i, n) in pairs {
        v[i as usize] = n;
    }
    v
}

/// The send check's counters.
fn send_verdicts(gate: &KernelGate) -> Result<SendVerdicts> {
    let all = gate.verdict_totals()?;
    let mut v = [0; SEND_VERDICTS];
    v.copy_from_slice(&all[..SEND_VERDICTS]);
    Ok(v)
}

/// Checks the send-check counters, and that the egress check dropped nothing (every test that
/// uses it sets a ceiling its stream stays within).
fn check_counters(gate: &KernelGate, want: &[(u32, u64)], what: &str) -> Result<()> {
    let got = send_verdicts(gate)?;
    let want = expected(want);
    ensure!(
        got == want,
        "{what}: send-check counters {got:?}, want {want:?}"
    );
    check_egress_clean(gate, what)
}

/// Checks that the egress check dropped no segment.
fn check_egress_clean(gate: &KernelGate, what: &str) -> Result<()> {
    let all = gate.verdict_totals()?;
    let drops = (
        all[verdict::EGRESS_DROP_CEILING as usize],
        all[verdict::EGRESS_DROP_UNPARSED as usize],
    );
    ensure!(
        drops == (0, 0),
        "{what}: the egress check dropped segments (ceiling, unparsed) {drops:?} of a stream within its ceiling"
    );
    Ok(())
}

fn events(gate: &KernelGate) -> Result<Vec<HaltEvent>> {
    let mut out = Vec::new();
    gate.drain_halt_events(&mut |e| out.push(e))?;
    Ok(out)
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

/// A socket under the gate without a policy (adopted on a governed port, never given one) is
/// tripped with nothing allowed: its first send is dropped.
#[test]
fn socket_without_policy_drops() -> Result<()> {
    let gate = live_gate()?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    gate.govern_port(listener.local_addr()?.port())?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    client.set_read_timeout(Some(Duration::from_secs(10)))?;
    let c = Conn { server, client };
    let view = gate.socket(c.server.as_fd())?;
    let st = view.state.context("adopted socket without state")?;
    assert_eq!((st.adopted, st.frames), (1, 0));
    assert!(view.policy.is_none());

    expect_dropped(send(&c.server, &token(0)), "send without a policy")?;
    expect_dropped(
        send(&c.server, &terminal(NONCE, TERMINAL_PAD)),
        "terminal without a policy",
    )?;
    let st = gate.socket(c.server.as_fd())?.state.context("state")?;
    assert_eq!(
        (st.trip_reason, st.dropped, st.frames, st.post_trip_frames),
        (trip_reason::NO_POLICY, 1, 1, 0)
    );
    // The socket sent through the gate: it can no longer be governed.
    match gate.govern(c.server.as_fd(), &untripped(0)) {
        Err(GateError::Ungovernable(_)) => {}
        other => bail!("governing a socket that already sent: {other:?}"),
    }
    assert_eq!(finish(c)?, Received::default());

    check_counters(&gate, &[(verdict::DROP_BUDGET, 1)], "no policy")?;
    let totals = gate.verdict_totals()?;
    assert_eq!(
        (
            totals[verdict::ADOPTED as usize],
            totals[verdict::ADOPT_FAILED as usize]
        ),
        (1, 0)
    );
    let ev = events(&gate)?;
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(
        (
            ev[0].stream_tag,
            ev[0].trip_reason,
            ev[0].verdict,
            ev[0].cause
        ),
        (0, trip_reason::NO_POLICY, verdict::DROP_BUDGET, 0),
        "no policy, no stream tag and no cause"
    );
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

/// Connects to `listener`, half-closes the client side, waits until the server sees the FIN,
/// and only then hands over the accepted socket.
fn half_closed(listener: &TcpListener) -> Result<(TcpStream, TcpStream)> {
    let client = TcpStream::connect(listener.local_addr()?)?;
    client.shutdown(Shutdown::Write)?;
    thread::sleep(Duration::from_millis(20));
    let (server, _) = listener.accept()?;
    server.set_read_timeout(Some(Duration::from_secs(1)))?;
    let n = (&server).read(&mut [0u8; 16])?;
    ensure!(
        n == 0,
        "the server should see the client's FIN (EOF) before governing, read {n} bytes"
    );
    client.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok((server, client))
}

/// A client that half-closes its connection before haltd accepts it: on a governed port the
/// adoption program governed the connection at establishment, so `govern` only gives it its
/// policy and its sends are policed; on a port that is not governed, userspace can no longer
/// insert it (the kernel's socket map takes only established sockets).
#[test]
fn adopted_at_establishment_even_after_half_close() -> Result<()> {
    let gate = live_gate()?;

    let listener = TcpListener::bind("127.0.0.1:0")?;
    gate.govern_port(listener.local_addr()?.port())?;
    let (server, mut client) = half_closed(&listener)?;
    let how = gate
        .govern(server.as_fd(), &untripped(0))
        .context("governing a half-closed connection on a governed port")?;
    ensure!(
        how == Governed::Adopted,
        "a connection on a governed port came under the gate as {how:?}"
    );
    let st = gate.socket(server.as_fd())?.state.context("state")?;
    assert_eq!((st.adopted, st.frames), (1, 0));
    // Untripped sends reach the client, which can still read after its half-close.
    for i in 0..3 {
        send(&server, &token(i)).with_context(|| format!("untripped frame {i}"))?;
    }
    let mut bytes = vec![0u8; usize::try_from(token_bytes(0..3))?];
    client
        .read_exact(&mut bytes)
        .context("the half-closed client reading the untripped frames")?;
    // Tripped with B = 0: the next send is refused.
    gate.set_policy(server.as_fd(), &tripped(3, token_bytes(0..3), 0))?;
    expect_dropped(send(&server, &token(3)), "send after a trip with B = 0")?;
    let st = gate.socket(server.as_fd())?.state.context("state")?;
    assert_eq!(
        (st.frames, st.trip_reason, st.dropped),
        (4, trip_reason::TRIPPED, 1)
    );
    drop(server);
    client.read_to_end(&mut bytes)?;
    assert_eq!(
        parse(bytes)?,
        Received {
            tokens: 3,
            ..Default::default()
        }
    );

    // The same half-closed connection on a port that is not governed: too late to insert.
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let (server, _client) = half_closed(&listener)?;
    match gate.govern(server.as_fd(), &untripped(0)) {
        Err(GateError::Ungovernable(why)) => println!("not governed, as expected: {why}"),
        other => bail!("governing a half-closed connection by insertion: {other:?}"),
    }

    check_counters(
        &gate,
        &[(verdict::PASS, 3), (verdict::DROP_BUDGET, 1)],
        "half-closed",
    )?;
    let totals = gate.verdict_totals()?;
    assert_eq!(
        (
            totals[verdict::ADOPTED as usize],
            totals[verdict::ADOPT_FAILED as usize]
        ),
        (1, 0),
        "one adoption: the connection on the governed port"
    );
    Ok(())
}

/// The stream's byte at offset `k` is `k % 251`: what arrives can be checked as a prefix.
fn pattern(from: usize, len: usize) -> Vec<u8> {
    (from..from + len).map(|k| (k % 251) as u8).collect()
}

/// The backpressure bypass, deterministically: the server's socket (tiny send buffer,
/// nonblocking) is filled with 64 KiB frames to a short write or EAGAIN while the client does
/// not read, then tripped with a small allowance (B = 1, E = 256), then handed new 4 KiB
/// frames, each larger than E. The send check drops each one it sees, but after a short write
/// (a push left partial) the kernel keeps its earlier verdict and accepts the next send without
/// running it; the egress check must hold every byte beyond the ceiling (pre-trip bytes +
/// B × E + T), and let every pre-trip byte through.
#[test]
fn egress_holds_bytes_beyond_the_ceiling() -> Result<()> {
    const SMALL_E: u32 = 256;
    const B: u32 = 1;
    const FRAME: usize = 4096;
    const FILL_FRAME: usize = 64 * 1024;
    const POST_TRIP_ATTEMPTS: usize = 400;
    let t = terminal_len();
    let gate = live_gate()?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    set_int(server.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 4096)?;
    server.set_nonblocking(true)?;
    gate.govern(
        server.as_fd(),
        &SockPolicy {
            max_event_bytes: SMALL_E,
            ..untripped(B)
        },
    )?;

    // Fill: whole frames until a short write or EAGAIN.
    let mut accepted = 0usize;
    let mut frames = 0u64;
    let fill_end = loop {
        match (&server).write(&pattern(accepted, FILL_FRAME)) {
            Ok(n) => {
                frames += 1;
                accepted += n;
                if n < FILL_FRAME {
                    break format!("short write of {n}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break "EAGAIN".to_owned(),
            Err(e) => return Err(e).context("filling the socket before the trip"),
        }
        ensure!(frames < 100_000, "the socket never filled");
    };
    let trip = trip_policy(frames, accepted as u64, B, SMALL_E, t);
    let ceiling = trip.egress_ceiling;
    gate.set_policy(server.as_fd(), &trip)?;

    // New 4 KiB frames after the trip.
    let mut post = 0usize;
    let (mut eagain, mut accepted_calls, mut eacces) = (0, 0, false);
    for _ in 0..POST_TRIP_ATTEMPTS {
        match (&server).write(&pattern(accepted + post, FRAME)) {
            Ok(n) => {
                post += n;
                accepted_calls += 1;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                eagain += 1;
                thread::sleep(Duration::from_micros(500));
            }
            Err(e) if e.raw_os_error() == Some(libc::EACCES) => {
                eacces = true;
                break;
            }
            Err(e) => return Err(e).context("sending after the trip"),
        }
    }

    // The client reads everything that arrives for a second.
    client.set_read_timeout(Some(Duration::from_millis(50)))?;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        match client.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e).context("reading at the client"),
        }
    }
    let view = gate.socket(server.as_fd())?;
    reset_on_close(&server)?;
    drop(server);
    let totals = gate.verdict_totals()?;
    let egress_drops = totals[verdict::EGRESS_DROP_CEILING as usize];
    let st = view.state.context("state")?;
    let eg = view.egress.context("egress state")?;
    let total = (accepted + post) as u64;
    println!(
        "fill: {frames} frames, {accepted} bytes, ended by {fill_end}; ceiling {ceiling}; after the trip: {post} bytes accepted in {accepted_calls} calls, {eagain} EAGAIN, EACCES {eacces}; client received {}; egress drops {egress_drops}; send-check state {st:?}; egress state {eg:?}",
        got.len()
    );

    ensure!(
        got == pattern(0, got.len()),
        "the client received bytes out of order or altered"
    );
    ensure!(
        got.len() >= accepted,
        "pre-trip bytes held back: the client received {} of the {accepted} bytes accepted before the trip",
        got.len()
    );
    ensure!(
        got.len() as u64 <= ceiling,
        "the client received {} bytes, beyond the ceiling {ceiling}",
        got.len()
    );
    ensure!(
        st.post_trip_frames <= u64::from(B),
        "the send check passed {} post-trip frames",
        st.post_trip_frames
    );
    if total > ceiling {
        ensure!(
            egress_drops > 0 && eg.dropped_segments > 0,
            "{total} bytes accepted, beyond the ceiling {ceiling}, yet the egress check dropped nothing"
        );
        ensure!(
            eg.passed_end <= ceiling && eg.dropped_end > ceiling,
            "egress state {eg:?} against the ceiling {ceiling}"
        );
    }
    // One event per check that dropped: the send check's (frames, post-trip frames), the
    // egress check's (where the dropped segment ended, the ceiling in force).
    let ev = events(&gate)?;
    ensure!(
        ev.iter().all(|e| e.stream_tag == TAG && e.cause == CAUSE),
        "halt events of another stream: {ev:?}"
    );
    let send_events: Vec<&HaltEvent> = ev
        .iter()
        .filter(|e| e.verdict < verdict::EGRESS_PASS)
        .collect();
    let egress_events: Vec<&HaltEvent> = ev
        .iter()
        .filter(|e| e.verdict >= verdict::EGRESS_PASS)
        .collect();
    ensure!(
        send_events.len() == usize::from(eacces),
        "send-check halt events {send_events:?}, EACCES {eacces}"
    );
    if let Some(e) = send_events.first() {
        ensure!(
            e.verdict == verdict::DROP_FRAME_SIZE && e.trip_reason == trip_reason::TRIPPED,
            "the send check dropped a 4 KiB post-trip frame for another reason: {e:?}"
        );
    }
    ensure!(
        egress_events.len() == usize::from(eg.dropped_segments > 0),
        "egress halt events {egress_events:?} for {} dropped segments",
        eg.dropped_segments
    );
    if let Some(e) = egress_events.first() {
        ensure!(
            e.verdict == verdict::EGRESS_DROP_CEILING
                && e.frames > ceiling
                && e.post_trip_frames == ceiling,
            "egress halt event {e:?}, ceiling {ceiling}"
        );
    }
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

/// The attack of issue 10, with haltd's own encoder: B = 1 and one send carrying 80 token
/// events after the trip. The stream's E is the built-in chat encoder's bound on one token
/// event; the send is far larger, so the send check drops it (`drop_frame_size`), the client
/// reads nothing of it, and a single event of the same stream would still have fitted.
#[test]
fn eighty_events_in_one_send_are_dropped() -> Result<()> {
    use haltd::{
        openai::{ChunkEncoder, Token},
        stream::{Endpoint, StreamId},
    };
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
    };
    let e = enc.max_event_bytes();
    let event = |out: &mut Vec<u8>, i: usize| {
        let tok = Token {
            text: " river",
            logprob: -0.25,
            top: &[],
        };
        enc.token_event(out, tok, i * 6, i == 0);
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
