//! Which sockets the gate governs: a socket without a policy, and connections adopted at
//! establishment, also after a half-close.

use std::{
    io::Read,
    net::{Shutdown, TcpListener, TcpStream},
    os::fd::AsFd,
    thread,
    time::Duration,
};

use anyhow::{bail, ensure, Context, Result};
use haltd::gate::{GateError, Governed};
use haltd_common::{trip_reason, verdict};

use super::{
    check_counters, events, expect_dropped, finish, live_gate, parse, send, terminal, token,
    token_bytes, tripped, untripped, Conn, Received, NONCE, TERMINAL_PAD,
};

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
