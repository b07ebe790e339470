//! Spec 002's five tool-call loops, run with and without haltd (`bench-tool-circuit` and its
//! smoke test in `tests/tests/it/tool_circuit_bench.rs`).
//!
//! Each case is an agent loop of the official `openai` SDK (`tests/py/openai_agent.py
//! --scenario`): the agent executes the tools (fakes whose results the case fixes, some of
//! them with a side effect: an order created), the scripted upstream plays the model, whose
//! move per turn the case fixes too: the loop a model falls into when a tool keeps failing
//! (paraphrase the query, repeat the write, retry the 503), ending in a text answer after a
//! few tries. A loop runs twice on the same upstream: straight against it (no haltd: the
//! agent in the server namespace, on the upstream's loopback) and through haltd with
//! `[tool_circuit]` ([`CONFIG`]: the spec's default budgets and backoff, a registry for the
//! cases' tools). What the model did is read from the upstream's request log, the same way
//! for both: the requests it got (model calls), the tokens it generated (`tokens_sent`:
//! content tokens plus tool-call deltas) and the bytes of the `messages` it was given (the
//! prompt it had to read; the scripted model has no tokenizer). What the tools did is the
//! agent's count: executions, and side effects beyond the first per tool (duplicates).

use std::{collections::BTreeSet, fs, path::Path, thread, time::Duration};

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{json, Value};

use crate::{clients::openai_agent, rig::Rig};

/// haltd's configuration for the loops: TokenCircuit on with the spec's defaults, and the
/// registry of the cases' tools.
pub const CONFIG: &str = r#"[tool_circuit]
enabled = true

[tool_circuit.tools.run_sql]
resource_class = "sql_namespace"
resource = "/schema"
auth_scope = { fixed = "analyst" }

[tool_circuit.tools.search_orders]
verifier = "count_orders"

[tool_circuit.tools.create_order]
method = "POST"
verifier = "get_order"
"#;

/// Turns an agent may take before it stops on its own.
const MAX_TURNS: usize = 8;
/// The model's text before a call, and the call's argument pieces (about a token each).
const CALL: &str = "tokens=24 args_chunks=8 needs_tool=1";
/// The model's final answer when it gives up.
const SUMMARY: &str = "[[script:normal tokens=48]]";

/// One of spec 002's five test cases as an agent loop.
#[derive(Debug, Clone)]
pub struct Case {
    /// Short name (`permission`, `validation`, ...).
    pub name: &'static str,
    /// The spec's name of the case.
    pub spec: &'static str,
    /// The `--scenario` file's content (`tests/py/openai_agent.py`).
    pub scenario: Value,
}

fn call(tool: &str, args: &str) -> String {
    format!("[[script:tool_call name={tool} args=\"{args}\" {CALL}]]")
}

