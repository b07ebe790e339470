//! HTTP from a test thread (in whatever namespace it joined): the ureq agent every client
//! uses, admin trips and JSON GETs.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde_json::Value;

/// A ureq agent for talking to haltd: statuses are not errors, no proxy, a global timeout.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .max_redirects(0)
        .timeout_global(Some(timeout))
        .build()
        .into()
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
