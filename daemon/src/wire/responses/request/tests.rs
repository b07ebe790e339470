use serde_json::{json, Value};

use super::*;
use crate::wire::fields::testing::{self, with, Translation};

/// A request with a bit of everything, which translates. Its input items, by index: a user
/// message, reasoning, an assistant message, a function call, its output, a user message of
/// parts.
fn full() -> Value {
    json!({
        "model": "m",
        "instructions": "s",
        "max_output_tokens": 16,
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "x", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"role": "user", "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": "https://x.test/i.png", "detail": "auto"},
            ]},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
        "tool_choice": "auto",
        "reasoning": {"effort": "low", "summary": "auto"},
        "include": [],
        "store": false,
        "metadata": {"k": "v"},
    })
}

/// This surface's translation, for the checks every translated surface shares.
const TRANSLATION: Translation = Translation {
    to_chat,
    fields: FIELDS,
    section: "Responses API requests",
};

fn translated(body: &Value) -> Value {
    to_chat(body).unwrap_or_else(|e| panic!("{body}: {e:?}"))
}

fn refusal(body: &Value) -> String {
    TRANSLATION.refusal(body)
}

/// Each line of `table`: the JSON pointer of the value set in [`full`], the value (JSON), and
/// how the refusal's message starts, separated by ` | `.
fn check_refusals(table: &str) {
    TRANSLATION.check_refusals(&full(), table);
}

#[test]
fn a_text_request_translates_to_a_chat_request() {
    let chat = translated(&json!({"model": "gpt-x", "input": "Hello"}));
    assert_eq!(
        chat,
        json!({"model": "gpt-x", "messages": [{"role": "user", "content": "Hello"}]})
    );
    let chat = translated(&full());
    assert_eq!(chat["max_tokens"], 16);
    assert_eq!(chat["reasoning_effort"], "low");
    for left_out in [
        "input",
        "instructions",
        "include",
        "store",
        "metadata",
        "reasoning",
    ] {
        assert!(chat.get(left_out).is_none(), "{left_out} was sent");
    }
}

#[test]
fn instructions_become_the_first_message() {
    let chat = translated(&with(full(), "/instructions", json!("Be brief.")));
    assert_eq!(
        chat["messages"][0],
        json!({"role": "system", "content": "Be brief."})
    );
    let chat = translated(&with(full(), "/instructions", Value::Null));
    assert_eq!(
        chat["messages"][0],
        json!({"role": "user", "content": "hi"})
    );
    let body = json!({"model": "m", "instructions": "a", "input": [
        {"role": "developer", "content": "b"},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "c"}]},
        {"role": "user", "content": "d"},
    ]});
    assert_eq!(
        translated(&body)["messages"],
        json!([
            {"role": "system", "content": "a"},
            {"role": "system", "content": "b"},
            {"role": "system", "content": "c"},
            {"role": "user", "content": "d"},
        ])
    );
}

#[test]
fn stream_asks_for_usage() {
    let chat = translated(&with(full(), "/stream", json!(true)));
    assert_eq!(chat["stream"], true);
    assert_eq!(chat["stream_options"], json!({"include_usage": true}));
    let body = with(
        full(),
        "/stream_options",
        json!({"include_obfuscation": false}),
    );
    let chat = translated(&with(body, "/stream", json!(true)));
    assert_eq!(chat["stream_options"], json!({"include_usage": true}));
    let chat = translated(&with(full(), "/stream", json!(false)));
    assert_eq!(chat["stream"], false);
    assert!(chat.get("stream_options").is_none());
    assert!(translated(&full()).get("stream").is_none());
}

