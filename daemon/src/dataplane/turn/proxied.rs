//! A proxied turn's start: the client's request parsed once and prepared for the upstream
//! (translated, or passed through as it came to a backend that serves its surface,
//! `--upstream-surfaces`), with what goes with it: SafetyCheck's inputs, the conversation's
//! TokenCircuit, the credential and headers sent upstream.

use std::collections::BTreeSet;

use serde_json::Value;

use super::circuit;
use crate::{
    upstream,
    wire::{ClientRequest, Endpoint, RequestHead},
};

/// The client's request, parsed once, prepared for the upstream, with SafetyCheck's inputs
/// taken from the same parsed request (the URLs it cites, its system prompt).
/// With TokenCircuit enabled, a chat turn (not degraded: that emits no tool calls) also
/// gets its conversation's circuit, rebuilt from the request's transcript.
pub(super) fn prepare_proxied(
    (endpoint, native): (Endpoint, bool),
    body: &[u8],
    degraded: Option<upstream::DegradedShape<'_>>,
    (routes, at): (&crate::policy::PolicySet, circuit::Arrival<'_>),
) -> Result<(Proxied, crate::policy::TurnPolicy), Box<circuit::Refusal>> {
    let mut req = if native {
        ClientRequest::parse_native(endpoint, body)?
    } else {
        ClientRequest::parse(endpoint, body)?
    };
    // The route decides TokenCircuit's budgets, so it is looked up before the circuit runs.
    let policy = routes.for_turn(&crate::policy::TurnKey {
        endpoint,
        model: req.json()["model"].as_str().unwrap_or_default(),
        key: at.key,
    });
    let urls = crate::safety::request_sources(req.json());
    let system_prompt = crate::safety::system_prompt(req.json());
    let circuit = match &policy.route.circuit {
        Some(policy) if endpoint.is_chat_shaped() && degraded.is_none() => {
            let c = circuit::TurnCircuit::of_request(policy, req.json(), &at)?;
            // An exhausted budget: answered here, or forwarded without the tool.
            c.apply_exhausted(&mut req, &at)?;
            Some(Box::new(c))
        }
        _ => None,
    };
    let up = upstream::prepare_turn(req, degraded)?;
    Ok(((up, urls, system_prompt, circuit), policy))
}

impl crate::dataplane::Io {
    /// Whether `who`'s turn runs degraded. Degraded mode decides what is forwarded, so a
    /// proxied turn looks it up before preparing the body (`open_turn` looks again, and
    /// records a legacy scope's migration).
    pub(super) fn degraded_now(&self, who: &crate::scope::Identity) -> bool {
        self.shared.expire_degraded();
        self.shared.modes.is_degraded(who.scope) || self.shared.modes.is_degraded(who.legacy)
    }

    /// How a degraded turn's upstream request is shaped (`--degraded-instruction`).
    pub(super) fn degraded_shape(&self) -> upstream::DegradedShape<'_> {
        upstream::DegradedShape {
            instruction: &self.shared.cfg.args.degraded_instruction,
        }
    }
}

/// The `Authorization` a proxied turn sends upstream (before `--upstream-api-key-file`
/// replaces it): the client's. Translated, the Anthropic SDK's `x-api-key` goes as the bearer
/// token chat backends read; passed through, it goes as the `x-api-key` it was
/// ([`RequestHead::messages_headers`]).
pub(super) fn upstream_authorization(
    head: &RequestHead,
    endpoint: Endpoint,
    native: Option<upstream::UpstreamSurface>,
) -> Option<String> {
    let auth = head.authorization.as_ref().map(|a| a.as_str().to_owned());
    match (auth, endpoint, head.bearer.as_ref(), native) {
        (None, Endpoint::Messages, Some(key), None) => Some(format!("Bearer {}", key.as_str())),
        (auth, ..) => auth,
    }
}

/// The client's headers a passed-through turn carries upstream (Messages:
/// [`RequestHead::messages_headers`]); none for a translated one.
pub(super) fn surface_headers(
    head: &RequestHead,
    native: Option<upstream::UpstreamSurface>,
) -> Vec<(&'static str, String)> {
    match native {
        Some(upstream::UpstreamSurface::Messages) => head.messages_headers(),
        Some(upstream::UpstreamSurface::Responses) | None => Vec::new(),
    }
}

/// The text of the last user message (chat) or the prompt (completions) of an upstream
/// request body: a grounding round's context. Once per turn, with intervene mode only.
pub(super) fn last_user_text(body: &[u8]) -> String {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    if let Some(p) = v["prompt"].as_str() {
        return p.to_owned();
    }
    v["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_owned()
}

/// A proxied turn's upstream request, SafetyCheck inputs and circuit.
pub(super) type Proxied = (
    upstream::UpstreamTurn,
    BTreeSet<String>,
    String,
    Option<Box<circuit::TurnCircuit>>,
);
