//! Native pass-through (`--upstream-surfaces`): client surfaces the backend serves itself.
//!
//! By default every surface is translated: a Messages or Responses request becomes a chat
//! request upstream ([`crate::wire::Endpoint::request_shape`]). For a surface the operator
//! names here, the client's request goes to the backend's own path of that surface
//! ([`UpstreamSurface::api_path`]) as it came, with only the fields haltd owns set
//! ([`native_body`]); the backend's stream, in the surface's own events, is read into the same
//! chunks as a chat stream (`chunk/native.rs`), so that the detectors, the budget B, the
//! kernel gate, TokenCircuit and the records govern it exactly as they govern a translated
//! turn, and the client's side is written by the same encoder.
//!
//! What haltd still reads from the request (the model, `stream`, tools, the transcript that
//! TokenCircuit judges) it reads from the translation, which is made and checked as for a
//! translated turn: a request haltd would refuse by translation is refused by pass-through
//! too, with the same error naming the field.

use clap::ValueEnum;
use serde_json::{Map, Value};

use crate::wire::Endpoint;

/// A client surface a backend can serve natively.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum UpstreamSurface {
    /// OpenAI's Responses API, `POST /v1/responses`.
    Responses,
    /// Anthropic's Messages API, `POST /v1/messages`.
    Messages,
}

/// API path of the Responses API.
pub const RESPONSES_PATH: &str = "/v1/responses";
/// API path of the Messages API.
pub const MESSAGES_PATH: &str = "/v1/messages";

/// The client headers a passed-through Messages request carries upstream as they came:
/// the API version and beta features the body was written for. (`x-api-key`, the credential,
/// goes too, unless `--upstream-api-key-file` replaces it.)
pub const MESSAGES_HEADERS: [&str; 2] = ["anthropic-version", "anthropic-beta"];

/// What haltd asks for in a passed-through Responses request: the logprobs of output text.
pub const RESPONSES_LOGPROBS_INCLUDE: &str = "message.output_text.logprobs";

impl UpstreamSurface {
    /// The client endpoint this surface answers.
    pub const fn endpoint(self) -> Endpoint {
        match self {
            UpstreamSurface::Responses => Endpoint::Responses,
            UpstreamSurface::Messages => Endpoint::Messages,
        }
    }

    /// The surface of a client endpoint, if it has one that a backend may serve natively.
    pub const fn of(endpoint: Endpoint) -> Option<Self> {
        match endpoint {
            Endpoint::Responses => Some(UpstreamSurface::Responses),
            Endpoint::Messages => Some(UpstreamSurface::Messages),
            Endpoint::Chat | Endpoint::Completion => None,
        }
    }

    /// The backend's path for the surface.
    pub const fn api_path(self) -> &'static str {
        match self {
            UpstreamSurface::Responses => RESPONSES_PATH,
            UpstreamSurface::Messages => MESSAGES_PATH,
        }
    }

    /// The request fields that define or select tools (removed in degraded mode).
    pub const fn tool_fields(self) -> &'static [&'static str] {
        match self {
            UpstreamSurface::Responses => &["tools", "tool_choice", "parallel_tool_calls"],
            UpstreamSurface::Messages => &["tools", "tool_choice"],
        }
    }
}

/// The surfaces of `--upstream-surfaces`: a small set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NativeSurfaces {
    responses: bool,
    messages: bool,
}

impl NativeSurfaces {
    pub fn of(list: &[UpstreamSurface]) -> Self {
        NativeSurfaces {
            responses: list.contains(&UpstreamSurface::Responses),
            messages: list.contains(&UpstreamSurface::Messages),
        }
    }

    /// The surface a request on `endpoint` is passed through as, if the backend serves it.
    pub fn passes(self, endpoint: Endpoint) -> Option<UpstreamSurface> {
        UpstreamSurface::of(endpoint).filter(|s| match s {
            UpstreamSurface::Responses => self.responses,
            UpstreamSurface::Messages => self.messages,
        })
    }

    pub fn is_empty(self) -> bool {
        !self.responses && !self.messages
    }
}

