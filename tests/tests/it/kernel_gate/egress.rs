//! The egress check (`halt_egress`): bytes beyond a stream's ceiling are held back, under
//! backpressure too.

use std::{
    io::{self, Read, Write},
    net::{TcpListener, TcpStream},
    os::fd::{AsFd, AsRawFd},
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd::gate::KernelGate;
use haltd_common::{trip_reason, verdict, HaltEvent, SockPolicy};
use haltd_tests::gate::{reset_on_close, set_int};

use super::{events, live_gate, terminal_len, trip_policy, untripped, CAUSE, TAG};

/// The stream's byte at offset `k` is `k % 251`: what arrives can be checked as a prefix.
fn pattern(from: usize, len: usize) -> Vec<u8> {
    (from..from + len).map(|k| (k % 251) as u8).collect()
}

/// What the server's writes after the trip came to.
struct PostTrip {
    /// Bytes the kernel accepted.
    post: usize,
    eagain: usize,
    accepted_calls: usize,
    /// A write failed with EACCES (the send check refused it outright).
    eacces: bool,
}

/// Writes whole 64 KiB frames until a short write or EAGAIN; returns the bytes accepted, the
/// frames written and how the fill ended.
fn fill_socket(server: &TcpStream) -> Result<(usize, u64, String)> {
    const FILL_FRAME: usize = 64 * 1024;
    let mut accepted = 0usize;
    let mut frames = 0u64;
    let fill_end = loop {
        match (&*server).write(&pattern(accepted, FILL_FRAME)) {
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
    Ok((accepted, frames, fill_end))
}

/// Up to `attempts` writes of new 4 KiB frames after the trip.
fn send_after_trip(server: &TcpStream, accepted: usize, attempts: usize) -> Result<PostTrip> {
    const FRAME: usize = 4096;
    let mut post = 0usize;
    let (mut eagain, mut accepted_calls, mut eacces) = (0, 0, false);
    for _ in 0..attempts {
        match (&*server).write(&pattern(accepted + post, FRAME)) {
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

    Ok(PostTrip {
        post,
        eagain,
        accepted_calls,
        eacces,
    })
}

/// Everything that reaches the client in one second.
fn read_for_a_second(client: &mut TcpStream) -> Result<Vec<u8>> {
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
    Ok(got)
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
    holds_beyond_the_ceiling(Leaf::Kept)
}

/// The same, with the gate's cgroup leaf removed (as a clean stop or the next start removes
/// it: `haltd::gate::KernelGate::leave_cgroup`) once the socket is governed and before it is
/// filled: the socket still belongs to the removed leaf, whose programs the kernel keeps for
/// it until it closes, so the egress check still holds every byte beyond the ceiling. Here
/// the bytes must go beyond it, so that the check has something to hold.
#[test]
fn egress_holds_after_its_leaf_is_removed() -> Result<()> {
    holds_beyond_the_ceiling(Leaf::Removed)
}

/// What becomes of the gate's cgroup leaf during [`holds_beyond_the_ceiling`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Leaf {
    Kept,
    /// Removed once the socket is governed.
    Removed,
}

/// A loopback connection whose server side (tiny send buffer, nonblocking) is governed with
/// largest event `e` and budget `b`; then the gate's leaf is removed if `leaf` says so.
fn backpressured(gate: &KernelGate, e: u32, b: u32, leaf: Leaf) -> Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    set_int(server.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 4096)?;
    server.set_nonblocking(true)?;
    let policy = SockPolicy {
        max_event_bytes: e,
        ..untripped(b)
    };
    gate.govern(server.as_fd(), &policy)?;
    if leaf == Leaf::Removed {
        let path = gate.cgroup().to_path_buf();
        gate.leave_cgroup().context("removing the gate's leaf")?;
        ensure!(!path.exists(), "{} is still there", path.display());
    }
    Ok((client, server))
}

fn holds_beyond_the_ceiling(leaf: Leaf) -> Result<()> {
    const SMALL_E: u32 = 256;
    const B: u32 = 1;
    const POST_TRIP_ATTEMPTS: usize = 400;
    let t = terminal_len();
    let gate = live_gate()?;
    let (mut client, server) = backpressured(&gate, SMALL_E, B, leaf)?;

    // Fill: whole frames until a short write or EAGAIN.
    let (accepted, frames, fill_end) = fill_socket(&server)?;
    let trip = trip_policy(frames, accepted as u64, B, SMALL_E, t);
    let ceiling = trip.egress_ceiling;
    gate.set_policy(server.as_fd(), &trip)?;

    // New 4 KiB frames after the trip.
    let PostTrip {
        post,
        eagain,
        accepted_calls,
        eacces,
    } = send_after_trip(&server, accepted, POST_TRIP_ATTEMPTS)?;

    // The client reads everything that arrives for a second.
    let got = read_for_a_second(&mut client)?;
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
    ensure!(
        leaf == Leaf::Kept || total > ceiling,
        "{total} bytes accepted, within the ceiling {ceiling}: nothing for the egress check of \
         the removed leaf to hold"
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
    check_halt_events(&gate, eacces, eg.dropped_segments, ceiling)
}

/// One halt event per check that dropped: the send check's (frames, post-trip frames), when a
/// write failed with EACCES; the egress check's (where the dropped segment ended, the ceiling
/// in force), when it dropped a segment.
fn check_halt_events(
    gate: &KernelGate,
    eacces: bool,
    dropped_segments: u64,
    ceiling: u64,
) -> Result<()> {
    let ev = events(gate)?;
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
        egress_events.len() == usize::from(dropped_segments > 0),
        "egress halt events {egress_events:?} for {} dropped segments",
        dropped_segments
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
