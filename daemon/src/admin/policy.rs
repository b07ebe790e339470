//! The policy at runtime (issue 37): `GET /admin/policy` (`haltctl detector list`),
//! `POST /admin/detectors/{name}/mode` (`haltctl detector mode`) and `POST /admin/profile`
//! (`haltctl profile set`).
//!
//! A switch rebuilds the policy set ([`HaltCore::prepare_policy`]): it applies to turns that
//! start afterwards and never to an open stream, which keeps the route and detectors it
//! started with. A switch that breaks the profile's floor, or that `--lock-policy` finds
//! loosening, is refused with 409 and changes nothing. Either way the action is an `admin`
//! record naming the operator, on disk before the answer (an incident-class record: never
//! sampled). An applied switch is then kept in the state store, so a restart keeps it.

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

use super::{record_action, AdminActor};
use crate::{
    detect::{pipeline::DETECTORS, DetectorId, DetectorMode},
    halt::{HaltCore, PolicyChangeError},
    policy::{policy_of, PolicySet, Profile},
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModeBody {
    mode: String,
    route: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileBody {
    profile: String,
}

/// The policy in force: profile, lock, and per route its B, batch-only, and each detector's
/// mode with its counts in that mode.
pub(super) fn view(shared: &HaltCore, set: &PolicySet) -> Value {
    let m = &shared.metrics.policy;
    let routes: Vec<Value> = set
        .routes
        .iter()
        .map(|r| {
            let detectors: Vec<Value> = DETECTORS
                .iter()
                .filter_map(|id| {
                    let p = policy_of(&r.detectors.cfg, *id)?;
                    let [judged, findings, trips] = m.counts(*id, p.mode, &r.name);
                    Some(json!({"name": id.as_str(), "mode": p.mode.as_str(),
                        "judged": judged, "findings": findings, "trips": trips}))
                })
                .collect();
            json!({"name": &*r.name, "budget": r.budget, "batch_only": r.batch_only,
                "turn_sample_rate": r.turn_sample_rate, "detectors": detectors})
        })
        .collect();
    json!({
        "profile": set.profile.as_str(),
        "lock_policy": shared.cfg.args.lock_policy,
        "routes": routes,
        "switches": shared.policy_overrides(),
    })
}

/// `GET /admin/policy`.
pub(super) async fn get_policy(State(shared): State<Arc<HaltCore>>) -> Response {
    let set = shared.policy.load_full();
    Json(view(&shared, &set)).into_response()
}

/// `POST /admin/detectors/{name}/mode {"mode": "observe" | "hard", "route": R}`.
pub(super) async fn set_mode(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let request = serde_json::from_slice::<Value>(&body).ok();
    let (resp, applied) = set_mode_inner(&shared, &name, &body);
    let action = json!({"action": "detector_mode", "detector": name, "request": request,
        "outcome": outcome(&resp)});
    finish(&shared, &actor, action, resp, applied).await
}

/// `POST /admin/profile {"profile": "full" | "mkp"}`.
pub(super) async fn set_profile(
    State(shared): State<Arc<HaltCore>>,
    Extension(actor): Extension<AdminActor>,
    body: Bytes,
) -> Response {
    let request = serde_json::from_slice::<Value>(&body).ok();
    let (resp, applied) = set_profile_inner(&shared, &body);
    let action = json!({"action": "profile", "request": request, "outcome": outcome(&resp)});
    finish(&shared, &actor, action, resp, applied).await
}

/// What the answer said, for the record: applied, refused (and why), or a bad request.
fn outcome(resp: &(StatusCode, Value)) -> Value {
    match resp.0 {
        StatusCode::OK => json!("applied"),
        StatusCode::CONFLICT => json!({"refused": resp.1["error"]["message"]}),
        _ => json!({"invalid": resp.1["error"]["message"]}),
    }
}

/// Records the action, then keeps an applied switch in the state store (after its record,
/// as every change of the store).
async fn finish(
    shared: &Arc<HaltCore>,
    actor: &AdminActor,
    action: Value,
    (status, body): (StatusCode, Value),
    applied: bool,
) -> Response {
    if let Err(unrecorded) = record_action(shared, actor, action, status).await {
        return unrecorded;
    }
    if applied {
        let overrides = serde_json::to_value(shared.policy_overrides()).unwrap_or_default();
        shared
            .state
            .apply(None, vec![crate::state::Change::RuntimePolicy(overrides)]);
    }
    (status, Json(body)).into_response()
}

fn refused(e: &PolicyChangeError) -> (StatusCode, Value) {
    (
        StatusCode::CONFLICT,
        json!({"error": {"type": "policy_refused", "message": e.to_string()}}),
    )
}

fn invalid(message: String) -> (StatusCode, Value) {
    (
        StatusCode::BAD_REQUEST,
        json!({"error": {"type": "invalid_request_error", "message": message}}),
    )
}

fn set_mode_inner(shared: &HaltCore, name: &str, body: &[u8]) -> ((StatusCode, Value), bool) {
    let Some(id) = DETECTORS.into_iter().find(|d| d.as_str() == name) else {
        let known: Vec<&str> = DETECTORS.iter().map(|d| d.as_str()).collect();
        return (
            invalid(format!(
                "unknown detector {name:?} (known: {})",
                known.join(", ")
            )),
            false,
        );
    };
    let body: ModeBody = match serde_json::from_slice(body) {
        Ok(b) => b,
        Err(e) => return (invalid(format!("invalid JSON body: {e}")), false),
    };
    let mode = match body.mode.as_str() {
        "observe" => DetectorMode::Observe,
        "hard" => DetectorMode::Hard,
        m => {
            return (
                invalid(format!("mode {m:?}: expected observe or hard")),
                false,
            )
        }
    };
    let route = body.route.as_deref();
    if let Some(r) = route {
        let names = shared.policy_route_names();
        if !names.iter().any(|n| n == r) {
            let names = names.join(", ");
            return (
                invalid(format!("no route is named {r:?} (routes: {names})")),
                false,
            );
        }
    }
    let before = mode_on(&shared.policy.load(), id, route);
    match shared.prepare_policy(|i| i.overrides.set_mode(id, route, mode)) {
        Err(e) => (refused(&e), false),
        Ok(p) => {
            shared.install_policy(p);
            tracing::info!(
                detector = name,
                route = route.unwrap_or("every route"),
                mode = mode.as_str(),
                "detector mode switched at runtime; new turns take it"
            );
            let body = json!({"detector": name, "route": route.unwrap_or("*"),
                "mode": mode.as_str(), "before": before,
                "applies_to": "turns that start from now; open streams keep their mode"});
            ((StatusCode::OK, body), true)
        }
    }
}

/// The mode of `id` on `route` (every route: each route's), before a switch.
fn mode_on(set: &PolicySet, id: DetectorId, route: Option<&str>) -> Value {
    let routes = set
        .routes
        .iter()
        .filter(|r| route.is_none_or(|n| *r.name == *n));
    let modes: serde_json::Map<String, Value> = routes
        .filter_map(|r| {
            let p = policy_of(&r.detectors.cfg, id)?;
            Some((r.name.to_string(), json!(p.mode.as_str())))
        })
        .collect();
    Value::Object(modes)
}

fn set_profile_inner(shared: &HaltCore, body: &[u8]) -> ((StatusCode, Value), bool) {
    let body: ProfileBody = match serde_json::from_slice(body) {
        Ok(b) => b,
        Err(e) => return (invalid(format!("invalid JSON body: {e}")), false),
    };
    let Some(profile) = Profile::parse(&body.profile) else {
        return (
            invalid(format!("profile {:?}: expected full or mkp", body.profile)),
            false,
        );
    };
    let before = shared.policy.load().profile;
    match shared.prepare_policy(|i| i.overrides.profile = Some(profile)) {
        Err(e) => (refused(&e), false),
        Ok(p) => {
            let set = shared.install_policy(p);
            tracing::info!(profile = %profile, before = %before, "profile switched at runtime; new turns take it");
            let routes: Vec<&str> = set.routes.iter().map(|r| &*r.name).collect();
            let body = json!({"profile": profile.as_str(), "before": before.as_str(),
                "routes": routes,
                "applies_to": "turns that start from now; open streams keep their route"});
            ((StatusCode::OK, body), true)
        }
    }
}
