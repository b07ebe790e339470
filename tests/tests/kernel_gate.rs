//! The halt gate on the real kernel: loads `halt_gate`, governs real loopback TCP sockets and
//! checks what the client receives, what each send returns, the verdict counters and the halt
//! events.
//!
//! Needs root (CAP_BPF, CAP_NET_ADMIN) and the BPF object:
//! `HALTD_BPF_OBJECT=$PWD/ebpf/haltd-ebpf/target/bpfel-unknown-none/release/haltd-ebpf \
//!  cargo test -p haltd-tests --test kernel_gate -- --test-threads=1`
//! Without root the tests fail (CI runs as root; a skip would hide a missing gate).
//!
//! Each test loads its own gate (its own maps and counters), so tests do not interfere.
use std::{
    io::{self, Read, Write},
    net::{TcpListener, TcpStream},
    os::fd::{AsFd, AsRawFd},
    path::PathBuf,
    thread,
    time::Duration,
};

use anyhow::{bail, ensure, Context, Result};
use haltd::gate::{monotonic_ns, GateConfig, GateObject, KernelGate};
use haltd_common::{trip_reason, verdict, HaltEvent, TripEntry, NONCE_LEN, SSE_TERMINAL_PREFIX};

const NONCE: &[u8; NONCE_LEN] = b"0123456789abcdef";
const TERMINAL_MAX: u32 = 256;

fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "kernel_gate tests load BPF programs and need root; run them as root (CI does)"
    );
}

fn config(deadline: Duration, budget_frames: u32, budget_bytes: u64) -> GateConfig {
    let object = match std::env::var_os("HALTD_BPF_OBJECT") {
        Some(path) => GateObject::Path(PathBuf::from(path)),
        None => GateObject::Embedded,
    };
    GateConfig {
        object,
        max_streams: 64,
        heartbeat_deadline: deadline,
        budget_frames,
        budget_bytes,
    }
}

/// A gate with a fresh heartbeat and a deadline no test reaches.
fn live_gate() -> Result<KernelGate> {
    require_root();
    let gate = KernelGate::load(&config(Duration::from_secs(600), 3, 1 << 20))
        .context("loading the gate (set HALTD_BPF_OBJECT to the built object)")?;
    gate.beat(monotonic_ns())?;
    Ok(gate)
}

/// A loopback connection whose server side is governed.
struct Conn {
    server: TcpStream,
    client: TcpStream,
}

fn conn(gate: &KernelGate, slot: u32, generation: u32) -> Result<Conn> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    client.set_read_timeout(Some(Duration::from_secs(10)))?;
    gate.govern(server.as_fd(), slot, generation)?;
    Ok(Conn { server, client })
}

fn token(i: usize) -> Vec<u8> {
    format!("data: {{\"t\":{i}}}\n\n").into_bytes()
}

fn terminal(nonce: &[u8; NONCE_LEN], pad: usize) -> Vec<u8> {
    let mut f = SSE_TERMINAL_PREFIX.to_vec();
    f.extend_from_slice(nonce);
    f.extend_from_slice(b"\nevent: halt\ndata: {\"code\":\"halted\"");
    f.extend(std::iter::repeat_n(b' ', pad));
    f.extend_from_slice(b"}\n\n");
    f
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
    tokens: usize,
    terminals: usize,
    /// A token after the terminal frame, or anything unrecognised.
    bad: usize,
}

/// Closes the server side and reads everything the client got.
fn finish(c: Conn) -> Result<Received> {
    let Conn { server, mut client } = c;
    drop(server);
    let mut bytes = Vec::new();
    client.read_to_end(&mut bytes)?;
    let text = String::from_utf8(bytes)?;
    let mut r = Received::default();
    for frame in text.split_terminator("\n\n") {
        if frame.starts_with(": haltd-halt") && r.terminals == 0 {
            r.terminals += 1;
        } else if r.terminals == 0 && frame == format!("data: {{\"t\":{}}}", r.tokens) {
            r.tokens += 1;
        } else {
            r.bad += 1;
        }
    }
    Ok(r)
}

