//! `POST /admin/safety/check`: SafetyCheck's verdict on demand.
//!
//! The body is one turn record as the ledger writes it (a line of the ledger). The reply is
//! the verdict of the daemon's current registry and pack (a SIGHUP reload included; the
//! record's route's, else the default route's) on the
//! inputs the record's `safety_verdict.inputs` kept, with each predicate's result: the same
//! shape as a record's `safety_verdict`. Nothing is recorded and nothing changes: it is a
//! read, like `GET /admin/status`. A body that is not JSON, or not a turn record with
//! recorded inputs, gets a 400 saying which.

use std::sync::Arc;

use axum::{
    body::Bytes,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    Json,
};

use super::error;
use crate::halt::HaltCore;

/// `POST /admin/safety/check`: the verdict on a turn record.
pub(super) async fn check(State(shared): State<Arc<HaltCore>>, body: Bytes) -> Response {
    let ctx = match crate::safety::context_from_record(&body) {
        Ok(ctx) => ctx,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                e.to_string(),
            )
        }
    };
    // The registry and pack of the record's route (a route gone since: the default one's).
    let set = shared.policy.load_full();
    let route = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|r| r["route"].as_str().and_then(|n| set.named(n)).cloned())
        .unwrap_or_else(|| Arc::clone(set.default_route()));
    let detectors = &route.detectors;
    Json(detectors.safety.check(&ctx, &detectors.safety_pack)).into_response()
}
