//! What the halt gate costs per send: N 64-byte `write`s on a loopback TCP socket, once on a
//! plain socket and once on a governed one (gate attached, heartbeat fresh, stream untripped),
//! in the same run, alternating which goes first each round. Prints the median ns per send of
//! each and the difference, as text and as one JSON line.
//!
//! Needs root and the gate object: `HALTD_BPF_OBJECT=PATH bench-gate-send [SENDS] [ROUNDS]`
//! (without the variable, the object embedded at build time).
use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    os::fd::AsFd,
    path::PathBuf,
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd::gate::{GateConfig, GateObject, KernelGate};

const FRAME: [u8; 64] = *b"data: {\"t\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}\n\n";

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let sends: usize = args.next().map_or(Ok(200_000), |a| a.parse())?;
    let rounds: usize = args.next().map_or(Ok(5), |a| a.parse())?;
    ensure!(sends > 0 && rounds > 0, "SENDS and ROUNDS must be positive");

    let object = match std::env::var_os("HALTD_BPF_OBJECT") {
        Some(p) => GateObject::Path(PathBuf::from(p)),
        None => GateObject::Embedded,
    };
    let gate = KernelGate::load(&GateConfig {
        object,
        max_sockets: 64,
        heartbeat_deadline: Duration::from_secs(600),
    })
    .context("loading the gate (needs root; set HALTD_BPF_OBJECT)")?;

    // Kernel run-time statistics on for this bench only (closed at exit): they add two clock
    // reads to every governed send, a little of which shows in `gate_ns`.
    let _stats = haltd::gate::enable_run_stats()?;
    let mut plain = Vec::new();
    let mut gated = Vec::new();
    for round in 0..rounds {
        gate.beat()?;
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for governed in order {
            let gov = governed.then_some(&gate);
            let ns = run(sends, gov)?;
            if governed {
                gated.push(ns);
            } else {
                plain.push(ns);
            }
        }
        println!(
            "round {round}: no gate {:.0} ns/send, gate {:.0} ns/send",
            plain[round], gated[round]
        );
    }
    let (no_gate_ns, gate_ns) = (median(&mut plain), median(&mut gated));
    let verdicts = gate.verdict_totals()?;
    let passed = verdicts[haltd_common::verdict::PASS as usize];
    ensure!(
        passed == (sends * rounds) as u64,
        "gate saw {passed} passing sends, expected {}: the governed socket was not gated",
        sends * rounds
    );
    println!(
        "median over {rounds} rounds of {sends} 64-byte sends: no gate {no_gate_ns:.0} ns/send, \
         gate {gate_ns:.0} ns/send, extra {:.0} ns/send ({:.2}x)",
        gate_ns - no_gate_ns,
        gate_ns / no_gate_ns
    );
    let prog = gate.program_stats()?;
    let prog_ns = prog.run_time.as_nanos() as f64 / prog.runs.max(1) as f64;
    println!(
        "the program itself: {prog_ns:.0} ns/run over {} runs ({} verified instructions, {} \
         bytes jited)",
        prog.runs,
        prog.verified_instructions.unwrap_or(0),
        prog.jited_bytes
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "gate_send",
            "sends": sends,
            "rounds": rounds,
            "no_gate_ns": no_gate_ns.round(),
            "gate_ns": gate_ns.round(),
            "extra_ns": (gate_ns - no_gate_ns).round(),
            "prog_ns": prog_ns.round(),
        })
    );
    Ok(())
}

/// Times `sends` writes of one frame on a fresh loopback connection, governed if `gov` says
/// so, with a client thread draining; returns ns per send.
fn run(sends: usize, gov: Option<&KernelGate>) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    // The daemon writes each frame out at once.
    server.set_nodelay(true)?;
    if let Some(gate) = gov {
        let policy = haltd_common::SockPolicy {
            budget: 16,
            max_event_bytes: 1 << 16,
            ..haltd_common::SockPolicy::default()
        };
        gate.govern(server.as_fd(), &policy)?;
    }
    let drain = thread::spawn(move || -> std::io::Result<u64> {
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            match client.read(&mut buf)? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    });
    let start = Instant::now();
    for i in 0..sends {
        let n = (&server)
            .write(&FRAME)
            .with_context(|| format!("send {i}"))?;
        ensure!(n == FRAME.len(), "short write at send {i}");
    }
    let elapsed = start.elapsed();
    drop(server);
    let got = drain
        .join()
        .map_err(|_| anyhow::anyhow!("drain thread panicked"))??;
    ensure!(
        got == (sends * FRAME.len()) as u64,
        "client got {got} bytes"
    );
    Ok(elapsed.as_nanos() as f64 / sends as f64)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
