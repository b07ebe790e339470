//! Request bodies in: a chat or completion request's body parsed once into a
//! [`ClientRequest`], which every token source takes its view of. The built-in source takes a
//! [`BuiltinTurn`] ([`ClientRequest::builtin_turn`]); the proxy validates what it forwards and
//! writes the upstream body from the same parsed JSON (`crate::upstream::request::prepare_turn`).
//! Both answer the client in kind, from the [`Ask`] their view fills in.
//!
//! Each source keeps its own rules, as documented in `docs/wire-format.md`: the built-in
//! source serves one model and checks the fields it uses by type (serde); the proxy forwards
//! every field the client set and checks only what haltd relies on.

use serde::Deserialize;
use serde_json::Value;

use crate::wire::{encode::MAX_TOP_LOGPROBS, endpoint::Endpoint, http::HttpError};

/// `max_tokens` when a chat request gives none.
pub const DEFAULT_CHAT_MAX_TOKENS: u32 = 256;
/// `max_tokens` when a completion request gives none (the OpenAI default).
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;
pub use crate::wire::endpoint::MAX_MAX_TOKENS;

/// A client's chat or completion request: the endpoint it came in on and its body, parsed
/// once. Every token source takes its view of it; nothing parses the body again.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientRequest {
    pub endpoint: Endpoint,
    json: Value,
    /// The body as the client sent it, kept when its surface is passed through to a backend
    /// that serves it natively (`--upstream-surfaces`, `crate::upstream::native`): that is
    /// what goes upstream, while `json` (the translation) is what haltd reads.
    native: Option<Value>,
}

/// What the client asked for, so that whichever source serves the turn answers in kind:
/// logprobs only when asked, usage only when asked, a batch body for `stream: false`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub endpoint: Endpoint,
    pub stream: bool,
    /// Chat: `logprobs: true`. Completions: `logprobs` given (any value, 0 included).
    pub logprobs: bool,
    /// Alternatives per token the client wants back: chat `top_logprobs`, completions
    /// `logprobs`.
    pub top_logprobs: u32,
    /// `stream_options.include_usage` (only meaningful for `stream: true`).
    pub include_usage: bool,
}

/// The built-in source's view of a request: the turn its model generates.
#[derive(Debug, Clone, PartialEq)]
pub struct BuiltinTurn {
    pub ask: Ask,
    /// The text the model continues: the messages' texts, or the prompt.
    pub prompt: String,
    /// Where in `prompt` the question is: the last user message's text (chat), the whole
    /// prompt (completions). See [`BuiltinTurn::question`].
    pub question: std::ops::Range<usize>,
    pub max_tokens: u32,
    pub seed: Option<u64>,
    /// vLLM's `ignore_eos`: generate exactly `max_tokens` tokens.
    pub ignore_eos: bool,
}

impl BuiltinTurn {
    /// The question the request asks: its last user message (empty when it has none), or
    /// a completion's prompt. The built-in model restates it with
    /// `--builtin-restate-prompt`.
    pub fn question(&self) -> &str {
        self.prompt.get(self.question.clone()).unwrap_or_default()
    }
}

impl ClientRequest {
    /// Parses a request body. Only JSON syntax is checked here (`invalid JSON body: ...`);
    /// each source's view checks the fields it needs.
    /// A Messages request is translated to chat here ([`crate::wire::messages::request`]):
    /// its errors name the Messages field.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, HttpError> {
        Self::parse_keeping(endpoint, body, false)
    }

    /// [`ClientRequest::parse`] for a surface passed through as it came: translated and
    /// checked as always, and the client's own body kept ([`ClientRequest::native`]).
    pub fn parse_native(endpoint: Endpoint, body: &[u8]) -> Result<Self, HttpError> {
        Self::parse_keeping(endpoint, body, true)
    }

    fn parse_keeping(endpoint: Endpoint, body: &[u8], keep: bool) -> Result<Self, HttpError> {
        let json: Value = serde_json::from_slice(body).map_err(json_error)?;
        let translated = match endpoint {
            Endpoint::Messages => crate::wire::messages::request::to_chat(&json)?,
            Endpoint::Responses => crate::wire::responses::request::to_chat(&json)?,
            Endpoint::Chat | Endpoint::Completion => {
                return Ok(ClientRequest {
                    endpoint,
                    json,
                    native: None,
                })
            }
        };
        Ok(ClientRequest {
            endpoint,
            json: translated,
            native: keep.then_some(json),
        })
    }

    /// The client's own body of a passed-through surface; `None` when translated.
    pub fn native(&self) -> Option<&Value> {
        self.native.as_ref()
    }

    /// [`ClientRequest::native`], to edit before it is forwarded.
    pub fn native_mut(&mut self) -> Option<&mut Value> {
        self.native.as_mut()
    }

    /// The body as the client sent it.
    pub fn json(&self) -> &Value {
        &self.json
    }

    /// The body, to edit before it is forwarded (TokenCircuit removes exhausted tools).
    pub fn json_mut(&mut self) -> &mut Value {
        &mut self.json
    }

    /// The body, for a source that forwards it (and edits what haltd owns).
    pub fn into_json(self) -> Value {
        self.json
    }

    /// The translation and, when passed through, the client's own body.
    pub fn into_parts(self) -> (Value, Option<Value>) {
        (self.json, self.native)
    }

    /// The built-in source's view: validated for the one model it serves (`served_model`).
    pub fn builtin_turn(&self, served_model: &str) -> Result<BuiltinTurn, HttpError> {
        match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                let b = ChatBody::deserialize(&self.json).map_err(json_error)?;
                let mut turn = builtin_chat(b, served_model)?;
                turn.ask.endpoint = self.endpoint;
                Ok(turn)
            }
            Endpoint::Completion => {
                let b = CompletionBody::deserialize(&self.json).map_err(json_error)?;
                builtin_completion(b, served_model)
            }
        }
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct ChatMessage {
    #[serde(default)]
    role: String,
    #[serde(default)]
    content: Value,
}

