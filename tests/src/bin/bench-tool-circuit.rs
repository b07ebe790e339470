//! What TokenCircuit saves (issue 15, spec 002): the spec's five tool-call loops
//! (`haltd_tests::circuit_loops`) run by the official `openai` SDK's agent loop, straight
//! against the scripted upstream playing the model and through haltd with `[tool_circuit]`,
//! `--runs` times each (alternating), on one haltd and one upstream.
//!
//! Per case and arm, the median over the runs of: model calls, completion tokens the model
//! generated, prompt bytes it was given, tool executions, duplicate side effects; how the
//! loop ended, and the saving (without − with). Prints a table and one transcript summary
//! per case (what the model tried, what haltd did), and writes the same as JSON to
//! `target/bench/tool-circuit.json` (`--out`), every run included.
//!
//! Needs root (namespaces, the gate) and `HALTD_PYTHON` (the venv with the `openai` SDK;
//! `cargo xtask bench` sets it). Reports; fails only if a loop cannot run.

use std::path::PathBuf;

use anyhow::{ensure, Result};
use clap::Parser;
use haltd_tests::bench_files::{sibling, write_report};
use haltd_tests::{
    circuit_loops::{self, Arm, Case},
    quantile,
    rig::Rig,
    temp_dir,
};
use serde_json::{json, Value};

#[derive(Debug, Parser)]
#[command(name = "bench-tool-circuit")]
struct Args {
    /// Runs of each loop per arm; the table shows medians.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Only the cases whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// JSON report (default `target/bench/tool-circuit.json`).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The metrics of the table, as `Arm`'s JSON keys.
const METRICS: [&str; 5] = [
    "model_calls",
    "completion_tokens",
    "prompt_bytes",
    "tool_executions",
    "duplicate_effects",
];

fn main() -> Result<()> {
    let args = Args::parse();
    haltd_tests::require_root()?;
    ensure!(args.runs >= 1, "--runs must be at least 1");
    let rig = Rig::with_config(&sibling("scripted-upstream")?, circuit_loops::CONFIG, &[])?;
    let dir = temp_dir("bench-tool-circuit")?;
    let mut results = Vec::new();
    let cases = circuit_loops::cases();
    let chosen = cases
        .iter()
        .filter(|c| args.only.as_deref().is_none_or(|o| c.name.contains(o)));
    for case in chosen {
        let (mut without, mut with) = (Vec::new(), Vec::new());
        for run in 0..args.runs {
            without.push(circuit_loops::run(&rig, case, None, &dir)?);
            let conv = format!("bench-{}-{run}", case.name);
            with.push(circuit_loops::run(&rig, case, Some(&conv), &dir)?);
        }
        results.push(report(case, &without, &with)?);
    }
    let out = json!({
        "bench": "tool_circuit",
        "runs": args.runs,
        "config": circuit_loops::CONFIG,
        "cases": results,
        "total": totals(&results),
    });
    print_table(&out);
    write_report(args.out, "tool-circuit.json", &out)
}

/// The median of each metric over the runs, and how the middle run ended.
fn medians(runs: &[Arm]) -> Result<Value> {
    let json: Vec<Value> = runs
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<_, _>>()?;
    let mut m = serde_json::Map::new();
    for key in METRICS {
        let values: Vec<u64> = json.iter().filter_map(|r| r[key].as_u64()).collect();
        m.insert(key.into(), quantile(&values, 0.5).into());
    }
    let ends: std::collections::BTreeSet<&str> =
        json.iter().filter_map(|r| r["ended"].as_str()).collect();
    m.insert(
        "ended".into(),
        ends.into_iter().collect::<Vec<_>>().join(" | ").into(),
    );
    Ok(Value::Object(m))
}

fn report(case: &Case, without: &[Arm], with: &[Arm]) -> Result<Value> {
    let (w, h) = (medians(without)?, medians(with)?);
    let saved: serde_json::Map<String, Value> = METRICS
        .iter()
        .map(|k| {
            let d = w[k].as_i64().unwrap_or(0) - h[k].as_i64().unwrap_or(0);
            ((*k).to_owned(), d.into())
        })
        .collect();
    let mid = without.len() / 2;
    Ok(json!({
        "case": case.name,
        "spec": case.spec,
        "without_haltd": w,
        "with_haltd": h,
        "saved": saved,
        "summary": circuit_loops::summary(case, &without[mid], &with[mid]),
        "runs_without_haltd": without,
        "runs_with_haltd": with,
    }))
}

fn totals(results: &[Value]) -> Value {
    let sum =
        |arm: &str, k: &str| -> i64 { results.iter().filter_map(|r| r[arm][k].as_i64()).sum() };
    let mut t = serde_json::Map::new();
    for arm in ["without_haltd", "with_haltd", "saved"] {
        let m: serde_json::Map<String, Value> = METRICS
            .iter()
            .map(|k| ((*k).to_owned(), sum(arm, k).into()))
            .collect();
        t.insert(arm.into(), Value::Object(m));
    }
    let (w, s) = (
        sum("without_haltd", "completion_tokens"),
        sum("saved", "completion_tokens"),
    );
    if w > 0 {
        t.insert(
            "completion_tokens_saved_pct".into(),
            (100.0 * s as f64 / w as f64).into(),
        );
    }
    Value::Object(t)
}

fn print_table(out: &Value) {
    println!(
        "TokenCircuit: spec 002's loops by the openai SDK's agent, without haltd / with haltd; medians of {} runs",
        out["runs"]
    );
    println!(
        "{:<16} | {:>11} | {:>17} | {:>17} | {:>9} | {:>9} | ended (with haltd)",
        "case", "model calls", "completion tokens", "prompt bytes", "tool runs", "dup. eff."
    );
    let pair = |r: &Value, k: &str| format!("{} / {}", r["without_haltd"][k], r["with_haltd"][k]);
    let rows = out["cases"].as_array().into_iter().flatten();
    for r in rows.chain(std::iter::once(&out["total"])) {
        println!(
            "{:<16} | {:>11} | {:>17} | {:>17} | {:>9} | {:>9} | {}",
            r["case"].as_str().unwrap_or("total"),
            pair(r, "model_calls"),
            pair(r, "completion_tokens"),
            pair(r, "prompt_bytes"),
            pair(r, "tool_executions"),
            pair(r, "duplicate_effects"),
            r["with_haltd"]["ended"].as_str().unwrap_or(""),
        );
    }
    if let Some(p) = out["total"]["completion_tokens_saved_pct"].as_f64() {
        println!("completion tokens saved: {p:.0}%");
    }
    for r in out["cases"].as_array().into_iter().flatten() {
        println!("- {}", r["summary"].as_str().unwrap_or(""));
    }
}
