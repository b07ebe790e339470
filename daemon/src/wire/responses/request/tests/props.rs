//! Property tests of the Responses translation: arbitrary JSON, the full request with one
//! value changed, and well-formed conversations of items.

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;

/// Names the translation reads, so that generated objects sometimes get past the checks.
const WORDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "stream",
    "type",
    "message",
    "role",
    "content",
    "user",
    "assistant",
    "system",
    "developer",
    "input_text",
    "output_text",
    "input_image",
    "image_url",
    "refusal",
    "text",
    "function_call",
    "function_call_output",
    "call_id",
    "name",
    "arguments",
    "output",
    "reasoning",
    "summary",
    "effort",
    "tools",
    "function",
    "parameters",
    "strict",
    "tool_choice",
    "auto",
    "required",
    "none",
    "include",
    "message.output_text.logprobs",
    "top_logprobs",
    "format",
    "json_schema",
    "schema",
    "metadata",
    "store",
    "truncation",
    "disabled",
    "background",
    "previous_response_id",
];

fn word() -> impl Strategy<Value = String> {
    testing::word(WORDS)
}

fn any_json() -> impl Strategy<Value = Value> {
    testing::any_json(WORDS)
}

fn check_chat(chat: &Value) -> Result<(), TestCaseError> {
    testing::check_chat(chat, false)
}

fn check_refusal(body: &Value, e: &HttpError) -> Result<(), TestCaseError> {
    TRANSLATION.check_refusal(body, e)?;
    prop_assert_eq!(
        e.code.is_some(),
        body.get("previous_response_id")
            .is_some_and(|v| !v.is_null())
    );
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
            "/model", "/input", "/instructions", "/max_output_tokens", "/input/0", "/input/1",
            "/input/2/content", "/input/2/content/0", "/input/3", "/input/4/output",
            "/input/5/content/1", "/tools/0", "/tool_choice", "/text", "/reasoning", "/include",
            "/metadata", "/stream", "/top_logprobs", "/truncation",
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

fn item() -> impl Strategy<Value = Value> {
    prop_oneof![
        "\\PC{0,8}".prop_map(|t| json!({"role": "user", "content": t})),
        "\\PC{0,8}".prop_map(|t| json!({"type": "message", "role": "developer",
            "content": [{"type": "input_text", "text": t}]})),
        "\\PC{0,8}".prop_map(|t| json!({"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": t, "annotations": []}]})),
        (word(), word()).prop_map(|(id, arg)| json!({"type": "function_call", "call_id": id,
            "name": "f", "arguments": json!({"arg": arg}).to_string()})),
        (word(), "\\PC{0,8}").prop_map(|(id, out)| json!({"type": "function_call_output",
            "call_id": id, "output": out})),
        Just(json!({"type": "reasoning", "id": "rs", "summary": []})),
    ]
}

/// The items of `input` of type `kind`.
fn items_of(input: &[Value], kind: &str) -> usize {
    input.iter().filter(|i| i["type"] == kind).count()
}

proptest! {
    /// Well-formed inputs translate, each call and output kept, in order, and calls join
    /// the assistant message before them.
    #[test]
    fn conversations_translate(input in proptest::collection::vec(item(), 1..8)) {
        let body = json!({"model": "m", "input": input});
        let only_reasoning = input.iter().all(|i| i["type"] == "reasoning");
        let chat = match to_chat(&body) {
            Ok(chat) => chat,
            Err(e) => {
                prop_assert!(only_reasoning, "{}", e.message);
                return Ok(());
            }
        };
        check_chat(&chat)?;
        let out = chat["messages"].as_array().expect("messages");
        let calls: Vec<&Value> = out
            .iter()
            .filter_map(|m| m["tool_calls"].as_array())
            .flatten()
            .collect();
        let sent: Vec<&Value> = input.iter().filter(|i| i["type"] == "function_call").collect();
        prop_assert_eq!(calls.len(), sent.len());
        for (call, item) in calls.iter().zip(&sent) {
            prop_assert_eq!(&call["id"], &item["call_id"]);
            prop_assert_eq!(&call["function"]["arguments"], &item["arguments"]);
        }
        let tools = out.iter().filter(|m| m["role"] == "tool").count();
        prop_assert_eq!(tools, items_of(&input, "function_call_output"));
        // Only reasoning items and calls that joined a message add no message.
        let messages = input.len() - items_of(&input, "reasoning") - sent.len();
        let call_messages = out.iter().filter(|m| m["tool_calls"].is_array() && m["content"] == "").count();
        prop_assert!(out.len() >= messages && out.len() <= messages + call_messages);
    }
}