/// A trip after `f` frames were handed to the kernel, with `b` post-trip frames.
fn trip_entry(generation: u32, f: u64, b: u64, budget_bytes: u64) -> TripEntry {
    TripEntry {
        generation,
        tripped: 1,
        cause: 42,
        terminal_max_bytes: TERMINAL_MAX,
        frame_limit: f + b,
        budget_bytes,
        nonce: *NONCE,
        pre_trip_frames: f,
    }
}

fn verdicts(pairs: &[(u32, u64)]) -> [u64; verdict::COUNT as usize] {
    let mut v = [0; verdict::COUNT as usize];
    for &(i, n) in pairs {
        v[i as usize] = n;
    }
    v
}

fn events(gate: &KernelGate) -> Result<Vec<HaltEvent>> {
    let mut out = Vec::new();
    gate.drain_halt_events(&mut |e| out.push(e))?;
    Ok(out)
}

#[test]
fn untripped_frames_pass() -> Result<()> {
    let gate = live_gate()?;
    let c = conn(&gate, 1, 7)?;
    for i in 0..100 {
        send(&c.server, &token(i)).with_context(|| format!("frame {i}"))?;
    }
    let st = gate.socket_state(c.server.as_fd())?.context("state")?;
    assert_eq!((st.slot, st.generation, st.frames), (1, 7, 100));
    assert_eq!((st.trip_reason, st.dropped, st.post_trip_frames), (0, 0, 0));
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 100,
            ..Default::default()
        }
    );
    assert_eq!(gate.verdict_totals()?, verdicts(&[(verdict::PASS, 100)]));
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

