//! The key store's admin API (`haltctl key add|revoke|rotate|list`, `keys.rs`):
//!
//! - `GET /admin/keys`: every key, without secrets or hashes, with its limits and its use of
//!   the current minute;
//! - `POST /admin/keys` `{"name", "limits"?}`: a new key; the answer holds its secret, once;
//! - `POST /admin/keys/{id}/rotate` `{"overlap_s"?}`: a new secret; the old ones keep working
//!   for `overlap_s` (default [`DEFAULT_OVERLAP_S`]);
//! - `POST /admin/keys/{id}/revoke`: the key is refused from its next request; its open turns
//!   are tripped (`OPERATOR_TRIP`).
//!
//! Each change: the `admin` ledger record with the caller, written and synced first; then the
//! state store's row, waited for; then the registry; then the answer (`keys.rs`, crash order).

use std::sync::Arc;

use axum::{
    body::Bytes,
    extract::{Extension, Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    Json,
};
use serde::Deserialize;
use serde_json::json;

use super::{error, AdminActor};
use crate::{
    clock::{monotonic_ns, unix_ms},
    codes::FailureCode,
    halt::HaltCore,
    identity::KeyId,
    keys::{self, ClientKey, ClientKeys, KeyLimits},
    ledger::{Record, RecordKind},
    scope::Scope,
    state::{Change, ClientKeyRow},
    stream::Initiator,
};

/// The overlap of a rotation when the operator names none: a day.
pub const DEFAULT_OVERLAP_S: u64 = 86_400;

/// The longest overlap accepted: 30 days.
const MAX_OVERLAP_S: u64 = 30 * 86_400;

/// The longest key name.
const MAX_NAME: usize = 128;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AddBody {
    name: String,
    #[serde(default)]
    limits: KeyLimits,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RotateBody {
    overlap_s: Option<u64>,
}

fn now_ms() -> u64 {
    unix_ms(std::time::SystemTime::now())
}

fn bad(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

fn off() -> Response {
    error(
        StatusCode::CONFLICT,
        "key_store_off",
        "the key store is off: start haltd with --client-keys store to issue keys",
    )
}

/// The key `id` names.
fn find(shared: &HaltCore, id: &str) -> Option<ClientKey> {
    KeyId::parse_fingerprint(id).and_then(|k| shared.keys.get(k))
}

fn not_found(id: &str) -> Response {
    error(StatusCode::NOT_FOUND, "not_found", format!("no key {id:?}"))
}

/// Records the change (with the caller), stores it and waits, then puts it in the registry.
async fn commit(
    shared: &Arc<HaltCore>,
    actor: &AdminActor,
    action: serde_json::Value,
    key: ClientKey,
) -> Result<(), Response> {
    let mut admin = action;
    admin["actor"] = json!(actor);
    admin["status"] = json!(200);
    admin["key"] = json!(key.id.fingerprint());
    admin["name"] = json!(key.name);
    tracing::info!(admin = %admin, "admin action");
    let rec = Record {
        kind: RecordKind::Admin,
        kernel_gate: shared.kernel_gate_label().to_owned(),
        admin: Some(admin),
        ..Record::default()
    };
    let row = ClientKeyRow {
        id: key.id.fingerprint(),
        body: serde_json::to_value(&key).unwrap_or_default(),
    };
    let core = Arc::clone(shared);
    let done = tokio::task::spawn_blocking(move || {
        core.record_durable(rec)?;
        core.state.apply(None, vec![Change::ClientKey(row)]);
        core.state.flush();
        Ok::<_, crate::ledger::LedgerError>(core.state.is_failed())
    })
    .await;
    match done {
        Ok(Ok(false)) => {
            shared.keys.put(key);
            Ok(())
        }
        Ok(Ok(true)) => Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "state_failure",
            "the change was recorded but the state store failed; haltd fails closed",
        )),
        Ok(Err(e)) => Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "recorder_failure",
            format!("the change's record could not be written ({e}); nothing changed"),
        )),
        Err(e) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "recorder_failure",
            format!("recording the change: {e}"),
        )),
    }
}

