//! What haltd costs while it serves nothing (issue 11: at most 1 ms of CPU per second with
//! 8,192 slots).
//!
//! Starts one `haltd serve` (built-in source, kernel gate, `--max-streams 8192` unless told
//! otherwise) in a fresh namespace pair, lets it settle, then measures it over `--rounds`
//! windows of `--window-s` seconds with no connection open, and reports the median of the
//! rounds:
//!
//! - **CPU per second**: user + system time of all its threads over the window, from the
//!   kernel's per-process CPU clock (`clock_getcpuclockid`, nanoseconds), and the same from
//!   `/proc/PID/stat` (`utime + stime`, in clock ticks of usually 10 ms: 0.5 ms/s resolution
//!   over 20 s, shown as a cross-check);
//! - **per thread**: each thread's time on a CPU (`/proc/PID/task/TID/schedstat`), so a
//!   regression names its thread;
//! - **watchdog wake-ups per second** (the watchdog thread's voluntary context switches): about
//!   1 with nothing open (the watchdog's idle mode, `daemon/src/pulse.rs`: it beats
//!   once a second and a new connection kicks it for a fresh beat before it is served), 200 at
//!   the default `--heartbeat-interval-ms` of 5 ms while streams are open or were within the
//!   last second.
//!
//! Prints a table and writes the same as JSON to `target/bench/idle-cpu.json` (`--out`).
//! Needs root (namespaces, the gate). Reports, never fails on a missed target; fails if haltd
//! exits or its threads cannot be read.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use haltd_tests::bench_files::default_out;
use haltd_tests::proc_cpu::{proc_stat_ticks, process_cpu_ns};
use haltd_tests::{Haltd, NetPair};
use serde_json::json;

/// Issue 11: idle CPU, microseconds per second, at most.
const TARGET_IDLE_US_PER_S: f64 = 1000.0;
/// Time haltd gets after it is ready before the first window (start-up work, first beats).
const SETTLE: Duration = Duration::from_secs(2);
/// The watchdog thread's name (`watchdog::spawn_unprivileged`).
const WATCHDOG_THREAD: &str = "haltd-watchdog";

/// haltd's CPU use with no stream open.
#[derive(Debug, Parser)]
#[command(name = "bench-idle-cpu")]
struct Args {
    /// Stream table size (`haltd serve --max-streams`).
    #[arg(long, default_value_t = 8192)]
    max_streams: u32,
    /// Length of one measurement window, in seconds.
    #[arg(long, default_value_t = 20)]
    window_s: u64,
    /// Windows measured; the report takes their median.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// JSON report (default: `bench/idle-cpu.json` in the target directory this binary was
    /// built into).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One thread's counters at one moment.
#[derive(Debug, Clone)]
struct ThreadSample {
    name: String,
    /// Time on a CPU, ns (`schedstat` field 1).
    run_ns: u64,
    voluntary_switches: u64,
}

/// The whole process at one moment.
#[derive(Debug)]
struct Sample {
    at: Instant,
    cpu_ns: u64,
    stat_ticks: u64,
    threads: BTreeMap<u32, ThreadSample>,
}

/// One window's rates.
#[derive(Debug)]
struct Round {
    seconds: f64,
    cpu_us_per_s: f64,
    stat_us_per_s: f64,
    watchdog_wakeups_per_s: f64,
    /// Thread name → µs of CPU per second (threads of one name summed).
    threads: BTreeMap<String, f64>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.rounds > 0 && args.window_s > 0,
        "--rounds and --window-s must be positive"
    );
    let pair = NetPair::new()?;
    let max_streams = args.max_streams.to_string();
    let mut extra = vec!["--max-streams", max_streams.as_str(), "--ledger-no-fsync"];
    let object = std::env::var("HALTD_BPF_OBJECT").ok();
    if let Some(obj) = &object {
        extra.extend(["--bpf-object", obj.as_str()]);
    }
    let mut haltd = Haltd::start(&pair, &extra)?;
    let pid = haltd.pid().context("haltd has no pid")?;
    eprintln!(
        "bench-idle-cpu: haltd pid {pid}, --max-streams {}; settling {SETTLE:?}, then {} × {} s",
        args.max_streams, args.rounds, args.window_s
    );
    thread::sleep(SETTLE);
    let mut rounds = Vec::with_capacity(args.rounds);
    for i in 0..args.rounds {
        let before = sample(pid)?;
        thread::sleep(Duration::from_secs(args.window_s));
        let after = sample(pid)?;
        ensure!(haltd.is_running(), "haltd exited during round {}", i + 1);
        let r = rates(&before, &after)?;
        eprintln!(
            "bench-idle-cpu: round {}: {:.0} µs/s (proc stat {:.0}), watchdog {:.0} wake-ups/s",
            i + 1,
            r.cpu_us_per_s,
            r.stat_us_per_s,
            r.watchdog_wakeups_per_s
        );
        rounds.push(r);
    }
    report(&args, &rounds)
}

