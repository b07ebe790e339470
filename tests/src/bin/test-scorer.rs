//! `test-scorer`: an external HaltMonitor scorer for haltd's tests, speaking the protocol of
//! `haltd::detect::scorer` (newline-delimited JSON over a Unix stream socket, one connection
//! per turn).
//!
//! ```text
//! test-scorer --socket PATH [--fail-on-text WORD] [--delay-ms N] [--garbage] [--close-after N]
//!             [--stall-on-text WORD --stall-ms N]
//! ```
//!
//! It removes a stale socket file at PATH, binds, prints `listening on PATH` and serves until
//! killed, one thread per connection. Per token (request line) it replies `{"score":1.0}`, or:
//!
//! * `--fail-on-text WORD`: `{"score":0.0}` when the token's text contains WORD;
//! * `--delay-ms N`: sleeps N ms before each reply (deadline tests);
//! * `--garbage`: replies `this is not json` instead;
//! * `--close-after N`: closes the connection after replying to N tokens (0: at once);
//! * `--stall-on-text WORD --stall-ms N`: a connection (a turn) that sends a token whose text
//!   contains WORD is stalled from then on: every reply on it, that token's included, waits
//!   N ms. Other connections are served at once (one stream's slow scorer).
//!
//! A request line that is not the protocol's JSON closes its connection.

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::{fs::FileTypeExt, net::UnixListener, net::UnixStream},
    path::PathBuf,
    process::ExitCode,
    sync::Arc,
    thread,
    time::Duration,
};

const USAGE: &str = "usage: test-scorer --socket PATH [--fail-on-text WORD] [--delay-ms N] [--garbage] [--close-after N] [--stall-on-text WORD --stall-ms N]";

#[derive(Debug, Default)]
struct Rules {
    fail_on_text: Option<String>,
    delay: Duration,
    garbage: bool,
    close_after: Option<u64>,
    stall_on_text: Option<String>,
    stall: Duration,
}

fn parse_args() -> Result<(PathBuf, Rules), String> {
    let mut socket = None;
    let mut rules = Rules::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String| {
            v.parse::<u64>()
                .map_err(|e| format!("{flag}: {v:?} is not a number: {e}"))
        };
        match flag.as_str() {
            "--socket" => socket = Some(PathBuf::from(value()?)),
            "--fail-on-text" => rules.fail_on_text = Some(value()?),
            "--delay-ms" => rules.delay = Duration::from_millis(number(value()?)?),
            "--garbage" => rules.garbage = true,
            "--close-after" => rules.close_after = Some(number(value()?)?),
            "--stall-on-text" => rules.stall_on_text = Some(value()?),
            "--stall-ms" => rules.stall = Duration::from_millis(number(value()?)?),
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let socket = socket.ok_or_else(|| format!("--socket is required\n{USAGE}"))?;
    Ok((socket, rules))
}

/// Serves one connection (one turn) until the peer closes, a rule closes, or a bad line.
fn serve(conn: UnixStream, rules: &Rules) {
    let Ok(read_half) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut conn = conn;
    let mut answered = 0u64;
    let mut stalled = false;
    let mut line = String::new();
    loop {
        if rules.close_after.is_some_and(|n| answered >= n) {
            return;
        }
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let Ok(req) = serde_json::from_str::<serde_json::Value>(&line) else {
            eprintln!("test-scorer: not a request line: {line:?}");
            return;
        };
        let Some(text) = req.get("text").and_then(serde_json::Value::as_str) else {
            eprintln!("test-scorer: request without text: {line:?}");
            return;
        };
        let reply = if rules.garbage {
            "this is not json\n".to_owned()
        } else {
            let fail = rules
                .fail_on_text
                .as_deref()
                .is_some_and(|w| text.contains(w));
            let score = if fail { 0.0 } else { 1.0 };
            format!("{{\"score\":{score:.1}}}\n")
        };
        if !rules.delay.is_zero() {
            thread::sleep(rules.delay);
        }
        stalled |= rules
            .stall_on_text
            .as_deref()
            .is_some_and(|w| text.contains(w));
        if stalled {
            thread::sleep(rules.stall);
        }
        if conn.write_all(reply.as_bytes()).is_err() {
            return;
        }
        answered += 1;
    }
}

fn main() -> ExitCode {
    let (path, rules) = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    // A socket file left by an earlier run would make bind fail; anything else is not ours.
    if let Ok(meta) = std::fs::symlink_metadata(&path) {
        if meta.file_type().is_socket() {
            let _ = std::fs::remove_file(&path);
        }
    }
    let listener = match UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("test-scorer: cannot bind {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    // Ignored: a harness that stopped reading stdout must not stop the scorer.
    let _ = writeln!(std::io::stdout(), "listening on {}", path.display());
    let rules = Arc::new(rules);
    for conn in listener.incoming() {
        match conn {
            Ok(conn) => {
                let rules = Arc::clone(&rules);
                thread::spawn(move || serve(conn, &rules));
            }
            Err(e) => eprintln!("test-scorer: accept: {e}"),
        }
    }
    ExitCode::SUCCESS
}
