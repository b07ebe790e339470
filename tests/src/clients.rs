//! Real clients run in a namespace: curl, the official OpenAI and Anthropic Python SDKs
//! (chat, completions and the Responses API; the Messages API) and the OpenAI Agents SDK.

use std::{env, path::Path, process::Command};

use anyhow::{ensure, Context, Result};
use serde_json::Value;

/// Runs the official OpenAI Python SDK client (`tests/py/openai_client.py` in the venv that
/// `cargo xtask setup` made) in namespace `ns`; returns its one JSON line.
pub fn openai_sdk(ns: &str, args: &[&str]) -> Result<Value> {
    let script = env::var("HALTD_OPENAI_CLIENT").unwrap_or_else(|_| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("py/openai_client.py")
            .display()
            .to_string()
    });
    python_sdk(ns, &script, args)
}

/// Runs `tests/py/openai_keepalive.py` (many turns with one SDK client) in namespace `ns`;
/// returns its one JSON line.
pub fn openai_sdk_keepalive(ns: &str, args: &[&str]) -> Result<Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("py/openai_keepalive.py");
    python_sdk(ns, &script.display().to_string(), args)
}

/// Runs `tests/py/openai_agent.py` (an agent loop with the SDK's tool calling, its tool
/// always failing) in namespace `ns`; returns its one JSON line.
pub fn openai_agent(ns: &str, args: &[&str]) -> Result<Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("py/openai_agent.py");
    python_sdk(ns, &script.display().to_string(), args)
}

/// Runs the official Anthropic Python SDK client (`tests/py/anthropic_client.py`, one turn of
/// `POST /v1/messages`) in namespace `ns`; returns its one JSON line. `args` are the script's
/// (`--base-url` is haltd's root, without `/v1`: the SDK adds `/v1/messages`); the line's keys
/// are listed in the script's docstring, e.g. `ok`, `stop_reason`, `text`, `events`, `halt`,
/// `exception`.
pub fn anthropic_client(ns: &str, args: &[&str]) -> Result<Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("py/anthropic_client.py");
    python_sdk(ns, &script.display().to_string(), args)
}

/// Runs several turns of [`anthropic_client`] in one process (`--turns`: the SDK is imported
/// once, which takes a second or two of CPU): `args` are common to every turn, `turns[i]` are
/// turn i's own (after them, so they override). Returns one JSON line per turn, in order.
pub fn anthropic_turns<T: AsRef<str>>(
    ns: &str,
    args: &[&str],
    turns: &[Vec<T>],
) -> Result<Vec<Value>> {
    python_turns(ns, "anthropic_client.py", args, turns)
}

/// Runs several turns of `POST /v1/responses` with the official OpenAI Python SDK
/// (`tests/py/openai_responses.py`: `client.responses.create`, streamed or not, and the
/// SDK's `responses.stream` helper) in one process, in namespace `ns`, as
/// [`anthropic_turns`] does: `args` common to every turn (`--base-url` is haltd's `/v1`, to
/// which the SDK adds `/responses`), `turns[i]` turn i's own. Returns one JSON line per turn,
/// in order; the line's keys are listed in the script's docstring, e.g. `ok`,
/// `response_status`, `incomplete_details`, `text`, `events`, `frames`, `halt`, `exception`.
pub fn openai_responses_turns<T: AsRef<str>>(
    ns: &str,
    args: &[&str],
    turns: &[Vec<T>],
) -> Result<Vec<Value>> {
    python_turns(ns, "openai_responses.py", args, turns)
}

/// Runs agent loops of the OpenAI Agents SDK (`tests/py/openai_agents_loop.py`: an
/// `agents.Agent` with `function_tool`s whose results a scenario scripts, over haltd's
/// Responses API with the SDK's default Responses model) in one process, in namespace `ns`, as
/// [`openai_responses_turns`] runs turns: `args` common to every run (`--base-url` is haltd's
/// `/v1`), `runs[i]` run i's own. Returns one JSON line per run, in order; the line's keys are
/// listed in the script's docstring, e.g. `requests`, `responses`, `tools_executed`,
/// `final_output`, `exception`.
pub fn openai_agents_runs<T: AsRef<str>>(
    ns: &str,
    args: &[&str],
    runs: &[Vec<T>],
) -> Result<Vec<Value>> {
    python_turns(ns, "openai_agents_loop.py", args, runs)
}

/// Runs `script` of `tests/py` (a client that takes `--turns`) with `args` and `turns`;
/// returns its lines as JSON, one per turn.
fn python_turns<T: AsRef<str>>(
    ns: &str,
    script: &str,
    args: &[&str],
    turns: &[Vec<T>],
) -> Result<Vec<Value>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("py")
        .join(script);
    let turns: Vec<Vec<&str>> = turns
        .iter()
        .map(|t| t.iter().map(AsRef::as_ref).collect())
        .collect();
    let spec = serde_json::to_string(&turns)?;
    let mut all = args.to_vec();
    all.extend(["--turns", spec.as_str()]);
    let script = script.display().to_string();
    let stdout = python_stdout(ns, &script, &all)?;
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("{script} printed {stdout:?}")))
        .collect::<Result<Vec<Value>>>()?;
    ensure!(
        lines.len() == turns.len(),
        "{script}: {} lines for {} turns: {lines:?}",
        lines.len(),
        turns.len()
    );
    Ok(lines)
}

/// Runs a Python script of `tests/py` with the venv's interpreter in namespace `ns`; returns
/// the JSON of its last line.
fn python_sdk(ns: &str, script: &str, args: &[&str]) -> Result<Value> {
    let stdout = python_stdout(ns, script, args)?;
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("{script} printed {stdout:?}"))
}

/// Runs a Python script of `tests/py` with the venv's interpreter in namespace `ns`; returns
/// its standard output (fails on a non-zero exit, with its standard error).
fn python_stdout(ns: &str, script: &str, args: &[&str]) -> Result<String> {
    let python = env::var("HALTD_PYTHON")
        .context("HALTD_PYTHON is not set: run the tests with `cargo xtask test`")?;
    let out = Command::new("ip")
        .args(["netns", "exec", ns, python.as_str(), script])
        .args(args)
        .output()
        .with_context(|| format!("running {script}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{script} {args:?} failed ({}): {stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout.into_owned())
}

/// Runs curl in namespace `ns` with `args`; returns (exit status success, stdout).
pub fn curl(ns: &str, args: &[&str]) -> Result<(bool, String)> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "curl", "-sS", "--max-time", "30"])
        .args(args)
        .output()
        .context("running curl (Debian package curl)")?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    ))
}
