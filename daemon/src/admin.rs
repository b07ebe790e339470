//! The control plane on tokio: the admin API (`--admin`) and the Prometheus endpoint
//! (`--metrics`). Nothing here is on the token path; a trip request calls
//! [`HaltCore::trip`], which writes the kernel trip map before it answers.
//!
//! Who may call the admin API, and how each call is attributed: [`auth`]. Where it listens:
//! [`listen`]. Every action that changes state writes an `admin` ledger record naming its
//! caller.

mod auth;
pub mod client;
mod handover;
mod keys;
mod label;
mod listen;
mod policy;
mod safety;
mod trip;

use std::{net::SocketAddr, sync::Arc};

pub use auth::AdminActor;
pub use listen::{bind_admin, take_staged_socket, AdminListener};

use axum::{
    body::Bytes,
    extract::{Extension, Path, State},
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use serde::Deserialize;
use serde_json::json;

use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    halt::HaltCore,
    ledger::{Record, RecordKind},
    modes::ScopeSel,
    pulse::HeartbeatState,
    scope::Scope,
};

fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": {"type": kind, "message": message.into()}})),
    )
        .into_response()
}

/// Causes only haltd itself raises: an operator claiming one would forge a record of a
/// failure of haltd's own machinery.
const RESERVED_CAUSES: [FailureCode; 8] = [
    FailureCode::HeartbeatLost,
    FailureCode::RecorderFailure,
    FailureCode::WatchdogTrip,
    FailureCode::UpstreamFailure,
    FailureCode::DetectorFailure,
    FailureCode::ServiceShutdown,
    FailureCode::ToolCircuitOpen,
    FailureCode::ClientStalled,
];

/// Writes the `admin` record of one action (what, by whom, with what outcome) and waits until
/// it is on disk: the caller answers only then, so an acknowledged action is never lost in a
/// crash (issue 13, point 5). The wait (one fsync) runs on the blocking pool, not on the
/// control plane's only thread. `Err`: the record could not be written; the action took
/// effect, the flight recorder has failed closed, and the answer must say so.
async fn record_action(
    shared: &Arc<HaltCore>,
    actor: &AdminActor,
    action: serde_json::Value,
    status: StatusCode,
) -> Result<(), Response> {
    let rec = admin_record(shared, actor, action, status);
    let core = Arc::clone(shared);
    let written = tokio::task::spawn_blocking(move || core.record_durable(rec)).await;
    match written {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(unrecorded(&e)),
        Err(e) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "recorder_failure",
            format!("recording the action: {e}"),
        )),
    }
}

/// The `admin` record of one action: what (`action`), by whom, with what outcome.
fn admin_record(
    shared: &HaltCore,
    actor: &AdminActor,
    action: serde_json::Value,
    status: StatusCode,
) -> Record {
    let mut admin = action;
    admin["actor"] = json!(actor);
    admin["status"] = json!(status.as_u16());
    tracing::info!(admin = %admin, "admin action");
    Record {
        kind: RecordKind::Admin,
        kernel_gate: shared.kernel_gate_label().to_owned(),
        stream_id: admin["stream_id"].as_str().map(str::to_owned),
        admin: Some(admin),
        ..Record::default()
    }
}

/// The answer to an action whose record could not be written.
fn unrecorded(e: &crate::ledger::LedgerError) -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "recorder_failure",
        format!("the action took effect but its record could not be written ({e}); the flight recorder failed closed"),
    )
}

async fn streams(State(shared): State<Arc<HaltCore>>) -> Response {
    let list: Vec<_> = shared
        .table
        .live()
        .map(|(idx, slot)| {
            let s = slot.snapshot(idx);
            json!({
                "stream_id": s.id.to_string(),
                "state": s.state,
                "mode": s.mode,
                "endpoint": s.endpoint,
                "tokens": s.tokens_submitted,
                "tokens_delivered": s.tokens_delivered,
                "trip_cause": s.trip_cause,
                "trip_token_index": s.trip_cause.map(|_| s.trip_token_index),
                "age_ms": monotonic_ns().saturating_sub(s.started_ns) / 1_000_000,
            })
        })
        .collect();
    Json(json!({"streams": list})).into_response()
}

