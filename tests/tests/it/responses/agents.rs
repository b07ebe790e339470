//! TokenCircuit (spec 002, docs/tokencircuit.md) on the Responses surface, driven by the
//! OpenAI Agents SDK (`tests/py/openai_agents_loop.py`): an `agents.Agent` with
//! `function_tool`s, run by `Runner.run_streamed` (and `Runner.run`) with the SDK's default
//! Responses model over haltd's `/v1/responses`. The agent executes the tools, whose results
//! each case scripts; the scripted upstream plays the model, one `[[script:...]]` directive
//! per turn (the driver's input filter adds it as a last user message). The history the SDK
//! sends is its own: `function_call` and `function_call_output` items, which haltd translates
//! into the chat transcript the circuit replays.
//!
//! The spec's five cases, one test each: permission/auth (the agent's next request answered
//! without the model, one request: the SDK does not retry the 409), validation (one repair,
//! then a forced summary; the same arguments again halted in the stream, streamed and batch),
//! transient (retries after the backoff within a budget of 2, then a forced summary), the
//! empty result told apart by the verifier (nothing found: the retry halted; data found: one
//! retry), and the uncertain write (its read-after-write check failed: the retry halted, no
//! duplicate). Every halt in the stream ends the SDK's run with `ModelBehaviorError`, the
//! model's call in the upstream's answer and none of it (no `function_call` item, no argument
//! delta) in the events the SDK got; every intervention has its `tool_circuit` ledger record.
//! And the hold: an allowed call's item and argument deltas reach the agent at once, when the
//! call is whole and judged, before the turn ends. The validation case runs once more with
//! the requests passed through to the backend's own `/v1/responses` (`--upstream-surfaces`):
//! the same repair, summary and halt, the exhausted tool removed from the request's own
//! `tools` and the note appended to its `instructions`.

use anyhow::{ensure, Context, Result};
use haltd_tests::{openai_agents_runs, rig::Rig};
use serde_json::{json, Value};

use crate::{responses::turn, tool_circuit::CHAT, UPSTREAM_BIN};

/// TokenCircuit with the spec's budgets, a 1 ms backoff (the model's retries come after it:
/// `first_ms` below), and the registry of the cases' tools.
const CONFIG: &str = r#"[tool_circuit]
enabled = true
backoff = { base_ms = 1, cap_ms = 1 }

[tool_circuit.tools.run_sql]
resource_class = "sql_namespace"
resource = "/namespace"
auth_scope = { fixed = "analyst" }

[tool_circuit.tools.search_orders]
verifier = "count_orders"

[tool_circuit.tools.create_order]
method = "POST"
verifier = "get_order"
"#;

/// Text tokens the scripted model writes before each call.
const TEXT_TOKENS: u64 = 2;

/// What the Agents SDK's `ModelBehaviorError` says for a halted response, streamed or batch.
const HALTED: &str = "Responses stream ended with terminal event `response.incomplete`. \
    status=incomplete; incomplete_details=IncompleteDetails(reason='content_filter').";

/// The model's final answer in text.
const SUMMARY: &str = "[[script:normal tokens=4]]";

/// The model calls `tool` with `args` (JSON written with `'` for `"`), after
/// [`TEXT_TOKENS`] text tokens and 5 ms (past the 1 ms backoff); as text when the request
/// offers no such tool (haltd forwarded it without the tool).
fn call(tool: &str, args: &str) -> String {
    format!(
        "[[script:tool_call name={tool} args=\"{args}\" tokens={TEXT_TOKENS} args_chunks=4 \
         first_ms=5 needs_tool=1]]"
    )
}

/// A run's own arguments: `scenario` (the tools' results, the model's moves) in
/// `conversation` (`x-haltd-conversation-id`), streamed or not (`mode`).
fn run(conversation: &str, mode: &str, scenario: &Value) -> Vec<String> {
    turn(&[
        "--conversation-id",
        conversation,
        "--mode",
        mode,
        "--scenario",
        &scenario.to_string(),
    ])
}

/// The agent runs against the rig's haltd, in one process; one result per run.
fn agents(rig: &Rig, runs: &[Vec<String>]) -> Result<Vec<Value>> {
    let base = format!("{}/v1", rig.haltd.api_url());
    openai_agents_runs(&rig.pair.cli, &["--base-url", &base], runs)
}

fn start() -> Result<Rig> {
    Rig::with_config(UPSTREAM_BIN, CONFIG, &[])
}

/// The backend's own Responses path (native pass-through).
const RESPONSES: &str = "/v1/responses";

