use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::wire::fields::testing::{self, with, Translation};

/// A request with a bit of everything, which translates.
fn full() -> Value {
    json!({
        "model": "m",
        "max_tokens": 16,
        "system": [{"type": "text", "text": "s"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "x"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                {"type": "image", "source": {"type": "url", "url": "https://x.test/i.png"}},
            ]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "u"},
    })
}

/// This surface's translation, for the checks every translated surface shares.
const TRANSLATION: Translation = Translation {
    to_chat,
    fields: FIELDS,
    section: "Messages API requests",
};

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
    let chat = to_chat(&json!({
        "model": "claude-x", "max_tokens": 100,
        "messages": [{"role": "user", "content": "Hello"}],
    }))
    .expect("translated");
    assert_eq!(
        chat,
        json!({
            "model": "claude-x", "max_tokens": 100,
            "messages": [{"role": "user", "content": "Hello"}],
        })
    );
    assert!(to_chat(&full()).is_ok());
}

#[test]
fn system_becomes_the_first_message() {
    let request = |system: Value| {
        let body = with(full(), "/system", system);
        to_chat(&body).expect("translated")["messages"][0].clone()
    };
    assert_eq!(
        request(json!("Be brief.")),
        json!({"role": "system", "content": "Be brief."})
    );
    let blocks = json!([
        {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "two"},
    ]);
    assert_eq!(
        request(blocks),
        json!({"role": "system", "content": "one\ntwo"})
    );
    let without = to_chat(&with(full(), "/system", Value::Null)).expect("translated");
    assert_eq!(without["messages"][0]["role"], "user");
}

#[test]
fn stream_asks_for_usage() {
    let chat = to_chat(&with(full(), "/stream", json!(true))).expect("translated");
    assert_eq!(chat["stream"], true);
    assert_eq!(chat["stream_options"], json!({"include_usage": true}));
    let chat = to_chat(&with(full(), "/stream", json!(false))).expect("translated");
    assert_eq!(chat["stream"], false);
    assert!(chat.get("stream_options").is_none());
    assert!(to_chat(&full())
        .expect("translated")
        .get("stream")
        .is_none());
}

#[test]
fn sampling_fields_and_metadata_translate() {
    let mut body = full();
    for (k, v) in [
        ("stop_sequences", json!(["END", "\n\n"])),
        ("temperature", json!(0.5)),
        ("top_p", json!(0.9)),
        ("top_k", json!(40)),
        ("metadata", json!({"user_id": "user-7"})),
        ("cache_control", json!({"type": "ephemeral"})),
    ] {
        body = with(body, &format!("/{k}"), v);
    }
    let chat = to_chat(&body).expect("translated");
    assert_eq!(chat["stop"], json!(["END", "\n\n"]));
    assert_eq!(
        (&chat["temperature"], &chat["top_p"], &chat["top_k"]),
        (&json!(0.5), &json!(0.9), &json!(40))
    );
    assert_eq!(chat["user"], "user-7");
    for left_out in ["metadata", "cache_control", "thinking", "system"] {
        assert!(chat.get(left_out).is_none(), "{left_out} was sent");
    }
    let chat = to_chat(&with(full(), "/metadata", json!({}))).expect("translated");
    assert!(chat.get("user").is_none());
}