async fn status(State(shared): State<Arc<HaltCore>>) -> Response {
    let now = monotonic_ns();
    let hb = shared.heartbeat_view(now);
    Json(json!({
        // Which daemon answered: an operator with several on a node tells them apart here.
        "pid": std::process::id(),
        "listen": shared.cfg.args.listen.to_string(),
        "admin": shared.cfg.args.admin.to_string(),
        "version": crate::build_info::VERSION,
        "commit": crate::build_info::COMMIT,
        "ledger": shared.cfg.args.ledger.display().to_string(),
        "kernel_gate": shared.kernel_gate_label(),
        "cgroup": shared.gate.as_ref().map(|g| g.cgroup().display().to_string()),
        "budget": shared.cfg.args.budget,
        "heartbeat_fresh": hb.fresh,
        "heartbeat_state": hb.state,
        "heartbeat_age_ms": hb.age_ms_json(),
        "heartbeat_clock": hb.clock,
        "heartbeat_error": hb.error,
        "streams_active": shared.table.active_count(),
        "max_streams": shared.table.capacity(),
        "workers": shared.cfg.workers,
        "ledger_records": shared.ledger.records_written(),
        "source": format!("{:?}", shared.cfg.args.source).to_lowercase(),
        "degraded_scopes": shared.modes.degraded_count(),
    }))
    .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModeBody {
    mode: String,
    #[serde(default)]
    scope: Option<String>,
}

/// `GET /admin/mode`: the degraded scopes.
async fn mode_get(State(shared): State<Arc<HaltCore>>) -> Response {
    shared.expire_degraded();
    Json(shared.modes.degraded_view()).into_response()
}

/// `POST /admin/mode {"mode": "full", "scope": "all" | "node" | "key:<fingerprint>"}`: the
/// operator ends degraded safe mode. Entering it by hand is a trip, not a mode change.
async fn mode_set(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    body: Bytes,
) -> Response {
    let resp = mode_set_inner(&shared, &body);
    let request = serde_json::from_slice::<serde_json::Value>(&body).ok();
    let action = json!({"action": "mode", "request": request});
    match record_action(&shared, &actor, action, resp.status()).await {
        Ok(()) => resp,
        Err(unrecorded) => unrecorded,
    }
}

fn mode_set_inner(shared: &HaltCore, body: &[u8]) -> Response {
    let body: ModeBody = match serde_json::from_slice(body) {
        Ok(b) => b,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("invalid JSON body: {e}"),
            )
        }
    };
    if shared.cfg.args.lock_policy {
        shared.metrics.policy.refused.inc();
        tracing::warn!("ending degraded mode refused: --lock-policy is set");
        return error(
            StatusCode::CONFLICT,
            "policy_refused",
            "refused by --lock-policy: ending a degraded scope loosens the policy; it ends when its --degraded-for-s timer does",
        );
    }
    if body.mode != "full" {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!(
                "mode {:?}: only \"full\" can be set; degraded mode follows a halt (trip a stream to cause one)",
                body.mode
            ),
        );
    }
    let sel = match body.scope.as_deref().unwrap_or("all") {
        "all" => ScopeSel::All,
        "node" => ScopeSel::Node,
        other => match Scope::parse(other) {
            Some(k) => ScopeSel::Scope(k),
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    format!("scope {other:?}: expected all, node or addr:, header:, apikey: or key: and 16 hex digits"),
                )
            }
        },
    };
    let changes = shared.modes.set_full(sel);
    for ch in &changes {
        shared.record_mode_change(ch);
    }
    Json(json!({"changed": changes, "mode": shared.modes.degraded_view()})).into_response()
}

/// `GET /admin/state`: what the state store holds (what a restart restores), read once every
/// change queued before is written.
async fn state_get(State(shared): State<Arc<HaltCore>>) -> Response {
    let store = Arc::clone(&shared.state);
    let read = tokio::task::spawn_blocking(move || store.read()).await;
    match read {
        Ok(Ok(held)) => Json(json!({
            "path": shared.state.path().display().to_string(),
            "schema_version": crate::state::schema::VERSION,
            "held": held,
        }))
        .into_response(),
        Ok(Err(e)) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            e.to_string(),
        ),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("reading the state store: {e}"),
        ),
    }
}

/// `GET /admin/circuit`: TokenCircuit's conversations (`circuit::store`), most recently
/// used first.
async fn circuit_all(State(shared): State<Arc<HaltCore>>) -> Response {
    circuit_view(&shared, None)
}

/// `GET /admin/circuit/{id}`: the conversations named `id` (a header value or a prefix
/// digest; one per key fingerprint that used it); 404 when none is kept.
async fn circuit_one(State(shared): State<Arc<HaltCore>>, Path(id): Path<String>) -> Response {
    circuit_view(&shared, Some(&id))
}

