//! `bench-token-instructions`: the instructions haltd's data-plane thread executes per proxied
//! token, counted by callgrind, for one haltd or for two side by side (issue 30, point 5), on
//! each client surface: chat, the Anthropic Messages API (issue 34, point 7) and the OpenAI
//! Responses API (issue 35, point 6).
//!
//! ```text
//! HALTD_BIN=target/release/haltd bench-token-instructions [--before OLD_HALTD]
//!     [--surfaces chat,chat-plain,messages,responses] [--tokens 2000] [--streams 1,20]
//!     [--rounds 3] [--keep-callgrind DIR] [--out FILE]
//! ```
//!
//! Why instructions: on these 2-vCPU machines single timing rounds scatter by ±30 %, and the
//! hardware counters are not exposed (`perf stat -e instructions:u` says `<not supported>`),
//! so CPU per token is compared as callgrind's instruction count, which repeats within a
//! fraction of a percent. It counts user space only; the kernel's share (TCP, io_uring) is
//! not in it.
//!
//! Each measurement starts a `scripted-upstream` (this executable's sibling, `--keep-alive`)
//! and one `haltd serve --source openai --workers 1 --no-kernel-gate` in front of it under
//! `valgrind --tool=callgrind`, collecting only inside the worker's event loop
//! (`--toggle-collect=*Worker>::run`: the data-plane thread, nothing of the watchdog, the
//! ledger writer or start-up). After one warm-up turn of 50 tokens on the surface measured it
//! zeroes the counters (`callgrind_control -z`), runs N concurrent streams of `--tokens`
//! tokens each (the upstream's `normal` script), dumps the counters (`callgrind_control -d`)
//! and divides the instructions by the tokens the clients received. The heartbeat deadline is
//! raised to 120 s: under callgrind haltd runs some 50 times slower, and a stream must not
//! halt with `HEARTBEAT_LOST` while it is measured.
//!
//! The surfaces (`--surfaces`, comma-separated; all four by default), each a streamed turn of
//! the same script, so the upstream's work is the same (haltd asks it for logprobs on every
//! surface):
//! - `chat`: `POST /v1/chat/completions` with `logprobs: true`, as this bench always measured
//!   (its figures stay comparable with earlier runs). A token is a `"content":"` delta; the
//!   stream must end in `data: [DONE]`.
//! - `chat-plain`: the same without logprobs, so haltd writes no logprobs to the client: the
//!   fair baseline for the translated surfaces, which write none unless asked.
//! - `messages`: `POST /v1/messages` (the request translated to chat for the upstream, the
//!   stream written as Messages events). A token is a `"type":"text_delta"` event; the last
//!   event must be `message_stop`, and no `"stop_reason":"refusal"` (a halt) may come.
//! - `responses`: `POST /v1/responses` with the script as `input` (translated to chat the same
//!   way, the stream written as Responses events). A token is a
//!   `"type":"response.output_text.delta"` event; the last event must be `response.completed`
//!   (a halt ends in `response.incomplete`).
//!
//! Every round measures every surface once, the order rotating from round to round. Per
//! stream count the table gives each surface's median with its min–max, then, for each
//! translated surface measured ([`TRANSLATED`]), its ratios over each chat baseline
//! ([`BASELINES`]) of the medians: `messages / chat-plain`, `messages / chat`, `responses /
//! chat-plain`, `responses / chat`. A translated surface's target (issue 34 for Messages, issue
//! 35 for Responses) passes when its ratio over chat-plain is at most 1.10.
//!
//! With `--before`, every round measures the old binary and then `HALTD_BIN`, alternating,
//! per surface, and the table gives each one's median with its min–max, and the ratio of the
//! medians. A figure passes (issue 30's rule) when it is within 5 % of before, or inside
//! before's min–max. The surface ratios are printed for each binary. Needs valgrind (`cargo
//! xtask setup` installs it); no root, no BPF.
//!
//! With `--keep-callgrind DIR`, each measurement's dump is kept as
//! `DIR/SURFACE-BINARY-nSTREAMS-rROUND.callgrind`, for `callgrind_annotate`.
//!
//! The JSON report (`--out`): `tokens`, `rounds`, `surfaces`, `targets` (each target ratio's
//! name and bound; `target_messages_over_chat_plain` too, as before), and per stream count in
//! `results`: `streams`, `surfaces` (per surface: `surface`, `per_binary` with each binary's
//! `counts`, and `verdict`, after against before, or null) and `ratios` (per binary:
//! `SURFACE_over_BASELINE` for each translated surface and baseline, e.g.
//! `messages_over_chat_plain`, `responses_over_chat`; `passes`, each translated surface's
//! target verdict; and `pass`, all measured targets met; null where a surface was not
//! measured).

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use haltd_tests::{temp_dir, wait_for};
use serde_json::{json, Value};

