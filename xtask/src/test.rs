//! `cargo xtask test` (root): set-up, the build, then the lint, the unit and property tests and
//! the root-only integration tests as steps. A red step does not stop the next, so one failure
//! hides no other result; cargo's "test result:" lines go to stdout for CI to parse.

use std::{
    ffi::OsString,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use clap::Args;

use crate::{
    build::{self, Built},
    ctx::Ctx,
    lint, setup,
    util::{is_root, run, secs},
};

/// The Python client the integration tests run, relative to the workspace root.
const OPENAI_CLIENT_SCRIPT: &str = "tests/py/openai_client.py";

#[derive(Debug, Args)]
pub(crate) struct Options {
    /// Run the integration tests against a release haltd instead of a debug one.
    #[arg(long)]
    release: bool,
    /// Skip the lint (`cargo xtask lint`: rustfmt and clippy).
    #[arg(long)]
    no_lint: bool,
    /// Skip the unit and property tests.
    #[arg(long)]
    no_unit: bool,
    /// Skip the root-only integration tests.
    #[arg(long)]
    no_integration: bool,
    /// Arguments for the integration test binary (after `--`), e.g. a test name filter.
    #[arg(last = true)]
    args: Vec<OsString>,
}

/// A step that ran: its name, how long it took, how it ended.
struct Step {
    name: &'static str,
    took: Duration,
    result: Result<()>,
}

impl Step {
    fn run(name: &'static str, f: impl FnOnce() -> Result<()>) -> Self {
        let t = Instant::now();
        let result = f();
        Step {
            name,
            took: t.elapsed(),
            result,
        }
    }
}

pub(crate) fn test(ctx: &Ctx, opts: &Options) -> Result<()> {
    if !is_root() {
        bail!("`cargo xtask test` must run as root: the integration tests create network namespaces and load the BPF gate (try `sudo -E env PATH=$PATH cargo xtask test`)");
    }
    let t0 = Instant::now();
    setup::setup_with(ctx, setup::RealBackend::Install)?;
    let t_setup = t0.elapsed();
    let t = Instant::now();
    // The production build first: both land on target/<profile>/haltd, and the fault-injection
    // one (what every other test runs) must be the one left there.
    let production = if !opts.no_integration && wants_production_build(&opts.args) {
        Some(build::build_production_copy(ctx, opts.release)?)
    } else {
        None
    };
    let built = build::build(ctx, opts.release, &["fault-injection".to_owned()])?;
    let t_build = t.elapsed();
    let mut steps = Vec::new();
    if !opts.no_lint {
        steps.push(Step::run("lint", || lint::lint(ctx, &built.object)));
    }
    if !opts.no_unit {
        steps.push(Step::run("unit", || unit_tests(ctx, &built)));
    }
    if !opts.no_integration {
        steps.push(Step::run("integration", || {
            integration_tests(ctx, &built, production.as_deref(), &opts.args)
        }));
    }
    summarize(&steps, t_setup, t_build, t0.elapsed())
}

fn unit_tests(ctx: &Ctx, built: &Built) -> Result<()> {
    println!("[test] unit and property tests: cargo test --workspace --exclude haltd-tests --features haltd/fault-injection");
    let mut c = ctx.cargo_with_gate(&built.object);
    c.args([
        "test",
        "--workspace",
        "--exclude",
        "haltd-tests",
        "--features",
        "haltd/fault-injection",
    ]);
    run(&mut c)
}

/// The integration test that runs the production haltd (`build_info::production_build_...`).
const PRODUCTION_TEST: &str = "build_info::production_build_refuses_faults";

/// Whether the integration run includes [`PRODUCTION_TEST`]: no name filter, or one it
/// contains (cargo's filters match substrings). Flags such as `--exact` are not filters.
fn wants_production_build(args: &[OsString]) -> bool {
    let filters: Vec<&str> = args
        .iter()
        .filter_map(|a| a.to_str())
        .filter(|a| !a.starts_with('-'))
        .collect();
    filters.is_empty() || filters.iter().any(|f| PRODUCTION_TEST.contains(f))
}

fn integration_tests(
    ctx: &Ctx,
    built: &Built,
    production: Option<&Path>,
    args: &[OsString],
) -> Result<()> {
    println!("[test] integration tests (root, serial): cargo test --no-fail-fast -p haltd-tests -- --test-threads=1");
    let mut c = ctx.cargo_with_gate(&built.object);
    // Same haltd features as the unit tests, so the haltd library builds once.
    // --nocapture: the scenario tests print their measured distributions.
    // --no-fail-fast: one red test binary must not hide the others' results.
    c.args([
        "test",
        "--no-fail-fast",
        "-p",
        "haltd-tests",
        "--features",
        "haltd/fault-injection",
        "--",
        "--test-threads=1",
        "--nocapture",
    ])
    .args(args)
    .env("HALTD_BIN", &built.haltd)
    .env("HALTCTL_BIN", &built.haltctl)
    // The official OpenAI SDK as a client: setup made the venv.
    .env("HALTD_PYTHON", setup::venv_python(ctx))
    .env("HALTD_OPENAI_CLIENT", ctx.root.join(OPENAI_CLIENT_SCRIPT))
    // The real backend's model (`real_backend::`), which setup made; the same venv serves it.
    .env("HALTD_LLAMA_MODEL", setup::llama_model_path(ctx)?);
    if let Some(production) = production {
        c.env("HALTD_PRODUCTION_BIN", production);
    }
    run(&mut c)
}

/// Prints the summary line; fails if a step did.
fn summarize(steps: &[Step], t_setup: Duration, t_build: Duration, total: Duration) -> Result<()> {
    let parts: Vec<String> = steps
        .iter()
        .map(|s| {
            let verdict = if s.result.is_ok() { "ok" } else { "FAILED" };
            format!("{} {verdict} ({})", s.name, secs(s.took))
        })
        .collect();
    let failed: Vec<String> = steps
        .iter()
        .filter(|s| s.result.is_err())
        .map(|s| match s.name {
            "lint" => "the lint".to_owned(),
            name => format!("{name} tests"),
        })
        .collect();
    println!(
        "xtask test: {} — setup {}, build {}, {}; total {}",
        if failed.is_empty() { "ok" } else { "FAILED" },
        secs(t_setup),
        secs(t_build),
        if parts.is_empty() {
            "no tests run".to_owned()
        } else {
            parts.join(", ")
        },
        secs(total),
    );
    if !failed.is_empty() {
        bail!("{} failed", failed.join(" and "));
    }
    Ok(())
}
