//! Responses API requests: a `POST /v1/responses` body translated into a chat body
//! (`wire::responses::request::to_chat`), then read as the data plane reads every chat body.

use serde_json::Value;

use crate::wire::responses::request::{to_chat, CODE_PREVIOUS_RESPONSE_NOT_SUPPORTED};

/// A Responses API request body (JSON; other bytes are skipped: the data plane refuses them
/// before translating).
///
/// Checks: a refusal is a 400 with a message, coded `previous_response_not_supported` exactly
/// when the body names a previous response; a translation is a JSON object that the chat path
/// takes whole ([`super::chat_path`]): it parses as a chat request, the built-in source serves
/// it under its model with the same `max_tokens` (or the chat default) and `stream`,
/// SafetyCheck reads its inputs, and the proxy accepts it in both modes (the upstream body a
/// JSON object with `stream: true`, in degraded mode without tool fields).
pub fn responses_request(data: &[u8]) {
    let Ok(body) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let chat = match to_chat(&body) {
        Ok(chat) => chat,
        Err(e) => {
            assert_eq!(e.status, 400, "{e:?}");
            assert!(!e.message.is_empty(), "{e:?}");
            let previous = body
                .get("previous_response_id")
                .is_some_and(|v| !v.is_null());
            assert_eq!(
                e.code == Some(CODE_PREVIOUS_RESPONSE_NOT_SUPPORTED),
                previous,
                "{e:?}"
            );
            return;
        }
    };
    super::chat_path(&chat);
}
