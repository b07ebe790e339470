//! Tests of the native surfaces against the real server, in process on 127.0.0.1: the event
//! sequences, and (where `HALTD_PYTHON` names the venv's interpreter, as `cargo xtask test`
//! sets it) the official OpenAI and Anthropic Python SDKs parsing them.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    path::Path,
    process::Command,
    sync::{atomic::AtomicU64, Arc},
};

use serde_json::{json, Value};

use super::{decode_chunked, handle_conn, listen, messages, responses, Framing, Server};

/// A server on 127.0.0.1 (its own runtime thread, alive until the test process ends).
fn server() -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let listener = rt
        .block_on(async { listen("127.0.0.1:0".parse().expect("addr")) })
        .expect("listen");
    let addr = listener.local_addr().expect("addr").to_string();
    let server = Arc::new(Server {
        framing: Framing::Chunked,
        keep_alive: false,
        keep_alive_idle: None,
        log: None,
        seq: AtomicU64::new(0),
        conns: AtomicU64::new(0),
        hooks: std::sync::Mutex::default(),
    });
    std::thread::spawn(move || {
        rt.block_on(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(handle_conn(Arc::clone(&server), s));
            }
        });
    });
    addr
}

/// POSTs `body` to `path`; returns the status and the (de-chunked) body.
fn post(addr: &str, path: &str, body: &Value) -> (u16, String) {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8(raw).expect("utf-8");
    let (head, rest) = text.split_once("\r\n\r\n").expect("head");
    let code = head[9..12].parse().expect("status");
    if head.contains("transfer-encoding: chunked") {
        let body = decode_chunked(rest.as_bytes())
            .expect("chunks")
            .expect("whole");
        (code, String::from_utf8(body).expect("utf-8"))
    } else {
        (code, rest.to_owned())
    }
}

/// The SSE events of a body: (event name, data).
fn events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').expect("two lines");
            let name = name.strip_prefix("event: ").expect("event line");
            let data = data.strip_prefix("data: ").expect("data line");
            (
                name.to_owned(),
                serde_json::from_str(data).expect("JSON data"),
            )
        })
        .collect()
}

#[test]
fn directives_come_from_each_surface_s_last_turn() {
    let texts = |b: Value| responses::request_text(b.as_object().expect("object"));
    assert_eq!(
        texts(json!({"input": "a [[script:stall]]"})),
        "a [[script:stall]]"
    );
    let items = json!({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "[[script:die]]"}]},
        {"role": "developer", "content": "a proxy's note"}]});
    assert_eq!(texts(items), "[[script:die]]");
    let tool = json!({"input": [{"role": "user", "content": "[[script:die]]"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "[[script:stall]]"}]});
    assert_eq!(texts(tool), "[[script:stall]]");

    let texts = |b: Value| messages::request_text(b.as_object().expect("object"));
    assert_eq!(
        texts(json!({"messages": [{"role": "user", "content": "[[script:die]]"}]})),
        "[[script:die]]"
    );
    let blocks = json!({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]},
        {"type": "text", "text": "[[script:stall]]"}]}]});
    assert_eq!(texts(blocks), "r\n[[script:stall]]");
}