/// A translated surface's target (issue 34 for Messages, issue 35 for Responses): its
/// instructions per token over chat-plain's, at most.
const TARGET_RATIO: f64 = 1.10;

/// The surfaces translated to chat, each compared with the chat baselines.
const TRANSLATED: [Surface; 2] = [Surface::Messages, Surface::Responses];

/// The baselines a translated surface is divided by; the first is its target's (no logprobs
/// written on either side).
const BASELINES: [Surface; 2] = [Surface::ChatPlain, Surface::Chat];

#[derive(Debug, Parser)]
#[command(name = "bench-token-instructions")]
struct Args {
    /// A second haltd to compare against (before a change); `HALTD_BIN` is the one after.
    #[arg(long)]
    before: Option<PathBuf>,
    /// Client surfaces to measure, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',',
          default_values_t = [Surface::Chat, Surface::ChatPlain, Surface::Messages,
                              Surface::Responses])]
    surfaces: Vec<Surface>,
    /// Tokens per stream.
    #[arg(long, default_value_t = 2000)]
    tokens: u32,
    /// Concurrent stream counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 20])]
    streams: Vec<u32>,
    /// Rounds per binary, surface and stream count.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Keep each measurement's callgrind dump in this directory.
    #[arg(long)]
    keep_callgrind: Option<PathBuf>,
    /// The report as JSON.
    #[arg(long, default_value = "target/bench/token-instructions.json")]
    out: PathBuf,
}

/// The API a client speaks to haltd (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
enum Surface {
    /// Chat completions with logprobs.
    Chat,
    /// Chat completions without logprobs.
    ChatPlain,
    /// The Anthropic Messages API.
    Messages,
    /// The OpenAI Responses API.
    Responses,
}

impl Surface {
    fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::ChatPlain => "chat-plain",
            Self::Messages => "messages",
            Self::Responses => "responses",
        }
    }

    /// The name as a JSON key (`chat_plain`).
    fn key(self) -> String {
        self.name().replace('-', "_")
    }
}

/// One measurement: instructions and the tokens they carried.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Count {
    instructions: u64,
    tokens: u64,
}

impl Count {
    fn per_token(self) -> f64 {
        self.instructions as f64 / self.tokens.max(1) as f64
    }
}

/// A binary measured: its name in the table (`before`, `after`) and path.
type Bin<'a> = (&'static str, &'a Path);

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(!args.surfaces.is_empty(), "--surfaces needs at least one");
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    let after = PathBuf::from(std::env::var_os("HALTD_BIN").context(
        "HALTD_BIN is not set: point it at a release haltd (`cargo xtask bench` sets it)",
    )?);
    let upstream = prerequisites()?;
    if let Some(dir) = &args.keep_callgrind {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut bins: Vec<Bin<'_>> = Vec::new();
    if let Some(b) = &args.before {
        bins.push(("before", b));
    }
    bins.push(("after", &after));
    let mut report = Vec::new();
    for &streams in &args.streams {
        let counts = measure_rounds(&args, &bins, &upstream, streams)?;
        report.push(summarize(&args.surfaces, &bins, streams, &counts));
    }
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let json = json!({
        "bench": "token-instructions",
        "tokens": args.tokens,
        "rounds": args.rounds,
        "surfaces": args.surfaces,
        "target_messages_over_chat_plain": TARGET_RATIO,
        "targets": TRANSLATED
            .iter()
            .map(|s| (format!("{}_over_{}", s.key(), BASELINES[0].key()), json!(TARGET_RATIO)))
            .collect::<serde_json::Map<_, _>>(),
        "results": report,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&json)?)
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("report: {}", args.out.display());
    Ok(())
}