#[test]
fn sampling_fields_and_the_user_translate() {
    let mut body = full();
    for (k, v) in [
        ("temperature", json!(0.5)),
        ("top_p", json!(0.9)),
        ("user", json!("user-7")),
        ("parallel_tool_calls", json!(false)),
        ("max_output_tokens", json!(1_000_000)),
    ] {
        body = with(body, &format!("/{k}"), v);
    }
    let chat = translated(&body);
    assert_eq!(
        (&chat["temperature"], &chat["top_p"], &chat["user"]),
        (&json!(0.5), &json!(0.9), &json!("user-7"))
    );
    assert_eq!(chat["parallel_tool_calls"], false);
    assert_eq!(chat["max_tokens"], 1_000_000);
    let chat = translated(&with(full(), "/max_output_tokens", Value::Null));
    assert!(chat.get("max_tokens").is_none());
}

#[test]
fn accepted_fields_are_checked_and_not_sent() {
    let mut body = full();
    for (k, v) in [
        ("store", json!(true)),
        ("truncation", json!("disabled")),
        ("background", json!(false)),
        ("max_tool_calls", json!(3)),
        ("safety_identifier", json!("h1")),
        ("prompt_cache_key", json!("k")),
        ("prompt_cache_retention", json!("24h")),
        (
            "prompt_cache_options",
            json!({"mode": "explicit", "ttl": "30m"}),
        ),
        ("stream_options", json!({"include_obfuscation": true})),
        (
            "metadata",
            json!((0..16)
                .map(|i| (format!("k{i}"), json!("v".repeat(512))))
                .collect::<serde_json::Map<_, _>>()),
        ),
    ] {
        body = with(body, &format!("/{k}"), v);
    }
    let chat = translated(&body);
    for (name, rule) in FIELDS {
        if matches!(rule, FieldRule::Accepted(_)) {
            assert!(chat.get(*name).is_none(), "{name} was sent");
        }
    }
    assert!(chat.get("stream_options").is_none());
}

#[test]
fn logprobs_follow_include() {
    let logprobs = |include: Value, top: Value| {
        let body = with(with(full(), "/include", include), "/top_logprobs", top);
        let chat = translated(&body);
        (
            chat.get("logprobs").cloned(),
            chat.get("top_logprobs").cloned(),
        )
    };
    let asked = json!(["message.output_text.logprobs"]);
    assert_eq!(
        logprobs(asked.clone(), json!(5)),
        (Some(json!(true)), Some(json!(5)))
    );
    assert_eq!(logprobs(asked, Value::Null), (Some(json!(true)), None));
    // Without the include, nothing comes back, so nothing is asked for.
    assert_eq!(logprobs(json!([]), json!(5)), (None, None));
    let harmless = json!([
        "reasoning.encrypted_content",
        "message.input_image.image_url"
    ]);
    assert_eq!(logprobs(harmless, json!(0)), (None, None));
}

#[test]
fn tools_become_functions() {
    let tools = json!([
        {"type": "function", "name": "weather", "description": "Weather of a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
         "strict": true},
        {"type": "function", "name": "clock", "parameters": null, "strict": null,
         "description": null, "defer_loading": false, "allowed_callers": ["direct"]},
    ]);
    let chat = translated(&with(full(), "/tools", tools));
    assert_eq!(
        chat["tools"],
        json!([
            {"type": "function", "function": {
                "name": "weather", "description": "Weather of a city", "strict": true,
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }},
            {"type": "function", "function": {"name": "clock"}},
        ])
    );
}

#[test]
fn tool_choice_translates() {
    let choice = |c: Value| translated(&with(full(), "/tool_choice", c))["tool_choice"].clone();
    for mode in ["auto", "none", "required"] {
        assert_eq!(choice(json!(mode)), json!(mode));
    }
    assert_eq!(
        choice(json!({"type": "function", "name": "f"})),
        json!({"type": "function", "function": {"name": "f"}})
    );
}

#[test]
fn text_format_becomes_response_format() {
    let format = |f: Value| {
        let chat = translated(&with(
            full(),
            "/text",
            json!({"format": f, "verbosity": "medium"}),
        ));
        chat.get("response_format").cloned()
    };
    assert_eq!(format(json!({"type": "text"})), None);
    assert_eq!(
        format(json!({"type": "json_object"})),
        Some(json!({"type": "json_object"}))
    );
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    assert_eq!(
        format(
            json!({"type": "json_schema", "name": "out", "schema": schema,
                      "description": "d", "strict": true})
        ),
        Some(json!({"type": "json_schema", "json_schema": {
            "name": "out", "schema": schema, "description": "d", "strict": true,
        }}))
    );
    assert!(translated(&with(full(), "/text", json!({})))
        .get("response_format")
        .is_none());
}

