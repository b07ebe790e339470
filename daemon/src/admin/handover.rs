//! `POST /admin/handover {"pid": P, "ledger": PATH}`: a successor started with `--take-over`
//! asks this haltd to hand over (docs/operations.md "Upgrading"; the successor's side:
//! `server/takeover.rs`).
//!
//! This process then
//! 1. writes its hand-over record (a `lifecycle` record whose `handover` field names the
//!    successor and its segment), on disk before the answer: the successor's segment starts
//!    with a record linked to it;
//! 2. stops moving its state store's point (the point stays a record the successor's chain
//!    continues from) and commits what it queued, so that the successor reads a store that
//!    holds every change this process recorded up to its hand-over record;
//! 3. serves on, as the successor's peer, until SIGUSR2 tells it to stop accepting and drain
//!    (`lifecycle.rs`). If the successor exits first (a start that failed after asking), the
//!    hand-over is called off, recorded, and this process serves on alone.
//!
//! One hand-over at a time: a second request while one is under way gets 409, and so does a
//! request during a drain, or one whose successor would write this process's own ledger file.

use std::{path::PathBuf, sync::Arc};

use axum::{
    body::Bytes,
    extract::{Extension, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    Json,
};
use serde::Deserialize;
use serde_json::json;

use super::{error, AdminActor};
use crate::{
    halt::HaltCore,
    ledger::{Record, RecordKind},
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HandoverBody {
    pid: u32,
    ledger: PathBuf,
}

pub(super) async fn handover(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    body: Bytes,
) -> Response {
    let req: HandoverBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("the body must be {{\"pid\": N, \"ledger\": PATH}}: {e}"),
            )
        }
    };
    if let Err((status, why)) = admissible(&shared, &req) {
        return error(status, "conflict", why);
    }
    let pidfd = match crate::halt::handover::pidfd_open(req.pid) {
        Ok(fd) => fd,
        Err(e) => {
            shared.handover.clear_successor();
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("no process {} to hand over to: {e}", req.pid),
            );
        }
    };
    let core = Arc::clone(&shared);
    let written = tokio::task::spawn_blocking(move || begin(&core, &req, &actor)).await;
    match written {
        Ok(Ok(answer)) => {
            let pid = answer["to_pid"].as_u64().unwrap_or_default();
            tokio::spawn(watch_successor(Arc::clone(&shared), pid, pidfd));
            Json(answer).into_response()
        }
        Ok(Err(why)) => refused(&shared, why),
        Err(e) => refused(&shared, e.to_string()),
    }
}

fn refused(shared: &HaltCore, why: String) -> Response {
    shared.handover.clear_successor();
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        format!("recording the hand-over: {why}"),
    )
}

/// Whether a hand-over to `req` may begin now; takes `req.pid` as the successor if so.
fn admissible(shared: &HaltCore, req: &HandoverBody) -> Result<(), (StatusCode, String)> {
    use std::sync::atomic::Ordering::SeqCst;
    if shared.draining.load(SeqCst) || shared.shutting_down.load(SeqCst) {
        return Err((StatusCode::CONFLICT, "this haltd is draining".to_owned()));
    }
    let ours = shared.ledger.path();
    let same = ours == req.ledger
        || std::fs::canonicalize(ours).ok() == std::fs::canonicalize(&req.ledger).ok()
            && req.ledger.exists();
    if same {
        return Err((
            StatusCode::CONFLICT,
            format!(
                "the successor would write this haltd's own ledger file {}: give it a --ledger of its own (the segments are linked)",
                ours.display()
            ),
        ));
    }
    shared.handover.begin_for(req.pid).map_err(|other| {
        (
            StatusCode::CONFLICT,
            format!("a hand-over to pid {other} is under way"),
        )
    })
}

/// Writes the hand-over record and freezes the store's point; the answer the successor links
/// its segment to. Blocking (the ledger's fsync, the store's commit).
fn begin(
    shared: &HaltCore,
    req: &HandoverBody,
    actor: &AdminActor,
) -> Result<serde_json::Value, String> {
    let rec = Record {
        kind: RecordKind::Lifecycle,
        kernel_gate: shared.kernel_gate_label().into(),
        message: Some(format!(
            "hand-over to pid {}: its ledger segment {} continues the chain from this record",
            req.pid,
            req.ledger.display()
        )),
        handover: Some(json!({
            "to_pid": req.pid,
            "to_segment": req.ledger,
            "actor": actor,
        })),
        ..Record::default()
    };
    let written = shared
        .ledger
        .append_sync_written(rec)
        .map_err(|e| e.to_string())?;
    shared.state.freeze_point();
    shared.state.flush();
    shared.handover.set_peer(true);
    tracing::info!(
        successor = req.pid,
        seq = written.seq,
        "hand-over record written; serving beside the successor until it sends SIGUSR2"
    );
    Ok(json!({
        "pid": std::process::id(),
        "to_pid": req.pid,
        "segment": shared.ledger.path(),
        "seq": written.seq,
        "hash": written.hash,
    }))
}

/// A successor that exits before it sent SIGUSR2 calls the hand-over off: this process
/// records it and serves on alone.
async fn watch_successor(shared: Arc<HaltCore>, pid: u64, pidfd: std::os::fd::OwnedFd) {
    use std::sync::atomic::Ordering::SeqCst;
    if let Err(e) = crate::halt::handover::exited(pidfd).await {
        tracing::warn!(successor = pid, error = %e, "watching the successor failed");
        return;
    }
    if shared.handover.handing_over.load(SeqCst) {
        return;
    }
    shared.handover.clear_successor();
    shared.handover.set_peer(false);
    shared.state.thaw_point();
    let message = format!("hand-over to pid {pid} called off: it exited before it took over (its stderr says why); this haltd serves on alone");
    tracing::warn!(successor = pid, "{message}");
    shared.record_lifecycle(message);
}