/// Reads the process's CPU clock, its `/proc` ticks and every thread's counters.
fn sample(pid: u32) -> Result<Sample> {
    let mut threads = BTreeMap::new();
    let task_dir = format!("/proc/{pid}/task");
    for entry in fs::read_dir(&task_dir).with_context(|| format!("reading {task_dir}"))? {
        let entry = entry?;
        let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        // A thread that ended between the listing and the reads is left out.
        if let Ok(t) = thread_sample(&entry.path()) {
            threads.insert(tid, t);
        }
    }
    Ok(Sample {
        at: Instant::now(),
        cpu_ns: process_cpu_ns(pid)?,
        stat_ticks: proc_stat_ticks(pid)?,
        threads,
    })
}

fn thread_sample(dir: &Path) -> Result<ThreadSample> {
    let name = fs::read_to_string(dir.join("comm"))?.trim().to_owned();
    let schedstat = fs::read_to_string(dir.join("schedstat"))?;
    let run_ns = schedstat
        .split_whitespace()
        .next()
        .context("empty schedstat")?
        .parse()?;
    let status = fs::read_to_string(dir.join("status"))?;
    let voluntary_switches = status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .context("no voluntary_ctxt_switches")?
        .trim()
        .parse()?;
    Ok(ThreadSample {
        name,
        run_ns,
        voluntary_switches,
    })
}

/// Rates over the window between two samples; threads present in both.
fn rates(before: &Sample, after: &Sample) -> Result<Round> {
    let seconds = after.at.duration_since(before.at).as_secs_f64();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let tick_us = if ticks > 0 { 1e6 / ticks as f64 } else { 1e4 };
    let mut threads = BTreeMap::new();
    let mut wakeups = None;
    for (tid, a) in &after.threads {
        let Some(b) = before.threads.get(tid) else {
            continue;
        };
        let us = a.run_ns.saturating_sub(b.run_ns) as f64 / 1e3 / seconds;
        *threads.entry(a.name.clone()).or_insert(0.0) += us;
        if a.name == WATCHDOG_THREAD {
            let n = a.voluntary_switches.saturating_sub(b.voluntary_switches);
            wakeups = Some(n as f64 / seconds);
        }
    }
    let Some(watchdog_wakeups_per_s) = wakeups else {
        bail!("haltd has no thread named {WATCHDOG_THREAD}");
    };
    Ok(Round {
        seconds,
        cpu_us_per_s: after.cpu_ns.saturating_sub(before.cpu_ns) as f64 / 1e3 / seconds,
        stat_us_per_s: after.stat_ticks.saturating_sub(before.stat_ticks) as f64 * tick_us
            / seconds,
        watchdog_wakeups_per_s,
        threads,
    })
}

/// Prints the medians and writes the JSON report.
fn report(args: &Args, rounds: &[Round]) -> Result<()> {
    let cpu = median(rounds.iter().map(|r| r.cpu_us_per_s));
    let stat = median(rounds.iter().map(|r| r.stat_us_per_s));
    let wakeups = median(rounds.iter().map(|r| r.watchdog_wakeups_per_s));
    let names: Vec<&String> = rounds[0].threads.keys().collect();
    let per_thread: BTreeMap<&String, f64> = names
        .iter()
        .map(|n| {
            (
                *n,
                median(
                    rounds
                        .iter()
                        .map(|r| r.threads.get(*n).copied().unwrap_or(0.0)),
                ),
            )
        })
        .collect();
    let pass = cpu <= TARGET_IDLE_US_PER_S;
    println!(
        "idle CPU: haltd serve, no stream open, --max-streams {}; median of {} windows of {} s; target ≤ {TARGET_IDLE_US_PER_S:.0} µs/s",
        args.max_streams, args.rounds, args.window_s
    );
    println!(
        "  CPU clock (user+sys, all threads)  {cpu:>9.1} µs/s  {}",
        if pass { "PASS" } else { "MISS" }
    );
    println!("  /proc/PID/stat utime+stime         {stat:>9.1} µs/s  (clock-tick resolution)");
    println!("  watchdog wake-ups                  {wakeups:>9.1} /s");
    for (name, us) in &per_thread {
        println!("  thread {name:<27} {us:>9.1} µs/s");
    }
    let report = json!({
        "bench": "idle_cpu",
        "target_us_per_s": TARGET_IDLE_US_PER_S,
        "max_streams": args.max_streams,
        "window_s": args.window_s,
        "rounds": rounds.iter().map(|r| json!({
            "seconds": r.seconds,
            "cpu_us_per_s": r.cpu_us_per_s,
            "proc_stat_us_per_s": r.stat_us_per_s,
            "watchdog_wakeups_per_s": r.watchdog_wakeups_per_s,
            "threads_us_per_s": r.threads,
        })).collect::<Vec<_>>(),
        "cpu_us_per_s": cpu,
        "proc_stat_us_per_s": stat,
        "watchdog_wakeups_per_s": wakeups,
        "threads_us_per_s": per_thread,
        "pass": pass,
    });
    let out = match &args.out {
        Some(p) => p.clone(),
        None => default_out("idle-cpu.json")?,
    };
    if let Some(dir) = out.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    fs::write(&out, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!("bench-idle-cpu: report in {}", out.display());
    Ok(())
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