#[test]
fn reasoning_effort_translates_and_the_rest_is_checked() {
    let effort = |r: Value| {
        translated(&with(full(), "/reasoning", r))
            .get("reasoning_effort")
            .cloned()
    };
    for e in EFFORTS {
        assert_eq!(effort(json!({"effort": e})), Some(json!(e)));
    }
    assert_eq!(
        effort(json!({"summary": "detailed", "generate_summary": "concise",
                      "context": "auto", "mode": "standard"})),
        None
    );
    check_refusals(
        r#"
        /reasoning | "high" | reasoning: must be an object
        /reasoning | {"effort": "extreme"} | reasoning.effort: must be "none", "minimal", "low", "medium", "high", "xhigh" or "max", not "extreme"
        /reasoning | {"summary": "long"} | reasoning.summary: must be "auto", "concise" or "detailed", not "long"
        /reasoning | {"context": "all_turns"} | reasoning.context: "all_turns" is not supported: haltd sends no earlier reasoning
        /reasoning | {"mode": "pro"} | reasoning.mode: "pro" is not supported
        /reasoning | {"budget_tokens": 5} | reasoning.budget_tokens: unknown field
        "#,
    );
}

#[test]
fn a_tool_round_trip_translates_in_chat_order() {
    let body = json!({
        "model": "m",
        "input": [
            {"role": "user", "content": "Weather in Oslo and Bergen?"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "two calls"}],
             "encrypted_content": "ZW5j"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Checking ", "annotations": []},
                {"type": "output_text", "text": "both.", "annotations": [], "logprobs": []},
            ]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather",
             "arguments": "{\"city\":\"Oslo\"}", "status": "completed"},
            {"type": "reasoning", "id": "rs_2", "summary": []},
            {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "weather",
             "arguments": "{\"city\":\"Bergen\"}", "caller": {"type": "direct"}},
            {"type": "function_call_output", "call_id": "call_1", "output": "4 °C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [
                {"type": "input_text", "text": "timed "}, {"type": "input_text", "text": "out"},
            ]},
            {"type": "function_call", "call_id": "call_3", "name": "weather",
             "arguments": "{\"city\":\"Bergen\"}"},
            {"type": "function_call_output", "call_id": "call_3", "output": ""},
            {"type": "message", "role": "assistant", "phase": "final_answer",
             "content": [{"type": "refusal", "refusal": "No more."}]},
            {"role": "user", "content": "Thanks."},
        ],
    });
    let call = |id: &str, city: &str| {
        json!({"id": id, "type": "function", "function": {
            "name": "weather", "arguments": format!("{{\"city\":\"{city}\"}}"),
        }})
    };
    let chat = translated(&body);
    assert_eq!(
        chat["messages"],
        json!([
            {"role": "user", "content": "Weather in Oslo and Bergen?"},
            {"role": "assistant", "content": "Checking both.",
             "tool_calls": [call("call_1", "Oslo"), call("call_2", "Bergen")]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 °C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "timed out"},
            {"role": "assistant", "content": "", "tool_calls": [call("call_3", "Bergen")]},
            {"role": "tool", "tool_call_id": "call_3", "content": ""},
            {"role": "assistant", "content": "No more."},
            {"role": "user", "content": "Thanks."},
        ])
    );
    assert!(chat.get("continue_final_message").is_none());
}

#[test]
fn images_become_image_url_parts() {
    let content = json!([
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"},
        {"type": "input_image", "image_url": "https://x.test/cat.jpg",
         "prompt_cache_breakpoint": {"mode": "explicit"}},
    ]);
    let body = json!({"model": "m", "input": [{"role": "user", "content": content}]});
    assert_eq!(
        translated(&body)["messages"][0]["content"],
        json!([
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}},
            {"type": "image_url", "image_url": {"url": "https://x.test/cat.jpg"}},
        ])
    );
}