#[test]
fn responses_stream_in_vllm_s_order() {
    let addr = server();
    let body = json!({"model": "m", "stream": true, "top_logprobs": 1,
        "include": ["message.output_text.logprobs"],
        "input": "[[script:tool_call tokens=3 reasoning=1 args_chunks=2 finish=length]]"});
    let (code, text) = post(&addr, "/v1/responses", &body);
    assert_eq!(code, 200);
    let evs = events(&text);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.reasoning_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (name, data)) in evs.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i);
    }
    assert_eq!(
        evs[10].1["logprobs"][0]["top_logprobs"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    let call = &evs[15].1["item"];
    assert_eq!(
        (call["type"].as_str(), call["arguments"].as_str()),
        (Some("function_call"), Some(""))
    );
    let done = &evs[20].1["response"];
    assert_eq!(done["status"], "incomplete");
    assert_eq!(done["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(done["usage"]["output_tokens"], 3 + 1 + 2);
    assert_eq!(
        done["usage"]["output_tokens_details"]["reasoning_tokens"],
        1
    );
}

#[test]
fn messages_stream_in_vllm_s_order() {
    let addr = server();
    let body = json!({"model": "m", "max_tokens": 9, "stream": true, "messages": [
        {"role": "user", "content": "[[script:tool_call tokens=2 reasoning=1 args_chunks=1]]"}]});
    let (code, text) = post(&addr, "/v1/messages", &body);
    assert_eq!(code, 200);
    let evs = events(&text);
    let summary: Vec<String> = evs
        .iter()
        .map(|(n, d)| {
            assert_eq!(d["type"], n.as_str());
            let detail = d["delta"]["type"]
                .as_str()
                .or(d["content_block"]["type"].as_str());
            format!("{n}{}", detail.map(|t| format!(":{t}")).unwrap_or_default())
        })
        .collect();
    assert_eq!(
        summary,
        [
            "message_start",
            "content_block_start:thinking",
            "content_block_delta:thinking_delta",
            "content_block_delta:signature_delta",
            "content_block_stop",
            "content_block_start:text",
            "content_block_delta:text_delta",
            "content_block_stop",
            "content_block_start:tool_use",
            "content_block_delta:input_json_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    assert_eq!(evs[11].1["delta"]["stop_reason"], "tool_use");
    assert_eq!(evs[11].1["usage"]["output_tokens"], 2 + 2);
}

#[test]
fn batch_answers_and_errors_in_each_surface_s_schema() {
    let addr = server();
    let input = "[[script:tool_call tokens=2 reasoning=1]]";
    let (code, text) = post(
        &addr,
        "/v1/responses",
        &json!({"model": "m", "input": input}),
    );
    let r: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(
        (code, r["object"].as_str(), r["status"].as_str()),
        (200, Some("response"), Some("completed"))
    );
    let types: Vec<&str> = r["output"]
        .as_array()
        .expect("output")
        .iter()
        .filter_map(|i| i["type"].as_str())
        .collect();
    assert_eq!(types, ["reasoning", "message", "function_call"]);

    let msgs = json!([{"role": "user", "content": input}]);
    let (code, text) = post(
        &addr,
        "/v1/messages",
        &json!({"model": "m", "messages": msgs}),
    );
    let m: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(
        (code, m["type"].as_str(), m["stop_reason"].as_str()),
        (200, Some("message"), Some("tool_use"))
    );
    assert_eq!(m["content"][2]["input"]["unit"], "celsius");

    let msgs = json!([{"role": "user", "content": "[[script:status code=529]]"}]);
    let (code, text) = post(
        &addr,
        "/v1/messages",
        &json!({"model": "m", "messages": msgs}),
    );
    let e: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(
        (code, e["type"].as_str(), e["error"]["type"].as_str()),
        (529, Some("error"), Some("overloaded_error"))
    );
    let (code, _) = post(
        &addr,
        "/v1/responses",
        &json!({"input": "[[script:llama_error]]"}),
    );
    assert_eq!(code, 400, "llama_error is chat's");
}

/// Runs a driver of `tests/py` against the server; `None` without `HALTD_PYTHON`.
fn sdk(script: &str, args: &[&str]) -> Option<Vec<Value>> {
    let Some(python) = std::env::var_os("HALTD_PYTHON") else {
        eprintln!("HALTD_PYTHON is not set: the SDK check is skipped (cargo xtask test sets it)");
        return None;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("py")
        .join(script);
    let out = Command::new(python)
        .arg(&script)
        .args(args)
        .output()
        .expect("python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(
        stdout
            .lines()
            .map(|l| serde_json::from_str(l).expect("JSON line"))
            .collect(),
    )
}

#[test]
fn the_official_sdks_read_both_surfaces() {
    let addr = server();
    let turns = |modes: &[&str]| {
        let mut t = Vec::new();
        for mode in modes {
            for script in [
                "normal tokens=3",
                "normal tokens=4 reasoning=2",
                "tool_call tokens=1",
                "normal tokens=2 finish=length",
            ] {
                t.push(json!([
                    "--mode",
                    mode,
                    "--prompt",
                    format!("[[script:{script}]]")
                ]));
            }
        }
        Value::from(t).to_string()
    };
    let base = format!("http://{addr}/v1");
    let spec = turns(&["create", "stream", "helper"]);
    let args = [
        "--base-url",
        &base,
        "--model",
        "m",
        "--tools",
        "weather",
        "--turns",
        &spec,
    ];
    if let Some(lines) = sdk("openai_responses.py", &args) {
        for l in &lines {
            assert_eq!(l["ok"], true, "{l}");
            assert!(
                l["response_status"] == "completed" || l["response_status"] == "incomplete",
                "{l}"
            );
        }
        assert_eq!(lines[1]["reasoning"], "The quick");
        assert_eq!(lines[6]["function_calls"][0]["name"], "get_weather");
        assert_eq!(
            lines[11]["incomplete_details"]["reason"],
            "max_output_tokens"
        );
    }
    let base = format!("http://{addr}");
    let spec = turns(&["create", "stream", "create-stream-raw"]);
    let args = [
        "--base-url",
        &base,
        "--model",
        "m",
        "--max-tokens",
        "9",
        "--turns",
        &spec,
    ];
    if let Some(lines) = sdk("anthropic_client.py", &args) {
        for l in &lines {
            assert_eq!(l["ok"], true, "{l}");
        }
        assert_eq!(lines[5]["thinking"], "The quick");
        assert_eq!(lines[6]["tool_uses"][0]["input"]["unit"], "celsius");
        assert_eq!(lines[11]["stop_reason"], "max_tokens");
    }
}
