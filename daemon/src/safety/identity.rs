//! `no_identity_override`: the identity a turn was answered under against the one requested,
//! and what counts as the same model under another name (an alias).
//!
//! An identity is a model name and the SHA-256 of the system prompt ([`ModelIdentity`]). The
//! system prompt must be the same byte for byte. The model names must be equal or aliases by
//! one of the [`AliasRule`]s, each a naming convention real backends answer with:
//!
//! * [`AliasRule::DatedSnapshot`]: OpenAI and Anthropic answer a floating name with the dated
//!   snapshot that served it: `gpt-4o` → `gpt-4o-2024-08-06`, `claude-3-5-sonnet` →
//!   `claude-3-5-sonnet-20241022`. Only that way round: a request that pinned a snapshot and
//!   got another one (or the floating name) is an override.
//! * [`AliasRule::OllamaLatest`]: Ollama answers `llama3` as `llama3:latest`.
//! * [`AliasRule::GgufFile`]: llama.cpp's server answers with the path of the GGUF file it
//!   loaded: `tiny` → `/models/tiny-q8_0.gguf`. The file's stem must be the requested name,
//!   or the requested name, one of `-._`, and a GGUF quantisation tag (`q8_0`, `Q4_K_M`,
//!   `iq2_xs`, `f16`, `bf16`, `f32`, `fp16`): `tiny-evil.gguf` is not `tiny`.
//! * [`AliasRule::Configured`]: both names are in one of the operator's
//!   `safety.model_aliases` groups: vLLM answers with the first of its `--served-model-name`s
//!   whichever one the request named, so `["llama-3-8b", "prod-chat"]` makes them one model.
//!
//! Names compare exactly (case matters) except the GGUF stem, which compares without case
//! (file names carry the quantisation tag in either case).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{missing, SafetyCheckResult, NO_IDENTITY_OVERRIDE};

/// One side of `no_identity_override`: a model name and the SHA-256 (hex) of the system
/// prompt (never the prompt itself).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelIdentity {
    pub model: String,
    pub system_prompt_sha256: String,
}

impl ModelIdentity {
    /// The identity of `model` under `system_prompt` ([`super::system_prompt`]).
    pub fn new(model: &str, system_prompt: &str) -> Self {
        ModelIdentity {
            model: model.to_owned(),
            system_prompt_sha256: hex::encode(Sha256::digest(system_prompt.as_bytes())),
        }
    }

    /// [`identity_digest`] of this identity.
    pub fn digest(&self) -> String {
        identity_digest(&self.model, &self.system_prompt_sha256)
    }
}

/// The identity digest the evidence names an identity by: hex SHA-256 over a domain tag, the
/// model name and the system prompt's SHA-256, each length-prefixed (no two pairs collide by
/// concatenation).
pub fn identity_digest(model: &str, system_prompt_sha256: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"haltd-identity-v2\0");
    for part in [model, system_prompt_sha256] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(h.finalize())
}

/// Why two model names are one model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AliasRule {
    /// The same name.
    Exact,
    /// The answer is the request's name and `-YYYY-MM-DD` or `-YYYYMMDD`.
    DatedSnapshot,
    /// The answer is the request's name and `:latest`.
    OllamaLatest,
    /// The answer is a GGUF file named after the request's name.
    GgufFile,
    /// Both names are in one `safety.model_aliases` group.
    Configured,
}

impl AliasRule {
    pub fn as_str(self) -> &'static str {
        match self {
            AliasRule::Exact => "exact",
            AliasRule::DatedSnapshot => "dated_snapshot",
            AliasRule::OllamaLatest => "ollama_latest",
            AliasRule::GgufFile => "gguf_file",
            AliasRule::Configured => "configured",
        }
    }
}

/// The operator's alias groups (`safety.model_aliases`): names in one group are one model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelAliases {
    groups: Vec<BTreeSet<String>>,
}

impl ModelAliases {
    pub fn new(groups: &[Vec<String>]) -> Self {
        ModelAliases {
            groups: groups.iter().map(|g| g.iter().cloned().collect()).collect(),
        }
    }