#[test]
fn a_previous_response_is_refused_with_its_code() {
    let e = to_chat(&with(full(), "/previous_response_id", json!("resp_1"))).expect_err("refused");
    assert_eq!(e.status, 400);
    assert_eq!(e.code, Some(CODE_PREVIOUS_RESPONSE_NOT_SUPPORTED));
    assert_eq!(
        e.message,
        "previous_response_id: not supported: haltd keeps no responses; send the whole \
         conversation in `input`"
    );
    // Even when something else is wrong too: the code says what to do first.
    let body = with(full(), "/previous_response_id", json!("resp_1"));
    let e = to_chat(&with(body, "/input", Value::Null)).expect_err("refused");
    assert_eq!(e.code, Some(CODE_PREVIOUS_RESPONSE_NOT_SUPPORTED));
    assert!(to_chat(&with(full(), "/previous_response_id", Value::Null)).is_ok());
    // Other refusals carry no code.
    assert_eq!(
        to_chat(&with(full(), "/conversation", json!("conv_1")))
            .expect_err("refused")
            .code,
        None
    );
}

#[test]
fn top_level_refusals_name_the_field() {
    check_refusals(
        r#"
        /model | null | model: required
        /model | 5 | model: must be a string
        /model | "" | model: must not be empty
        /input | null | input: required
        /input | [] | input: must not be empty
        /input | {} | input: must be a string or an array of input items
        /input | [{"type": "reasoning", "summary": []}] | input: holds no message, function call or function call output
        /instructions | ["s"] | instructions: must be a string
        /max_output_tokens | 0 | max_output_tokens: must be an integer from 1 to 1000000
        /max_output_tokens | 1000001 | max_output_tokens: must be an integer from 1 to 1000000
        /max_output_tokens | 1.5 | max_output_tokens: must be an integer from 1 to 1000000
        /stream | "yes" | stream: must be true or false
        /stream_options | true | stream_options: must be an object
        /stream_options | {"include_usage": true} | stream_options.include_usage: unknown field
        /temperature | "0.5" | temperature: must be a number
        /top_p | true | top_p: must be a number
        /top_logprobs | 21 | top_logprobs: must be an integer from 0 to 20
        /top_logprobs | -1 | top_logprobs: must be an integer from 0 to 20
        /include | "x" | include: must be an array of strings
        /include | [1] | include[0]: must be a string
        /include | ["file_search_call.results"] | include[0]: "file_search_call.results" is the output of a built-in tool, which haltd does not run
        /include | ["reasoning.encrypted_content", "web_search_call.action.sources"] | include[1]: "web_search_call.action.sources" is the output of a built-in tool
        /include | ["everything"] | include[0]: unknown value "everything"
        /parallel_tool_calls | 1 | parallel_tool_calls: must be true or false
        /user | 7 | user: must be a string
        /metadata | "m" | metadata: must be an object
        /metadata | {"k": 1} | metadata.k: must be a string
        /store | "no" | store: must be true or false
        /truncation | "auto" | truncation: "auto" is not supported: haltd does not drop input items
        /truncation | "some" | truncation: must be "auto" or "disabled", not "some"
        /background | true | background: true is not supported: haltd streams or answers in the request that asks
        /background | "no" | background: must be true or false
        /max_tool_calls | -1 | max_tool_calls: must be a non-negative integer
        /safety_identifier | 1 | safety_identifier: must be a string
        /prompt_cache_key | {} | prompt_cache_key: must be a string
        /prompt_cache_retention | "1h" | prompt_cache_retention: must be "in_memory" or "24h", not "1h"
        /prompt_cache_options | {"ttl": "1h"} | prompt_cache_options.ttl: must be "30m", not "1h"
        /prompt_cache_options | {"mode": "auto"} | prompt_cache_options.mode: must be "implicit" or "explicit"
        /prompt_cache_options | {"size": 1} | prompt_cache_options.size: unknown field
        /text | "json" | text: must be an object
        /text | {"verbosity": "low"} | text.verbosity: "low" is not supported: chat backends take no verbosity
        /text | {"verbosity": "loud"} | text.verbosity: must be "low", "medium" or "high", not "loud"
        /text | {"format": {"type": "yaml"}} | text.format.type: must be "text", "json_schema" or "json_object", not "yaml"
        /text | {"format": {"type": "json_schema", "name": "n"}} | text.format.schema: required
        /text | {"format": {"type": "json_schema", "schema": {}}} | text.format.name: required
        /text | {"format": {"type": "json_schema", "name": "n", "schema": []}} | text.format.schema: must be an object
        /text | {"format": {"type": "text", "name": "n"}} | text.format.name: unknown field
        /text | {"type": "text"} | text.type: unknown field
        /seed | 1 | seed: unknown field
        /messages | [] | messages: unknown field
        /conversation | "conv_1" | conversation: not supported: haltd keeps no conversations
        /prompt | {"id": "pmpt_1"} | prompt: not supported: haltd keeps no prompt templates
        /context_management | [] | context_management: not supported: haltd does not compact
        /service_tier | "auto" | service_tier: not supported: haltd has no capacity tiers
        /moderation | {"model": "omni-moderation-latest"} | moderation: not supported: haltd runs no moderation model
        "#,
    );
    assert_eq!(refusal(&json!("hi")), "request body must be a JSON object");
    let message = refusal(&with(full(), "/metadata/k", json!("v".repeat(513))));
    assert_eq!(message, "metadata.k: must be at most 512 characters");
    let key = "k".repeat(65);
    let message = refusal(&with(full(), &format!("/metadata/{key}"), json!("v")));
    assert_eq!(
        message,
        format!(
            "metadata.{}: a key must be at most 64 characters",
            &key[..64]
        )
    );
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    let message = refusal(&with(full(), "/metadata", Value::Object(many)));
    assert_eq!(message, "metadata: must have at most 16 members");
    let long = "k".repeat(500);
    let message = refusal(&with(full(), &format!("/{long}"), json!(1)));
    assert_eq!(message, format!("{}: unknown field", "k".repeat(64)));
}

