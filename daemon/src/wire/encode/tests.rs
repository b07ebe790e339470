use super::*;

fn id() -> StreamId {
    StreamId {
        slot: 3,
        generation: 9,
    }
}

fn enc(endpoint: Endpoint, logprobs: bool) -> ChunkEncoder {
    ChunkEncoder {
        stream_id: id(),
        logprobs,
        top_logprobs: 2,
        ..test_encoder(endpoint, "builtin")
    }
}

fn event_json(frame: &[u8]) -> Value {
    let text = std::str::from_utf8(frame).expect("utf8");
    let data = text
        .strip_prefix("data: ")
        .and_then(|t| t.strip_suffix("\n\n"))
        .expect("one SSE event");
    serde_json::from_str(data).expect("valid JSON")
}

#[test]
fn an_annotation_is_a_chunk_without_choices() {
    for endpoint in [Endpoint::Chat, Endpoint::Completion] {
        let mut out = Vec::new();
        let note = serde_json::json!({"revision": "post_hoc", "evidence": [{"claim": "a\"b"}]});
        enc(endpoint, false).annotation_event(&mut out, "haltd_grounding", &note);
        let v = event_json(&out);
        assert_eq!(v["choices"], serde_json::json!([]));
        assert_eq!(v["haltd_grounding"], note);
        assert_eq!(
            v["id"],
            "chatcmpl-hs_0000000900000003".replace(
                "chatcmpl-",
                if endpoint == Endpoint::Chat {
                    "chatcmpl-"
                } else {
                    "cmpl-"
                },
            )
        );
    }
}

#[test]
fn numbers_and_the_chunk_head_are_written_as_fmt_writes_them() {
    for n in [0, 7, 9, 10, 99, 100, 255, 1_700_000_000, u64::MAX] {
        let mut out = Vec::new();
        write_u64(&mut out, n);
        assert_eq!(out, n.to_string().into_bytes());
    }
    let mut out = Vec::new();
    write_bytes(&mut out, "a\u{e9}\0");
    assert_eq!(out, b"[97,195,169,0]");
    for (slot, generation, created) in [
        (0, 0, 0),
        (7, 0xdead_beef, 1_700_000_000),
        (u32::MAX, 1, u64::MAX),
    ] {
        for endpoint in [Endpoint::Chat, Endpoint::Completion] {
            let mut e = enc(endpoint, false);
            e.stream_id = StreamId { slot, generation };
            e.created = created;
            let mut out = Vec::new();
            e.chunk_head(&mut out);
            let object = match endpoint {
                Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                    "chat.completion.chunk"
                }
                Endpoint::Completion => "text_completion",
            };
            let want = format!(
                "{{\"id\":\"{}{}\",\"object\":\"{object}\",\"created\":{created},\"model\":\"builtin\",\"choices\":[",
                e.id_prefix(),
                e.stream_id,
            );
            assert_eq!(String::from_utf8(out).expect("utf8"), want);
        }
    }
}

