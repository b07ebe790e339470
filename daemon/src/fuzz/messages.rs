//! Messages API requests: a `POST /v1/messages` body translated into a chat body
//! (`wire::messages::request::to_chat`), then read as the data plane reads every chat body.

use serde_json::Value;

use crate::{
    upstream,
    wire::{messages::request::to_chat, request::MAX_MAX_TOKENS, ClientRequest, Endpoint},
};

/// A Messages API request body (JSON; other bytes are skipped: the data plane refuses them
/// before translating).
///
/// Checks: a refusal is a 400 with a message; a translation is a JSON object that the chat path
/// takes whole: it parses as a chat request, the built-in source serves it under its model
/// with the same `max_tokens` (1 to 1,000,000) and `stream`, SafetyCheck reads its inputs, and
/// the proxy accepts it in both modes (the upstream body a JSON object with `stream: true`, in
/// degraded mode without tool fields).
pub fn messages_request(data: &[u8]) {
    let Ok(body) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let chat = match to_chat(&body) {
        Ok(chat) => chat,
        Err(e) => {
            assert_eq!(e.status, 400, "{e:?}");
            assert!(!e.message.is_empty(), "{e:?}");
            return;
        }
    };
    assert!(chat.is_object(), "{chat}");
    let model = chat["model"].as_str().expect("a model").to_owned();
    let bytes = serde_json::to_vec(&chat).expect("a JSON value serialises");
    let req = ClientRequest::parse(Endpoint::Chat, &bytes).expect("the chat body parses");
    let turn = req
        .builtin_turn(&model)
        .unwrap_or_else(|e| panic!("the built-in source refused {chat}: {e:?}"));
    assert_eq!(
        Some(u64::from(turn.max_tokens)),
        chat["max_tokens"].as_u64()
    );
    assert!((1..=MAX_MAX_TOKENS).contains(&turn.max_tokens));
    assert_eq!(turn.ask.stream, chat["stream"] == true);
    let _urls = crate::safety::request_sources(req.json());
    let _system = crate::safety::system_prompt(req.json());
    for degraded in [false, true] {
        let turn = upstream::prepare_turn(req.clone(), degraded)
            .unwrap_or_else(|e| panic!("the proxy refused {chat}: {e:?}"));
        let sent: Value = serde_json::from_slice(&turn.body).expect("the upstream body is JSON");
        let obj = sent.as_object().expect("the upstream body is an object");
        assert_eq!(obj.get("stream"), Some(&Value::Bool(true)));
        if degraded {
            for f in upstream::request::TOOL_FIELDS {
                assert!(!obj.contains_key(f), "degraded mode forwards {f}");
            }
        }
    }
}