/// The upstream beside this executable, once valgrind is known to be there.
fn prerequisites() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let upstream = exe.with_file_name("scripted-upstream");
    ensure!(
        upstream.is_file(),
        "{} is missing: build the haltd-tests binaries",
        upstream.display()
    );
    ensure!(
        Command::new("valgrind")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "valgrind is missing: run `cargo xtask setup` as root (or `apt-get install -y valgrind`)"
    );
    Ok(upstream)
}

/// Every round of one stream count: each binary on each surface, the surfaces' order rotating
/// from round to round. `counts[surface][binary]` holds a count per round.
fn measure_rounds(
    args: &Args,
    bins: &[Bin<'_>],
    upstream: &Path,
    streams: u32,
) -> Result<Vec<Vec<Vec<Count>>>> {
    let mut counts = vec![vec![Vec::new(); bins.len()]; args.surfaces.len()];
    for round in 1..=args.rounds {
        let mut order: Vec<usize> = (0..args.surfaces.len()).collect();
        order.rotate_left((round - 1) as usize % args.surfaces.len());
        for s in order {
            let surface = args.surfaces[s];
            for (i, (name, bin)) in bins.iter().enumerate() {
                let keep = args.keep_callgrind.as_ref().map(|d| {
                    d.join(format!(
                        "{}-{name}-n{streams}-r{round}.callgrind",
                        surface.name()
                    ))
                });
                let c = measure(
                    bin,
                    upstream,
                    surface,
                    (streams, args.tokens),
                    keep.as_deref(),
                )?;
                eprintln!(
                    "[{name} {} N={streams} round {round}/{}] {} tokens, {} instructions, {:.0} per token",
                    surface.name(),
                    args.rounds,
                    c.tokens,
                    c.instructions,
                    c.per_token()
                );
                counts[s][i].push(c);
            }
        }
    }
    Ok(counts)
}

/// Median, min and max of the per-token figures of `counts`.
fn stats(counts: &[Count]) -> (f64, f64, f64) {
    let mut v: Vec<f64> = counts.iter().map(|c| c.per_token()).collect();
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Prints one stream count's lines (one per surface, then the ratios) and returns them as
/// JSON.
fn summarize(
    surfaces: &[Surface],
    bins: &[Bin<'_>],
    streams: u32,
    counts: &[Vec<Vec<Count>>],
) -> Value {
    let per_surface: Vec<Value> = surfaces
        .iter()
        .zip(counts)
        .map(|(&surface, c)| surface_line(surface, bins, streams, c))
        .collect();
    let median_of = |surface: Surface, bin: usize| {
        let s = surfaces.iter().position(|&x| x == surface)?;
        Some(stats(&counts[s][bin]).0)
    };
    let ratios: Vec<Value> = bins
        .iter()
        .enumerate()
        .map(|(i, (name, _))| ratio_lines(name, streams, |s| median_of(s, i)))
        .collect();
    json!({"streams": streams, "surfaces": per_surface, "ratios": ratios})
}

/// One surface's line: each binary's median (min–max), and after against before.
fn surface_line(surface: Surface, bins: &[Bin<'_>], streams: u32, counts: &[Vec<Count>]) -> Value {
    let stats: Vec<(f64, f64, f64)> = counts.iter().map(|c| stats(c)).collect();
    let mut line = format!("N={streams:<5} {:<10}", surface.name());
    for ((name, _), (med, min, max)) in bins.iter().zip(&stats) {
        line += &format!(" | {name} {med:.0} ({min:.0}–{max:.0}) instructions/token");
    }
    let mut verdict = Value::Null;
    if let [(b, bmin, bmax), (a, _, _)] = stats[..] {
        let ratio = a / b;
        let pass = ratio <= 1.05 || (bmin..=bmax).contains(&a);
        line += &format!(
            " | after/before {ratio:.4} {}",
            if pass { "PASS" } else { "MISS" }
        );
        verdict = json!({"ratio": ratio, "pass": pass});
    }
    println!("{line}");
    json!({
        "surface": surface,
        "per_binary": bins.iter().zip(counts).map(|((n, p), c)| json!({
            "binary": n, "path": p, "counts": c,
        })).collect::<Vec<_>>(),
        "verdict": verdict,
    })
}

/// One binary's surface ratios, a line per translated surface measured: over chat-plain (the
/// target) and over chat. `median` is the binary's median per surface, if measured.
fn ratio_lines(name: &str, streams: u32, median: impl Fn(Surface) -> Option<f64>) -> Value {
    let mut out = serde_json::Map::new();
    out.insert("binary".to_owned(), json!(name));
    let mut passes = serde_json::Map::new();
    for surface in TRANSLATED {
        let ratios = BASELINES.map(|base| Some(median(surface)? / median(base)?));
        let pass = ratios[0].map(|r| r <= TARGET_RATIO);
        passes.insert(surface.key(), json!(pass));
        for (base, r) in BASELINES.iter().zip(ratios) {
            out.insert(format!("{}_over_{}", surface.key(), base.key()), json!(r));
        }
        if ratios.iter().all(Option::is_none) {
            continue;
        }
        let show = |r: Option<f64>| r.map_or_else(|| "-".to_owned(), |r| format!("{r:.4}"));
        let target = match pass {
            Some(true) => format!("PASS (target ≤ {TARGET_RATIO:.2})"),
            Some(false) => format!("MISS (target ≤ {TARGET_RATIO:.2})"),
            None => "(not measured)".to_owned(),
        };
        let s = surface.name();
        println!(
            "N={streams:<5} {name}: {s}/{} {} {target} | {s}/{} {}",
            BASELINES[0].name(),
            show(ratios[0]),
            BASELINES[1].name(),
            show(ratios[1]),
        );
    }
    let measured: Vec<bool> = passes.values().filter_map(Value::as_bool).collect();
    let all = (!measured.is_empty()).then(|| measured.iter().all(|&p| p));
    out.insert("passes".to_owned(), Value::Object(passes));
    out.insert("pass".to_owned(), json!(all));
    Value::Object(out)
}

/// Kills a child when dropped (a failed measurement leaves nothing running).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `scripted-upstream` writing its address into `dir`; the process and the address.
fn start_upstream(upstream: &Path, dir: &Path) -> Result<(Reaped, String)> {
    let ready = dir.join("upstream.addr");
    let up = Reaped(
        Command::new(upstream)
            .args(["--listen", "127.0.0.1:0", "--keep-alive", "--ready-file"])
            .arg(&ready)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting scripted-upstream")?,
    );
    let addr = wait_for(Duration::from_secs(10), "the upstream's address", || {
        Ok(std::fs::read_to_string(&ready)
            .ok()
            .filter(|s| !s.trim().is_empty()))
    })?;
    Ok((up, addr))
}

/// One haltd under callgrind in front of one upstream: `streams` streams of `tokens` tokens
/// on `surface`; the dump copied to `keep` if given.
fn measure(
    haltd: &Path,
    upstream: &Path,
    surface: Surface,
    (streams, tokens): (u32, u32),
    keep: Option<&Path>,
) -> Result<Count> {
    let dir = temp_dir("token-instructions")?;
    let (_up, up_addr) = start_upstream(upstream, &dir)?;
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let cg = dir.join("callgrind.out");
    let mut cmd = Command::new("valgrind");
    cmd.args([
        "--tool=callgrind",
        "--collect-atstart=no",
        "--toggle-collect=*Worker>::run",
    ])
    .arg(format!("--callgrind-out-file={}", cg.display()))
    .arg(haltd)
    .args([
        "serve",
        "--no-kernel-gate",
        "--ledger-no-fsync",
        "--source",
        "openai",
    ])
    .args(["--workers", "1", "--heartbeat-deadline-ms", "120000"])
    .arg("--listen")
    .arg(format!("127.0.0.1:{port}"))
    .arg("--upstream")
    .arg(format!("http://{}", up_addr.trim()))
    .arg("--ledger")
    .arg(dir.join("ledger.jsonl"))
    .arg("--state-dir")
    .arg(&dir)
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(dir.join("haltd.log"))?);
    let haltd = Reaped(cmd.spawn().context("starting haltd under valgrind")?);
    let pid = haltd.0.id().to_string();
    wait_for(
        Duration::from_secs(180),
        "haltd ready under callgrind",
        || Ok(get_status(port, "/readyz").ok().filter(|&s| s == 200)),
    )?;
    stream(port, surface, 50)?;
    control(&["-z", &pid])?;
    let workers: Vec<_> = (0..streams)
        .map(|_| std::thread::spawn(move || stream(port, surface, tokens)))
        .collect();
    let mut received = 0;
    for w in workers {
        received += w
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
    }
    control(&["-d", &pid])?;
    let instructions = wait_for(Duration::from_secs(60), "callgrind's dump", || dumped(&cg))?;
    drop(haltd);
    if let Some(keep) = keep {
        let dump = PathBuf::from(format!("{}.1", cg.display()));
        std::fs::copy(&dump, keep).with_context(|| format!("keeping {}", keep.display()))?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    ensure!(
        received == u64::from(streams * tokens),
        "{received} tokens received, {} sent",
        streams * tokens
    );
    Ok(Count {
        instructions,
        tokens: received,
    })
}

/// `callgrind_control ARGS`.
fn control(args: &[&str]) -> Result<()> {
    let out = Command::new("callgrind_control")
        .args(args)
        .output()
        .context("callgrind_control")?;
    ensure!(out.status.success(), "callgrind_control {args:?} failed");
    Ok(())
}

/// The instructions of the dump `callgrind_control -d` wrote (`FILE.1`), once it is complete.
fn dumped(base: &Path) -> Result<Option<u64>> {
    let file = PathBuf::from(format!("{}.1", base.display()));
    let Ok(text) = std::fs::read_to_string(&file) else {
        return Ok(None);
    };
    let Some(line) = text
        .lines()
        .find(|l| l.starts_with("totals:") || l.starts_with("summary:"))
    else {
        return Ok(None);
    };
    let n = line
        .split_whitespace()
        .nth(1)
        .context("an empty totals line")?;
    Ok(Some(n.parse().with_context(|| format!("totals `{n}`"))?))
}

/// A GET's status code.
fn get_status(port: u16, path: &str) -> Result<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head)?;
    let code = std::str::from_utf8(&head[9..12])?;
    Ok(code.parse()?)
}

/// One streamed turn of `tokens` tokens on `surface`; the tokens received.
fn stream(port: u16, surface: Surface, tokens: u32) -> Result<u64> {
    let script = format!("[[script:normal tokens={tokens}]]");
    let (path, body) = match surface {
        Surface::Chat | Surface::ChatPlain => (
            "/v1/chat/completions",
            json!({"model": "scripted", "stream": true,
                   "logprobs": surface == Surface::Chat,
                   "messages": [{"role": "user", "content": script}]}),
        ),
        Surface::Messages => (
            "/v1/messages",
            json!({"model": "scripted", "stream": true, "max_tokens": tokens.max(4096),
                   "messages": [{"role": "user", "content": script}]}),
        ),
        Surface::Responses => (
            "/v1/responses",
            json!({"model": "scripted", "stream": true, "max_output_tokens": tokens.max(4096),
                   "input": script}),
        ),
    };
    let body = body.to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let text = String::from_utf8_lossy(&out);
    let last_event = |name: &str| {
        text.rfind("event: ")
            .is_some_and(|i| text[i..].starts_with(&format!("event: {name}\n")))
    };
    let complete = match surface {
        Surface::Chat | Surface::ChatPlain => text.contains("data: [DONE]"),
        Surface::Messages => {
            last_event("message_stop") && !text.contains(r#""stop_reason":"refusal""#)
        }
        Surface::Responses => last_event("response.completed"),
    };
    if !complete {
        bail!(
            "the {} stream did not complete: {}",
            surface.name(),
            text.chars().take(300).collect::<String>()
        );
    }
    Ok(match surface {
        Surface::Chat | Surface::ChatPlain => text.matches(r#""content":""#).count(),
        Surface::Messages => text.matches(r#""type":"text_delta""#).count(),
        Surface::Responses => text
            .matches(r#""type":"response.output_text.delta""#)
            .count(),
    } as u64)
}
