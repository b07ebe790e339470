//! `--escalation-url` and its flags: where a scope's entry into degraded mode is escalated to
//! a human (spec 000 §4.2 step 4), checked and read at start (`escalation.rs` delivers).

use std::{sync::Arc, time::Duration};

use super::{err, ConfigError, ServeArgs};
use crate::upstream::{url::UpstreamUrl, UpstreamApiKey, UpstreamTls};

/// Most attempts of one escalation (`--escalation-attempts`).
pub const MAX_ATTEMPTS: u32 = 20;
/// Longest `--escalation-deadline-ms`: ten minutes.
pub const MAX_DEADLINE_MS: u64 = 600_000;

/// Where and how escalations go.
#[derive(Debug)]
pub struct Escalation {
    /// The endpoint: scheme, host, port; its whole path is [`Escalation::path`].
    pub url: UpstreamUrl,
    /// The request target (the URL's path, `/` when it has none).
    pub path: String,
    /// Trust roots, server name and ALPN of the `https://` endpoint.
    pub tls: Arc<UpstreamTls>,
    /// `Bearer <token>` of `--escalation-token-file`, if any (its `Debug` hides it).
    pub authorization: Option<UpstreamApiKey>,
    pub attempts: u32,
    /// For all attempts and their backoff together.
    pub deadline: Duration,
}

impl ServeArgs {
    /// `--escalation-url` and the flags that go with it; `None` without it. The URL is
    /// `https://` only (an incident names clients' scopes), its token file is read now.
    pub(super) fn escalation(&self) -> Result<Option<Arc<Escalation>>, ConfigError> {
        let Some(raw) = &self.escalation_url else {
            for (set, flag) in [
                (
                    self.escalation_token_file.is_some(),
                    "escalation-token-file",
                ),
                (self.escalation_ca_file.is_some(), "escalation-ca-file"),
            ] {
                if set {
                    return Err(err(flag, "is only used with --escalation-url"));
                }
            }
            return Ok(None);
        };
        let mut url = UpstreamUrl::parse(raw).map_err(|e| err("escalation-url", e.to_string()))?;
        if !url.tls {
            return Err(err(
                "escalation-url",
                "must be https://: an escalation names the degraded scope and its incident",
            ));
        }
        if !(1..=MAX_ATTEMPTS).contains(&self.escalation_attempts) {
            return Err(err(
                "escalation-attempts",
                format!("must be 1 to {MAX_ATTEMPTS}"),
            ));
        }
        if !(100..=MAX_DEADLINE_MS).contains(&self.escalation_deadline_ms) {
            return Err(err(
                "escalation-deadline-ms",
                format!("must be 100 to {MAX_DEADLINE_MS}"),
            ));
        }
        let tls = UpstreamTls::load(&url, self.escalation_ca_file.as_deref())
            .map_err(|e| err("escalation-ca-file", e.to_string()))?;
        let authorization = match &self.escalation_token_file {
            None => None,
            Some(p) => Some(UpstreamApiKey::read(p).map_err(|e| err("escalation-token-file", e))?),
        };
        // The URL's path is the target itself, not a base that API paths go below.
        let path = std::mem::take(&mut url.base_path);
        let path = if path.is_empty() {
            "/".to_owned()
        } else {
            path
        };
        Ok(Some(Arc::new(Escalation {
            url,
            path,
            tls: Arc::new(tls),
            authorization,
            attempts: self.escalation_attempts,
            deadline: Duration::from_millis(self.escalation_deadline_ms),
        })))
    }
}
