//! Checks one configuration and prints what the checker found, for exploring bounds larger
//! than the tests use:
//!
//! ```text
//! cargo run --release -p haltd-model --example explore -- B EMITTER HEARTBEAT [MISTAKE]
//! ```
//!
//! EMITTER: `honest`, `disciplined`, `adversarial` (its own small bounds) or `wide` (the wider
//! adversarial bounds); HEARTBEAT: `live`, `sticky`, `flicker`, `recover`; MISTAKE: `no-egress`,
//! `no-nonce`, `off-by-one`, `not-sticky`, `no-frame-in-progress`. Environment variables
//! override bounds: `E`, `T`, `SEND`, `SNDBUF`, `MSS`, `STREAM`, `FRAMES`, `LOSS` (0/1),
//! `ADVANCE` (0/1), `THREADS`.

use std::process::ExitCode;

use haltd_model::{check, Config, Emitter, Heartbeat, Mistake};

fn parse_config(args: &[String]) -> Result<Config, String> {
    let [budget, emitter, heartbeat, rest @ ..] = args else {
        return Err("usage: explore B EMITTER HEARTBEAT [MISTAKE]".into());
    };
    let budget: u8 = budget.parse().map_err(|e| format!("B: {e}"))?;
    let heartbeat = match heartbeat.as_str() {
        "live" => Heartbeat::Live,
        "sticky" => Heartbeat::Sticky,
        "flicker" => Heartbeat::Flicker,
        "recover" => Heartbeat::RecoverAfterTrip,
        other => return Err(format!("unknown heartbeat {other:?}")),
    };
    let mut cfg = match emitter.as_str() {
        "honest" => Config::small(budget, Emitter::Honest, heartbeat),
        "disciplined" => Config::small(budget, Emitter::Disciplined, heartbeat),
        "adversarial" => Config::adversarial(budget, heartbeat),
        "wide" => Config::adversarial_wide(budget, heartbeat),
        other => return Err(format!("unknown emitter {other:?}")),
    };
    if let Some(mistake) = rest.first() {
        cfg.mistake = Some(match mistake.as_str() {
            "no-egress" => Mistake::NoEgressCheck,
            "no-nonce" => Mistake::TerminalWithoutNonce,
            "off-by-one" => Mistake::PreTripOffByOne,
            "not-sticky" => Mistake::LatchNotSticky,
            "no-frame-in-progress" => Mistake::CeilingWithoutFrameInProgress,
            other => return Err(format!("unknown mistake {other:?}")),
        });
    }
    let env = |name: &str, default: u8| -> Result<u8, String> {
        match std::env::var(name) {
            Ok(v) => v.parse().map_err(|e| format!("{name}: {e}")),
            Err(_) => Ok(default),
        }
    };
    cfg.max_event = env("E", cfg.max_event)?;
    cfg.terminal_len = env("T", cfg.terminal_len)?;
    cfg.max_send = env("SEND", cfg.max_send)?;
    cfg.sndbuf = env("SNDBUF", cfg.sndbuf)?;
    cfg.mss = env("MSS", cfg.mss)?;
    cfg.max_stream = env("STREAM", cfg.max_stream)?;
    cfg.max_frames = env("FRAMES", cfg.max_frames)?;
    cfg.net_loss = env("LOSS", u8::from(cfg.net_loss))? == 1;
    cfg.drop_advances = env("ADVANCE", u8::from(cfg.drop_advances))? == 1;
    Ok(cfg)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = match parse_config(&args) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let threads = std::env::var("THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let o = check(cfg, threads, None);
    println!("{}", o.summary());
    println!("violated: {:?}", o.violated());
    println!("no example: {:?}", o.unreached());
    for ((name, always, path), last) in o.discoveries.iter().zip(&o.last_states) {
        if let (true, Some(path), Some(last)) = (always, path, last) {
            println!("--- {name}: {} steps", path.len());
            for a in path {
                println!("  {a:?}");
            }
            println!("  last state: {last:?}");
        }
    }
    ExitCode::SUCCESS
}