#[test]
fn input_refusals_name_the_path() {
    check_refusals(
        r#"
        /input/0 | "hi" | input[0]: must be an object
        /input/0 | {"content": "hi"} | input[0].type: required
        /input/0 | {"type": 1} | input[0].type: must be a string
        /input/0/role | "tool" | input[0].role: must be "user", "system", "developer" or "assistant", not "tool"
        /input/0/role | null | input[0].type: required
        /input/0 | {"type": "message", "content": "hi"} | input[0].role: required
        /input/0/content | null | input[0].content: required
        /input/0/content | 3 | input[0].content: must be a string or an array of content parts
        /input/0/name | "x" | input[0].name: unknown field
        /input/2/status | 1 | input[2].status: must be a string
        /input/5/content/0 | "x" | input[5].content[0]: must be an object
        /input/5/content/0 | {"text": "x"} | input[5].content[0].type: required
        /input/5/content/0/type | "output_text" | input[5].content[0].type: "output_text" parts are only accepted in assistant messages
        /input/5/content/0/type | "refusal" | input[5].content[0].type: "refusal" parts are only accepted in assistant messages
        /input/5/content/0/type | "input_file" | input[5].content[0].type: "input_file" parts are not supported
        /input/5/content/0/type | "input_audio" | input[5].content[0].type: "input_audio" parts are not supported
        /input/5/content/0/text | 1 | input[5].content[0].text: must be a string
        /input/5/content/0/prompt_cache_breakpoint | "x" | input[5].content[0].prompt_cache_breakpoint: must be an object
        /input/5/content/1/image_url | null | input[5].content[1].image_url: required
        /input/5/content/1/file_id | "file_1" | input[5].content[1].file_id: not supported: haltd keeps no files
        /input/5/content/1/detail | "original" | input[5].content[1].detail: "original" is not supported
        /input/5/content/1/detail | "max" | input[5].content[1].detail: must be "auto", "low", "high" or "original", not "max"
        /input/5/content/1/url | "u" | input[5].content[1].url: unknown field
        /input/2/role | "developer" | input[2].content[0].type: "output_text" parts are only accepted in assistant messages
        /input/2/content/0/type | "input_text" | input[2].content[0].type: "input_text" parts are only accepted in user, system and developer messages
        /input/2/content/0/type | "input_image" | input[2].content[0].type: "input_image" parts are only accepted in user messages
        /input/2/content/0/annotations | {} | input[2].content[0].annotations: must be an array
        /input/2/content/0/refusal | "no" | input[2].content[0].refusal: unknown field
        /input/3/call_id | null | input[3].call_id: required
        /input/3/name | null | input[3].name: required
        /input/3/arguments | null | input[3].arguments: required
        /input/3/arguments | {} | input[3].arguments: must be a string
        /input/3/namespace | "ns" | input[3].namespace: not supported: haltd serves function tools without namespaces
        /input/3/caller | {"type": "program", "caller_id": "p"} | input[3].caller.type: "program" is not supported: programmatic tool calling runs on OpenAI's servers
        /input/3/caller | {"type": "direct", "x": 1} | input[3].caller.x: unknown field
        /input/3/output | "ok" | input[3].output: unknown field
        /input/4/call_id | 5 | input[4].call_id: must be a string
        /input/4/output | null | input[4].output: required
        /input/4/output | 5 | input[4].output: must be a string or an array of content parts
        /input/4/output | [{"type": "input_image", "image_url": "u"}] | input[4].output[0].type: "input_image" parts are not supported in a function call output
        /input/4/output | [{"type": "input_text"}] | input[4].output[0].text: required
        /input/4/name | 1 | input[4].name: must be a string
        /input/4/arguments | "{}" | input[4].arguments: unknown field
        /input/1/summary | "s" | input[1].summary: must be an array
        /input/1/encrypted_content | 1 | input[1].encrypted_content: must be a string
        /input/1/text | "t" | input[1].text: unknown field
        /input/1 | {"type": "item_reference", "id": "msg_1"} | input[1].type: "item_reference" items are not supported: haltd keeps no items
        /input/1 | {"type": "web_search_call", "id": "ws_1"} | input[1].type: "web_search_call" items are not supported
        /input/1 | {"type": "computer_call_output", "call_id": "c"} | input[1].type: "computer_call_output" items are not supported
        /input/1 | {"type": "custom_tool_call", "call_id": "c"} | input[1].type: "custom_tool_call" items are not supported
        /input/1 | {"type": "mcp_call", "id": "m"} | input[1].type: "mcp_call" items are not supported
        "#,
    );
}

