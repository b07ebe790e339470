//! `POST /admin/incidents/{id}/label {"label": "tp" | "fp", "note": TEXT}` (`haltctl incident
//! label`): an operator's verdict on a stream's incident (`labels.rs`).
//!
//! The action is recorded first (an `admin` record with `action: "label"`, the caller, the
//! status and, when it was given, `labelled`: the incident's seq and hash, what tripped it,
//! its route and the label) and takes effect once that record is on disk: the counts in
//! `/metrics` move, and the state store keeps the label. A refusal is recorded too, as every
//! admin action is. Label actions run one at a time, so they apply in the ledger's order.

use std::sync::Arc;

use axum::{
    body::Bytes,
    extract::{Extension, Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    Json,
};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{admin_record, error, AdminActor};
use crate::{
    halt::HaltCore,
    labels::{find_incident, Label, LabelError, Labelled},
    state::Change,
    wire::StreamId,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LabelBody {
    label: Label,
    #[serde(default)]
    note: Option<String>,
}

/// Longest note kept, in bytes (a note is for people; the record stays one line).
const NOTE_MAX: usize = 1024;

pub(super) async fn label(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let done = tokio::task::spawn_blocking(move || label_now(&shared, &actor, &id, &body)).await;
    done.unwrap_or_else(|e| {
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("labelling the incident: {e}"),
        )
    })
}

/// A refusal: its status, error type and message.
struct Refusal(StatusCode, &'static str, String);

impl From<LabelError> for Refusal {
    fn from(e: LabelError) -> Self {
        match e {
            LabelError::NoIncident { .. } => {
                Refusal(StatusCode::NOT_FOUND, "not_found", e.to_string())
            }
            LabelError::Read { .. } | LabelError::Unhashed { .. } => Refusal(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            ),
        }
    }
}

fn bad(message: String) -> Refusal {
    Refusal(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// The incident `id` names, with the label `body` gives it.
fn decide(shared: &HaltCore, id: &str, body: &[u8]) -> Result<Labelled, Refusal> {
    let id: StreamId = id
        .parse()
        .map_err(|e: crate::wire::BadStreamId| bad(e.to_string()))?;
    let body: LabelBody = serde_json::from_slice(body).map_err(|e| {
        bad(format!(
            "invalid JSON body: {e} (expected {{\"label\": \"tp\" | \"fp\", \"note\": TEXT}})"
        ))
    })?;
    if body.note.as_ref().is_some_and(|n| n.len() > NOTE_MAX) {
        return Err(bad(format!("note: longer than {NOTE_MAX} bytes")));
    }
    Ok(find_incident(
        &shared.cfg.args.ledger,
        &id.to_string(),
        body.label,
        body.note,
    )?)
}

/// Decides, records, then applies (on the blocking pool: it waits for one fsync).
fn label_now(shared: &HaltCore, actor: &AdminActor, id: &str, body: &[u8]) -> Response {
    let _one_at_a_time = shared.labels.serial();
    let decided = decide(shared, id, body);
    let request = serde_json::from_slice::<Value>(body).ok();
    let mut action = json!({"action": "label", "stream_id": id, "request": request});
    let status = match &decided {
        Ok(l) => {
            action["labelled"] = json!(l);
            action["previous"] = json!(shared.labels.get(l.incident_seq).map(|p| p.label.as_str()));
            StatusCode::OK
        }
        Err(r) => r.0,
    };
    let rec = admin_record(shared, actor, action, status);
    if let Err(e) = shared.record_durable(rec) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "recorder_failure",
            format!("the label was not given: its record could not be written ({e}); the flight recorder failed closed"),
        );
    }
    let labelled = match decided {
        Ok(l) => l,
        Err(Refusal(status, kind, message)) => return error(status, kind, message),
    };
    let previous = shared.labels.set(labelled.clone());
    shared
        .state
        .apply(None, vec![Change::IncidentLabel(labelled.row())]);
    shared.state.flush();
    if shared.state.is_failed() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "state_failure",
            "the label is recorded in the ledger and counted, but the state store failed: haltd fails closed",
        );
    }
    let mut answer = json!(labelled);
    answer["previous"] = json!(previous.map(Label::as_str));
    (StatusCode::OK, Json(answer)).into_response()
}