#[derive(Deserialize)]
struct ChatBody {
    model: Option<String>,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    stream: bool,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    logprobs: bool,
    top_logprobs: Option<u32>,
    seed: Option<u64>,
    n: Option<u32>,
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: bool,
}

#[derive(Deserialize)]
struct CompletionBody {
    model: Option<String>,
    prompt: Value,
    #[serde(default)]
    stream: bool,
    max_tokens: Option<u32>,
    logprobs: Option<u32>,
    seed: Option<u64>,
    n: Option<u32>,
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: bool,
}

fn check_model(model: Option<&str>, served: &str) -> Result<(), HttpError> {
    match model {
        None => Ok(()),
        Some(m) if m == served => Ok(()),
        Some(m) => Err(HttpError::new(
            404,
            "invalid_request_error",
            format!(
                "the model `{}` does not exist; this node serves `{served}`",
                m.chars().take(128).collect::<String>()
            ),
        )
        .with_code("model_not_found")),
    }
}

fn check_n(n: Option<u32>) -> Result<(), HttpError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(HttpError::bad_request(format!(
            "n = {n} is not supported by the built-in source: each choice would need its own governed stream; send n = 1"
        ))
        .with_code("n_not_supported")),
    }
}

fn check_max_tokens(v: Option<u32>, default: u32) -> Result<u32, HttpError> {
    match v {
        None => Ok(default),
        Some(0) => Err(HttpError::bad_request("max_tokens must be at least 1")),
        Some(v) if v > MAX_MAX_TOKENS => Err(HttpError::bad_request(format!(
            "max_tokens must be at most {MAX_MAX_TOKENS}"
        ))),
        Some(v) => Ok(v),
    }
}

fn json_error(e: serde_json::Error) -> HttpError {
    HttpError::bad_request(format!("invalid JSON body: {e}"))
}

fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

fn builtin_chat(b: ChatBody, served_model: &str) -> Result<BuiltinTurn, HttpError> {
    check_model(b.model.as_deref(), served_model)?;
    check_n(b.n)?;
    if b.messages.is_empty() {
        return Err(HttpError::bad_request("messages must not be empty"));
    }
    if let Some(m) = b.messages.iter().find(|m| {
        !matches!(
            m.role.as_str(),
            "system" | "developer" | "user" | "assistant" | "tool"
        )
    }) {
        return Err(HttpError::bad_request(format!(
            "unknown message role {:?}",
            m.role.chars().take(32).collect::<String>()
        )));
    }
    let top = b.top_logprobs.unwrap_or(0);
    if top > MAX_TOP_LOGPROBS {
        return Err(HttpError::bad_request(format!(
            "top_logprobs must be at most {MAX_TOP_LOGPROBS}"
        )));
    }
    if top > 0 && !b.logprobs {
        return Err(HttpError::bad_request(
            "top_logprobs requires logprobs: true",
        ));
    }
    let mut prompt = String::new();
    let mut question = 0..0;
    for (i, m) in b.messages.iter().enumerate() {
        if i > 0 {
            prompt.push('\n');
        }
        let start = prompt.len();
        prompt.push_str(&text_of(&m.content));
        if m.role == "user" {
            question = start..prompt.len();
        }
    }
    Ok(BuiltinTurn {
        ask: Ask {
            endpoint: Endpoint::Chat,
            stream: b.stream,
            logprobs: b.logprobs,
            top_logprobs: top,
            include_usage: b.stream_options.is_some_and(|o| o.include_usage),
        },
        prompt,
        question,
        max_tokens: check_max_tokens(
            b.max_completion_tokens.or(b.max_tokens),
            DEFAULT_CHAT_MAX_TOKENS,
        )?,
        seed: b.seed,
        ignore_eos: b.ignore_eos,
    })
}