#[test]
fn tool_refusals_name_the_path() {
    check_refusals(
        r#"
        /tools | {} | tools: must be an array of tools
        /tools/0 | "f" | tools[0]: must be an object
        /tools/0/type | null | tools[0].type: required
        /tools/0/type | "web_search" | tools[0].type: "web_search" tools are not supported: haltd serves function tools, which the client runs
        /tools/0/type | "file_search" | tools[0].type: "file_search" tools are not supported
        /tools/0/type | "computer_use_preview" | tools[0].type: "computer_use_preview" tools are not supported
        /tools/0/type | "code_interpreter" | tools[0].type: "code_interpreter" tools are not supported
        /tools/0/type | "mcp" | tools[0].type: "mcp" tools are not supported
        /tools/0/type | "image_generation" | tools[0].type: "image_generation" tools are not supported
        /tools/0/type | "custom" | tools[0].type: "custom" tools are not supported
        /tools/0/name | null | tools[0].name: required
        /tools/0/parameters | "object" | tools[0].parameters: must be an object
        /tools/0/description | 1 | tools[0].description: must be a string
        /tools/0/strict | "yes" | tools[0].strict: must be true or false
        /tools/0/defer_loading | true | tools[0].defer_loading: not supported: deferred tools are loaded by OpenAI's tool search
        /tools/0/allowed_callers | ["programmatic"] | tools[0].allowed_callers[0]: "programmatic" is not supported
        /tools/0/allowed_callers | ["robot"] | tools[0].allowed_callers[0]: must be "direct" or "programmatic", not "robot"
        /tools/0/allowed_callers | "direct" | tools[0].allowed_callers: must be an array of strings
        /tools/0/output_schema | {} | tools[0].output_schema: not supported: a chat function has no schema of its output
        /tools/0/function | {} | tools[0].function: unknown field
        /tool_choice | "any" | tool_choice: must be "auto", "none" or "required", not "any"
        /tool_choice | 1 | tool_choice: must be a string or an object
        /tool_choice | {"name": "f"} | tool_choice.type: required
        /tool_choice | {"type": "function"} | tool_choice.name: required
        /tool_choice | {"type": "function", "name": "f", "x": 1} | tool_choice.x: unknown field
        /tool_choice | {"type": "allowed_tools", "mode": "auto", "tools": []} | tool_choice.type: "allowed_tools" is not supported: send only the allowed tools in `tools`
        /tool_choice | {"type": "file_search"} | tool_choice.type: "file_search" is not supported: haltd serves function tools only
        /tool_choice | {"type": "mcp", "server_label": "s"} | tool_choice.type: "mcp" is not supported
        "#,
    );
}