/// The five cases.
pub fn cases() -> Vec<Case> {
    let sql = |q: &str| call("run_sql", &format!("{{'schema': 'hr', 'q': '{q}'}}"));
    let slot = |s: &str| call("book_meeting", &format!("{{'room': 'A', 'slot': '{s}'}}"));
    let weather = call("get_weather", "{'location': 'Paris, France'}");
    let search = |c: &str| call("search_orders", &format!("{{'customer': '{c}'}}"));
    let order = call("create_order", "{'sku': 'A-1', 'qty': 1}");
    vec![
        Case {
            name: "permission",
            spec: "permission/auth, paraphrased queries",
            scenario: json!({
                "tools": {"run_sql": [r#"{"status": 403, "error": "permission denied for schema hr"}"#]},
                "model": [sql("select salary from employees"), sql("select pay from salaries"),
                          sql("SELECT * FROM hr.salaries LIMIT 1"),
                          sql("select compensation from payroll"), SUMMARY],
            }),
        },
        Case {
            name: "validation",
            spec: "validation: one repair, then a forced summary",
            scenario: json!({
                "tools": {"book_meeting": ["ValidationError: slot must be HH:MM (24 h)"]},
                "model": [slot("9am"), slot("9:00 am"), slot("09:00am"), slot("nine"), SUMMARY],
            }),
        },
        Case {
            name: "transient",
            spec: "transient: backoff and a small budget",
            scenario: json!({
                "tools": {"get_weather": ["HTTP 503 Service Unavailable"]},
                "model": [&weather, &weather, &weather, &weather, &weather, SUMMARY],
            }),
        },
        Case {
            name: "ambiguous_empty",
            spec: "ambiguous/empty: the verifier tells valid empty from a wrong query",
            scenario: json!({
                "tools": {"search_orders": [r#"{"rows": []}"#]},
                "model": [search("ACME"), search("Acme Corp"), search("acme"),
                          search("ACME Inc."), SUMMARY],
            }),
        },
        Case {
            name: "side_effect",
            spec: "side-effect uncertainty: no duplicate write",
            scenario: json!({
                "tools": {"create_order": [
                    {"content": "urllib3.exceptions.ReadTimeoutError: read timed out",
                     "effect": true},
                    {"content": r#"{"order_id": "o-2", "status": "created"}"#, "effect": true},
                ]},
                "model": [&order, &order, SUMMARY],
            }),
        },
    ]
}

/// What one run of a loop cost and how it ended.
#[derive(Debug, Clone, Serialize)]
pub struct Arm {
    /// Requests the model got.
    pub model_calls: usize,
    /// Tokens the model generated (content and tool-call deltas).
    pub completion_tokens: u64,
    /// Bytes of the `messages` the model was given, summed over its calls.
    pub prompt_bytes: u64,
    /// Model calls haltd forwarded with the exhausted tool removed (and its note).
    pub forwarded_without_tool: usize,
    /// Tool calls the agent executed.
    pub tool_executions: u64,
    /// Side effects beyond the first per tool (a second order created).
    pub duplicate_effects: u64,
    /// How the loop ended.
    pub ended: String,
    /// The calls the model made, in order (`tool(args)`), and its text answers (`text`).
    pub tried: Vec<String>,
}

/// Runs `case` once: through haltd with `conversation` as `x-haltd-conversation-id`, or
/// (`None`) straight against the upstream.
pub fn run(rig: &Rig, case: &Case, conversation: Option<&str>, dir: &Path) -> Result<Arm> {
    run_with_history(rig, case, conversation, "full", dir)
}

/// [`run`] with the agent keeping its history as `history` says (`tests/py/openai_agent.py
/// --history`: `full`, `trim` or `flatten`; the last two carry on after haltd's refusals).
pub fn run_with_history(
    rig: &Rig,
    case: &Case,
    conversation: Option<&str>,
    history: &str,
    dir: &Path,
) -> Result<Arm> {
    let file = dir.join(format!("{}.json", case.name));
    fs::write(&file, case.scenario.to_string()).context("writing the scenario")?;
    let file = file.display().to_string();
    let before = model_requests(rig)?.len();
    let max_turns = MAX_TURNS.to_string();
    let (ns, base) = match conversation {
        Some(_) => (&rig.pair.cli, format!("{}/v1", rig.haltd.api_url())),
        None => (&rig.pair.srv, format!("{}/v1", rig.up.url)),
    };
    let mut args = vec![
        "--base-url",
        base.as_str(),
        "--scenario",
        file.as_str(),
        "--max-turns",
        max_turns.as_str(),
        "--history",
        history,
    ];
    if let Some(c) = conversation {
        args.extend(["--conversation-id", c]);
    }
    let out = openai_agent(ns, &args)?;
    let requests = settled_requests(rig, before)?;
    Ok(arm(&out, &requests))
}

/// The model's requests since the `before`-th, once the upstream logged the last one's end
/// (a halted stream's upstream request ends a moment after the agent saw the halt).
fn settled_requests(rig: &Rig, before: usize) -> Result<Vec<Value>> {
    let mut last = usize::MAX;
    for _ in 0..20 {
        thread::sleep(Duration::from_millis(50));
        let all = model_requests(rig)?;
        if all.len() == last {
            return Ok(all[before.min(all.len())..].to_vec());
        }
        last = all.len();
    }
    let all = model_requests(rig)?;
    Ok(all[before.min(all.len())..].to_vec())
}

/// The chat requests the upstream has finished, oldest first.
fn model_requests(rig: &Rig) -> Result<Vec<Value>> {
    Ok(rig
        .up
        .requests()?
        .into_iter()
        .filter(|r| r.get("event").is_none() && r["path"] == "/v1/chat/completions")
        .collect())
}

/// haltd's error in what the SDK kept as the error's body (the error object, or the whole
/// body with it under `error`).
fn haltd_error(out: &Value) -> &Value {
    let body = &out["error"]["body"];
    if body.get("code").is_some() {
        body
    } else {
        &body["error"]
    }
}

fn arm(out: &Value, requests: &[Value]) -> Arm {
    let count = |key: &str| {
        out[key]
            .as_object()
            .map_or(0, |m| m.values().filter_map(Value::as_u64).sum::<u64>())
    };
    let duplicates = out["effects"].as_object().map_or(0, |m| {
        m.values()
            .filter_map(Value::as_u64)
            .map(|n| n.saturating_sub(1))
            .sum()
    });
    let mut tried = Vec::new();
    for turn in out["turns"].as_array().into_iter().flatten() {
        let calls = turn["tool_calls"].as_array().into_iter().flatten();
        let mut any = false;
        for c in calls {
            any = true;
            tried.push(format!(
                "{}({})",
                c["name"].as_str().unwrap_or("?"),
                c["arguments"].as_str().unwrap_or("")
            ));
        }
        if !any {
            tried.push("text".to_owned());
        }
    }
    let turns = out["turns"].as_array().map_or(0, Vec::len);
    let ended = match &out["error"] {
        Value::Null if tried.last().map(String::as_str) == Some("text") => {
            "answered in text".into()
        }
        Value::Null => format!("stopped after {turns} turns"),
        e => {
            let h = haltd_error(out);
            let class = h["tool_circuit"]["failure_class"].as_str().unwrap_or("?");
            let how = match e["status_code"].as_u64() {
                Some(409) => "answered by haltd without the model",
                _ => "halted in the stream",
            };
            format!(
                "{how}: {} ({class})",
                h["code"].as_str().unwrap_or("no code")
            )
        }
    };
    Arm {
        model_calls: requests.len(),
        completion_tokens: requests
            .iter()
            .filter_map(|r| r["tokens_sent"].as_u64())
            .sum(),
        prompt_bytes: requests
            .iter()
            .map(|r| r["body"]["messages"].to_string().len() as u64)
            .sum(),
        forwarded_without_tool: requests
            .iter()
            .filter(|r| r["body"].get("tools").is_none())
            .count(),
        tool_executions: count("executed"),
        duplicate_effects: duplicates,
        ended,
        tried,
    }
}

/// The one-line transcript summary of a case: what the model tried, what haltd did.
pub fn summary(case: &Case, without: &Arm, with: &Arm) -> String {
    let tools = |a: &Arm| {
        let calls: Vec<&str> = a
            .tried
            .iter()
            .map(String::as_str)
            .filter(|t| *t != "text")
            .collect();
        let distinct: BTreeSet<&str> = calls.iter().copied().collect();
        let names: BTreeSet<&str> = calls
            .iter()
            .map(|c| c.split('(').next().unwrap_or(c))
            .collect();
        format!(
            "{} call(s) of {} with {} distinct arguments",
            calls.len(),
            names.into_iter().collect::<Vec<_>>().join(", "),
            distinct.len()
        )
    };
    let forwarded = if with.forwarded_without_tool > 0 {
        format!(
            ", {} turn(s) forwarded without the tool",
            with.forwarded_without_tool
        )
    } else {
        String::new()
    };
    format!(
        "{}: without haltd the model made {} ({} tool runs, {} duplicate effects) and the loop \
         {}; with haltd {} reached the agent ({} tool runs, {} duplicate effects){}, loop {}",
        case.name,
        tools(without),
        without.tool_executions,
        without.duplicate_effects,
        without.ended,
        tools(with),
        with.tool_executions,
        with.duplicate_effects,
        forwarded,
        with.ended,
    )
}