fn circuit_view(shared: &HaltCore, id: Option<&str>) -> Response {
    let conversations = shared.circuits.view(id, std::time::Instant::now());
    let (kept, evicted) = shared.circuits.counts();
    if let (Some(id), true) = (id, conversations.is_empty()) {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no conversation {id:?} is kept (never seen, or evicted)"),
        );
    }
    Json(json!({
        "enabled": shared.cfg.tool_circuit.is_some(),
        "kept": kept,
        "evicted": evicted,
        "conversations": conversations,
        "unreconciled": shared.circuits.dispatched.list(false),
    }))
    .into_response()
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ReconcileQuery {
    #[serde(default)]
    all: bool,
}

/// `GET /admin/reconcile[?all=true]`: the dispatched calls of failed turns that wait for an
/// outcome (with `all`, the reconciled ones too), delivered first.
async fn reconcile_list(
    State(shared): State<Arc<HaltCore>>,
    axum::extract::Query(q): axum::extract::Query<ReconcileQuery>,
) -> Response {
    Json(json!({"calls": shared.circuits.dispatched.list(q.all)})).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReconcileBody {
    #[serde(rename = "ref")]
    reference: String,
    outcome: String,
}

/// `POST /admin/reconcile {"ref": R, "outcome": "done" | "not_done" | "compensated"}`: the
/// operator's outcome for a dispatched call, recorded in the ledger with the caller's
/// identity, then kept in the state store (crash order: the record first).
async fn reconcile(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    body: Bytes,
) -> Response {
    use crate::circuit::dispatched::Outcome;
    let parsed = serde_json::from_slice::<ReconcileBody>(&body)
        .map_err(|e| format!("invalid JSON body: {e}"))
        .and_then(|b| match Outcome::parse(&b.outcome) {
            Some(o) => Ok((b.reference, o)),
            None => Err(format!(
                "outcome {:?}: expected done, not_done or compensated",
                b.outcome
            )),
        });
    let (status, resp, call) = match parsed {
        Err(why) => (
            StatusCode::BAD_REQUEST,
            error(StatusCode::BAD_REQUEST, "invalid_request_error", why),
            None,
        ),
        Ok((reference, outcome)) => {
            let now = crate::clock::unix_ms_now();
            match shared
                .circuits
                .dispatched
                .reconcile(&reference, outcome, json!(actor), now)
            {
                Ok(c) => (
                    StatusCode::OK,
                    Json(json!({"call": c})).into_response(),
                    Some(c),
                ),
                Err(e) => {
                    let (status, kind) = match e {
                        crate::circuit::dispatched::ReconcileError::Unknown(_) => {
                            (StatusCode::NOT_FOUND, "not_found")
                        }
                        crate::circuit::dispatched::ReconcileError::Already { .. } => {
                            (StatusCode::CONFLICT, "conflict")
                        }
                    };
                    (status, error(status, kind, e.to_string()), None)
                }
            }
        }
    };
    let request = serde_json::from_slice::<serde_json::Value>(&body).ok();
    let mut action = json!({"action": "reconcile", "request": request, "call": call});
    if let Some(c) = &call {
        action["stream_id"] = json!(c.stream_id);
    }
    match record_action(&shared, &actor, action, status).await {
        Ok(()) => {
            if let Some(c) = &call {
                shared.circuits.dispatched.keep(c);
            }
            resp
        }
        Err(unrecorded) => unrecorded,
    }
}

/// `GET /admin/conversations`: committed per-conversation state (TURN-ACID).
async fn conversations(State(shared): State<Arc<HaltCore>>) -> Response {
    Json(json!({"conversations": shared.modes.conversations_view()})).into_response()
}

/// `GET /admin/limits`: this node's per-scope limits and what each scope used in its current
/// minute (`limits.rs`).
async fn limits(State(shared): State<Arc<HaltCore>>) -> Response {
    let l = shared.limits.limits();
    let scopes: Vec<serde_json::Value> = shared
        .limits
        .view(monotonic_ns())
        .into_iter()
        .map(|(scope, u)| json!({"scope": scope.name(), "in_flight": u.in_flight, "requests": u.requests, "tokens": u.tokens}))
        .collect();
    Json(json!({
        "limits": {
            "concurrency": l.concurrency,
            "requests_per_minute": l.requests_per_minute,
            "tokens_per_minute": l.tokens_per_minute,
        },
        "per": "node",
        "scopes": scopes,
    }))
    .into_response()
}

async fn metrics(State(shared): State<Arc<HaltCore>>) -> Response {
    let now = monotonic_ns();
    let hb = shared.heartbeat_view(now);
    let age = hb.age_s;
    shared
        .metrics
        .halts
        .heartbeat_age_seconds
        .set(if age.is_finite() { age } else { -1.0 });
    shared
        .metrics
        .halts
        .watchdog_idle
        .set(i64::from(hb.state == HeartbeatState::Idle));
    shared
        .metrics
        .ledger
        .records
        .set(shared.ledger.records_written() as i64);
    if let Some(gate) = &shared.gate {
        match gate.verdict_totals() {
            Ok(totals) => shared.metrics.gate.observe_kernel_totals(&totals),
            Err(e) => tracing::warn!(error = %e, "reading kernel verdict counters failed"),
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        shared.metrics.encode(),
    )
        .into_response()
}

/// Serves the admin API and the metrics endpoint until the process exits.
pub async fn serve(
    shared: Arc<HaltCore>,
    admin: AdminListener,
    metrics_listener: tokio::net::TcpListener,
) -> std::io::Result<()> {
    let guard = auth::Guard {
        token: shared.cfg.admin_token.clone().map(Arc::new),
    };
    let admin_app = Router::new()
        .route("/admin/streams/{id}/trip", post(trip::trip))
        .route("/admin/incidents/{id}/label", post(label::label))
        .route("/admin/streams", get(streams))
        .route("/admin/status", get(status))
        .route("/admin/mode", get(mode_get).post(mode_set))
        .route("/admin/policy", get(policy::get_policy))
        .route("/admin/detectors/{name}/mode", post(policy::set_mode))
        .route("/admin/profile", post(policy::set_profile))
        .route("/admin/conversations", get(conversations))
        .route("/admin/limits", get(limits))
        .route("/admin/keys", get(keys::list).post(keys::add))
        .route("/admin/keys/{id}/rotate", post(keys::rotate))
        .route("/admin/keys/{id}/revoke", post(keys::revoke))
        .route("/admin/state", get(state_get))
        .route("/admin/circuit", get(circuit_all))
        .route("/admin/circuit/{id}", get(circuit_one))
        .route("/admin/reconcile", get(reconcile_list).post(reconcile))
        .route("/admin/safety/check", post(safety::check))
        .route("/admin/handover", post(handover::handover))
        .layer(axum::middleware::from_fn_with_state(guard, auth::guard))
        .with_state(Arc::clone(&shared));
    // The degraded-mode timer: ends expired scopes (and records it) even when no turn comes.
    tokio::spawn(degraded_timer(Arc::clone(&shared)));
    let metrics_app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(shared);
    let m = axum::serve(metrics_listener, metrics_app);
    let admin_service = admin_app.into_make_service_with_connect_info::<AdminActor>();
    match admin {
        AdminListener::Unix(l) => {
            let a = axum::serve(tokio::net::UnixListener::from_std(l)?, admin_service);
            tokio::try_join!(async { a.await }, async { m.await })?;
        }
        AdminListener::Tcp(l) => {
            let a = axum::serve(tokio::net::TcpListener::from_std(l)?, admin_service);
            tokio::try_join!(async { a.await }, async { m.await })?;
        }
    }
    Ok(())
}

/// Ends degraded scopes when their timers run out, on the monotonic clock (a wall-clock step
/// changes no timer). It sleeps until the first expiry, at most a second, and with no timer
/// running until one is set: an idle haltd's control plane does not wake.
async fn degraded_timer(shared: Arc<HaltCore>) {
    const MAX_SLEEP: std::time::Duration = std::time::Duration::from_secs(1);
    const MIN_SLEEP: std::time::Duration = std::time::Duration::from_millis(1);
    loop {
        shared.expire_degraded();
        match shared.modes.next_expiry(crate::clock::monotonic_ns()) {
            None => shared.modes.timer_set().await,
            Some(d) => {
                tokio::select! {
                    () = tokio::time::sleep(d.clamp(MIN_SLEEP, MAX_SLEEP)) => {}
                    () = shared.modes.timer_set() => {}
                }
            }
        }
    }
}

/// Binds a control-plane listener, with the flag name in the error.
pub fn bind(
    addr: SocketAddr,
    flag: &str,
    sharing: crate::reuseport::Sharing,
) -> std::io::Result<std::net::TcpListener> {
    let listener = crate::reuseport::bind(addr, sharing)
        .and_then(|s| crate::reuseport::listen(s, 1024))
        .map_err(|e| std::io::Error::new(e.kind(), format!("binding --{flag} {addr}: {e}")))?;
    // tokio takes it over in the control plane's runtime, which needs it non-blocking.
    listener.set_nonblocking(true)?;
    Ok(listener)
}