/// F frames, trip with limit F + B, B frames pass, the next token frame is dropped and so is
/// everything after it.
#[test]
fn trip_allows_exactly_budget_then_drops() -> Result<()> {
    for b in [0u64, 5] {
        let gate = live_gate()?;
        let f = 10usize;
        let c = conn(&gate, 2, 1)?;
        for i in 0..f {
            send(&c.server, &token(i))?;
        }
        gate.trip(2, trip_entry(1, f as u64, b, 1 << 20))?;
        for i in f..f + b as usize {
            send(&c.server, &token(i)).with_context(|| format!("B={b}: post-trip frame {i}"))?;
        }
        expect_dropped(
            send(&c.server, &token(f + b as usize)),
            "token beyond budget",
        )?;
        // Drops are permanent, the nonce frame included.
        expect_dropped(send(&c.server, &token(0)), "token after a drop")?;
        expect_dropped(
            send(&c.server, &terminal(NONCE, 0)),
            "terminal after a drop",
        )?;

        let st = gate.socket_state(c.server.as_fd())?.context("state")?;
        assert_eq!(st.frames, f as u64 + b + 1, "B={b}");
        assert_eq!(st.post_trip_frames, b as u32, "B={b}");
        assert_eq!((st.dropped, st.trip_reason), (1, trip_reason::TRIPPED));
        assert_ne!(st.first_post_trip_ns, 0);

        let got = finish(c)?;
        assert_eq!(
            got,
            Received {
                tokens: f + b as usize,
                ..Default::default()
            },
            "B={b}"
        );
        // The kernel does not run the program again after a drop: one drop counted.
        assert_eq!(
            gate.verdict_totals()?,
            verdicts(&[
                (verdict::PASS, f as u64),
                (verdict::PASS_POST_TRIP, b),
                (verdict::DROP_BUDGET, 1),
            ]),
            "B={b}"
        );
        let ev = events(&gate)?;
        assert_eq!(ev.len(), 1, "B={b}: {ev:?}");
        let e = ev[0];
        assert_eq!(
            (
                e.slot,
                e.generation,
                e.verdict,
                e.trip_reason,
                e.frames,
                e.post_trip_frames,
                e.cause
            ),
            (
                2,
                1,
                verdict::DROP_BUDGET,
                trip_reason::TRIPPED,
                f as u64 + b + 1,
                b as u32,
                42
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
    for b in [0u64, 5] {
        let gate = live_gate()?;
        let f = 4usize;
        let c = conn(&gate, 3, 9)?;
        for i in 0..f {
            send(&c.server, &token(i))?;
        }
        gate.trip(3, trip_entry(9, f as u64, b, 1 << 20))?;
        for i in f..f + b as usize {
            send(&c.server, &token(i))?;
        }
        send(&c.server, &terminal(NONCE, 0)).with_context(|| format!("B={b}: terminal"))?;
        expect_dropped(send(&c.server, &token(99)), "token after terminal")?;
        expect_dropped(send(&c.server, &terminal(NONCE, 0)), "second terminal")?;

        let st = gate.socket_state(c.server.as_fd())?.context("state")?;
        assert_eq!((st.terminal_sent, st.dropped), (1, 1));
        let got = finish(c)?;
        assert_eq!(
            got,
            Received {
                tokens: f + b as usize,
                terminals: 1,
                bad: 0
            },
            "B={b}"
        );
        assert_eq!(
            gate.verdict_totals()?,
            verdicts(&[
                (verdict::PASS, f as u64),
                (verdict::PASS_POST_TRIP, b),
                (verdict::PASS_TERMINAL, 1),
                (verdict::DROP_AFTER_TERMINAL, 1),
            ])
        );
        let ev = events(&gate)?;
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].verdict, verdict::DROP_AFTER_TERMINAL);
    }
    Ok(())
}

/// A frame with a wrong nonce, an oversized terminal, or a zero nonce counts as a token frame.
#[test]
fn fake_or_oversized_terminal_is_a_token() -> Result<()> {
    let gate = live_gate()?;
    let oversized = terminal(NONCE, TERMINAL_MAX as usize);
    assert!(oversized.len() > TERMINAL_MAX as usize);

    // B = 1: a wrong-nonce "terminal" uses the one post-trip frame, the real one still passes.
    let c = conn(&gate, 4, 1)?;
    send(&c.server, &token(0))?;
    gate.trip(4, trip_entry(1, 1, 1, 1 << 20))?;
    send(&c.server, &terminal(b"fedcba9876543210", 0)).context("wrong nonce within budget")?;
    expect_dropped(
        send(&c.server, &terminal(b"fedcba9876543210", 0)),
        "wrong nonce",
    )?;
    let st = gate.socket_state(c.server.as_fd())?.context("state")?;
    assert_eq!((st.post_trip_frames, st.terminal_sent), (1, 0));
    drop(c);

    // B = 0: oversized terminal with the right nonce is a token beyond the budget.
    let c = conn(&gate, 5, 1)?;
    send(&c.server, &token(0))?;
    gate.trip(5, trip_entry(1, 1, 0, 1 << 20))?;
    expect_dropped(send(&c.server, &oversized), "oversized terminal")?;
    drop(c);

    // B = 0, trip entry with an all-zero nonce: a frame with zeros there is not a terminal.
    let c = conn(&gate, 6, 1)?;
    gate.trip(
        6,
        TripEntry {
            nonce: [0; NONCE_LEN],
            ..trip_entry(1, 0, 0, 1 << 20)
        },
    )?;
    let mut zeros = SSE_TERMINAL_PREFIX.to_vec();
    zeros.extend_from_slice(&[0; NONCE_LEN]);
    zeros.extend_from_slice(b"\n\n");
    expect_dropped(send(&c.server, &zeros), "zero nonce")?;
    drop(c);

    // B = 0 and the right nonce in a frame of the allowed size: passes.
    let c = conn(&gate, 7, 1)?;
    gate.trip(7, trip_entry(1, 0, 0, 1 << 20))?;
    send(&c.server, &terminal(NONCE, 0)).context("real terminal")?;
    assert_eq!(
        finish(c)?,
        Received {
            terminals: 1,
            ..Default::default()
        }
    );

    assert_eq!(
        gate.verdict_totals()?,
        verdicts(&[
            (verdict::PASS, 2),
            (verdict::PASS_POST_TRIP, 1),
            (verdict::PASS_TERMINAL, 1),
            (verdict::DROP_BUDGET, 3),
        ])
    );
    Ok(())
}

/// No heartbeat yet: the gate trips every stream itself, with the heartbeat budget.
#[test]
fn no_heartbeat_yet_trips_with_heartbeat_budget() -> Result<()> {
    require_root();
    let gate = KernelGate::load(&config(Duration::from_secs(600), 3, 1 << 20))?;
    let c = conn(&gate, 1, 1)?;
    for i in 0..3 {
        send(&c.server, &token(i)).with_context(|| format!("frame {i} within budget"))?;
    }
    expect_dropped(
        send(&c.server, &token(3)),
        "first frame beyond the heartbeat budget",
    )?;
    let st = gate.socket_state(c.server.as_fd())?.context("state")?;
    assert_eq!(
        (st.trip_reason, st.post_trip_frames),
        (trip_reason::HEARTBEAT, 3)
    );
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 3,
            ..Default::default()
        }
    );
    assert_eq!(
        gate.verdict_totals()?,
        verdicts(&[(verdict::PASS_POST_TRIP, 3), (verdict::DROP_BUDGET, 1)])
    );
    let ev = events(&gate)?;
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].trip_reason, ev[0].cause),
        (trip_reason::HEARTBEAT, 0)
    );
    Ok(())
}

