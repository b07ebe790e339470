//! Client requests: the head as `dataplane/conn/request.rs` parses it on every read, and the body
//! as it routes it (the built-in source's view, the proxy's, SafetyCheck's inputs).

use crate::{
    credential::Credential,
    identity::NodeSecret,
    upstream,
    wire::{
        encode::MAX_TOP_LOGPROBS,
        http::{self, HttpError, RequestHead, MAX_HEAD_BYTES},
        request::MAX_MAX_TOKENS,
        ClientRequest, Endpoint,
    },
};

/// `--max-body-bytes`' default.
const MAX_BODY: usize = 1 << 20;
/// The header the identity runs name (`--identity-header`).
const IDENTITY_HEADER: &str = "x-user";
/// The model the built-in source serves.
const MODEL: &str = "builtin";

/// Statuses a refused request may get from the head and body parsers.
const REFUSALS: &[u16] = &[400, 404, 411, 413, 417, 431, 505];

fn check_refusal(e: &HttpError, what: &str) {
    assert!(
        REFUSALS.contains(&e.status),
        "{what}: unexpected status {e:?}"
    );
    assert_ne!(http::reason(e.status), "Unknown", "{what}: {e:?}");
    assert!(!e.message.is_empty(), "{what}: {e:?}");
}

/// A request's bytes as they arrive: the head, parsed on each read until it is complete
/// (with and without `--identity-header`), then the body routed as the data plane routes it.
///
/// Checks: a complete head lies within the bytes and the limits (16 KiB head, the body
/// limit); no earlier read of its bytes is refused or complete (the answer does not depend
/// on how the client's bytes were cut); the head alone parses to the same head; every
/// refusal has a status the data plane answers with; a bearer token's spellings that differ
/// only in the scheme's case and whitespace are one credential, another namespace than a
/// header value with its bytes.
pub fn request_head(data: &[u8]) {
    for identity in [None, Some(IDENTITY_HEADER)] {
        let head = match http::parse_head_with(data, MAX_BODY, identity) {
            Ok(Some(h)) => h,
            Ok(None) => {
                assert!(
                    data.len() <= MAX_HEAD_BYTES,
                    "an incomplete head over the limit"
                );
                continue;
            }
            Err(e) => {
                check_refusal(&e, "head");
                continue;
            }
        };
        check_head(data, &head, identity);
        let body = &data[head.head_len..];
        if body.len() == head.content_length {
            route(&head, body);
        }
    }
}

fn check_head(data: &[u8], head: &RequestHead, identity: Option<&str>) {
    assert!(
        head.head_len <= data.len() && head.head_len <= MAX_HEAD_BYTES,
        "{head:?}"
    );
    assert!(head.content_length <= MAX_BODY, "{head:?}");
    assert!(
        data[..head.head_len].ends_with(b"\n"),
        "a head ends with its blank line"
    );
    let mut arrived = 0;
    for piece in super::pieces(&data[..head.head_len]) {
        arrived += piece.len();
        if arrived < head.head_len {
            let early = http::parse_head_with(&data[..arrived], MAX_BODY, identity);
            assert!(
                matches!(early, Ok(None)),
                "the first {arrived} bytes of a valid head gave {early:?}"
            );
        }
    }
    let alone = http::parse_head_with(&data[..head.head_len], MAX_BODY, identity)
        .expect("the head alone parses")
        .expect("the head alone is complete");
    assert_eq!(
        (
            alone.head_len,
            alone.content_length,
            &alone.method,
            &alone.path
        ),
        (head.head_len, head.content_length, &head.method, &head.path)
    );
    assert_eq!(alone.credential(), head.credential());
    if let Credential::Bearer(token) = head.credential() {
        // The one credential rule (`credential.rs`): the scheme's case and the whitespace
        // around the token fold, the token does not; x-api-key is the same credential.
        let respelled = format!("  BEARER \t {token} ");
        assert_eq!(
            crate::credential::bearer(Some(respelled.trim()), Some(token)),
            Ok(Some(token)),
            "{respelled:?} and x-api-key are the bearer token"
        );
        let secret = NodeSecret::from_bytes([7; 32]);
        assert_ne!(
            secret.key_id(Credential::Bearer(token)),
            secret.key_id(Credential::Header(token)),
            "a header value and a bearer token are two namespaces"
        );
    }
}

/// The body of a complete request, as `Step::route` sends it on.
fn route(head: &RequestHead, body: &[u8]) {
    let path = head.path.split('?').next().unwrap_or_default();
    let endpoint = match path {
        "/v1/chat/completions" => Endpoint::Chat,
        "/v1/completions" => Endpoint::Completion,
        _ => return,
    };
    if head.method == "POST" {
        body_views(endpoint, body, false);
    }
}

/// A request body: the first byte picks the endpoint (bit 0) and degraded mode (bit 1), the
/// rest is the body, parsed once and read by each source as the data plane does.
///
/// Checks: a turn the built-in source accepts asks for 1 to 1,000,000 tokens and at most
/// [`MAX_TOP_LOGPROBS`] alternatives; the proxy's upstream body is a JSON object that
/// streams, without tool fields in degraded mode; every refusal is a 4xx with a message.
pub fn request_body(data: &[u8]) {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let endpoint = if sel & 1 == 0 {
        Endpoint::Chat
    } else {
        Endpoint::Completion
    };
    body_views(endpoint, body, sel & 2 != 0);
}

fn body_views(endpoint: Endpoint, body: &[u8], degraded: bool) {
    let req = match ClientRequest::parse(endpoint, body) {
        Ok(r) => r,
        Err(e) => return check_refusal(&e, "body"),
    };
    match req.builtin_turn(MODEL) {
        Ok(turn) => {
            assert_eq!(turn.ask.endpoint, endpoint);
            assert!((1..=MAX_MAX_TOKENS).contains(&turn.max_tokens), "{turn:?}");
            assert!(turn.ask.top_logprobs <= MAX_TOP_LOGPROBS, "{turn:?}");
        }
        Err(e) => check_refusal(&e, "builtin turn"),
    }
    // The proxy's view (`dataplane/turn.rs`, `prepare_proxied`).
    let _urls = crate::safety::request_sources(req.json());
    let _system = crate::safety::system_prompt(req.json());
    match upstream::prepare_turn(req, degraded.then_some(upstream::DegradedShape::DEFAULT)) {
        Ok(turn) => {
            assert_eq!(turn.ask.endpoint, endpoint);
            assert!(turn.ask.top_logprobs <= MAX_TOP_LOGPROBS, "{:?}", turn.ask);
            let sent: serde_json::Value =
                serde_json::from_slice(&turn.body).expect("the upstream body is JSON");
            let obj = sent.as_object().expect("the upstream body is an object");
            assert_eq!(obj.get("stream"), Some(&serde_json::Value::Bool(true)));
            if degraded {
                for f in upstream::request::TOOL_FIELDS {
                    assert!(!obj.contains_key(f), "degraded mode forwards {f}");
                }
            }
        }
        Err(e) => check_refusal(&e, "proxied turn"),
    }
}