#[test]
fn tools_become_functions() {
    let tools = json!([
        {"name": "weather", "description": "Weather of a city",
         "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
         "cache_control": {"type": "ephemeral"}},
        {"type": "custom", "name": "clock", "input_schema": {"type": "object"}},
    ]);
    let chat = to_chat(&with(full(), "/tools", tools)).expect("translated");
    assert_eq!(
        chat["tools"],
        json!([
            {"type": "function", "function": {
                "name": "weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }},
            {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}},
        ])
    );
}

#[test]
fn tool_choice_translates() {
    let choice = |c: Value| {
        let chat = to_chat(&with(full(), "/tool_choice", c)).expect("translated");
        (
            chat["tool_choice"].clone(),
            chat.get("parallel_tool_calls").cloned(),
        )
    };
    assert_eq!(choice(json!({"type": "auto"})), (json!("auto"), None));
    assert_eq!(choice(json!({"type": "any"})), (json!("required"), None));
    assert_eq!(choice(json!({"type": "none"})), (json!("none"), None));
    assert_eq!(
        choice(json!({"type": "tool", "name": "f", "disable_parallel_tool_use": true})),
        (
            json!({"type": "function", "function": {"name": "f"}}),
            Some(json!(false))
        )
    );
    assert_eq!(
        choice(json!({"type": "any", "disable_parallel_tool_use": false})),
        (json!("required"), None)
    );
}

#[test]
fn a_tool_round_trip_translates_in_chat_order() {
    let body = json!({
        "model": "m", "max_tokens": 64,
        "messages": [
            {"role": "user", "content": "Weather in Oslo and Bergen?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "two calls", "signature": "c2ln"},
                {"type": "redacted_thinking", "data": "ZGF0YQ=="},
                {"type": "text", "text": "Checking "},
                {"type": "text", "text": "both."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Bergen"}},
            ]},
            {"role": "user", "content": [
                {"type": "text", "text": "Thanks."},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 °C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                 "content": [{"type": "text", "text": "timed "}, {"type": "text", "text": "out"}]},
            ]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_3", "name": "weather", "input": {"city": "Bergen"}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
        ],
    });
    let call = |id: &str, city: &str| {
        json!({"id": id, "type": "function", "function": {
            "name": "weather", "arguments": format!("{{\"city\":\"{city}\"}}"),
        }})
    };
    let chat = to_chat(&body).expect("translated");
    assert_eq!(
        chat["messages"],
        json!([
            {"role": "user", "content": "Weather in Oslo and Bergen?"},
            {"role": "assistant", "content": "Checking both.",
             "tool_calls": [call("toolu_1", "Oslo"), call("toolu_2", "Bergen")]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "4 °C"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timed out"},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "", "tool_calls": [call("toolu_3", "Bergen")]},
            {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
        ])
    );
    assert!(chat.get("continue_final_message").is_none());
}

#[test]
fn images_become_image_url_parts() {
    let content = json!([
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://x.test/cat.jpg"},
         "cache_control": {"type": "ephemeral"}},
    ]);
    let body = json!({"model": "m", "max_tokens": 8,
                      "messages": [{"role": "user", "content": content}]});
    let chat = to_chat(&body).expect("translated");
    assert_eq!(
        chat["messages"][0]["content"],
        json!([
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "image_url", "image_url": {"url": "https://x.test/cat.jpg"}},
        ])
    );
}

#[test]
fn a_final_assistant_message_is_a_prefill() {
    let body = json!({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]},
    ]});
    let chat = to_chat(&body).expect("translated");
    assert_eq!(chat["continue_final_message"], true);
    assert_eq!(chat["add_generation_prompt"], false);
    assert_eq!(
        chat["messages"][1],
        json!({"role": "assistant", "content": "The colour is"})
    );
}

#[test]
fn thinking_is_checked_and_not_sent() {
    for thinking in [
        json!({"type": "enabled", "budget_tokens": 2048}),
        json!({"type": "enabled", "budget_tokens": 2048, "display": "omitted"}),
        json!({"type": "adaptive"}),
        json!({"type": "adaptive", "display": "summarized"}),
        json!({"type": "disabled"}),
    ] {
        let chat = to_chat(&with(full(), "/thinking", thinking.clone())).expect("accepted");
        assert!(chat.get("thinking").is_none(), "{thinking}");
    }
    check_refusals(
        r#"
        /thinking | "on" | thinking: must be an object
        /thinking | {} | thinking.type: required
        /thinking | {"type": "on"} | thinking.type: must be "enabled", "adaptive" or "disabled", not "on"
        /thinking | {"type": "enabled"} | thinking.budget_tokens: required
        /thinking | {"type": "enabled", "budget_tokens": 0} | thinking.budget_tokens: must be a positive integer
        /thinking | {"type": "disabled", "budget_tokens": 5} | thinking.budget_tokens: unknown field
        /thinking | {"type": "adaptive", "display": "full"} | thinking.display: must be
        "#,
    );
}

