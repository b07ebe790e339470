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
//!
//! By sub-topic: `send_check`, `heartbeat`, `adoption` and `egress`; the helpers they share
//! are here.

use std::{
    io::{self, Read, Write},
    net::{TcpListener, TcpStream},
    os::fd::AsFd,
    time::Duration,
};

use anyhow::{bail, ensure, Context, Result};
use haltd::gate::{Governed, KernelGate};
use haltd_common::{
    verdict, HaltEvent, SockPolicy, HTTP_TERMINAL_PREFIX, NONCE_LEN, SSE_TERMINAL_PREFIX,
};
use haltd_tests::gate::TestGate;

mod adoption;
mod egress;
mod heartbeat;
mod privileges;
mod send_check;

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
        framing: haltd_common::framing::PLAIN,
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
