//! Which capabilities driving a loaded gate still needs: none. The gate is loaded with root's,
//! then a thread drops every capability (`haltd::privs::drop_thread`, as every haltd thread
//! does after start-up) and does all that haltd does with the gate afterwards; each works.
//! What still needs a capability is refused there: loading a gate (map creation, `CAP_BPF` and
//! `CAP_NET_ADMIN`), turning on BPF statistics (`CAP_SYS_ADMIN`), and the JIT size in a
//! program's info (`CAP_BPF`, reads 0 without). The findings are docs/operations.md's table.

use std::{
    net::{TcpListener, TcpStream},
    os::fd::AsFd,
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use haltd::{gate::Governed, privs::ThreadCaps};
use haltd_common::verdict;

use super::{
    events, expect_dropped, finish, live_gate, send, terminal, token, token_bytes, tripped,
    untripped, Conn, NONCE, TERMINAL_PAD,
};

/// Everything haltd does with a loaded gate, from a thread without capabilities: the
/// heartbeat stamp and clock read (`BPF_PROG_RUN`), a governed port, an adopted and an
/// inserted socket, a policy and a trip the kernel then enforces, the per-socket state, the
/// counters and the halt events.
#[test]
fn a_loaded_gate_is_driven_without_any_capability() -> Result<()> {
    let gate = live_gate()?;
    let adopting = TcpListener::bind("127.0.0.1:0")?;
    let plain = TcpListener::bind("127.0.0.1:0")?;
    let gate = &*gate;
    std::thread::scope(|s| {
        s.spawn(|| -> Result<()> {
            haltd::privs::drop_thread().context("dropping every capability")?;
            let me = ThreadCaps::read(std::path::Path::new("/proc/thread-self"))?;
            ensure!(
                !me.holds_any() && me.bounding == 0,
                "the thread still holds capabilities: {me:?}"
            );
            gate.beat().context("BPF_PROG_RUN of the heartbeat stamp")?;
            let clock = gate.clock().context("BPF_PROG_RUN of the clock read")?;
            ensure!(!clock.heartbeat_lost(), "{clock:?}");
            gate.govern_port(adopting.local_addr()?.port())
                .context("a HASH map update (governed port)")?;

            // Adopted at establishment, governed after the drop; tripped with B = 2.
            let client = TcpStream::connect(adopting.local_addr()?)?;
            let (server, _) = adopting.accept()?;
            client.set_read_timeout(Some(Duration::from_secs(10)))?;
            let how = gate.govern(server.as_fd(), &untripped(2))?;
            ensure!(how == Governed::Adopted, "{how:?}");
            let c = Conn { server, client };
            for i in 0..3 {
                send(&c.server, &token(i))?;
            }
            gate.set_policy(c.server.as_fd(), &tripped(3, token_bytes(0..3), 2))
                .context("an SK_STORAGE update (the trip)")?;
            for i in 3..5 {
                send(&c.server, &token(i))?;
            }
            expect_dropped(send(&c.server, &token(5)), "a token past B")?;
            // Drops are permanent, the nonce frame included.
            expect_dropped(
                send(&c.server, &terminal(NONCE, TERMINAL_PAD)),
                "a terminal after a drop",
            )?;
            let got = finish(c)?;
            ensure!(
                (got.tokens, got.terminals, got.bad) == (5, 0, 0),
                "the client got {got:?}"
            );

            // Not on a governed port: inserted into the SOCKHASH through its fd.
            let client = TcpStream::connect(plain.local_addr()?)?;
            let (server, _) = plain.accept()?;
            let how = gate
                .govern(server.as_fd(), &untripped(0))
                .context("a SOCKHASH insertion")?;
            ensure!(how == Governed::Inserted, "{how:?}");
            ensure!(gate.socket(server.as_fd())?.policy.is_some());
            drop((client, server));

            let totals = gate.verdict_totals()?;
            ensure!(
                totals[verdict::DROP_BUDGET as usize] == 1,
                "counters {totals:?}"
            );
            ensure!(!events(gate)?.is_empty(), "no halt event drained");
            refused_without_capabilities(gate)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the capability-less thread panicked"))?
    })
}

/// What the capability-less thread cannot do: load a gate, turn on BPF statistics, read the
/// JIT size.
fn refused_without_capabilities(gate: &haltd::gate::KernelGate) -> Result<()> {
    let load = haltd_tests::gate::TestGate::load(8, Duration::from_secs(5));
    let err = load.err().context("a gate loaded without capabilities")?;
    ensure!(
        format!("{err:#}").contains("Operation not permitted"),
        "loading without capabilities failed, but not with EPERM: {err:#}"
    );
    ensure!(
        haltd::gate::enable_run_stats().is_err(),
        "BPF statistics turned on without CAP_SYS_ADMIN"
    );
    let stats = gate.program_stats()?;
    ensure!(
        stats.jited_bytes == 0 && stats.verified_instructions.is_some(),
        "program info without CAP_BPF: {stats:?}"
    );
    Ok(())
}
