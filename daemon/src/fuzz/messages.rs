//! Messages API requests: a `POST /v1/messages` body translated into a chat body
//! (`wire::messages::request::to_chat`), then read as the data plane reads every chat body.

use serde_json::Value;

use crate::wire::messages::request::to_chat;

/// A Messages API request body (JSON; other bytes are skipped: the data plane refuses them
/// before translating).
///
/// Checks: a refusal is a 400 with a message; a translation carries `max_tokens` and is a
/// JSON object that the chat path takes whole ([`super::chat_path`]): it parses as a chat
/// request, the built-in source serves it under its model with the same `max_tokens` (1 to
/// 1,000,000) and `stream`, SafetyCheck reads its inputs, and the proxy accepts it in both
/// modes (the upstream body a JSON object with `stream: true`, in degraded mode without tool
/// fields).
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
    // The Messages API requires `max_tokens`, so every translation carries it.
    assert!(chat["max_tokens"].is_u64(), "{chat}");
    super::chat_path(&chat);
}