/// The upstream body of a passed-through request: the client's object with the fields haltd
/// owns set. Always `stream: true` (haltd streams from the upstream even for a client's batch
/// request, as for chat). Responses: `top_logprobs` (at least 1) and the output text's
/// logprobs in `include`, so the monitors can score every token. Degraded mode removes the
/// surface's tool fields, sets `temperature` 0 and adds the degraded instruction
/// ([`super::degraded::DegradedShape`]).
pub fn native_body(
    surface: UpstreamSurface,
    obj: &mut Map<String, Value>,
    top_logprobs: u32,
    degraded: Option<super::degraded::DegradedShape<'_>>,
) {
    obj.insert("stream".into(), Value::Bool(true));
    if surface == UpstreamSurface::Responses {
        obj.insert("top_logprobs".into(), Value::from(top_logprobs.max(1)));
        let include = obj
            .entry("include")
            .or_insert_with(|| Value::Array(Vec::new()));
        if !include.is_array() {
            *include = Value::Array(Vec::new());
        }
        if let Value::Array(list) = include {
            if !list.iter().any(|v| v == RESPONSES_LOGPROBS_INCLUDE) {
                list.push(Value::from(RESPONSES_LOGPROBS_INCLUDE));
            }
        }
    }
    if let Some(shape) = degraded {
        for f in surface.tool_fields() {
            obj.remove(*f);
        }
        obj.insert("temperature".into(), Value::from(0));
        if !shape.instruction.is_empty() {
            add_instruction(surface, obj, shape.instruction);
        }
    }
}

/// TokenCircuit's edit of a passed-through request whose conversation has used up the
/// budget of the tools `names`: those tools removed (and every tool field when none is left,
/// since some backends refuse an empty list), a `tool_choice` that names one set to `auto`,
/// and `note` added to the instructions the model reads (Responses `instructions`, Messages
/// `system`), as a translated request gets a system message.
pub fn withhold_tools(surface: UpstreamSurface, body: &mut Value, names: &[&str], note: &str) {
    let named = |t: &Value| {
        let name = t.get("name").or_else(|| t.pointer("/function/name"));
        name.and_then(Value::as_str)
            .is_some_and(|n| names.contains(&n))
    };
    let Some(obj) = body.as_object_mut() else {
        return;
    };
    if let Some(Value::Array(tools)) = obj.get_mut("tools") {
        tools.retain(|t| !named(t));
    }
    let no_tools = obj
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty);
    if no_tools {
        for f in surface.tool_fields() {
            obj.remove(*f);
        }
    } else if obj.get("tool_choice").is_some_and(named) {
        let auto = match surface {
            UpstreamSurface::Responses => Value::from("auto"),
            UpstreamSurface::Messages => serde_json::json!({"type": "auto"}),
        };
        obj.insert("tool_choice".into(), auto);
    }
    add_instruction(surface, obj, note);
}

