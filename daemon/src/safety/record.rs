//! What a verdict records of its inputs (`safety_verdict.inputs`), and the check context read
//! back from a turn record: `POST /admin/safety/check` and `haltctl safety check` judge a
//! record again with the daemon's registry from it.
//!
//! The record keeps no prompt or output text: URLs as their [`super::url_digest`] (at most
//! [`MAX_RECORDED_URL_KEYS`] per set; a larger set is recorded as `null`, so a second
//! judgement of it is not checkable), identities as model names and system prompt digests.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{inputs::is_url_key, ModelIdentity, SafetyContext, TextDelivery, UrlKeys};

/// Most URL keys of one set the record keeps.
pub const MAX_RECORDED_URL_KEYS: usize = 64;

/// A verdict's inputs as the record keeps them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedInputs {
    pub request_source_urls: Option<UrlKeys>,
    pub cited_urls: Option<UrlKeys>,
    pub text_delivery: Option<TextDelivery>,
    pub identity_before: Option<ModelIdentity>,
    pub identity_after: Option<ModelIdentity>,
    pub versor_condition: Option<f64>,
}

fn bounded(keys: Option<&UrlKeys>) -> Option<UrlKeys> {
    keys.filter(|k| k.len() <= MAX_RECORDED_URL_KEYS).cloned()
}

impl RecordedInputs {
    /// What the record keeps of `ctx`.
    pub fn of(ctx: &SafetyContext) -> Self {
        RecordedInputs {
            request_source_urls: bounded(ctx.request_source_urls.as_ref()),
            cited_urls: bounded(ctx.cited_urls.as_ref()),
            text_delivery: ctx.text_delivery,
            identity_before: ctx.identity_before.clone(),
            identity_after: ctx.identity_after.clone(),
            versor_condition: ctx.versor_condition,
        }
    }

    /// The check context these inputs describe.
    pub fn context(self) -> SafetyContext {
        SafetyContext {
            request_source_urls: self.request_source_urls,
            cited_urls: self.cited_urls,
            text_delivery: self.text_delivery,
            identity_before: self.identity_before,
            identity_after: self.identity_after,
            versor_condition: self.versor_condition,
        }
    }
}

/// Why a body is not a turn record SafetyCheck can judge.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("body is not JSON: {0}")]
    Json(serde_json::Error),
    #[error("body is not a turn record: not a JSON object")]
    NotObject,
    #[error("body is not a turn record: \"kind\" is {0}, not \"turn\"")]
    NotTurn(String),
    #[error("turn record has no \"safety_verdict\" object")]
    NoVerdict,
    #[error("turn record's safety_verdict has no \"inputs\" (written before haltd recorded them)")]
    NoInputs,
    #[error("turn record's safety_verdict.inputs: {0}")]
    BadInputs(String),
}

/// The check context of a turn record, as the ledger writes it (one JSON object).
pub fn context_from_record(body: &[u8]) -> Result<SafetyContext, RecordError> {
    let v: Value = serde_json::from_slice(body).map_err(RecordError::Json)?;
    let Value::Object(rec) = v else {
        return Err(RecordError::NotObject);
    };
    match rec.get("kind") {
        Some(Value::String(k)) if k == "turn" => {}
        Some(other) => return Err(RecordError::NotTurn(other.to_string())),
        None => return Err(RecordError::NotTurn("missing".to_owned())),
    }
    let Some(Value::Object(verdict)) = rec.get("safety_verdict") else {
        return Err(RecordError::NoVerdict);
    };
    let inputs = verdict.get("inputs").ok_or(RecordError::NoInputs)?;
    let inputs =
        RecordedInputs::deserialize(inputs).map_err(|e| RecordError::BadInputs(e.to_string()))?;
    for (key, set) in [
        ("request_source_urls", &inputs.request_source_urls),
        ("cited_urls", &inputs.cited_urls),
    ] {
        if let Some(bad) = set.iter().flatten().find(|k| !is_url_key(k)) {
            return Err(RecordError::BadInputs(format!(
                "{key}: {bad:?} is not a URL key (16 lower-case hex digits)"
            )));
        }
    }
    Ok(inputs.context())
}