fn builtin_completion(b: CompletionBody, served_model: &str) -> Result<BuiltinTurn, HttpError> {
    check_model(b.model.as_deref(), served_model)?;
    check_n(b.n)?;
    let prompt = match &b.prompt {
        Value::String(s) => s.clone(),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_owned()
        }
        Value::Array(_) => return Err(HttpError::bad_request(
            "a batch of prompts is not supported by the built-in source; send one prompt string",
        )),
        _ => return Err(HttpError::bad_request("prompt must be a string")),
    };
    let lp = b.logprobs.unwrap_or(0);
    if lp > MAX_TOP_LOGPROBS {
        return Err(HttpError::bad_request(format!(
            "logprobs must be at most {MAX_TOP_LOGPROBS}"
        )));
    }
    Ok(BuiltinTurn {
        ask: Ask {
            endpoint: Endpoint::Completion,
            stream: b.stream,
            logprobs: b.logprobs.is_some(),
            top_logprobs: lp,
            include_usage: b.stream_options.is_some_and(|o| o.include_usage),
        },
        question: 0..prompt.len(),
        prompt,
        max_tokens: check_max_tokens(b.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)?,
        seed: b.seed,
        ignore_eos: b.ignore_eos,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parse_turn(
        endpoint: Endpoint,
        body: &[u8],
        served_model: &str,
    ) -> Result<BuiltinTurn, HttpError> {
        ClientRequest::parse(endpoint, body)?.builtin_turn(served_model)
    }

    #[test]
    fn parse_turn_validates_fields() {
        let ok = parse_turn(Endpoint::Chat, br#"{"model":"builtin","messages":[{"role":"user","content":"hi"}],"stream":true,"logprobs":true,"top_logprobs":3}"#, "builtin").expect("valid");
        assert!(ok.ask.stream && ok.ask.logprobs && ok.ask.top_logprobs == 3 && ok.prompt == "hi");
        assert_eq!(ok.question(), "hi");
        let err = |e: Endpoint, b: &[u8]| parse_turn(e, b, "builtin").expect_err("invalid");
        assert_eq!(err(Endpoint::Chat, b"{").status, 400);
        assert_eq!(err(Endpoint::Chat, br#"{"messages":[]}"#).status, 400);
        assert_eq!(
            err(
                Endpoint::Chat,
                br#"{"model":"gpt-x","messages":[{"role":"user","content":"hi"}]}"#
            )
            .status,
            404
        );
        assert_eq!(
            err(
                Endpoint::Chat,
                br#"{"messages":[{"role":"user","content":"hi"}],"n":2}"#
            )
            .status,
            400
        );
        assert_eq!(
            err(
                Endpoint::Chat,
                br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":0}"#
            )
            .status,
            400
        );
        assert_eq!(err(Endpoint::Chat, br#"{"messages":[{"role":"user","content":"hi"}],"top_logprobs":30,"logprobs":true}"#).status, 400);
        assert_eq!(err(Endpoint::Completion, br#"{"prompt":5}"#).status, 400);
        let c = parse_turn(Endpoint::Completion, br#"{"prompt":"x"}"#, "builtin").expect("valid");
        assert_eq!(c.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS);
        assert_eq!(c.question(), "x");
    }

    #[test]
    fn the_question_is_the_last_user_message() {
        let t = parse_turn(Endpoint::Chat, br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"first?"},{"role":"assistant","content":"yes"},{"role":"user","content":[{"type":"text","text":"What is"},{"type":"text","text":"2 + 2?"}]},{"role":"assistant","content":"It is"}]}"#, "builtin").expect("valid");
        assert_eq!(t.prompt, "be brief\nfirst?\nyes\nWhat is 2 + 2?\nIt is");
        assert_eq!(t.question(), "What is 2 + 2?");
        let none = parse_turn(
            Endpoint::Chat,
            br#"{"messages":[{"role":"system","content":"hi"}]}"#,
            "builtin",
        )
        .expect("valid");
        assert_eq!((none.prompt.as_str(), none.question()), ("hi", ""));
    }

    proptest::proptest! {
        /// Arbitrary bodies (bytes, or JSON of the right rough shape) never panic and every
        /// refusal is a client error.
        #[test]
        fn arbitrary_bodies_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            for endpoint in [Endpoint::Chat, Endpoint::Completion] {
                if let Err(e) = parse_turn(endpoint, &bytes, "builtin") {
                    proptest::prop_assert!(e.status == 400 || e.status == 404);
                }
            }
        }

        #[test]
        fn arbitrary_fields_never_panic(
            max_tokens in proptest::option::of(proptest::num::i64::ANY),
            top in proptest::option::of(proptest::num::i64::ANY),
            n in proptest::option::of(0u32..5),
            content in "\\PC{0,64}",
            stream in proptest::bool::ANY,
        ) {
            let body = json!({
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "top_logprobs": top, "logprobs": top.is_some(),
                "n": n, "stream": stream,
            });
            match parse_turn(Endpoint::Chat, body.to_string().as_bytes(), "builtin") {
                Ok(t) => {
                    proptest::prop_assert!(t.max_tokens >= 1 && t.max_tokens <= MAX_MAX_TOKENS);
                    proptest::prop_assert!(t.ask.top_logprobs <= MAX_TOP_LOGPROBS);
                }
                Err(e) => proptest::prop_assert_eq!(e.status, 400),
            }
        }
    }
}
