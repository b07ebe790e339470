//! `cargo xtask bench`: a release haltd with fault injection, then the benches in [`BENCHES`],
//! then the ops checks (the Debian package and the container image, [`ops`]).

use std::ffi::OsString;

use anyhow::{Context, Result};
use clap::Args;

use crate::{
    build::{self, Built},
    ctx::Ctx,
    dist, fuzz, setup,
    util::run,
};

/// Benches run by `cargo xtask bench`: (package, binary). A bench not written yet is skipped.
/// All binaries of a bench's package are built first: a bench may run its siblings
/// (`bench-halt-slo` runs `bench-gate-send` and `bench-proxy-overhead`, which runs
/// `scripted-upstream`, `bench-proxy` and, beside haltd, nginx). The first one is the halt SLO bench, and the
/// arguments after `cargo xtask bench --` go to it.
const BENCHES: &[(&str, &str)] = &[
    ("haltd-tests", "bench-halt-slo"),
    // The cost figures beside nginx, TTFB, the scorer stall, and (issue 34) the TTFB and
    // per-token latency haltd adds on the Messages API beside chat (bench-halt-slo runs it
    // without them).
    ("haltd-tests", "bench-proxy-overhead"),
    ("haltd-tests", "bench-detectors"),
    // Issue 11: haltd's CPU with nothing open and 8,192 slots.
    ("haltd-tests", "bench-idle-cpu"),
    ("haltd-tests", "bench-upstream-path"),
    // Issue 30: instructions per proxied token in the data-plane thread (callgrind); issues 34
    // and 35: on chat, chat without logprobs, Messages and Responses, with the ratios Messages
    // / chat-plain and Responses / chat-plain.
    ("haltd-tests", "bench-token-instructions"),
    // Issue 13: 1,000 SIGKILLs under trip and turn load; every acknowledged record survives.
    ("haltd-tests", "bench-kill-loop"),
    // A start restoring 10,000 degraded scopes from the state store (target: at most 1 s).
    ("haltd-tests", "bench-state-restore"),
    // Issue 17: haltd in front of llama.cpp's server, beside the scripted upstream.
    ("haltd-tests", "bench-real-backend"),
    // Issue 16: grounding A/B, canary against intervene, on the stand-in and llama.cpp.
    ("haltd-tests", "bench-grounding-ab"),
    // Issue 15: spec 002's tool-call loops with and without TokenCircuit.
    ("haltd-tests", "bench-tool-circuit"),
];

#[derive(Debug, Args)]
pub(crate) struct Options {
    /// Run only the kill loop (`bench-kill-loop`: SIGKILL haltd under load, 1,000 times by
    /// default, printing progress), with this many kills.
    #[arg(long, value_name = "KILLS", num_args = 0..=1, default_missing_value = "1000")]
    kill_loop: Option<u32>,
    /// Run only the ops checks (`ops-package`: the Debian package and the container image,
    /// built, installed, started and stopped), not the benches.
    #[arg(long)]
    ops_only: bool,
    /// After the benches, fuzz every target for this many seconds (`cargo xtask fuzz
    /// --seconds N`); 0 skips it.
    #[arg(long, default_value_t = 0, value_name = "N")]
    fuzz_seconds: u64,
    /// Extra arguments for `bench-halt-slo` (after `--`), e.g. `--quick` or
    /// `--streams 1,100`.
    #[arg(last = true)]
    args: Vec<OsString>,
}

pub(crate) fn bench(ctx: &Ctx, opts: &Options) -> Result<()> {
    if opts.ops_only {
        setup::setup(ctx)?;
        return ops(ctx);
    }
    // `bench-real-backend` serves llama.cpp's server: setup installs it (once) and its model.
    let real_backend = if opts.kill_loop.is_some() {
        setup::RealBackend::Skip
    } else {
        setup::RealBackend::Install
    };
    setup::setup_with(ctx, real_backend)?;
    let built = build::build(ctx, true, &["fault-injection".to_owned()])?;
    if let Some(kills) = opts.kill_loop {
        build_package_bins(ctx, "haltd-tests", &built)?;
        let args = [OsString::from("--kills"), kills.to_string().into()];
        return run_bench(ctx, "haltd-tests", "bench-kill-loop", &args, &built);
    }
    let bins = ctx.workspace_bins();
    let mut ran = 0;
    let mut built_pkgs: Vec<&str> = Vec::new();
    for &(pkg, bin) in BENCHES {
        if !bins.iter().any(|(p, b)| p == pkg && b == bin) {
            println!("[bench] {bin}: package {pkg} has no such binary yet, skipped");
            continue;
        }
        if !built_pkgs.contains(&pkg) {
            build_package_bins(ctx, pkg, &built)?;
            built_pkgs.push(pkg);
        }
        let args: &[OsString] = if bin == BENCHES[0].1 { &opts.args } else { &[] };
        run_bench(ctx, pkg, bin, args, &built)?;
        ran += 1;
    }
    println!("bench: {ran} of {} benches ran", BENCHES.len());
    // After the benches: the production build replaces their fault-injection binary.
    ops(ctx)?;
    if opts.fuzz_seconds > 0 {
        fuzz::fuzz(ctx, &fuzz::Options::short(opts.fuzz_seconds))?;
    }
    Ok(())
}

/// The ops checks, which need a Debian mirror (or the cached base), root and podman, so they
/// run here and not in the CI suite: `cargo xtask dist`, then `ops-package` on its package
/// (tests/src/bin/ops-package.rs: the install in a throwaway root, the container image).
fn ops(ctx: &Ctx) -> Result<()> {
    let (built, deb) = dist::package(ctx)?;
    println!("[bench] ops-package: {}", deb.display());
    let mut c = ctx.cargo_with_gate(&built.object);
    c.args([
        "run",
        "--release",
        "-p",
        "haltd-tests",
        "--bin",
        "ops-package",
        "--",
    ])
    .arg("--deb")
    .arg(&deb);
    run(&mut c).context("the ops checks failed")
}

/// `cargo run --bin` builds only that binary; the siblings it runs must be current.
fn build_package_bins(ctx: &Ctx, pkg: &str, built: &Built) -> Result<()> {
    let mut c = ctx.cargo_with_gate(&built.object);
    c.args(["build", "--release", "-p", pkg, "--bins"]);
    run(&mut c).with_context(|| format!("building the binaries of {pkg} failed"))
}

fn run_bench(ctx: &Ctx, pkg: &str, bin: &str, args: &[OsString], built: &Built) -> Result<()> {
    println!("[bench] {bin}: cargo run --release -p {pkg} --bin {bin}");
    let mut c = ctx.cargo_with_gate(&built.object);
    c.args(["run", "--release", "-p", pkg, "--bin", bin]);
    if !args.is_empty() {
        c.arg("--").args(args);
    }
    c.env("HALTD_BIN", &built.haltd)
        .env("HALTCTL_BIN", &built.haltctl)
        .env("HALTD_PYTHON", setup::venv_python(ctx))
        .env("HALTD_LLAMA_MODEL", setup::llama_model_path(ctx)?);
    run(&mut c).with_context(|| format!("bench {bin} failed"))
}