/// Fresh heartbeat passes; a stale one trips with the heartbeat budget, counted from the frame
/// that saw it stale, and the trip sticks after the heartbeat comes back.
#[test]
fn stale_heartbeat_trips_and_sticks() -> Result<()> {
    require_root();
    let deadline = Duration::from_millis(100);
    let gate = KernelGate::load(&config(deadline, 3, 1 << 20))?;
    gate.beat(monotonic_ns())?;
    let c = conn(&gate, 1, 1)?;
    for i in 0..5 {
        send(&c.server, &token(i)).context("fresh heartbeat")?;
    }
    thread::sleep(deadline * 2);
    // Frame 6 sees the beat lost: frames 6, 7, 8 pass (limit 5 + 3).
    send(&c.server, &token(5)).context("frame 6")?;
    gate.beat(monotonic_ns())?;
    send(&c.server, &token(6)).context("frame 7")?;
    send(&c.server, &token(7)).context("frame 8")?;
    expect_dropped(
        send(&c.server, &token(8)),
        "frame 9, heartbeat back but trip sticky",
    )?;
    let st = gate.socket_state(c.server.as_fd())?.context("state")?;
    assert_eq!(st.trip_reason, trip_reason::HEARTBEAT);
    assert_eq!(st.stale_frame_limit, 8 + 1, "stored as limit + 1");
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 8,
            ..Default::default()
        }
    );

    // A new connection under a fresh heartbeat is untripped.
    gate.beat(monotonic_ns())?;
    let c = conn(&gate, 2, 1)?;
    send(&c.server, &token(0)).context("fresh heartbeat, new stream")?;
    assert_eq!(
        gate.socket_state(c.server.as_fd())?
            .context("state")?
            .stale_frame_limit,
        0
    );
    drop(c);
    assert_eq!(
        gate.verdict_totals()?,
        verdicts(&[
            (verdict::PASS, 6),
            (verdict::PASS_POST_TRIP, 3),
            (verdict::DROP_BUDGET, 1)
        ])
    );
    Ok(())
}

