//! HTTP from a test thread (in whatever namespace it joined): the ureq agent every client
//! uses, admin trips and JSON GETs.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde_json::Value;

/// A ureq agent for talking to haltd: statuses are not errors, no proxy, a global timeout.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .middleware(authenticate_admin)
        .http_status_as_error(false)
        .proxy(None)
        .max_redirects(0)
        .timeout_global(Some(timeout))
        .build()
        .into()
}

/// The admin token every test haltd is started with (`--admin-token-file`).
pub const TEST_ADMIN_TOKEN: &str = "haltd-test-admin-token-0123456789";

/// Requests to the admin API (`/admin/...`) carry the test admin token, and say JSON when they
/// send a body, unless the test set those headers itself (to test their absence, say).
fn authenticate_admin(
    mut req: ureq::http::Request<ureq::SendBody>,
    next: ureq::middleware::MiddlewareNext,
) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
    if req.uri().path().starts_with("/admin/") {
        let headers = req.headers_mut();
        if !headers.contains_key("authorization") {
            let value = format!("Bearer {TEST_ADMIN_TOKEN}");
            if let Ok(v) = ureq::http::HeaderValue::from_str(&value) {
                headers.insert("authorization", v);
            }
        }
        if !headers.contains_key("content-type") {
            headers.insert(
                "content-type",
                ureq::http::HeaderValue::from_static("application/json"),
            );
        }
    }
    next.handle(req)
}

/// A response header as a string.
pub fn header<B>(resp: &ureq::http::Response<B>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// POSTs a trip from the current thread's namespace.
pub fn trip_here(url: &str, cause: Option<&str>) -> Result<(u16, Value)> {
    let req = agent(Duration::from_secs(10)).post(url);
    let resp = match cause {
        Some(cause) => req.send_json(serde_json::json!({ "cause": cause })),
        None => req.send_empty(),
    };
    let mut resp = resp.with_context(|| format!("POST {url}"))?;
    let status = resp.status().as_u16();
    let body = resp.body_mut().read_to_string().unwrap_or_default();
    Ok((status, serde_json::from_str(&body).unwrap_or(Value::Null)))
}

/// POSTs `body` as JSON from the current thread's namespace: the status and the JSON answer.
pub fn post_json_here(url: &str, body: &Value) -> Result<(u16, Value)> {
    let mut resp = agent(Duration::from_secs(10))
        .post(url)
        .send_json(body)
        .with_context(|| format!("POST {url}"))?;
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
}

/// GETs JSON from the current thread's namespace.
pub fn get_json_here(url: &str) -> Result<Value> {
    let mut resp = agent(Duration::from_secs(10))
        .get(url)
        .call()
        .with_context(|| format!("GET {url}"))?;
    ensure!(resp.status() == 200, "GET {url}: status {}", resp.status());
    resp.body_mut()
        .read_json()
        .with_context(|| format!("GET {url}: body is not JSON"))
}