#[test]
fn top_level_refusals_name_the_field() {
    check_refusals(
        r#"
        /model | null | model: required
        /model | 5 | model: must be a string
        /model | "" | model: must not be empty
        /max_tokens | null | max_tokens: required
        /max_tokens | 0 | max_tokens: must be an integer from 1 to 1000000
        /max_tokens | 1000001 | max_tokens: must be an integer from 1 to 1000000
        /max_tokens | 1.5 | max_tokens: must be an integer from 1 to 1000000
        /messages | null | messages: required
        /messages | [] | messages: must not be empty
        /messages | {} | messages: must be an array of messages
        /system | 1 | system: must be a string or an array of text blocks
        /system/0/type | "image" | system[0].type: must be "text", not "image"
        /system/0/text | 1 | system[0].text: must be a string
        /stream | "yes" | stream: must be true or false
        /stop_sequences | "END" | stop_sequences: must be an array of strings
        /stop_sequences | ["a", 1] | stop_sequences[1]: must be a string
        /temperature | "0.5" | temperature: must be a number
        /top_p | true | top_p: must be a number
        /top_k | -1 | top_k: must be a non-negative integer
        /top_k | 2.5 | top_k: must be a non-negative integer
        /metadata | "u" | metadata: must be an object
        /metadata/user_id | 5 | metadata.user_id: must be a string
        /metadata/tags | [] | metadata.tags: unknown field
        /cache_control | true | cache_control: must be an object
        /frequency_penalty | 1 | frequency_penalty: unknown field
        /service_tier | "auto" | service_tier: not supported: haltd has no capacity tiers
        /mcp_servers | [] | mcp_servers: not supported: haltd calls no MCP server
        "#,
    );
    assert_eq!(refusal(&json!([1])), "request body must be a JSON object");
    let long = "k".repeat(500);
    let message = refusal(&with(full(), &format!("/{long}"), json!(1)));
    assert_eq!(message, format!("{}: unknown field", "k".repeat(64)));
}

#[test]
fn message_refusals_name_the_path() {
    check_refusals(
        r#"
        /messages/0 | "hi" | messages[0]: must be an object
        /messages/0/role | "system" | messages[0].role: must be "user" or "assistant", not "system"
        /messages/0/role | null | messages[0].role: required
        /messages/0/content | null | messages[0].content: required
        /messages/0/content | 3 | messages[0].content: must be a string or an array of content blocks
        /messages/0/name | "x" | messages[0].name: unknown field
        /messages/0/content | [{"text": "x"}] | messages[0].content[0].type: required
        /messages/0/content | ["x"] | messages[0].content[0]: must be an object
        /messages/2/content/1/type | "document" | messages[2].content[1].type: "document" blocks are not supported
        /messages/2/content/1/type | "search_result" | messages[2].content[1].type: "search_result" blocks are not supported
        /messages/2/content/1/type | "container_upload" | messages[2].content[1].type: "container_upload" blocks are not supported
        /messages/1/content/0/type | "server_tool_use" | messages[1].content[0].type: "server_tool_use" blocks are not supported
        /messages/1/content/0/type | "web_search_tool_result" | messages[1].content[0].type: "web_search_tool_result" blocks are not supported
        /messages/1/content/0 | {"type": "image"} | messages[1].content[0].type: "image" blocks are only accepted in user messages
        /messages/1/content/0 | {"type": "tool_result"} | messages[1].content[0].type: "tool_result" blocks are only accepted in user messages
        /messages/0/content | [{"type": "tool_use"}] | messages[0].content[0].type: "tool_use" blocks are only accepted in assistant messages
        /messages/0/content | [{"type": "thinking"}] | messages[0].content[0].type: "thinking" blocks are only accepted in assistant messages
        /messages/1/content/0/text | ["x"] | messages[1].content[0].text: must be a string
        /messages/1/content/0/citations | {} | messages[1].content[0].citations: must be an array
        "#,
    );
}

