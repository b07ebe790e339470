//! The grounding A/B harness (issue 16, point 5): the labelled prompt set through haltd in
//! canary mode (surprise `observe`) and in intervene mode, side by side, per backend
//! (`haltd_tests::grounding_ab`; definitions in docs/grounding.md, "The A/B harness").
//!
//! With `--backend URL --model NAME [--continuation vllm|llama_cpp|none]` it runs against that
//! OpenAI-compatible server only; with `--backend builtin`, against haltd's built-in source
//! only (restating the question, `--builtin-restate-prompt`). Without `--backend`: the
//! stand-in model (the scripted upstream) resumed in vLLM's, llama.cpp's and no continuation
//! shape, the built-in source, and llama.cpp's server with the tiny model when `HALTD_PYTHON`
//! and `HALTD_LLAMA_MODEL` are set (`cargo xtask bench` sets them; `--no-llama` leaves it
//! out).
//!
//! Prints a table and writes the reports as JSON (`--out`, default
//! `target/bench/grounding-ab.json`). Needs no root: haltd runs on loopback without the kernel
//! gate. Reports, never fails on a figure; fails if a turn or a process fails.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use haltd_tests::{
    grounding_ab::{
        llama, load_items, report, run_backend, shipped_set, Backend, Continuation, Settings,
    },
    temp_dir,
};
use serde_json::json;

#[derive(Debug, Parser)]
#[command(about = "Grounding A/B: canary (observe) against intervene, per backend")]
struct Args {
    /// An OpenAI-compatible server (its base URL, without `/v1`, with `--model`), or
    /// `builtin` (haltd's built-in source); without it, the stand-in, the built-in source
    /// and (when set up) llama.cpp's server.
    #[arg(long)]
    backend: Option<String>,
    /// The model name to send to `--backend`.
    #[arg(long)]
    model: Option<String>,
    /// How haltd resumes `--backend` after a rewind.
    #[arg(long, default_value = "vllm")]
    continuation: Continuation,
    /// Leave llama.cpp's server out when no `--backend` is given.
    #[arg(long)]
    no_llama: bool,
    /// The prompt set and memory store (default: tests/grounding/).
    #[arg(long)]
    prompts: Option<PathBuf>,
    #[arg(long)]
    memory: Option<PathBuf>,
    /// Only the first N items.
    #[arg(long)]
    limit: Option<usize>,
    /// The surprise detector: threshold (bits), window, tokens before it may breach, hold-back.
    #[arg(long, default_value_t = 2.0)]
    threshold_bits: f64,
    #[arg(long, default_value_t = 4)]
    window: usize,
    #[arg(long, default_value_t = 2)]
    min_tokens: usize,
    #[arg(long, default_value_t = 16)]
    hold_back: usize,
    #[arg(long, default_value_t = 2)]
    max_rounds: usize,
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// The stand-in's delay before each token, ms; the built-in source's token interval.
    #[arg(long, default_value_t = 5)]
    pace_ms: u64,
    /// The stand-in's reply length in tokens (its claim, then filler words).
    #[arg(long, default_value_t = 48)]
    reply_tokens: usize,
    /// Where the JSON goes (default `target/bench/grounding-ab.json`).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// A sibling binary of this one (`haltd` from `HALTD_BIN` when set).
fn sibling(name: &str, env: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Ok(p.into());
    }
    let exe = std::env::current_exe().context("locating this executable")?;
    Ok(exe.with_file_name(name))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (prompts, memory) = shipped_set();
    let mut items = load_items(args.prompts.as_ref().unwrap_or(&prompts))?;
    items.truncate(args.limit.unwrap_or(items.len()));
    let s = Settings {
        haltd_bin: sibling("haltd", "HALTD_BIN")?,
        upstream_bin: sibling("scripted-upstream", "HALTD_UPSTREAM_BIN")?,
        memory_dir: args.memory.clone().unwrap_or(memory),
        threshold_bits: args.threshold_bits,
        window: args.window,
        min_tokens: args.min_tokens,
        hold_back: args.hold_back,
        max_rounds: args.max_rounds,
        max_tokens: args.max_tokens,
        pace_ms: args.pace_ms,
        reply_tokens: args.reply_tokens,
    };
    let dir = temp_dir("grounding-ab")?;
    let mut held_servers = Vec::new();
    let backends = match (args.backend.as_deref(), &args.model) {
        (Some("builtin"), _) => vec![Backend::Builtin],
        (Some(url), Some(model)) => vec![Backend::Server {
            name: url.to_owned(),
            url: url.trim_end_matches('/').to_owned(),
            model: model.clone(),
            continuation: args.continuation,
        }],
        (Some(_), None) => anyhow::bail!("--backend URL needs --model"),
        (None, _) => {
            let mut b: Vec<Backend> = [
                Continuation::Vllm,
                Continuation::LlamaCpp,
                Continuation::None,
            ]
            .map(Backend::StandIn)
            .into();
            b.push(Backend::Builtin);
            if !args.no_llama {
                if let Some(l) = llama::start_if_set_up(&dir)? {
                    b.push(l.backend.clone());
                    held_servers.push(l);
                } else {
                    eprintln!(
                        "llama.cpp's server left out: HALTD_PYTHON or HALTD_LLAMA_MODEL unset"
                    );
                }
            }
            b
        }
    };
    let mut reports = Vec::new();
    for (n, b) in backends.iter().enumerate() {
        let sub = dir.join(format!("backend-{n}"));
        std::fs::create_dir_all(&sub)?;
        let pairs = run_backend(b, &s, &items, &sub)?;
        reports.push(report::report(b, &pairs));
    }
    drop(held_servers);
    print!("{}", report::table(&reports));
    let out = args
        .out
        .unwrap_or_else(|| PathBuf::from("target/bench/grounding-ab.json"));
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let doc = json!({
        "settings": {"threshold_bits": s.threshold_bits, "window": s.window,
            "min_tokens": s.min_tokens, "hold_back": s.hold_back, "max_rounds": s.max_rounds,
            "max_tokens": s.max_tokens, "stand_in_pace_ms": s.pace_ms,
            "stand_in_reply_tokens": s.reply_tokens, "items": items.len()},
        "backends": reports,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&doc)?)?;
    println!("\nwritten to {}", out.display());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