/// The model requests (chat, or Responses passed through) the upstream has finished, oldest first, once it logged `n` (a halted
/// stream's upstream request ends a moment after the SDK saw the halt).
fn model_calls(rig: &Rig, n: usize) -> Result<Vec<Value>> {
    for _ in 0..40 {
        let calls: Vec<Value> = rig
            .up
            .requests()?
            .into_iter()
            .filter(|r| r.get("event").is_none() && (r["path"] == CHAT || r["path"] == RESPONSES))
            .collect();
        if calls.len() >= n {
            return Ok(calls);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    anyhow::bail!("the upstream did not log {n} model calls")
}

/// The tools the agent executed, by name, in order.
fn executed(r: &Value) -> Vec<&str> {
    r["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["name"].as_str())
        .collect()
}

/// Every request of the run was answered 200 (no SDK retry, no refusal).
fn all_ok(r: &Value) -> Result<usize> {
    let requests = r["requests"].as_array().context("requests")?;
    ensure!(
        requests.iter().all(|q| q["status"] == 200),
        "a refused request: {r}"
    );
    Ok(requests.len())
}

/// The run ended in text (the forced summary): no exception, a final output.
fn summarized(r: &Value) -> Result<()> {
    ensure!(r["exception"].is_null(), "{r}");
    ensure!(
        r["final_output"].as_str().is_some_and(|t| !t.is_empty()),
        "no final output: {r}"
    );
    Ok(())
}

/// The model's `n`-th call (the upstream's, counted from 1) was forwarded without `tool` and
/// with the circuit's note naming it and `class`.
fn forwarded_without(rig: &Rig, n: usize, tool: &str, class: &str) -> Result<()> {
    let calls = model_calls(rig, n)?;
    let body = &calls.get(n - 1).context("a model call")?["body"];
    let mut offered = body["tools"].as_array().into_iter().flatten();
    ensure!(
        !offered.any(|t| t["function"]["name"] == tool),
        "{tool} still offered: {body}"
    );
    let last = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .context("messages")?;
    ensure!(
        last["role"] == "system"
            && last["content"]
                .as_str()
                .is_some_and(|s| s.contains(tool) && s.contains(class)),
        "the note: {last}"
    );
    Ok(())
}

/// The artifact of a run that haltd halted in the stream with `TOOL_CIRCUIT_OPEN`: the SDK
/// raised `ModelBehaviorError` for the `response.incomplete`; the halted response carried
/// haltd's halt object and no call (no `function_call` item, no argument delta), though the
/// model's answer to that request (the upstream's `n`-th) held the call's deltas; its
/// `tool_circuit` ledger record says `halted`.
fn halted_in_stream(rig: &Rig, r: &Value, n: usize) -> Result<Value> {
    let e = &r["exception"];
    ensure!(
        e["class"] == "ModelBehaviorError" && e["message"] == HALTED,
        "{r}"
    );
    let halted = r["responses"]
        .as_array()
        .and_then(|v| v.last())
        .context("the halted response")?;
    let events: Vec<&str> = halted["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    ensure!(events.last() == Some(&"response.incomplete"), "{halted}");
    ensure!(
        halted["function_calls"] == json!([])
            && !events.contains(&"response.function_call_arguments.delta"),
        "a held call reached the SDK: {halted}"
    );
    let halt = &halted["haltd"];
    ensure!(
        halt["type"] == "halted" && halt["code"] == "TOOL_CIRCUIT_OPEN",
        "{halted}"
    );
    let request = r["requests"]
        .as_array()
        .and_then(|v| v.last())
        .context("requests")?;
    ensure!(halt["stream_id"] == request["stream_id"], "{r}");
    let answer = model_calls(rig, n)?
        .get(n - 1)
        .cloned()
        .context("the halted turn's model call")?;
    ensure!(
        answer["script"] == "tool_call"
            && answer["tokens_sent"]
                .as_u64()
                .is_some_and(|t| t > TEXT_TOKENS),
        "the model's answer held the call: {answer}"
    );
    let sid = request["stream_id"].as_str().context("stream id")?;
    let rec = rig.record("tool_circuit", sid)?;
    ensure!(rec["tool_circuit"]["action"] == "halted", "{rec}");
    Ok(halt["tool_circuit"].clone())
}

/// The trips of `class` counted so far.
fn trips(rig: &Rig, class: &str) -> Result<f64> {
    rig.haltd
        .metrics()?
        .value("haltd_tool_circuit_trips_total", &[("class", class)])
}

#[test]
fn permission_auth_stops_the_agent_after_its_first_failure() -> Result<()> {
    let rig = start()?;
    let sql = |q: &str| call("run_sql", &format!("{{'namespace': 'hr', 'q': '{q}'}}"));
    // The model would paraphrase its query every turn; the first 403 is the last run.
    let scenario = json!({
        "tools": {"run_sql": [r#"{"status": 403, "error": "permission denied for namespace hr"}"#]},
        "model": [sql("select salary from employees"), sql("select pay from salaries"),
                  sql("SELECT * FROM hr.salaries LIMIT 1"), SUMMARY],
    });
    let r = &agents(&rig, &[run("agents-permission", "stream", &scenario)])?[0];
    ensure!(executed(r) == ["run_sql"], "{r}");
    let e = &r["exception"];
    ensure!(
        e["class"] == "ConflictError" && e["status_code"] == 409,
        "{r}"
    );
    let body = &e["body"];
    let err = if body.get("code").is_some() {
        body
    } else {
        &body["error"]
    };
    ensure!(err["code"] == "TOOL_CIRCUIT_OPEN", "{r}");
    let a = &err["tool_circuit"];
    ensure!(
        a["failure_class"] == "permission/auth" && a["budget"] == 0,
        "{a}"
    );
    let key = &a["equivalence_key"];
    ensure!(
        key["tool_name"] == "run_sql"
            && key["resource_class"] == "sql_namespace:hr"
            && key["auth_scope"] == "analyst",
        "{key}"
    );
    // One answer without the model, and one request for it: the SDK did not retry the 409.
    let requests = r["requests"].as_array().context("requests")?;
    let statuses: Vec<&Value> = requests.iter().map(|q| &q["status"]).collect();
    ensure!(statuses == [&json!(200), &json!(409)], "{r}");
    ensure!(
        model_calls(&rig, 1)?.len() == 1,
        "the model was called again"
    );
    ensure!(trips(&rig, "permission/auth")? == 1.0);
    let sid = requests[1]["stream_id"].as_str().context("stream id")?;
    let rec = rig.record("tool_circuit", sid)?;
    ensure!(rec["tool_circuit"]["action"] == "answered", "{rec}");
    Ok(())
}

/// The validation case's scenarios: `book_meeting` fails validation every time. In the
/// first, one repair (9:00 am) goes out, and its failure uses the budget of 1 up: the next
/// turn is forwarded without the tool, and the model summarizes. In the second, the model
/// "repairs" with the arguments that failed: halted in the stream.
fn validation_scenarios() -> (Value, Value) {
    let slot = |s: &str| call("book_meeting", &format!("{{'room': 'A', 'slot': '{s}'}}"));
    let invalid = "ValidationError: slot must be HH:MM (24 h)";
    let repaired = json!({
        "tools": {"book_meeting": [invalid]},
        "model": [slot("9am"), slot("9:00 am"), slot("09:00am"), SUMMARY],
    });
    let same = json!({
        "tools": {"book_meeting": [invalid]},
        "model": [slot("9am"), slot("9am"), SUMMARY],
    });
    (repaired, same)
}

#[test]
fn validation_gets_one_repair_then_a_forced_summary() -> Result<()> {
    let rig = start()?;
    let (repaired, same) = validation_scenarios();
    let runs = agents(
        &rig,
        &[
            run("agents-validation", "stream", &repaired),
            run("agents-validation-same", "stream", &same),
            run("agents-validation-batch", "run", &same),
        ],
    )?;

    let r = &runs[0];
    summarized(r)?;
    ensure!(executed(r) == ["book_meeting", "book_meeting"], "{r}");
    ensure!(all_ok(r)? == 3, "{r}");
    forwarded_without(&rig, 3, "book_meeting", "validation")?;

    let r = &runs[1];
    ensure!(executed(r) == ["book_meeting"], "{r}");
    let a = halted_in_stream(&rig, r, 5)?;
    ensure!(
        a["failure_class"] == "validation" && a["next_action"] == "correct_arguments",
        "{a}"
    );

    // Batch: the whole response is withheld, and the SDK raises the same error.
    let r = &runs[2];
    ensure!(executed(r) == ["book_meeting"], "{r}");
    let e = &r["exception"];
    ensure!(
        e["class"] == "ModelBehaviorError" && e["message"] == HALTED,
        "{r}"
    );
    let last = r["requests"]
        .as_array()
        .and_then(|v| v.last())
        .context("requests")?;
    ensure!(last["halted"] == "TOOL_CIRCUIT_OPEN", "{r}");
    ensure!(trips(&rig, "validation")? == 2.0);
    Ok(())
}

#[test]
fn transient_failures_retry_within_a_small_budget_then_summarize() -> Result<()> {
    let rig = start()?;
    let weather = call("get_weather", "{'location': 'Paris, France'}");
    // The tool raises: the SDK tells the model only "An error occurred while running the
    // tool. Please try again.", which haltd reads as transient.
    let scenario = json!({
        "tools": {"get_weather": [{"raise": "HTTP 503 Service Unavailable"}]},
        "model": [&weather, &weather, &weather, &weather, SUMMARY],
    });
    let r = &agents(&rig, &[run("agents-transient", "stream", &scenario)])?[0];
    // The call and two retries (a unit each, after the backoff) ran; the budget of 2 used
    // up, the fourth turn went to the model without the tool.
    summarized(r)?;
    ensure!(executed(r).len() == 3, "{r}");
    ensure!(all_ok(r)? == 4, "{r}");
    forwarded_without(&rig, 4, "get_weather", "transient")?;
    let v = rig.get_admin("/admin/circuit/agents-transient")?;
    let open = &v["conversations"][0]["open"][0];
    ensure!(
        open["failure_class"] == "transient" && open["retry_count"] == 2 && open["budget"] == 2,
        "{v}"
    );
    Ok(())
}

#[test]
fn an_empty_result_is_told_apart_by_the_verifier() -> Result<()> {
    let rig = start()?;
    let search = |c: &str| call("search_orders", &format!("{{'customer': '{c}'}}"));
    let count = call("count_orders", "{'customer': 'ACME'}");
    let empty = r#"{"rows": []}"#;
    let moves = json!([search("ACME"), count, search("Acme Corp"), SUMMARY]);
    // The verifier finds nothing either: the empty answer was valid; the search again halts.
    let valid = json!({"tools": {"search_orders": [empty], "count_orders": [empty]},
                       "model": moves});
    // The verifier finds orders: the query was probably wrong; one search again goes out.
    let wrong = json!({"tools": {"search_orders": [empty],
                                 "count_orders": [r#"{"rows": [{"count": 3}]}"#]},
                       "model": moves});
    let runs = agents(
        &rig,
        &[
            run("agents-empty-valid", "stream", &valid),
            run("agents-empty-wrong", "stream", &wrong),
        ],
    )?;

    let r = &runs[0];
    ensure!(executed(r) == ["search_orders", "count_orders"], "{r}");
    let a = halted_in_stream(&rig, r, 3)?;
    ensure!(a["failure_class"] == "ambiguous_effect", "{a}");
    ensure!(a["equivalence_key"]["side_effect_boundary"] == false, "{a}");
    ensure!(
        a["safety_justification"]
            .as_str()
            .is_some_and(|s| s.contains("valid")),
        "{a}"
    );

    let r = &runs[1];
    summarized(r)?;
    ensure!(
        executed(r) == ["search_orders", "count_orders", "search_orders"],
        "{r}"
    );
    ensure!(trips(&rig, "ambiguous_effect")? == 1.0);
    Ok(())
}

#[test]
fn an_uncertain_write_is_never_duplicated() -> Result<()> {
    let rig = start()?;
    let order = call("create_order", "{'sku': 'A-1', 'qty': 1}");
    let check = call("get_order", "{'sku': 'A-1'}");
    // The write timed out after it created the order; the read-after-write check failed too
    // (503): the write's outcome is unknown, and its retry would create a second order.
    let scenario = json!({
        "tools": {
            "create_order": [
                {"content": "urllib3.exceptions.ReadTimeoutError: read timed out", "effect": true},
                {"content": r#"{"order_id": "o-2", "status": "created"}"#, "effect": true},
            ],
            "get_order": ["HTTP 503 Service Unavailable"],
        },
        "model": [&order, &check, &order, SUMMARY],
    });
    let r = &agents(&rig, &[run("agents-write", "stream", &scenario)])?[0];
    ensure!(executed(r) == ["create_order", "get_order"], "{r}");
    ensure!(
        r["effects"] == json!({"create_order": 1}),
        "a duplicate: {r}"
    );
    let a = halted_in_stream(&rig, r, 3)?;
    ensure!(a["failure_class"] == "ambiguous_effect", "{a}");
    // The write reached the agent (the kernel accepted the frame that started it): it counts
    // as dispatched, so its timeout is ambiguous, not transient.
    ensure!(a["equivalence_key"]["side_effect_boundary"] == true, "{a}");
    ensure!(
        a["safety_justification"]
            .as_str()
            .is_some_and(|s| s.contains("may have happened")),
        "{a}"
    );
    let first = r["requests"][0]["stream_id"]
        .as_str()
        .context("stream id")?;
    let rec = rig.turn_record(first)?;
    ensure!(
        rec["tool_calls"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c.to_string().contains("create_order"))),
        "the write dispatched: {rec}"
    );
    Ok(())
}

#[test]
fn a_judged_call_reaches_the_agent_whole_before_the_turn_ends() -> Result<()> {
    let rig = start()?;
    // Two calls, 150 ms between the model's deltas: each `function_call` item (its
    // `output_item.added` and its argument deltas) reaches the agent at once, when the call is
    // whole and judged (call 0 when call 1 begins), not piece by piece (450 ms) and not at
    // the end of the turn.
    let scenario = json!({
        "tools": {"get_weather": [r#"{"temp_c": 14}"#]},
        "model": ["[[script:tool_call tokens=2 calls=2 args_chunks=3 pace_ms=150]]", SUMMARY],
    });
    let r = &agents(&rig, &[run("agents-hold", "stream", &scenario)])?[0];
    summarized(r)?;
    ensure!(executed(r) == ["get_weather", "get_weather"], "{r}");
    let first = &r["responses"][0];
    let events = first["events"].as_array().context("events")?;
    let times = first["times"].as_array().context("times")?;
    // Per call: (the time its item opened, its last delta's, its deltas).
    let mut calls: Vec<(f64, f64, usize)> = Vec::new();
    let mut item = None;
    for (e, at) in events.iter().zip(times) {
        let at = at.as_f64().context("a time")?;
        match e.as_str() {
            Some("response.output_item.added") => item = Some(at),
            Some("response.function_call_arguments.delta") => {
                match (calls.last_mut(), item.take()) {
                    (_, Some(opened)) => calls.push((opened, at, 1)),
                    (Some(c), None) => (c.1, c.2) = (at, c.2 + 1),
                    (None, None) => anyhow::bail!("a delta before its item: {first}"),
                }
            }
            _ => {}
        }
    }
    ensure!(calls.len() == 2, "two calls: {first}");
    for (opened, last, pieces) in &calls {
        ensure!(
            *pieces >= 3 && last - opened < 250.0,
            "a call's {pieces} pieces reached the agent over {} ms: not held until whole",
            last - opened
        );
    }
    let gap = calls[1].0 - calls[0].1;
    ensure!(
        gap >= 300.0,
        "call 0 went out {gap} ms before call 1: held to the end of the turn?"
    );
    Ok(())
}

#[test]
fn a_passed_through_agent_is_judged_as_a_translated_one() -> Result<()> {
    // The same validation case with the Responses requests passed through as they came to
    // the backend's own `/v1/responses` (`--upstream-surfaces`): the circuit reads the
    // translation, the hold and the halt act on the backend's own events, and the exhausted
    // budget's edit is made in the request's own fields.
    let rig = Rig::with_config(UPSTREAM_BIN, CONFIG, &crate::passthrough::PASS_THROUGH)?;
    let (repaired, same) = validation_scenarios();
    let runs = agents(
        &rig,
        &[
            run("native-validation", "stream", &repaired),
            run("native-validation-same", "stream", &same),
        ],
    )?;
    let r = &runs[0];
    summarized(r)?;
    ensure!(executed(r) == ["book_meeting", "book_meeting"], "{r}");
    ensure!(all_ok(r)? == 3, "{r}");
    let calls = model_calls(&rig, 3)?;
    ensure!(
        calls.iter().all(|c| c["path"] == RESPONSES),
        "not passed through"
    );
    let body = &calls[2]["body"];
    let offered = body["tools"].as_array().into_iter().flatten();
    ensure!(
        !offered.clone().any(|t| t["name"] == "book_meeting") && body["input"].is_array(),
        "book_meeting still offered: {body}"
    );
    ensure!(
        body["instructions"]
            .as_str()
            .is_some_and(|s| s.contains("book_meeting") && s.contains("validation")),
        "the note in the instructions: {body}"
    );
    let r = &runs[1];
    ensure!(executed(r) == ["book_meeting"], "{r}");
    let a = halted_in_stream(&rig, r, 5)?;
    ensure!(a["failure_class"] == "validation", "{a}");
    Ok(())
}