#[test]
fn block_refusals_name_the_path() {
    check_refusals(
        r#"
        /messages/1/content/1/input | "{}" | messages[1].content[1].input: must be an object
        /messages/1/content/1/id | null | messages[1].content[1].id: required
        /messages/1/content/1/name | 1 | messages[1].content[1].name: must be a string
        /messages/1/content/1/caller | {} | messages[1].content[1].caller: unknown field
        /messages/2/content/0/tool_use_id | null | messages[2].content[0].tool_use_id: required
        /messages/2/content/0/content | [{"type": "image"}] | messages[2].content[0].content[0].type: must be "text", not "image"
        /messages/2/content/0/content | {} | messages[2].content[0].content: must be a string or an array of text blocks
        /messages/2/content/0/is_error | "yes" | messages[2].content[0].is_error: must be true or false
        /messages/2/content/0/cache_control | "ephemeral" | messages[2].content[0].cache_control: must be an object
        /messages/2/content/1/source | null | messages[2].content[1].source: required
        /messages/2/content/1/source | "https://x.test/i.png" | messages[2].content[1].source: must be an object
        /messages/2/content/1/source/type | "file" | messages[2].content[1].source.type: "file" image sources are not supported
        /messages/2/content/1/source/url | 1 | messages[2].content[1].source.url: must be a string
        /messages/2/content/1/source | {"type": "base64", "media_type": "image/svg+xml", "data": "AA=="} | messages[2].content[1].source.media_type: must be one of image/jpeg, image/png, image/gif, image/webp
        /messages/2/content/1/source | {"type": "base64", "media_type": "image/png"} | messages[2].content[1].source.data: required
        /messages/2/content/1/source | {"type": "url", "url": "u", "detail": "high"} | messages[2].content[1].source.detail: unknown field
        "#,
    );
}

#[test]
fn tool_refusals_name_the_path() {
    check_refusals(
        r#"
        /tools | {} | tools: must be an array of tools
        /tools/0 | "f" | tools[0]: must be an object
        /tools/0/type | "web_search_20250305" | tools[0].type: "web_search_20250305" is an Anthropic server tool; haltd serves client tools ("custom") only
        /tools/0/type | "bash_20250124" | tools[0].type: "bash_20250124" is an Anthropic server tool
        /tools/0/type | "computer_20250124" | tools[0].type: "computer_20250124" is an Anthropic server tool
        /tools/0/type | 7 | tools[0].type: must be a string
        /tools/0/name | null | tools[0].name: required
        /tools/0/input_schema | null | tools[0].input_schema: required
        /tools/0/input_schema | "object" | tools[0].input_schema: must be an object
        /tools/0/description | 1 | tools[0].description: must be a string
        /tools/0/strict | true | tools[0].strict: unknown field
        /tool_choice | "auto" | tool_choice: must be an object
        /tool_choice/type | "some" | tool_choice.type: must be "auto", "any", "tool" or "none", not "some"
        /tool_choice | {"type": "tool"} | tool_choice.name: required
        /tool_choice | {"type": "none", "disable_parallel_tool_use": true} | tool_choice.disable_parallel_tool_use: unknown field
        /tool_choice/disable_parallel_tool_use | 1 | tool_choice.disable_parallel_tool_use: must be true or false
        "#,
    );
}

