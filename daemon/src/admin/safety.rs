//! `POST /admin/safety/check` (`haltctl safety check`): SafetyCheck's verdict on demand.
//!
//! The body is one turn record as the ledger writes it (a line of the ledger). The reply is
//! the verdict of the daemon's current registry and pack (a SIGHUP reload included) on the
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
    let detectors = shared.detectors.load_full();
    Json(detectors.safety.check(&ctx, &detectors.safety_pack)).into_response()
}