/// `note` after the instructions the model reads (Responses `instructions`, Messages
/// `system`), as a translated request gets a system message.
fn add_instruction(surface: UpstreamSurface, obj: &mut Map<String, Value>, note: &str) {
    let field = match surface {
        UpstreamSurface::Responses => "instructions",
        UpstreamSurface::Messages => "system",
    };
    let noted = match obj.remove(field) {
        None | Some(Value::Null) => Value::from(note),
        Some(Value::String(s)) if s.is_empty() => Value::from(note),
        Some(Value::String(s)) => Value::from(format!("{s}\n\n{note}")),
        // Messages `system` as text blocks: one more block.
        Some(Value::Array(mut blocks)) => {
            blocks.push(serde_json::json!({"type": "text", "text": note}));
            Value::Array(blocks)
        }
        // Any other shape was refused by the translation; keep it as it came.
        Some(other) => other,
    };
    obj.insert(field.into(), noted);
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(o) => o,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn surfaces_pass_only_what_was_named() {
        let none = NativeSurfaces::default();
        assert!(none.is_empty());
        assert_eq!(none.passes(Endpoint::Responses), None);
        let both = NativeSurfaces::of(&[UpstreamSurface::Messages, UpstreamSurface::Responses]);
        assert_eq!(
            both.passes(Endpoint::Responses),
            Some(UpstreamSurface::Responses)
        );
        assert_eq!(
            both.passes(Endpoint::Messages),
            Some(UpstreamSurface::Messages)
        );
        assert_eq!(both.passes(Endpoint::Chat), None);
        assert_eq!(both.passes(Endpoint::Completion), None);
        let one = NativeSurfaces::of(&[UpstreamSurface::Messages]);
        assert_eq!(one.passes(Endpoint::Responses), None);
        for s in [UpstreamSurface::Responses, UpstreamSurface::Messages] {
            assert_eq!(UpstreamSurface::of(s.endpoint()), Some(s));
        }
    }

    #[test]
    fn the_body_keeps_every_field_and_streams_with_logprobs() {
        let mut o = obj(json!({
            "model": "m", "input": "hi", "stream": false, "store": true,
            "include": ["reasoning.encrypted_content"], "vendor_x": {"a": 1}, "tools": []
        }));
        native_body(UpstreamSurface::Responses, &mut o, 0, None);
        assert_eq!(
            Value::Object(o),
            json!({
                "model": "m", "input": "hi", "stream": true, "store": true,
                "include": ["reasoning.encrypted_content", RESPONSES_LOGPROBS_INCLUDE],
                "vendor_x": {"a": 1}, "tools": [], "top_logprobs": 1
            })
        );
        let mut o = obj(
            json!({"model": "m", "max_tokens": 5, "messages": [], "tools": [{"name": "t"}],
            "tool_choice": {"type": "any"}}),
        );
        native_body(
            UpstreamSurface::Messages,
            &mut o,
            3,
            Some(crate::upstream::DegradedShape { instruction: "" }),
        );
        assert_eq!(
            Value::Object(o),
            json!({"model": "m", "max_tokens": 5, "messages": [], "stream": true,
                "temperature": 0})
        );
        // Degraded with an instruction: after the request's own, at temperature 0.
        let degraded = Some(crate::upstream::DegradedShape {
            instruction: "Facts only.",
        });
        let mut o = obj(
            json!({"model": "m", "input": "hi", "instructions": "Be brief.",
            "temperature": 0.7, "tools": [{"type": "function", "name": "f"}]}),
        );
        native_body(UpstreamSurface::Responses, &mut o, 0, degraded);
        assert_eq!(
            (&o["instructions"], &o["temperature"], o.get("tools")),
            (&json!("Be brief.\n\nFacts only."), &json!(0), None)
        );
        let mut o = obj(json!({"model": "m", "max_tokens": 5, "messages": [],
            "system": [{"type": "text", "text": "s"}]}));
        native_body(UpstreamSurface::Messages, &mut o, 0, degraded);
        assert_eq!(
            o["system"],
            json!([{"type": "text", "text": "s"}, {"type": "text", "text": "Facts only."}])
        );
    }

    #[test]
    fn withheld_tools_leave_the_rest_and_add_the_note() {
        let mut b = json!({"tools": [{"type": "function", "name": "a"}, {"type": "function", "name": "b"}],
            "tool_choice": {"type": "function", "name": "a"}, "instructions": "Be brief."});
        withhold_tools(
            UpstreamSurface::Responses,
            &mut b,
            &["a"],
            "a is out of budget",
        );
        assert_eq!(
            b,
            json!({"tools": [{"type": "function", "name": "b"}], "tool_choice": "auto",
                "instructions": "Be brief.\n\na is out of budget"})
        );
        let mut b = json!({"tools": [{"name": "a"}], "tool_choice": {"type": "tool", "name": "a"},
            "system": [{"type": "text", "text": "Be brief."}]});
        withhold_tools(UpstreamSurface::Messages, &mut b, &["a"], "note");
        assert_eq!(
            b,
            json!({"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "note"}]})
        );
        let mut b = json!({"tools": [{"name": "a"}, {"name": "c"}], "tool_choice": {"type": "tool", "name": "a"}});
        withhold_tools(UpstreamSurface::Messages, &mut b, &["a"], "note");
        assert_eq!(
            b,
            json!({"tools": [{"name": "c"}], "tool_choice": {"type": "auto"}, "system": "note"})
        );
    }
}