/// A value of each top-level field that is accepted when the field is.
fn sample(name: &str) -> Value {
    match name {
        "model" => json!("m"),
        "max_tokens" => json!(1),
        "messages" => json!([{"role": "user", "content": "x"}]),
        "system" | "service_tier" | "container" | "inference_geo" => json!("x"),
        "stream" => json!(true),
        "stop_sequences" | "tools" | "mcp_servers" => json!([]),
        "temperature" | "top_p" | "top_k" => json!(1),
        "thinking" => json!({"type": "disabled"}),
        "tool_choice" => json!({"type": "auto"}),
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

/// Names the translation reads, so that generated objects sometimes get past the checks.
const WORDS: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stream",
    "role",
    "content",
    "type",
    "text",
    "user",
    "assistant",
    "image",
    "source",
    "base64",
    "url",
    "media_type",
    "data",
    "image/png",
    "tool_use",
    "tool_result",
    "tool_use_id",
    "id",
    "name",
    "input",
    "is_error",
    "thinking",
    "tools",
    "input_schema",
    "tool_choice",
    "auto",
    "any",
    "tool",
    "none",
    "custom",
    "enabled",
    "budget_tokens",
    "disabled",
    "metadata",
    "user_id",
    "cache_control",
    "service_tier",
];

fn word() -> impl Strategy<Value = String> {
    testing::word(WORDS)
}

fn any_json() -> impl Strategy<Value = Value> {
    testing::any_json(WORDS)
}

fn check_chat(chat: &Value) -> Result<(), TestCaseError> {
    testing::check_chat(chat, true)
}

fn check_refusal(body: &Value, e: &HttpError) -> Result<(), TestCaseError> {
    TRANSLATION.check_refusal(body, e)?;
    Ok(())
}

proptest! {
    #[test]
    fn arbitrary_json_never_panics(body in any_json()) {
        match to_chat(&body) {
            Ok(chat) => check_chat(&chat)?,
            Err(e) => check_refusal(&body, &e)?,
        }
    }

    /// The full request with one value replaced by arbitrary JSON.
    #[test]
    fn a_request_with_one_value_changed_never_panics(
        at in proptest::sample::select(&[
            "/model", "/max_tokens", "/system", "/system/0", "/messages/0", "/messages/1/content",
            "/messages/1/content/1", "/messages/2/content/0", "/messages/2/content/1/source",
            "/tools/0", "/tool_choice", "/thinking", "/metadata", "/stream", "/top_k",
        ][..]),
        v in any_json(),
    ) {
        let body = with(full(), at, v);
        match to_chat(&body) {
            Ok(chat) => check_chat(&chat)?,
            Err(e) => check_refusal(&body, &e)?,
        }
    }
}

fn user_block() -> impl Strategy<Value = Value> {
    prop_oneof![
        "\\PC{0,8}".prop_map(|t| json!({"type": "text", "text": t})),
        Just(json!({"type": "image", "source":
            {"type": "base64", "media_type": "image/gif", "data": "R0lGODdh"}})),
        (word(), any::<bool>()).prop_map(|(id, e)| json!({"type": "tool_result",
            "tool_use_id": id, "is_error": e, "content": [{"type": "text", "text": "r"}]})),
    ]
}

fn assistant_block() -> impl Strategy<Value = Value> {
    prop_oneof![
        "\\PC{0,8}".prop_map(|t| json!({"type": "text", "text": t})),
        (word(), word()).prop_map(|(id, arg)| json!({"type": "tool_use", "id": id,
            "name": "f", "input": {"arg": arg}})),
        Just(json!({"type": "thinking", "thinking": "t", "signature": "s"})),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    let blocks = |b| proptest::collection::vec(b, 0..4);
    prop_oneof![
        "\\PC{0,8}".prop_map(|t| json!({"role": "user", "content": t})),
        blocks(user_block().boxed()).prop_map(|b| json!({"role": "user", "content": b})),
        blocks(assistant_block().boxed()).prop_map(|b| json!({"role": "assistant", "content": b})),
    ]
}

/// The blocks of `messages` of type `kind`.
fn blocks_of(messages: &[Value], kind: &str) -> usize {
    let blocks = messages
        .iter()
        .filter_map(|m| m["content"].as_array())
        .flatten();
    blocks.filter(|b| b["type"] == kind).count()
}

proptest! {
    /// Well-formed conversations translate, each call and result kept, each assistant
    /// message one chat message.
    #[test]
    fn conversations_translate(messages in proptest::collection::vec(message(), 1..6)) {
        let body = json!({"model": "m", "max_tokens": 5, "messages": messages});
        let chat = to_chat(&body).map_err(|e| TestCaseError::fail(e.message))?;
        check_chat(&chat)?;
        let out = chat["messages"].as_array().expect("messages");
        let with_role = |list: &[Value], role: &str| list.iter().filter(|m| m["role"] == role).count();
        let calls: usize = out.iter().filter_map(|m| m["tool_calls"].as_array()).map(Vec::len).sum();
        prop_assert_eq!(calls, blocks_of(&messages, "tool_use"));
        prop_assert_eq!(with_role(out, "tool"), blocks_of(&messages, "tool_result"));
        prop_assert_eq!(with_role(out, "assistant"), with_role(&messages, "assistant"));
        let prefill = messages.last().is_some_and(|m| m["role"] == "assistant");
        prop_assert_eq!(chat.get("continue_final_message").is_some(), prefill);
    }
}
