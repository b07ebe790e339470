//! `cargo xtask fuzz`: builds the libFuzzer targets in `fuzz/` (nightly, `cargo fuzz`), runs
//! each for a while and reports per target what libFuzzer did: executions, coverage (`cov`,
//! `ft`), the corpus it reached, the CPU time it used and the crashes it found
//! (docs/fuzzing.md).
//!
//! Each target runs from two corpus directories: a scratch one under `fuzz/target/corpus/`,
//! where libFuzzer writes what it finds, and the committed `fuzz/corpus/<target>/`, which it
//! only reads; `--cmin` merges what was found into the committed corpus, minimized with
//! `cargo fuzz cmin` to a set cover of the edges. A crash leaves its input in
//! `fuzz/artifacts/<target>/`.

use std::{
    fs,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::Instant,
};

use anyhow::{bail, Context, Result};
use clap::Args;
use haltd_ebpf_build::{toolchain_command, TOOLCHAIN};

use crate::{
    build,
    ctx::Ctx,
    setup,
    util::{capture, run, secs, show},
};

/// The targets, in the order they run (`fuzz/Cargo.toml` has one `[[bin]]` each).
pub(crate) const TARGETS: &[&str] = &[
    "request_head",
    "request_body",
    "messages_request",
    "responses_request",
    "upstream_response",
    "upstream_sse",
    "config_file",
    "ledger_verify",
];

/// cargo-fuzz release installed when it is missing.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

#[derive(Debug, Args)]
pub(crate) struct Options {
    /// Fuzz only this target (repeatable); default: every target.
    #[arg(long = "target", value_name = "TARGET")]
    targets: Vec<String>,
    /// libFuzzer's time per target (`-max_total_time`), in seconds.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Targets fuzzed at once, one process each.
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// After the runs, merge what was found into the committed corpus (`cargo fuzz cmin`).
    #[arg(long)]
    cmin: bool,
    /// Sanitizer for `cargo fuzz build` (`none`, `address`, ...). The parsers are safe Rust,
    /// so the default is none: several times the executions per second.
    #[arg(long, default_value = "none")]
    sanitizer: String,
}

impl Options {
    /// A short run of every target, for `cargo xtask bench --fuzz-seconds N`.
    pub(crate) fn short(seconds: u64) -> Self {
        Options {
            targets: Vec::new(),
            seconds,
            jobs: 1,
            cmin: false,
            sanitizer: "none".to_owned(),
        }
    }
}

/// What one target's run did.
#[derive(Debug, Default, Clone)]
struct Outcome {
    target: String,
    execs: u64,
    cov: u64,
    ft: u64,
    /// libFuzzer's last `corp:` (inputs/size of the corpus it keeps).
    corpus: String,
    cpu_s: f64,
    crashes: Vec<String>,
    ok: bool,
}

pub(crate) fn fuzz(ctx: &Ctx, opts: &Options) -> Result<()> {
    let targets = selected(opts)?;
    setup::setup(ctx)?;
    ensure_cargo_fuzz()?;
    let object = build::build_ebpf(ctx)?;
    let fuzz_dir = ctx.root.join("fuzz");
    let t = Instant::now();
    println!(
        "[fuzz] build: cargo +{TOOLCHAIN} fuzz build --sanitizer {}",
        opts.sanitizer
    );
    run(fuzz_cmd(ctx, &object).args(["fuzz", "build", "--sanitizer", &opts.sanitizer]))
        .context("building the fuzz targets failed")?;
    println!("[fuzz] built in {}", secs(t.elapsed()));
    let bin_dir = fuzz_dir.join("target/x86_64-unknown-linux-gnu/release");
    let mut outcomes = Vec::new();
    for batch in targets.chunks(opts.jobs.max(1)) {
        let handles: Vec<_> = batch
            .iter()
            .map(|&target| {
                let bin = bin_dir.join(target);
                let dir = fuzz_dir.clone();
                let seconds = opts.seconds;
                thread::spawn(move || run_target(&dir, &bin, target, seconds))
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(r) => outcomes.push(r?),
                Err(_) => bail!("a fuzz runner thread panicked"),
            }
        }
    }
    if opts.cmin {
        for o in &outcomes {
            merge_corpus(ctx, &object, &fuzz_dir, &o.target, &opts.sanitizer)?;
        }
    }
    report(&outcomes)
}

fn selected(opts: &Options) -> Result<Vec<&'static str>> {
    if opts.targets.is_empty() {
        return Ok(TARGETS.to_vec());
    }
    opts.targets
        .iter()
        .map(|t| {
            TARGETS.iter().find(|k| *k == t).copied().with_context(|| {
                format!("no fuzz target {t:?}; the targets: {}", TARGETS.join(", "))
            })
        })
        .collect()
}

/// The nightly cargo (outer cargo's variables scrubbed) in `fuzz/`, with the gate object the
/// daemon embeds.
fn fuzz_cmd(ctx: &Ctx, object: &Path) -> Command {
    let mut c = toolchain_command("cargo");
    c.current_dir(ctx.root.join("fuzz"))
        .env("HALTD_BPF_OBJECT", object);
    c
}

/// Installs cargo-fuzz from crates.io when `cargo fuzz` is missing (cargo shows its progress).
fn ensure_cargo_fuzz() -> Result<()> {
    if let Some(v) = capture(toolchain_command("cargo").args(["fuzz", "--version"])) {
        println!("[fuzz] {}", v.trim());
        return Ok(());
    }
    println!("[fuzz] cargo-fuzz missing: cargo install cargo-fuzz --version {CARGO_FUZZ_VERSION} --locked");
    run(toolchain_command("cargo").args([
        "install",
        "cargo-fuzz",
        "--version",
        CARGO_FUZZ_VERSION,
        "--locked",
    ]))
    .context("could not install cargo-fuzz (is crates.io reachable?)")
}