/// A socket whose slot now belongs to another generation is dropped at once (no terminal).
#[test]
fn stale_slot_generation_drops() -> Result<()> {
    let gate = live_gate()?;
    let c = conn(&gate, 9, 1)?;
    send(&c.server, &token(0))?;
    send(&c.server, &token(1))?;
    // The slot was reassigned (generation 2) while this socket is still open.
    gate.trip(
        9,
        TripEntry {
            generation: 2,
            cause: 77,
            ..TripEntry::default()
        },
    )?;
    expect_dropped(send(&c.server, &terminal(NONCE, 0)), "stale slot")?;
    let st = gate.socket_state(c.server.as_fd())?.context("state")?;
    assert_eq!((st.trip_reason, st.dropped), (trip_reason::STALE_SLOT, 1));
    let ev = events(&gate)?;
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].slot, ev[0].trip_reason, ev[0].verdict, ev[0].cause),
        (9, trip_reason::STALE_SLOT, verdict::DROP_BUDGET, 0),
        "the new stream's cause is not this stream's"
    );

    // Governing another socket on an occupied slot is refused (it would unpolice this one)...
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let other = TcpStream::connect(listener.local_addr()?)?;
    let err = gate
        .govern(other.as_fd(), 9, 3)
        .expect_err("slot 9 is occupied");
    assert!(
        matches!(err, haltd::gate::GateError::SlotInUse { slot: 9 }),
        "{err}"
    );
    // ...and allowed once the kernel removed the closed socket.
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 2,
            ..Default::default()
        }
    );
    gate.govern(other.as_fd(), 9, 3)
        .context("slot free after close")?;
    assert_eq!(
        gate.verdict_totals()?,
        verdicts(&[(verdict::PASS, 2), (verdict::DROP_BUDGET, 1)])
    );
    Ok(())
}

/// io_uring `IORING_OP_SEND` goes through the gate exactly like `write`.
#[test]
fn io_uring_send_is_policed() -> Result<()> {
    let gate = live_gate()?;
    let mut ring = io_uring::IoUring::new(8)?;
    let c = conn(&gate, 10, 1)?;
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
    gate.trip(10, trip_entry(1, 3, 2, 1 << 20))?;
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
    assert_eq!(
        gate.verdict_totals()?,
        verdicts(&[
            (verdict::PASS, 3),
            (verdict::PASS_POST_TRIP, 2),
            (verdict::DROP_BUDGET, 1)
        ])
    );
    Ok(())
}

/// One large send after the trip that would exceed the byte budget is dropped whole, even with
/// frames to spare.
#[test]
fn byte_budget_drops_large_send() -> Result<()> {
    let gate = live_gate()?;
    let c = conn(&gate, 11, 1)?;
    send(&c.server, &token(0))?;
    send(&c.server, &token(1))?;
    gate.trip(11, trip_entry(1, 2, 5, 1000))?;
    send(&c.server, &token(2)).context("small post-trip frame")?;
    let mut batch = Vec::new();
    for i in 3..200 {
        batch.extend_from_slice(&token(i));
    }
    assert!(batch.len() > 1000);
    expect_dropped(
        send(&c.server, &batch),
        "batched send beyond the byte budget",
    )?;
    let st = gate.socket_state(c.server.as_fd())?.context("state")?;
    assert_eq!(
        (st.post_trip_frames, st.post_trip_bytes),
        (1, token(2).len() as u64)
    );
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 3,
            ..Default::default()
        }
    );
    assert_eq!(
        gate.verdict_totals()?,
        verdicts(&[
            (verdict::PASS, 2),
            (verdict::PASS_POST_TRIP, 1),
            (verdict::DROP_BYTES, 1)
        ])
    );
    let ev = events(&gate)?;
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].verdict, verdict::DROP_BYTES);
    Ok(())
}