#[test]
fn chat_token_events_are_valid_openai_chunks() {
    let mut out = Vec::new();
    let top = [(" river", -0.5f32), (" \"sea\"", -1.5)];
    enc(Endpoint::Chat, true).token_event(
        &mut out,
        Token {
            text: " river",
            logprob: -0.5,
            top: &top,
        },
        0,
        true,
        Channel::Content,
    );
    let v = event_json(&out);
    assert_eq!(v["object"], "chat.completion.chunk");
    assert_eq!(v["id"], "chatcmpl-hs_0000000900000003");
    assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(v["choices"][0]["delta"]["content"], " river");
    assert_eq!(v["choices"][0]["logprobs"]["content"][0]["logprob"], -0.5);
    assert_eq!(
        v["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1]["token"],
        " \"sea\""
    );
    assert!(v["choices"][0]["finish_reason"].is_null());
}

#[test]
fn completion_token_events_carry_legacy_logprobs() {
    let mut out = Vec::new();
    let top = [("a", -0.1f32), ("a", -0.2)];
    enc(Endpoint::Completion, true).token_event(
        &mut out,
        Token {
            text: "a",
            logprob: f32::NEG_INFINITY,
            top: &top,
        },
        17,
        false,
        Channel::Content,
    );
    let v = event_json(&out);
    assert_eq!(v["choices"][0]["text"], "a");
    assert_eq!(v["choices"][0]["logprobs"]["token_logprobs"][0], -9999.0);
    assert_eq!(v["choices"][0]["logprobs"]["text_offset"][0], 17);
    assert_eq!(
        v["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .map(|o| o.len()),
        Some(1)
    );
}

#[test]
fn alternatives_longer_than_the_cap_are_cut_and_keys_dedupe_after_the_cut() {
    let long = format!("{}é{}", "x".repeat(MAX_TOKEN_TEXT_BYTES - 1), "tail");
    let other = format!("{}é{}", "x".repeat(MAX_TOKEN_TEXT_BYTES - 1), "other");
    let top = [(long.as_str(), -0.1f32), (other.as_str(), -0.2)];
    let tok = Token {
        text: "x",
        logprob: -0.1,
        top: &top,
    };
    // The cut falls inside `é` (bytes 63..65): it is dropped whole.
    let cut = "x".repeat(MAX_TOKEN_TEXT_BYTES - 1);
    let mut out = Vec::new();
    enc(Endpoint::Chat, true).token_event(&mut out, tok, 0, false, Channel::Content);
    let v = event_json(&out);
    let alts = &v["choices"][0]["logprobs"]["content"][0]["top_logprobs"];
    assert_eq!(alts[0]["token"], cut.as_str());
    assert_eq!(alts[1]["token"], cut.as_str());
    assert_eq!(alts[0]["bytes"].as_array().map(Vec::len), Some(cut.len()));
    out.clear();
    enc(Endpoint::Completion, true).token_event(&mut out, tok, 0, false, Channel::Content);
    let v = event_json(&out);
    let keys = v["choices"][0]["logprobs"]["top_logprobs"][0]
        .as_object()
        .expect("object")
        .clone();
    assert_eq!(keys.len(), 1, "one key after the cut: {keys:?}");
    assert!((keys[cut.as_str()].as_f64().expect("number") + 0.1).abs() < 1e-6);
}

#[test]
fn text_events_carry_null_logprobs_even_when_asked() {
    for endpoint in [Endpoint::Chat, Endpoint::Completion] {
        let mut out = Vec::new();
        enc(endpoint, true).text_event(&mut out, "é", true, Channel::Content);
        let v = event_json(&out);
        assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
        let text = match endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
                &v["choices"][0]["delta"]["content"]
            }
            Endpoint::Completion => &v["choices"][0]["text"],
        };
        assert_eq!(text, "é");
    }
}

#[test]
fn reasoning_frames_write_reasoning_content_and_keep_their_logprobs() {
    let top = [("Let", -0.1f32)];
    let tok = Token {
        text: "Let",
        logprob: -0.1,
        top: &top,
    };
    let mut out = Vec::new();
    enc(Endpoint::Chat, true).token_event(&mut out, tok, 0, true, Channel::Reasoning);
    let v = event_json(&out);
    let delta = &v["choices"][0]["delta"];
    assert_eq!(delta["role"], "assistant");
    assert_eq!(delta["reasoning_content"], "Let");
    assert!(delta.get("content").is_none(), "{v}");
    assert_eq!(v["choices"][0]["logprobs"]["content"][0]["token"], "Let");
    out.clear();
    enc(Endpoint::Chat, true).text_event(&mut out, "é", false, Channel::Reasoning);
    let v = event_json(&out);
    assert_eq!(v["choices"][0]["delta"]["reasoning_content"], "é");
    assert!(v["choices"][0]["delta"].get("content").is_none(), "{v}");
    // A batch message carries the reasoning beside the answer, and leaves it out when
    // there was none.
    let body = |reasoning| {
        let b =
            enc(Endpoint::Chat, false).batch_body(("4", reasoning), &[], &[], "stop", (1, 2), None);
        serde_json::from_slice::<Value>(&b).expect("valid JSON")
    };
    let v = body("2+2 is 4");
    assert_eq!(v["choices"][0]["message"]["content"], "4");
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "2+2 is 4");
    let v = body("");
    assert!(v["choices"][0]["message"]
        .get("reasoning_content")
        .is_none());
}

#[test]
fn tool_call_events_are_openai_deltas() {
    let mut out = Vec::new();
    let e = enc(Endpoint::Chat, false);
    let header = ToolCallDelta {
        index: 1,
        id: Some("call_1"),
        name: Some("get_weather"),
        arguments: "",
    };
    e.tool_call_event(&mut out, header, true);
    let v = event_json(&out);
    let call = &v["choices"][0]["delta"]["tool_calls"][0];
    assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        call,
        &json!({"index": 1, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}})
    );
    assert!(v["choices"][0]["logprobs"].is_null());
    out.clear();
    let piece = ToolCallDelta {
        index: 1,
        id: None,
        name: None,
        arguments: "{\"city\":",
    };
    e.tool_call_event(&mut out, piece, false);
    let v = event_json(&out);
    assert!(v["choices"][0]["delta"].get("role").is_none());
    assert_eq!(
        v["choices"][0]["delta"]["tool_calls"][0],
        json!({"index": 1, "function": {"arguments": "{\"city\":"}})
    );
}