/// Runs one target for `seconds` and reads libFuzzer's report from its output.
fn run_target(fuzz_dir: &Path, bin: &Path, target: &str, seconds: u64) -> Result<Outcome> {
    let work = fuzz_dir.join("target/corpus").join(target);
    let artifacts = fuzz_dir.join("artifacts").join(target);
    for d in [&work, &artifacts] {
        fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let mut c = Command::new(bin);
    c.arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg(&work)
        .arg(fuzz_dir.join("corpus").join(target))
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    println!("[fuzz] {target}: {}", show(&c));
    let mut child = c
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut out = Outcome {
        target: target.to_owned(),
        ..Outcome::default()
    };
    read_log(&mut child, target, &mut out)?;
    out.cpu_s = cpu_seconds(child.id());
    let status = child.wait()?;
    out.ok = status.success();
    Ok(out)
}

/// Follows libFuzzer's stderr: status lines are echoed (prefixed), the last `cov`/`ft`, the
/// final `stat::number_of_executed_units` and crash files are kept.
fn read_log(child: &mut Child, target: &str, out: &mut Outcome) -> Result<()> {
    let stderr = child.stderr.take().context("libFuzzer's stderr")?;
    for line in BufReader::new(stderr).lines() {
        let line = line?;
        if let Some(n) = field(&line, "cov:") {
            out.cov = n;
        }
        if let Some(n) = field(&line, "ft:") {
            out.ft = n;
        }
        if let Some(c) = line
            .split("corp:")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
        {
            c.clone_into(&mut out.corpus);
        }
        if let Some(n) = line.strip_prefix("stat::number_of_executed_units:") {
            out.execs = n.trim().parse().unwrap_or(0);
        } else if line.starts_with('#') && !line.contains("pulse") {
            if let Some(n) = line[1..]
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
            {
                out.execs = n;
            }
        }
        if let Some(path) = line.split("Test unit written to ").nth(1) {
            out.crashes.push(path.trim().to_owned());
        }
        // Everything but the per-input lines (NEW, REDUCE): the periodic `pulse` and the final
        // `DONE` status, INFO lines, and a crash's panic message, backtrace and file.
        let status = line.starts_with('#');
        if !status || line.contains("pulse") || line.contains("DONE") || line.contains("INITED") {
            println!("[fuzz {target}] {line}");
        }
    }
    Ok(())
}

/// The number after `key` in a libFuzzer status line (`cov: 1234`).
fn field(line: &str, key: &str) -> Option<u64> {
    let rest = line.split(key).nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

/// User plus system CPU of a process that has closed its output (it is exiting; its
/// `/proc/PID/stat` stays readable until it is reaped). Ticks are `USER_HZ`, 100 on Linux.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command (which may hold spaces) start at field 3; utime and stime are
    // fields 14 and 15.
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = after
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    match (f.get(11), f.get(12)) {
        (Some(u), Some(s)) => (u + s) as f64 / 100.0,
        _ => 0.0,
    }
}

/// Adds what the run found to the committed corpus, then minimizes it with `cargo fuzz cmin`,
/// as a set cover of the edges (`-set_cover_merge=1 -use_counters=0`): every edge the inputs
/// reach stays reached, while the hit-count distinctions libFuzzer's own corpus keeps (ten
/// times the files: 2 MB for `upstream_sse` alone) are dropped.
fn merge_corpus(
    ctx: &Ctx,
    object: &Path,
    fuzz_dir: &Path,
    target: &str,
    sanitizer: &str,
) -> Result<()> {
    let corpus = fuzz_dir.join("corpus").join(target);
    let work = fuzz_dir.join("target/corpus").join(target);
    for e in fs::read_dir(&work)? {
        let p: PathBuf = e?.path();
        if let Some(name) = p.file_name() {
            fs::copy(&p, corpus.join(name))?;
        }
    }
    println!("[fuzz] {target}: cargo fuzz cmin");
    run(fuzz_cmd(ctx, object)
        .args(["fuzz", "cmin", "--sanitizer", sanitizer, target])
        .arg(&corpus)
        .args(["--", "-set_cover_merge=1", "-use_counters=0"]))
    .with_context(|| format!("cargo fuzz cmin {target} failed"))
}

fn report(outcomes: &[Outcome]) -> Result<()> {
    println!(
        "[fuzz] target               cpu s      executions     cov      ft        corpus  crashes"
    );
    let mut bad = Vec::new();
    for o in outcomes {
        println!(
            "[fuzz] {:<18} {:>9.1} {:>15} {:>7} {:>7} {:>13} {:>8}",
            o.target,
            o.cpu_s,
            o.execs,
            o.cov,
            o.ft,
            o.corpus,
            o.crashes.len()
        );
        for c in &o.crashes {
            println!("[fuzz]   crash: {c}");
        }
        if !o.ok || !o.crashes.is_empty() {
            bad.push(o.target.clone());
        }
    }
    let cpu: f64 = outcomes.iter().map(|o| o.cpu_s).sum();
    let execs: u64 = outcomes.iter().map(|o| o.execs).sum();
    println!("[fuzz] total: {cpu:.1} CPU s, {execs} executions");
    if !bad.is_empty() {
        bail!("fuzzing failed for {}", bad.join(", "));
    }
    Ok(())
}