/// A trip written while the emitter keeps sending: exactly `F + B` frames reach the client,
/// where `F` is what had been handed to the kernel when the trip was decided. Frames racing the
/// write are still within the absolute limit, and the program never reads a half-written trip
/// entry as "tripped with limit 0" (that would drop early).
#[test]
fn trip_while_sending_is_exact() -> Result<()> {
    use std::sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    };
    let gate = live_gate()?;
    const B: u64 = 2000;
    for round in 0..10u32 {
        let slot = 20 + round;
        let c = conn(&gate, slot, round)?;
        let Conn { server, mut client } = c;
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
        gate.trip(slot, trip_entry(round, f, B, u64::MAX))?;
        let passed = sender
            .join()
            .map_err(|_| anyhow::anyhow!("sender panicked"))??;
        ensure!(
            passed == f + B,
            "round {round}: F={f}, {passed} frames passed, want F+B"
        );
        let bytes = reader
            .join()
            .map_err(|_| anyhow::anyhow!("reader panicked"))??;
        let tokens = String::from_utf8(bytes)?.split_terminator("\n\n").count() as u64;
        ensure!(
            tokens == f + B,
            "round {round}: client got {tokens} frames, want {}",
            f + B
        );
    }
    Ok(())
}

/// Frames userspace handed to the kernel before the trip but that reach the gate after it (in
/// flight) pass as pre-trip frames and leave the whole byte budget to the B post-trip frames.
#[test]
fn in_flight_pre_trip_frames_do_not_use_the_byte_budget() -> Result<()> {
    let gate = live_gate()?;
    let c = conn(&gate, 12, 1)?;
    send(&c.server, &token(0))?;
    send(&c.server, &token(1))?;
    // F = 5 frames handed to the kernel at the trip, 3 of them not through the gate yet.
    let b = 2u64;
    let per = token(5).len() as u64; // every token below 10 has this length
    gate.trip(12, trip_entry(1, 5, b, b * per))?;
    for i in 2..5 {
        send(&c.server, &token(i)).with_context(|| format!("in-flight pre-trip frame {i}"))?;
    }
    for i in 5..7 {
        send(&c.server, &token(i)).with_context(|| format!("post-trip frame {i}"))?;
    }
    expect_dropped(send(&c.server, &token(7)), "frame beyond F + B")?;
    let st = gate.socket_state(c.server.as_fd())?.context("state")?;
    assert_eq!((st.post_trip_frames, st.post_trip_bytes), (2, b * per));
    assert_eq!(
        finish(c)?,
        Received {
            tokens: 7,
            ..Default::default()
        }
    );
    assert_eq!(
        gate.verdict_totals()?,
        verdicts(&[
            (verdict::PASS, 5),
            (verdict::PASS_POST_TRIP, 2),
            (verdict::DROP_BUDGET, 1)
        ])
    );
    Ok(())
}

/// The nonce is found when the terminal frame comes as one `writev` of many small iovecs
/// (one program run; the kernel copies them into its own message pages), and in the HTTP form
/// used before the response headers went out.
#[test]
fn terminal_frame_scattered_or_http_form_is_recognised() -> Result<()> {
    let gate = live_gate()?;

    let c = conn(&gate, 13, 1)?;
    send(&c.server, &token(0))?;
    gate.trip(13, trip_entry(1, 1, 0, 1 << 20))?;
    let frame = terminal(NONCE, 0);
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
            bad: 0
        }
    );

    let c = conn(&gate, 14, 1)?;
    gate.trip(14, trip_entry(1, 0, 0, 1 << 20))?;
    let mut http = haltd_common::HTTP_TERMINAL_PREFIX.to_vec();
    http.extend_from_slice(NONCE);
    http.extend_from_slice(b"\r\ncontent-type: text/event-stream\r\n\r\n");
    send(&c.server, &http).context("HTTP-form terminal")?;
    expect_dropped(
        send(&c.server, &token(0)),
        "token after the HTTP-form terminal",
    )?;
    drop(c);

    assert_eq!(
        gate.verdict_totals()?,
        verdicts(&[
            (verdict::PASS, 1),
            (verdict::PASS_TERMINAL, 2),
            (verdict::DROP_AFTER_TERMINAL, 1)
        ])
    );
    Ok(())
}
