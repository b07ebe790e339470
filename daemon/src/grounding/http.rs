//! The grounding arms' HTTP client (registered tools, the search endpoint): ureq, blocking,
//! no proxy from the environment, no redirects, a small body limit, and every request's
//! timeout set to what is left of the arm's deadline. That timeout covers connecting and
//! reading but not name resolution, which is why the router also waits with its own
//! deadline ([`super::router`]).

use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use super::arm::ArmError;

/// The most bytes read of an answer.
pub const MAX_BODY_BYTES: u64 = 1 << 20;

/// An agent with the settings above.
pub fn agent() -> ureq::Agent {
    config().new_agent()
}

/// The settings of [`agent`], for building one with other parts (tests use a slow
/// resolver).
pub fn config() -> ureq::config::Config {
    ureq::Agent::config_builder()
        .proxy(None)
        .max_redirects(0)
        .http_status_as_error(true)
        .user_agent(concat!("haltd-grounding/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// What is left before `deadline` (at least 1 ms: ureq reads zero as "no timeout").
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn http_err(what: &str) -> impl FnOnce(ureq::Error) -> ArmError + '_ {
    move |e| ArmError::Http {
        what: what.to_owned(),
        source: Box::new(e),
    }
}

fn read<T: DeserializeOwned>(
    what: &str,
    mut resp: ureq::http::Response<ureq::Body>,
) -> Result<T, ArmError> {
    resp.body_mut()
        .with_config()
        .limit(MAX_BODY_BYTES)
        .read_json()
        .map_err(|e| ArmError::BadAnswer {
            what: what.to_owned(),
            reason: e.to_string(),
        })
}

/// `GET url?k=v...`, its JSON answer.
pub fn get_json<T: DeserializeOwned>(
    agent: &ureq::Agent,
    what: &str,
    url: &str,
    query: &[(&str, &str)],
    deadline: Instant,
) -> Result<T, ArmError> {
    let resp = agent
        .get(url)
        .query_pairs(query.iter().copied())
        .config()
        .timeout_global(Some(left(deadline)))
        .build()
        .call()
        .map_err(http_err(what))?;
    read(what, resp)
}

/// `POST url` with a JSON body, its JSON answer.
pub fn post_json<T: DeserializeOwned>(
    agent: &ureq::Agent,
    what: &str,
    url: &str,
    body: &serde_json::Value,
    deadline: Instant,
) -> Result<T, ArmError> {
    let resp = agent
        .post(url)
        .config()
        .timeout_global(Some(left(deadline)))
        .build()
        .send_json(body)
        .map_err(http_err(what))?;
    read(what, resp)
}
