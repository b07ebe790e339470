//! `POST /admin/streams/{id}/trip` (`haltctl trip`): an operator's trip, and what it did to
//! degraded mode.
//!
//! A halt of a degrading cause puts the turn's scope into degraded mode (`modes.rs`). For a
//! detector's or the watchdog's trip that happens when the halt completes. An operator's trip
//! degrades the scope at once, before the answer, so that the answer can say whether the
//! scope is degraded now and until when, and so that the scope's next request is degraded
//! whether or not the halted stream has ended by then. `{"degrade": false}` (`haltctl trip
//! --no-degrade`) opts the trip out: the halt then degrades nothing, and the action's ledger
//! record says `"degrade": false`. A scope that was already degraded stays so: opting out
//! never ends degraded mode.

use std::sync::{atomic::Ordering::SeqCst, Arc};

use axum::{
    body::Bytes,
    extract::{Extension, Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    Json,
};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{error, record_action, AdminActor, RESERVED_CAUSES};
use crate::{
    codes::FailureCode,
    halt::HaltCore,
    modes::cause_degrades,
    scope::ScopeKind,
    stream::{Initiator, TripError},
    wire::StreamId,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TripBody {
    cause: Option<String>,
    /// `false`: the halt does not degrade the turn's scope (`--no-degrade`).
    #[serde(default = "yes")]
    degrade: bool,
}

fn yes() -> bool {
    true
}

impl Default for TripBody {
    fn default() -> Self {
        TripBody {
            cause: None,
            degrade: true,
        }
    }
}

/// What the trip did to degraded mode: the answer's `degrade` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DegradeAnswer {
    /// This trip degraded the scope (or restarted its timer).
    Degraded,
    /// The scope (or the node) was degraded already, and stays so as it was.
    AlreadyDegraded,
    /// The operator opted out.
    Declined,
    /// The cause does not degrade (`modes::cause_degrades`).
    CauseDoesNotDegrade,
    /// The turn had no scope yet (tripped before its request was read): its halt degrades it.
    AtHalt,
    /// haltd is shutting down: nothing degrades.
    ShuttingDown,
}

impl DegradeAnswer {
    const fn as_str(self) -> &'static str {
        match self {
            DegradeAnswer::Degraded => "degraded",
            DegradeAnswer::AlreadyDegraded => "already_degraded",
            DegradeAnswer::Declined => "declined",
            DegradeAnswer::CauseDoesNotDegrade => "cause_does_not_degrade",
            DegradeAnswer::AtHalt => "at_halt",
            DegradeAnswer::ShuttingDown => "shutting_down",
        }
    }
}

pub(super) async fn trip(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let parsed = parse_body(&body);
    let resp = match &parsed {
        Ok(b) => trip_inner(&shared, &id, b),
        Err(e) => e.clone().into_response(),
    };
    let (cause, degrade) = match &parsed {
        Ok(b) => (b.cause.clone(), b.degrade),
        Err(_) => (None, true),
    };
    let mut action = json!({"action": "trip", "stream_id": id, "cause": cause});
    if !degrade {
        action["degrade"] = json!(false);
    }
    match record_action(&shared, &actor, action, resp.status()).await {
        Ok(()) => resp,
        Err(unrecorded) => unrecorded,
    }
}

/// A refusal, kept as its parts so that it can be answered after the action is recorded.
#[derive(Clone)]
struct Refusal(StatusCode, &'static str, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        error(self.0, self.1, self.2)
    }
}

fn bad(message: impl Into<String>) -> Refusal {
    Refusal(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        message.into(),
    )
}

fn parse_body(body: &[u8]) -> Result<TripBody, Refusal> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(TripBody::default());
    }
    serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))
}

fn trip_inner(shared: &HaltCore, id: &str, body: &TripBody) -> Response {
    let id: StreamId = match id.parse() {
        Ok(id) => id,
        Err(e) => return bad(e.to_string()).into_response(),
    };
    let cause = match body.cause.as_deref().map(str::parse::<FailureCode>) {
        None => FailureCode::OperatorTrip,
        Some(Ok(c)) if RESERVED_CAUSES.contains(&c) => {
            return bad(format!("cause {c} is raised only by haltd itself; an operator trip uses OPERATOR_TRIP or a detector's cause")).into_response()
        }
        Some(Ok(c)) => c,
        Some(Err(e)) => return bad(e.to_string()).into_response(),
    };
    match operator_trip(shared, id, cause, body.degrade) {
        Ok(answer) => (StatusCode::OK, Json(answer)).into_response(),
        Err(e @ TripError::Unknown(_)) => error(StatusCode::NOT_FOUND, "not_found", e.to_string()),
        Err(TripError::AlreadyTripped { id, cause, trip_token_index }) => (
            StatusCode::CONFLICT,
            Json(json!({
                "error": {"type": "already_tripped", "message": format!("stream {id} already tripped")},
                "stream_id": id.to_string(), "cause": cause, "trip_token_index": trip_token_index,
            })),
        )
            .into_response(),
        Err(e @ TripError::Finished(_)) => error(StatusCode::CONFLICT, "finished", e.to_string()),
    }
}

/// Trips the stream, degrades its scope now unless told not to, and answers with the trip
/// and the scope's degraded state after it.
fn operator_trip(
    shared: &HaltCore,
    id: StreamId,
    cause: FailureCode,
    degrade: bool,
) -> Result<Value, TripError> {
    // The scope is read before the trip: once tripped, the stream may end and its slot be
    // reused. The trip succeeds only for this generation, so a scope read under it is the
    // stream's own. A turn admitted after this read has no scope here (kind 0, the legacy
    // kind no turn is given), and its halt degrades it instead.
    let before = shared.table.slot(id.slot).snapshot(id.slot);
    let scope =
        (before.id == id && before.scope_kind != ScopeKind::Key.as_u8()).then(|| before.scope());
    let what = if !degrade {
        DegradeAnswer::Declined
    } else if !cause_degrades(cause) {
        DegradeAnswer::CauseDoesNotDegrade
    } else if shared.shutting_down.load(SeqCst) {
        DegradeAnswer::ShuttingDown
    } else if scope.is_none() {
        DegradeAnswer::AtHalt
    } else {
        DegradeAnswer::Degraded
    };
    let halt_degrades = what == DegradeAnswer::AtHalt;
    let info = shared.trip_with(id, (cause, Initiator::Operator, halt_degrades))?;
    let what = match (what, scope) {
        (DegradeAnswer::Degraded, Some(scope)) => {
            match shared.modes.enter(scope, cause, &id.to_string()) {
                Some(ch) => {
                    shared.record_mode_change(&ch);
                    DegradeAnswer::Degraded
                }
                None => DegradeAnswer::AlreadyDegraded,
            }
        }
        (other, _) => other,
    };
    let mut answer = json!(info);
    answer["degrade"] = json!(what.as_str());
    answer["degraded_scope"] = scope
        .and_then(|s| shared.modes.degraded_state(s))
        .unwrap_or(Value::Null);
    Ok(answer)
}
