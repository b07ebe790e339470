use serde_json::json;

use super::*;

/// A degraded turn's shape, with the default instruction, or none.
fn shape(degraded: bool) -> Option<DegradedShape<'static>> {
    degraded.then_some(DegradedShape::DEFAULT)
}

/// The client's request parsed, then prepared for the upstream.
fn prepare(endpoint: Endpoint, body: &[u8], degraded: bool) -> Result<UpstreamTurn, HttpError> {
    prepare_turn(ClientRequest::parse(endpoint, body)?, shape(degraded))
}

/// What the client asked for (with the model and tools) and the upstream body.
fn prep(endpoint: Endpoint, body: Value, degraded: bool) -> (ClientAsk, Value) {
    let up = prepare(endpoint, body.to_string().as_bytes(), degraded)
        .unwrap_or_else(|e| panic!("{body}: {e}"));
    let ask = ClientAsk {
        endpoint: up.ask.endpoint,
        stream: up.ask.stream,
        logprobs: up.ask.logprobs,
        top_logprobs: up.ask.top_logprobs,
        include_usage: up.ask.include_usage,
        model: up.model,
        tools_requested: up.tools_requested,
    };
    (
        ask,
        serde_json::from_slice(&up.body).expect("upstream body is JSON"),
    )
}

/// The fields of [`UpstreamTurn`] other than the body, flat, for comparisons.
#[derive(Debug, PartialEq, Eq)]
struct ClientAsk {
    endpoint: Endpoint,
    stream: bool,
    logprobs: bool,
    top_logprobs: u32,
    include_usage: bool,
    model: String,
    tools_requested: bool,
}

fn refuse(endpoint: Endpoint, body: &str) -> HttpError {
    match prepare(endpoint, body.as_bytes(), false) {
        Ok(up) => panic!("{body} accepted as {up:?}"),
        Err(e) => e,
    }
}

#[test]
fn one_parse_serves_both_sources_and_they_read_the_same_ask() {
    let chat = json!({"model": "builtin", "messages": [{"role": "user", "content": "hi"}],
                      "stream": true, "logprobs": true, "top_logprobs": 2,
                      "stream_options": {"include_usage": true}});
    let cmpl = json!({"model": "builtin", "prompt": "x", "logprobs": 3});
    for (endpoint, body) in [(Endpoint::Chat, chat), (Endpoint::Completion, cmpl)] {
        let req = ClientRequest::parse(endpoint, body.to_string().as_bytes()).expect("parses");
        let builtin = req
            .builtin_turn("builtin")
            .expect("the built-in source takes it");
        let up = prepare_turn(req, None).expect("the proxy takes it");
        assert_eq!(builtin.ask, up.ask, "{body}");
    }
}

#[test]
fn chat_batch_request_is_streamed_upstream_with_logprobs() {
    let body = json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.7,
        "seed": 42,
        "stop": ["\n\n"],
        "ignore_eos": true,
        "max_tokens": 64,
    });
    let (ask, up) = prep(Endpoint::Chat, body.clone(), false);
    assert_eq!(
        ask,
        ClientAsk {
            endpoint: Endpoint::Chat,
            stream: false,
            logprobs: false,
            top_logprobs: 0,
            include_usage: false,
            model: "meta-llama/Llama-3.1-8B-Instruct".into(),
            tools_requested: false,
        }
    );
    let mut expected = body;
    expected["stream"] = json!(true);
    expected["stream_options"] = json!({"include_usage": true});
    expected["logprobs"] = json!(true);
    expected["top_logprobs"] = json!(0);
    assert_eq!(up, expected);
}

#[test]
fn chat_client_logprobs_and_usage_are_remembered() {
    let (ask, up) = prep(
        Endpoint::Chat,
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true,
               "logprobs": true, "top_logprobs": 3,
               "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
        false,
    );
    assert!(ask.stream && ask.logprobs && ask.include_usage);
    assert_eq!(ask.top_logprobs, 3);
    assert_eq!(up["top_logprobs"], json!(3));
    assert_eq!(up["logprobs"], json!(true));
    assert_eq!(up["stream_options"], json!({"include_usage": true}));
}

#[test]
fn nulls_count_as_absent() {
    let (ask, up) = prep(
        Endpoint::Chat,
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": null,
               "n": null, "logprobs": null, "top_logprobs": null, "stream_options": null,
               "tools": null}),
        false,
    );
    assert!(!ask.stream && !ask.logprobs && !ask.include_usage && !ask.tools_requested);
    assert_eq!(up["n"], Value::Null);
    assert_eq!(up["stream"], json!(true));
}