/// A value of each top-level field that is accepted when the field is.
fn sample(name: &str) -> Value {
    match name {
        "model"
        | "input"
        | "instructions"
        | "user"
        | "safety_identifier"
        | "prompt_cache_key"
        | "previous_response_id"
        | "conversation"
        | "service_tier" => {
            json!("x")
        }
        "max_output_tokens" | "temperature" | "top_p" | "top_logprobs" | "max_tool_calls" => {
            json!(1)
        }
        "stream" | "store" | "parallel_tool_calls" => json!(true),
        "background" => json!(false),
        "truncation" => json!("disabled"),
        "prompt_cache_retention" => json!("in_memory"),
        "tool_choice" => json!("none"),
        "tools" | "include" | "context_management" => json!([]),
        _ => json!({}),
    }
}

#[test]
fn every_field_is_handled_as_its_rule_says() {
    TRANSLATION.check_every_field(&full(), sample);
}

#[test]
fn the_docs_list_every_field_in_order() {
    TRANSLATION.check_documented_fields();
}

#[test]
fn the_documented_example_is_what_haltd_sends() {
    TRANSLATION.check_documented_example();
}

/// A tool's parameters nested so that the client's body is at serde_json's limit become one
/// level deeper under `tools[].function`: refused, so that every translation is a body the
/// chat path could read again from its bytes. One level less translates.
#[test]
fn a_translation_past_the_depth_limit_is_refused() {
    // The body's own nesting: the body, `tools`, the tool, then `parameters` nested `n`.
    let with_parameters = |n: usize| {
        let mut p = json!({});
        for _ in 1..n {
            p = json!({ "a": p });
        }
        let mut body = json!({"model": "m", "input": "hi"});
        body["tools"] = json!([{"type": "function", "name": "f", "parameters": p}]);
        body
    };
    let at_limit = with_parameters(crate::wire::fields::MAX_NESTING - 3);
    let text = at_limit.to_string();
    assert!(
        serde_json::from_str::<Value>(&text).is_ok(),
        "the client's body parses"
    );
    let e = to_chat(&at_limit).expect_err("one level past the limit once translated");
    assert_eq!(e.status, 400);
    assert!(e.message.contains("nests 128 levels deep"), "{}", e.message);
    let chat = to_chat(&with_parameters(crate::wire::fields::MAX_NESTING - 4)).expect("translates");
    serde_json::from_str::<Value>(&chat.to_string()).expect("the chat body parses again");
}

mod props;
