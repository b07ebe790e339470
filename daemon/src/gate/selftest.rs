//! The gate's start-up self-test: before haltd serves, it trips two loopback connections of
//! its own and checks that the kernel really refuses what the gate must refuse. A gate that
//! loaded but does not enforce (a program attached to the wrong cgroup, a kernel that skips
//! the hook) is a gate that only looks on; haltd then refuses to start.
//!
//! 1. **Adoption**: a connection accepted on a governed port is in `GOVERNED` before haltd
//!    touches it.
//! 2. **Send check**: after a trip with budget 0, the next send fails with `EACCES`.
//! 3. **Egress check**: after a trip whose send budget lets one more frame through but whose
//!    byte ceiling does not, that send is accepted by the send check and held back by the
//!    egress check: the peer receives nothing of it and the egress drop counter moves.
//! 4. **Clock**: the heartbeat the kernel sees is fresh.

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::AsFd,
    time::{Duration, Instant},
};

use haltd_common::{verdict, SockPolicy};

use super::{GateError, Governed, KernelGate, SelfTestError};

/// What the self-test saw.
#[derive(Debug, Clone, Copy)]
pub struct SelfTestReport {
    /// Bytes the egress check held back (sent after the trip, never received).
    pub egress_held_bytes: usize,
    /// The heartbeat's age as the kernel saw it.
    pub heartbeat_age: Duration,
    pub took: Duration,
}

const FRAME: &[u8] = b"data: {\"selftest\":1}\n\n";

/// Runs the self-test on loopback (of `ip`'s family; `ip` itself if it is a specific local
/// address). The caller must have beaten the heartbeat just before (the checks need a live
/// heartbeat, or the gate trips the test connections itself).
pub fn run(gate: &KernelGate, ip: IpAddr) -> Result<SelfTestReport, SelfTestError> {
    let t0 = Instant::now();
    let ip = match ip {
        IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        a => a,
    };
    let listener =
        TcpListener::bind(SocketAddr::new(ip, 0)).map_err(io("binding a loopback listener"))?;
    let port = listener
        .local_addr()
        .map_err(io("reading its address"))?
        .port();
    gate.govern_port(port)
        .map_err(gate_err("governing the self-test port"))?;
    let result = checks(gate, &listener);
    let _ = gate.ungovern_port(port);
    let held = result?;
    gate.beat().map_err(gate_err("stamping the heartbeat"))?;
    let clock = gate
        .clock()
        .map_err(gate_err("reading the kernel's clock"))?;
    let age = clock
        .heartbeat_age()
        .ok_or_else(|| SelfTestError::NotEnforced("no heartbeat in the kernel yet".into()))?;
    if clock.heartbeat_lost() {
        return Err(SelfTestError::NotEnforced(format!(
            "the kernel sees the heartbeat as lost (age {age:?})"
        )));
    }
    Ok(SelfTestReport {
        egress_held_bytes: held,
        heartbeat_age: age,
        took: t0.elapsed(),
    })
}

fn io(step: &'static str) -> impl FnOnce(std::io::Error) -> SelfTestError {
    move |source| SelfTestError::Io { step, source }
}

fn gate_err(step: &'static str) -> impl FnOnce(GateError) -> SelfTestError {
    move |source| SelfTestError::Gate { step, source }
}

/// A connection through the listener, its server side governed, one frame sent through.
fn governed_pair(
    gate: &KernelGate,
    listener: &TcpListener,
) -> Result<(TcpStream, TcpStream), SelfTestError> {
    let client = TcpStream::connect(listener.local_addr().map_err(io("reading the address"))?)
        .map_err(io("connecting to the self-test listener"))?;
    let (server, _) = listener.accept().map_err(io("accepting"))?;
    client
        .set_read_timeout(Some(Duration::from_millis(100)))
        .map_err(io("setting a read timeout"))?;
    let policy = SockPolicy {
        budget: 0,
        max_event_bytes: FRAME.len() as u32,
        ..SockPolicy::default()
    };
    match gate.govern(server.as_fd(), &policy) {
        Ok(Governed::Adopted) => {}
        Ok(Governed::Inserted) => {
            return Err(SelfTestError::NotEnforced(
                "the adoption program did not govern a connection on a governed port (is it attached to haltd's cgroup?)".into(),
            ))
        }
        Err(e) => return Err(gate_err("governing a self-test connection")(e)),
    }
    (&server)
        .write_all(FRAME)
        .map_err(io("sending an untripped frame"))?;
    Ok((server, client))
}

fn trip(budget: u32, ceiling: u64) -> SockPolicy {
    SockPolicy {
        tripped: 1,
        budget,
        max_event_bytes: FRAME.len() as u32,
        pre_trip_frames: 1,
        egress_ceiling: ceiling,
        terminal_len: 0,
        nonce: *b"5e1f7e575e1f7e57",
        ..SockPolicy::default()
    }
}

/// Returns the bytes the egress check held back.
fn checks(gate: &KernelGate, listener: &TcpListener) -> Result<usize, SelfTestError> {
    // 2. Budget 0: the next send is refused.
    let (server, _client) = governed_pair(gate, listener)?;
    gate.set_policy(server.as_fd(), &trip(0, FRAME.len() as u64))
        .map_err(gate_err("tripping a self-test connection"))?;
    match (&server).write(FRAME) {
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => {}
        Err(e) => {
            return Err(SelfTestError::NotEnforced(format!(
                "a send after a trip with budget 0 failed with {e}, not EACCES"
            )))
        }
        Ok(n) => {
            return Err(SelfTestError::NotEnforced(format!(
                "a send after a trip with budget 0 was accepted ({n} bytes): the send check does not enforce"
            )))
        }
    }

    // 3. One frame allowed by the send check, none by the byte ceiling.
    let (server, mut client) = governed_pair(gate, listener)?;
    let before = gate
        .verdict_totals()
        .map_err(gate_err("reading counters"))?[verdict::EGRESS_DROP_CEILING as usize];
    gate.set_policy(server.as_fd(), &trip(1, FRAME.len() as u64))
        .map_err(gate_err("tripping a self-test connection"))?;
    (&server)
        .write_all(FRAME)
        .map_err(io("sending the frame the send check allows"))?;
    let mut got = vec![0u8; 4 * FRAME.len()];
    let mut n = 0;
    let deadline = Instant::now() + Duration::from_millis(100);
    while Instant::now() < deadline {
        match client.read(&mut got[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break
            }
            Err(e) => return Err(io("reading at the self-test client")(e)),
        }
    }
    let after = gate
        .verdict_totals()
        .map_err(gate_err("reading counters"))?[verdict::EGRESS_DROP_CEILING as usize];
    if n != FRAME.len() || after == before {
        return Err(SelfTestError::NotEnforced(format!(
            "the egress check did not hold back bytes beyond the ceiling: the client received {n} bytes (expected {}), egress drops {before} -> {after} (is halt_egress attached to haltd's cgroup?)",
            FRAME.len()
        )));
    }
    // The held-back connection ends with a reset: nothing of it lingers in a send queue.
    let _ = set_linger_zero(&server);
    Ok(FRAME.len())
}

/// `SO_LINGER {on, 0}`: close resets the connection instead of waiting to send what is
/// queued.
pub fn set_linger_zero(s: &impl std::os::fd::AsRawFd) -> std::io::Result<()> {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads a live `linger` of the size given.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const l).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