#[test]
fn completions_logprobs_at_least_one_upstream() {
    let (ask, up) = prep(
        Endpoint::Completion,
        json!({"model": "m", "prompt": "Once upon", "max_tokens": 5}),
        false,
    );
    assert!(!ask.logprobs);
    assert_eq!(ask.top_logprobs, 0);
    assert_eq!(up["logprobs"], json!(1));
    assert_eq!(up["stream"], json!(true));
    assert!(up.get("top_logprobs").is_none());

    let (ask, up) = prep(
        Endpoint::Completion,
        json!({"model": "m", "prompt": "x", "logprobs": 0}),
        false,
    );
    assert!(ask.logprobs);
    assert_eq!(ask.top_logprobs, 0);
    assert_eq!(up["logprobs"], json!(1));

    let (ask, up) = prep(
        Endpoint::Completion,
        json!({"model": "m", "prompt": "x", "logprobs": 5, "echo": false}),
        false,
    );
    assert_eq!(ask.top_logprobs, 5);
    assert_eq!(up["logprobs"], json!(5));
    assert_eq!(up["echo"], json!(false));
}

#[test]
fn completions_prompt_shapes() {
    for p in [
        json!("text"),
        json!(""),
        json!(["one prompt"]),
        json!([1, 2, 3]),
        json!([[1, 2, 3]]),
    ] {
        let (_, up) = prep(
            Endpoint::Completion,
            json!({"model": "m", "prompt": p}),
            false,
        );
        assert_eq!(up["prompt"], p, "prompt passes through unchanged");
    }
    let e = refuse(Endpoint::Completion, r#"{"model":"m","prompt":["a","b"]}"#);
    assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
    assert!(e.message.contains("a batch of 2 prompts"), "{}", e.message);
    let e = refuse(Endpoint::Completion, r#"{"model":"m","prompt":[[1],[2]]}"#);
    assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
    for bad in [
        r#"{"model":"m"}"#,
        r#"{"model":"m","prompt":null}"#,
        r#"{"model":"m","prompt":[]}"#,
        r#"{"model":"m","prompt":7}"#,
        r#"{"model":"m","prompt":[1,"a"]}"#,
        r#"{"model":"m","prompt":[-1]}"#,
        r#"{"model":"m","prompt":[{"a":1}]}"#,
    ] {
        let e = refuse(Endpoint::Completion, bad);
        assert_eq!(e.status, 400);
        assert!(e.message.contains("prompt"), "{bad}: {}", e.message);
    }
}

#[test]
fn n_and_best_of() {
    for ok in [r#""n":1"#, r#""best_of":1"#, r#""n":null"#] {
        let body = format!(r#"{{"model":"m","prompt":"x",{ok}}}"#);
        prepare(Endpoint::Completion, body.as_bytes(), false).expect(ok);
    }
    let e = refuse(
        Endpoint::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}"#,
    );
    assert_eq!(e.status, 400);
    assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
    assert_eq!(
        e.message,
        "n = 2 is not supported: haltd governs one choice per stream so that the halt budget holds per connection; send separate requests instead"
    );
    let e = refuse(Endpoint::Completion, r#"{"model":"m","prompt":"x","n":0}"#);
    assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
    let e = refuse(
        Endpoint::Completion,
        r#"{"model":"m","prompt":"x","best_of":3}"#,
    );
    assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
    assert!(e.message.starts_with("best_of = 3"));
    let e = refuse(
        Endpoint::Completion,
        r#"{"model":"m","prompt":"x","best_of":0}"#,
    );
    assert_eq!(e.code, None);
    let e = refuse(
        Endpoint::Completion,
        r#"{"model":"m","prompt":"x","n":"2"}"#,
    );
    assert_eq!(e.message, "n must be a non-negative integer");
    let e = refuse(
        Endpoint::Completion,
        r#"{"model":"m","prompt":"x","n":1.5}"#,
    );
    assert_eq!(e.message, "n must be a non-negative integer");
}

/// Each case is refused with 400, `invalid_request_error` and exactly this message.
fn assert_refusals(cases: Vec<(Endpoint, String, &str)>) {
    for (ep, body, msg) in cases {
        let e = refuse(ep, &body);
        assert_eq!(e.status, 400, "{body}");
        assert_eq!(e.kind, "invalid_request_error");
        assert_eq!(e.message, msg, "{body}");
    }
}

#[test]
fn type_errors_name_the_field() {
    let cases: Vec<(Endpoint, String, &str)> = vec![
        (
            Endpoint::Chat,
            "[]".into(),
            "request body must be a JSON object",
        ),
        (
            Endpoint::Chat,
            "\"x\"".into(),
            "request body must be a JSON object",
        ),
        (
            Endpoint::Chat,
            r#"{"messages":[{}]}"#.into(),
            "model is required: the upstream serves requests by model name",
        ),
        (
            Endpoint::Chat,
            r#"{"model":1,"messages":[{}]}"#.into(),
            "model must be a string",
        ),
        (
            Endpoint::Chat,
            r#"{"model":"","messages":[{}]}"#.into(),
            "model must not be empty",
        ),
        (
            Endpoint::Chat,
            r#"{"model":"m"}"#.into(),
            "messages is required",
        ),
        (
            Endpoint::Chat,
            r#"{"model":"m","messages":[]}"#.into(),
            "messages must not be empty",
        ),
        (
            Endpoint::Chat,
            r#"{"model":"m","messages":"hi"}"#.into(),
            "messages must be an array of message objects",
        ),
        (
            Endpoint::Chat,
            r#"{"model":"m","messages":[{},"x"]}"#.into(),
            "messages[1] must be an object",
        ),
    ];
    assert_refusals(cases);
}

#[test]
fn option_type_errors_name_the_field() {
    let chat = |extra: &str| {
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#)
    };
    let cases: Vec<(Endpoint, String, &str)> = vec![
        (
            Endpoint::Chat,
            chat(r#","stream":"yes""#),
            "stream must be true or false",
        ),
        (
            Endpoint::Chat,
            chat(r#","logprobs":1"#),
            "logprobs must be true or false",
        ),
        (
            Endpoint::Chat,
            chat(r#","logprobs":true,"top_logprobs":21"#),
            "top_logprobs must be at most 20",
        ),
        (
            Endpoint::Chat,
            chat(r#","logprobs":true,"top_logprobs":-1"#),
            "top_logprobs must be an integer from 0 to 20",
        ),
        (
            Endpoint::Chat,
            chat(r#","logprobs":true,"top_logprobs":"3""#),
            "top_logprobs must be an integer from 0 to 20",
        ),
        (
            Endpoint::Chat,
            chat(r#","top_logprobs":2"#),
            "top_logprobs requires logprobs: true",
        ),
        (
            Endpoint::Chat,
            chat(r#","stream_options":true"#),
            "stream_options must be an object",
        ),
        (
            Endpoint::Chat,
            chat(r#","stream_options":{"include_usage":"y"}"#),
            "stream_options.include_usage must be true or false",
        ),
        (
            Endpoint::Completion,
            r#"{"model":"m","prompt":"x","logprobs":6}"#.into(),
            "logprobs must be an integer from 0 to 5 for completions",
        ),
        (
            Endpoint::Completion,
            r#"{"model":"m","prompt":"x","logprobs":true}"#.into(),
            "logprobs must be an integer from 0 to 5 for completions",
        ),
    ];
    assert_refusals(cases);
}

#[test]
fn invalid_json_carries_serdes_message() {
    let e = refuse(Endpoint::Chat, r#"{"model":"m","#);
    assert_eq!(e.status, 400);
    assert!(
        e.message.starts_with("invalid JSON body: "),
        "{}",
        e.message
    );
    assert!(e.message.contains("line 1"), "{}", e.message);
    let e = refuse(Endpoint::Chat, "");
    assert!(e.message.starts_with("invalid JSON body: "));
}

#[test]
fn tools_removed_only_when_degraded() {
    let body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        "tool_choice": "auto",
        "parallel_tool_calls": false,
        "functions": [{"name": "f"}],
        "function_call": "auto",
    });
    let (ask, up) = prep(Endpoint::Chat, body.clone(), false);
    assert!(ask.tools_requested);
    for f in TOOL_FIELDS {
        assert_eq!(up[f], body[f], "{f} passes through in full mode");
    }
    let (ask, up) = prep(Endpoint::Chat, body, true);
    assert!(ask.tools_requested);
    for f in TOOL_FIELDS {
        assert!(up.get(f).is_none(), "{f} removed in degraded mode");
    }
    // Fact-only literal content: the instruction first, at temperature 0.
    assert_eq!(
        up["messages"][0],
        json!({"role": "system", "content": DegradedShape::DEFAULT.instruction})
    );
    assert_eq!(up["messages"][1]["content"], json!("weather?"));
    assert_eq!(up["temperature"], json!(0));
    let completion = json!({"model": "m", "prompt": "p", "temperature": 1.0});
    let (_, up) = prep(Endpoint::Completion, completion, true);
    assert_eq!(
        (&up["prompt"], &up["temperature"]),
        (&json!("p"), &json!(0))
    );
    let silent = Some(DegradedShape { instruction: "" });
    let req = ClientRequest::parse(
        Endpoint::Chat,
        br#"{"model":"m","messages":[{"role":"user","content":"q"}]}"#,
    )
    .expect("parsed");
    let up: Value =
        serde_json::from_slice(&prepare_turn(req, silent).expect("prepared").body).expect("JSON");
    assert_eq!(up["messages"].as_array().map(Vec::len), Some(1), "{up}");

    let (ask, _) = prep(
        Endpoint::Chat,
        json!({"model": "m", "messages": [{}], "tools": []}),
        true,
    );
    assert!(!ask.tools_requested, "an empty tool list requests nothing");
    let (ask, up) = prep(
        Endpoint::Chat,
        json!({"model": "m", "messages": [{}], "tool_choice": "none"}),
        true,
    );
    assert!(ask.tools_requested);
    assert!(up.get("tool_choice").is_none());
}

fn url() -> UpstreamUrl {
    UpstreamUrl::parse("http://127.0.0.1:8000/v1").expect("url")
}

#[test]
fn http_request_post() {
    let mut out = Vec::new();
    write_http_request(
        &mut out,
        &url(),
        "POST",
        CHAT_PATH,
        Some("Bearer sk-abc"),
        Some(br#"{"a":1}"#),
    );
    let text = String::from_utf8(out.clone()).expect("ascii");
    assert_eq!(
        text,
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\nuser-agent: haltd/{}\r\naccept: text/event-stream\r\naccept-encoding: identity\r\nauthorization: Bearer sk-abc\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{{\"a\":1}}",
            env!("CARGO_PKG_VERSION")
        )
    );
    // The head parses as a request with exactly these headers.
    let mut headers = [httparse::EMPTY_HEADER; 16];
    let mut req = httparse::Request::new(&mut headers);
    let n = match req.parse(&out) {
        Ok(httparse::Status::Complete(n)) => n,
        other => panic!("{other:?}"),
    };
    assert_eq!(&out[n..], br#"{"a":1}"#);
}

#[test]
fn http_request_get_with_prefix() {
    let mut out = Vec::new();
    let u = UpstreamUrl::parse("http://[::1]/ollama/v1").expect("url");
    write_http_request(&mut out, &u, "GET", MODELS_PATH, None, None);
    let text = String::from_utf8(out).expect("ascii");
    assert!(
        text.starts_with("GET /ollama/v1/models HTTP/1.1\r\nhost: [::1]\r\n"),
        "{text}"
    );
    assert!(text.contains("accept: application/json\r\n"));
    assert!(!text.contains("authorization"));
    assert!(!text.contains("content-length"));
    // Keep-alive: the upstream pool reuses the connection.
    assert!(!text.contains("connection:"));
    assert!(text.ends_with("accept-encoding: identity\r\n\r\n"));
}

#[test]
fn a_json_post_asks_for_json_once() {
    let mut out = Vec::new();
    let u = UpstreamUrl::parse("https://hooks.example:8443").expect("url");
    let extra = [("accept", "application/json"), ("x-request-id", "r-1")];
    write_http_request_with(
        &mut out,
        &u,
        ("POST", "/hooks/a"),
        None,
        &extra,
        Some(b"{}"),
    );
    let text = String::from_utf8(out).expect("ascii");
    assert_eq!(text.matches("accept: ").count(), 1, "{text}");
    assert!(text.contains("accept: application/json\r\n"), "{text}");
    assert!(text.contains("x-request-id: r-1\r\n"), "{text}");
}

#[test]
fn http_request_never_injects_headers() {
    for bad in [
        "Bearer x\r\nx-injected: 1",
        "Bearer x\nx-injected: 1",
        "Bearer x\r",
        "Bearer \0x",
        "Bearer \u{7f}",
        "Bearer clé",
    ] {
        assert!(!valid_header_value(bad), "{bad:?}");
        let mut out = Vec::new();
        write_http_request(&mut out, &url(), "POST", CHAT_PATH, Some(bad), Some(b"{}"));
        let text = String::from_utf8_lossy(&out);
        assert!(!text.contains("injected"), "{text}");
        assert!(!text.contains("authorization"), "{text}");
    }
    let mut out = Vec::new();
    write_http_request_with(
        &mut out,
        &url(),
        ("POST", CHAT_PATH),
        None,
        &[
            ("x-request-id", "r-1"),
            ("traceparent", "bad\r\ninjected: 1"),
        ],
        Some(b"{}"),
    );
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("\r\nx-request-id: r-1\r\n"), "{text}");
    assert!(!text.contains("injected"), "{text}");
    assert!(valid_header_value("Bearer sk-proj-AZaz09_-.~+/="));
    assert!(valid_header_value("Basic\tabc"));
}

proptest::proptest! {
    #[test]
    fn prepare_never_panics(body in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
        let _ = prepare(Endpoint::Chat, &body, false);
        let _ = prepare(Endpoint::Completion, &body, true);
    }

    #[test]
    fn upstream_body_always_streams_with_logprobs(
        stream in proptest::option::of(proptest::bool::ANY),
        logprobs in proptest::option::of(proptest::bool::ANY),
        top in 0u32..=20,
        clp in proptest::option::of(0u32..=5),
        degraded in proptest::bool::ANY,
    ) {
        let mut chat = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        if let Some(s) = stream { chat["stream"] = json!(s); }
        if let Some(l) = logprobs { chat["logprobs"] = json!(l); }
        if logprobs == Some(true) { chat["top_logprobs"] = json!(top); }
        let (ask, up) = prep(Endpoint::Chat, chat, degraded);
        proptest::prop_assert_eq!(ask.stream, stream.unwrap_or(false));
        proptest::prop_assert_eq!(&up["stream"], &json!(true));
        proptest::prop_assert_eq!(&up["logprobs"], &json!(true));
        proptest::prop_assert_eq!(&up["stream_options"]["include_usage"], &json!(true));

        let mut cmpl = json!({"model": "m", "prompt": "x"});
        if let Some(l) = clp { cmpl["logprobs"] = json!(l); }
        let (ask, up) = prep(Endpoint::Completion, cmpl, degraded);
        proptest::prop_assert_eq!(ask.logprobs, clp.is_some());
        proptest::prop_assert_eq!(&up["logprobs"], &json!(clp.unwrap_or(0).max(1)));
    }
}

/// A passed-through request (`--upstream-surfaces`): its upstream body and path.
fn native(
    endpoint: Endpoint,
    body: &Value,
    degraded: bool,
) -> Result<(Value, &'static str, Ask), HttpError> {
    let req = ClientRequest::parse_native(endpoint, body.to_string().as_bytes())?;
    let up = prepare_turn(req, shape(degraded))?;
    let sent = serde_json::from_slice(&up.body).expect("upstream body is JSON");
    Ok((sent, up.api_path(), up.ask))
}

#[test]
fn a_passed_through_request_goes_as_it_came_to_its_own_path() {
    let body = json!({"model": "m", "input": [{"role": "user", "content": "hi"}],
        "instructions": "Be brief.", "store": true, "max_output_tokens": 9,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "metadata": {"k": "v"}, "temperature": 0.5});
    let (sent, path, ask) = native(Endpoint::Responses, &body, false).expect("passed");
    assert_eq!(path, native::RESPONSES_PATH);
    let mut want = body.clone();
    want["stream"] = json!(true);
    want["top_logprobs"] = json!(1);
    want["include"] = json!([native::RESPONSES_LOGPROBS_INCLUDE]);
    assert_eq!(sent, want);
    assert_eq!((ask.endpoint, ask.stream), (Endpoint::Responses, false));
    let body = json!({"model": "m", "max_tokens": 5, "stream": true, "system": "s",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"}});
    let (sent, path, ask) = native(Endpoint::Messages, &body, true).expect("passed");
    assert_eq!(path, native::MESSAGES_PATH);
    assert_eq!(
        sent,
        json!({"model": "m", "max_tokens": 5, "stream": true,
            "system": format!("s\n\n{}", DegradedShape::DEFAULT.instruction),
            "messages": [{"role": "user", "content": "hi"}], "temperature": 0}),
        "degraded: no tools, the instruction after the request's own, temperature 0"
    );
    assert!(ask.stream);
}

#[test]
fn a_passed_through_request_is_checked_as_its_translation() {
    for (endpoint, body, field) in [
        (
            Endpoint::Responses,
            json!({"model": "m", "input": "hi", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (Endpoint::Responses, json!({"input": "hi"}), "model"),
        (
            Endpoint::Messages,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            "max_tokens",
        ),
    ] {
        let e = native(endpoint, &body, false).expect_err("refused");
        assert_eq!(e.status, 400, "{body}");
        assert!(e.message.contains(field), "{body}: {}", e.message);
    }
    // Chat and completions have nothing to pass through: shaped as always.
    let req = ClientRequest::parse_native(
        Endpoint::Chat,
        br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
    )
    .expect("parsed");
    assert!(req.native().is_none());
    let up = prepare_turn(req, None).expect("prepared");
    assert_eq!((up.native, up.api_path()), (None, CHAT_PATH));
}