    fn same_group(&self, a: &str, b: &str) -> bool {
        self.groups.iter().any(|g| g.contains(a) && g.contains(b))
    }
}

/// `-YYYY-MM-DD` or `-YYYYMMDD`.
fn is_date_suffix(s: &str) -> bool {
    let Some(d) = s.strip_prefix('-') else {
        return false;
    };
    let b = d.as_bytes();
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    match b.len() {
        8 => digits(0..8),
        10 => digits(0..4) && b[4] == b'-' && digits(5..7) && b[7] == b'-' && digits(8..10),
        _ => false,
    }
}

/// A GGUF quantisation tag (`q8_0`, `Q4_K_M`, `iq2_xs`, `f16`, `bf16`, `fp16`, `f32`),
/// lower-cased.
fn is_quant_tag(tag: &str) -> bool {
    let digit_after = |p: &str| {
        tag.strip_prefix(p)
            .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
    };
    matches!(tag, "f16" | "f32" | "bf16" | "fp16" | "fp32") || digit_after("q") || digit_after("iq")
}

/// `answered` is a GGUF file (a path or a bare file name) whose stem is `requested`, or
/// `requested` and a quantisation tag.
fn is_gguf_of(requested: &str, answered: &str) -> bool {
    let file = answered.rsplit(['/', '\\']).next().unwrap_or(answered);
    let lower = file.to_lowercase();
    let Some(stem) = lower.strip_suffix(".gguf") else {
        return false;
    };
    let req = requested.to_lowercase();
    if req.is_empty() {
        return false;
    }
    if stem == req {
        return true;
    }
    stem.strip_prefix(req.as_str())
        .and_then(|r| r.strip_prefix(['-', '.', '_']))
        .is_some_and(is_quant_tag)
}

/// Whether the model `answered` is `requested` under another name, and by which rule.
pub fn alias_rule(requested: &str, answered: &str, aliases: &ModelAliases) -> Option<AliasRule> {
    if requested == answered {
        return Some(AliasRule::Exact);
    }
    if let Some(rest) = answered.strip_prefix(requested) {
        if !requested.is_empty() && is_date_suffix(rest) {
            return Some(AliasRule::DatedSnapshot);
        }
        if !requested.is_empty() && !requested.contains(':') && rest == ":latest" {
            return Some(AliasRule::OllamaLatest);
        }
    }
    if is_gguf_of(requested, answered) {
        return Some(AliasRule::GgufFile);
    }
    aliases
        .same_group(requested, answered)
        .then_some(AliasRule::Configured)
}

/// `no_identity_override` with the operator's alias groups: holds iff the system prompt is
/// unchanged and the answered model is the requested one or an alias of it
/// ([`alias_rule`]); checkable only when both identities are known.
pub fn no_identity_override(
    ctx: &super::SafetyContext,
    aliases: &ModelAliases,
) -> SafetyCheckResult {
    let id = NO_IDENTITY_OVERRIDE;
    let (before, after) = match (&ctx.identity_before, &ctx.identity_after) {
        (Some(b), Some(a)) => (b, a),
        (None, Some(_)) => return missing(id, "identity_before"),
        (Some(_), None) => return missing(id, "identity_after"),
        (None, None) => return missing(id, "identity_before and identity_after"),
    };
    let rule = alias_rule(&before.model, &after.model, aliases);
    let result = if before.system_prompt_sha256 != after.system_prompt_sha256 {
        SafetyCheckResult::violated(
            id,
            "the system prompt the turn was answered under differs from the one requested",
        )
    } else if rule.is_none() {
        SafetyCheckResult::violated(
            id,
            "the model that answered is neither the one requested nor an alias of it \
             (exact, dated snapshot, :latest, its GGUF file, or a safety.model_aliases group)",
        )
    } else {
        SafetyCheckResult::upheld(id, "the turn was answered under the identity requested")
    };
    let mut result = result
        .with_evidence("identity_before", before.digest())
        .with_evidence("identity_after", after.digest())
        .with_evidence("model_requested", before.model.as_str())
        .with_evidence("model_answered", after.model.as_str());
    if let Some(rule) = rule {
        result = result.with_evidence("alias", rule.as_str());
    }
    result
}
