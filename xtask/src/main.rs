//! `cargo xtask <task>`: haltd's developer and CI tasks; one module per task.
//!
//! Every task that builds or runs something first runs `setup`, which is idempotent: it checks
//! what is present and installs only what is missing, so `cargo xtask run` and
//! `cargo xtask test` work on a fresh Debian machine with rustup (stable + nightly). Setup also
//! keeps a Python virtual environment with the official `openai` and `anthropic` SDKs and the
//! OpenAI Agents SDK at `~/.local/share/haltd/venv`, which the integration tests use as real
//! clients; `setup` and `test` also put llama.cpp's OpenAI server (`llama-cpp-python`, pinned)
//! in that venv and make the tiny model it serves, the tests' real inference server.
//!
//! Nested cargo runs inherit stdio, so their progress shows as it happens.

mod bench;
mod build;
mod ctx;
mod dist;
mod fuzz;
mod lint;
mod load;
mod run;
mod setup;
mod test;
mod util;

use std::process::exit;

use clap::{Parser, Subcommand};

use crate::ctx::Ctx;

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    about = "haltd developer and CI tasks",
    long_about = "haltd developer and CI tasks. `run` and `test` do all set-up themselves."
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Install what is missing: Debian packages, nightly rust-src, bpf-linker, the venv with the
    /// openai and anthropic SDKs, llama.cpp's server in it and the tiny model it serves; mount
    /// bpffs.
    Setup,
    /// Build the BPF halt gate (nightly, bpfel-unknown-none, with BTF).
    BuildEbpf,
    /// Build the BPF gate, then haltd and haltctl with the gate embedded.
    Build(build::Options),
    /// Build a release haltd and run it on localhost with the built-in token source.
    Run(run::Options),
    /// `lint`, the unit and property tests, then the root-only integration tests (serially).
    Test(test::Options),
    /// Check formatting and run clippy with warnings denied, with and without fault injection.
    Lint,
    /// Build a release haltd with fault injection and run the benches: the halt SLO bench
    /// (with the gate cost per send and the streaming overhead), then the detector cost.
    Bench(bench::Options),
    /// Build the BPF gate and have haltd load and attach it once (`haltd check-gate`).
    Load,
    /// Build the libFuzzer targets (nightly, cargo-fuzz, installed when missing) and run each
    /// for a while: executions, coverage, CPU time and crashes per target.
    Fuzz(fuzz::Options),
    /// Build the production release as operators install it, in target/dist: stripped
    /// binaries with split debug info, completions, man pages and a Debian package.
    Dist(dist::Options),
}

fn main() {
    let cli = Cli::parse();
    let result = Ctx::new().and_then(|ctx| match cli.task {
        Task::Setup => setup::setup_with(&ctx, setup::RealBackend::Install),
        Task::BuildEbpf => build::build_ebpf(&ctx).map(drop),
        Task::Build(opts) => build::build_task(&ctx, &opts),
        Task::Run(opts) => run::run(&ctx, opts),
        Task::Test(opts) => test::test(&ctx, &opts),
        Task::Lint => lint::lint_task(&ctx),
        Task::Bench(opts) => bench::bench(&ctx, &opts),
        Task::Load => load::load(&ctx),
        Task::Fuzz(opts) => fuzz::fuzz(&ctx, &opts),
        Task::Dist(opts) => dist::dist(&ctx, &opts),
    });
    if let Err(e) = result {
        eprintln!("xtask: error: {e:#}");
        exit(1);
    }
}