/// `GET /admin/keys`.
pub(super) async fn list(State(shared): State<Arc<HaltCore>>) -> Response {
    let usage = shared.limits.view(monotonic_ns());
    let node = shared.limits.limits();
    let keys: Vec<serde_json::Value> = shared
        .keys
        .list(now_ms())
        .into_iter()
        .map(|k| {
            let mut v = json!(k);
            let id = KeyId::parse_fingerprint(&k.id).unwrap_or(KeyId(0));
            let used = usage.iter().find(|(s, _)| *s == Scope::of_api_key(id));
            v["usage"] = json!(used.map(|(_, u)| *u).unwrap_or_default());
            v["limits_in_force"] = json!(k.limits.over(node));
            v
        })
        .collect();
    Json(json!({
        "client_keys": shared.cfg.args.client_keys == ClientKeys::Store,
        "keys": keys,
    }))
    .into_response()
}

/// `POST /admin/keys`.
pub(super) async fn add(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    body: Bytes,
) -> Response {
    if shared.cfg.args.client_keys == ClientKeys::Off {
        return off();
    }
    let body: AddBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return bad(format!("invalid JSON body: {e}")),
    };
    let name = body.name.trim();
    if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
        return bad(format!(
            "name: 1 to {MAX_NAME} bytes without control characters"
        ));
    }
    let id = keys::new_id(|k| shared.keys.contains(k));
    let secret = keys::new_secret(id);
    let key = ClientKey {
        id,
        name: name.to_owned(),
        created_unix_ms: now_ms(),
        revoked_unix_ms: None,
        secrets: vec![secret.hash],
        limits: body.limits,
    };
    let action = json!({"action": "key_add", "limits": body.limits});
    if let Err(r) = commit(&shared, &actor, action, key.clone()).await {
        return r;
    }
    let mut answer = json!(key.view(now_ms()));
    answer["secret"] = json!(secret.token);
    (StatusCode::CREATED, Json(answer)).into_response()
}

/// `POST /admin/keys/{id}/rotate`.
pub(super) async fn rotate(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let body: RotateBody = if body.is_empty() {
        RotateBody::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => return bad(format!("invalid JSON body: {e}")),
        }
    };
    let overlap_s = body.overlap_s.unwrap_or(DEFAULT_OVERLAP_S);
    if overlap_s > MAX_OVERLAP_S {
        return bad(format!("overlap_s: at most {MAX_OVERLAP_S} (30 days)"));
    }
    let key = match find(&shared, &id) {
        Some(k) if k.is_revoked() => {
            return error(
                StatusCode::CONFLICT,
                "revoked",
                format!("key {id} is revoked"),
            )
        }
        Some(k) => k,
        None => return not_found(&id),
    };
    let (next, token) = keys::rotated(&key, overlap_s.saturating_mul(1000), now_ms());
    let action = json!({"action": "key_rotate", "overlap_s": overlap_s});
    if let Err(r) = commit(&shared, &actor, action, next.clone()).await {
        return r;
    }
    let mut answer = json!(next.view(now_ms()));
    answer["secret"] = json!(token);
    Json(answer).into_response()
}

/// `POST /admin/keys/{id}/revoke`.
pub(super) async fn revoke(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    Path(id): Path<String>,
) -> Response {
    let Some(mut key) = find(&shared, &id) else {
        return not_found(&id);
    };
    if key.is_revoked() {
        return Json(json!({"key": key.view(now_ms()), "changed": false, "tripped": []}))
            .into_response();
    }
    key.revoked_unix_ms = Some(now_ms());
    let tripped_before = open_turns(&shared, key.id);
    let action = json!({"action": "key_revoke", "open_turns": tripped_before});
    if let Err(r) = commit(&shared, &actor, action, key.clone()).await {
        return r;
    }
    // Refused from the next request on; the turns it has open are halted.
    let tripped: Vec<String> = open_turns(&shared, key.id)
        .into_iter()
        .filter(|sid| {
            sid.parse()
                .ok()
                .and_then(|s| {
                    shared
                        .trip_by(s, FailureCode::OperatorTrip, Initiator::Operator)
                        .ok()
                })
                .is_some()
        })
        .collect();
    Json(json!({"key": key.view(now_ms()), "changed": true, "tripped": tripped})).into_response()
}

/// The stream ids of the turns key `id` has open.
fn open_turns(shared: &HaltCore, id: KeyId) -> Vec<String> {
    let apikey = Scope::of_api_key(id);
    shared
        .table
        .live()
        .map(|(idx, slot)| slot.snapshot(idx))
        .filter(|s| s.scope() == apikey && s.trip_cause.is_none())
        .map(|s| s.id.to_string())
        .collect()
}
