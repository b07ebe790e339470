//! `[grounding]` of the config file: the arms a grounding round may use, their deadlines and
//! orders, and the most rounds per reply. Read once at start (the memory store is indexed
//! then). Whether rounds happen at all is the surprise detector's mode (`intervene`); this
//! section only says how a round grounds.
//!
//! ```toml
//! [grounding]
//! max_rounds = 2
//! round_deadline_ms = 2000
//! arm_deadline_ms = 800
//! order_computable = ["memory", "tool", "web"]
//! order_other = ["memory", "web", "tool"]
//!
//! [grounding.memory]
//! dir = "/var/lib/haltd/grounding"
//! floor = 2.0
//!
//! [grounding.tool]
//! evaluator = true
//!
//! [grounding.tool.http.status]
//! url = "http://127.0.0.1:9100/status"
//! method = "GET"
//! pattern = "(?i)\\b(status|uptime|is down)\\b"
//!
//! [grounding.web]
//! endpoint = "http://127.0.0.1:8888"
//!
//! # how a proxied reply is resumed after a rewind: "vllm" | "llama_cpp" | "none"
//! # (set at the top of [grounding], with max_rounds)
//! ```

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

use super::ArmKind;

/// Most rounds per reply a config may allow.
pub const MAX_ROUNDS: u32 = 10;
/// The longest round deadline (ms): a round pauses the reply, so it must stay short.
pub const MAX_ROUND_DEADLINE_MS: u64 = 30_000;
/// Most snippets one arm may keep.
pub const MAX_RESULTS: usize = 20;

/// The section as written, with its defaults.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GroundingConfig {
    /// Most grounding rounds per reply (default 2).
    pub max_rounds: u32,
    /// A round's deadline, all arms together (default 2000 ms).
    pub round_deadline_ms: u64,
    /// Each arm's deadline within the round (default 800 ms).
    pub arm_deadline_ms: u64,
    /// Arm order for computable spans (default memory, tool, web).
    pub order_computable: Vec<ArmKind>,
    /// Arm order for the other spans (default memory, web, tool).
    pub order_other: Vec<ArmKind>,
    /// The memory arm: off without `dir`.
    pub memory: MemoryConfig,
    /// The tool arm.
    pub tool: ToolConfig,
    /// The web arm: off without `endpoint`.
    pub web: WebConfig,
    /// How a proxied reply is resumed after a rewind: `"vllm"`, `"llama_cpp"` or `"none"`
    /// (default: the post-hoc fallback; docs/wire-format.md "Grounded continuation").
    pub continuation: super::plan::Continuation,
}

impl Default for GroundingConfig {
    fn default() -> Self {
        GroundingConfig {
            max_rounds: 2,
            round_deadline_ms: 2000,
            arm_deadline_ms: 800,
            order_computable: vec![ArmKind::Memory, ArmKind::Tool, ArmKind::Web],
            order_other: vec![ArmKind::Memory, ArmKind::Web, ArmKind::Tool],
            memory: MemoryConfig::default(),
            tool: ToolConfig::default(),
            web: WebConfig::default(),
            continuation: super::plan::Continuation::None,
        }
    }
}

/// `[grounding.memory]`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// The document store: a directory of `.txt` and `.md` files, read recursively at start.
    pub dir: Option<PathBuf>,
    /// The relevance floor: passages scoring below it (BM25) are not evidence (default 2.0).
    pub floor: f32,
    /// Most snippets kept (default 3).
    pub max_results: usize,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            dir: None,
            floor: 2.0,
            max_results: 3,
        }
    }
}

/// `[grounding.tool]`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolConfig {
    /// The built-in evaluator: arithmetic, dates, unit conversions (default on).
    pub evaluator: bool,
    /// Operator-registered HTTP tools, by name.
    pub http: BTreeMap<String, HttpToolConfig>,
}

impl Default for ToolConfig {
    fn default() -> Self {
        ToolConfig {
            evaluator: true,
            http: BTreeMap::new(),
        }
    }
}

/// How an HTTP tool is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub enum HttpMethod {
    /// `GET url?q=<span>`.
    #[serde(rename = "GET")]
    Get,
    /// `POST url` with `{"span", "context", "prompt"}`.
    #[serde(rename = "POST")]
    Post,
}

/// `[grounding.tool.http.NAME]`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HttpToolConfig {
    /// An `http://` URL.
    pub url: String,
    /// `GET` (default) or `POST`.
    #[serde(default = "default_method")]
    pub method: HttpMethod,
    /// A regular expression: the tool is called for spans it matches.
    pub pattern: String,
}

fn default_method() -> HttpMethod {
    HttpMethod::Get
}

/// `[grounding.web]`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebConfig {
    /// The SearxNG-compatible endpoint's base URL (`http://`); none: the arm is off.
    pub endpoint: Option<String>,
    /// Most results kept (default 3).
    pub max_results: usize,
}

impl Default for WebConfig {
    fn default() -> Self {
        WebConfig {
            endpoint: None,
            max_results: 3,
        }
    }
}

/// A bad `[grounding]` value, with the key it is at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct SectionError {
    /// The dotted key (`grounding.memory.floor`).
    pub key: String,
    pub reason: String,
}

fn bad(key: impl Into<String>, reason: impl Into<String>) -> SectionError {
    SectionError {
        key: key.into(),
        reason: reason.into(),
    }
}

impl GroundingConfig {
    /// Reads the section (`None`: absent, the defaults).
    pub fn load(section: Option<toml::Value>) -> Result<Self, SectionError> {
        let Some(value) = section else {
            return Ok(GroundingConfig::default());
        };
        if !value.is_table() {
            return Err(bad("grounding", "must be a table ([grounding])"));
        }
        GroundingConfig::deserialize(value)
            .map_err(|e| bad("grounding", e.message().to_owned()))?
            .validate()
    }

    /// The per-arm deadline.
    pub fn arm_deadline(&self) -> Duration {
        Duration::from_millis(self.arm_deadline_ms)
    }

    /// The per-round deadline.
    pub fn round_deadline(&self) -> Duration {
        Duration::from_millis(self.round_deadline_ms)
    }

    /// Checks ranges, orders, URLs, patterns and the memory directory.
    pub fn validate(self) -> Result<Self, SectionError> {
        if !(1..=MAX_ROUNDS).contains(&self.max_rounds) {
            return Err(bad(
                "grounding.max_rounds",
                format!("{} is not in 1..={MAX_ROUNDS}", self.max_rounds),
            ));
        }
        if !(1..=MAX_ROUND_DEADLINE_MS).contains(&self.round_deadline_ms) {
            return Err(bad(
                "grounding.round_deadline_ms",
                format!(
                    "{} is not in 1..={MAX_ROUND_DEADLINE_MS}",
                    self.round_deadline_ms
                ),
            ));
        }
        if !(1..=self.round_deadline_ms).contains(&self.arm_deadline_ms) {
            return Err(bad(
                "grounding.arm_deadline_ms",
                format!(
                    "{} is not in 1..=round_deadline_ms ({})",
                    self.arm_deadline_ms, self.round_deadline_ms
                ),
            ));
        }
        check_order("grounding.order_computable", &self.order_computable)?;
        check_order("grounding.order_other", &self.order_other)?;
        self.memory.check()?;
        for (name, tool) in &self.tool.http {
            tool.check(name)?;
        }
        if let Some(url) = &self.web.endpoint {
            check_url("grounding.web.endpoint", url)?;
        }
        check_results("grounding.web.max_results", self.web.max_results)?;
        Ok(self)
    }
}

fn check_order(key: &str, order: &[ArmKind]) -> Result<(), SectionError> {
    if order.is_empty() {
        return Err(bad(key, "names no arm (known: memory, tool, web)"));
    }
    for (i, arm) in order.iter().enumerate() {
        if order[..i].contains(arm) {
            return Err(bad(key, format!("names {arm:?} twice")));
        }
    }
    Ok(())
}

fn check_results(key: &str, n: usize) -> Result<(), SectionError> {
    if (1..=MAX_RESULTS).contains(&n) {
        Ok(())
    } else {
        Err(bad(key, format!("{n} is not in 1..={MAX_RESULTS}")))
    }
}

/// An `http://` URL with a host. The grounding client has no TLS (ureq is built without
/// it here): an `https://` endpoint is refused rather than failing at every round.
fn check_url(key: &str, url: &str) -> Result<(), SectionError> {
    let rest = if let Some(rest) = url.strip_prefix("http://") {
        rest
    } else if url.starts_with("https://") {
        return Err(bad(
            key,
            format!("{url:?}: https is not supported for grounding (the client has no TLS); use an http:// endpoint on this host or a trusted network"),
        ));
    } else {
        return Err(bad(key, format!("{url:?} is not an http:// URL")));
    };
    let host = rest.split(['/', '?']).next().unwrap_or("");
    if host.is_empty() || url.parse::<ureq::http::Uri>().is_err() {
        return Err(bad(key, format!("{url:?} is not a URL with a host")));
    }
    Ok(())
}

impl MemoryConfig {
    fn check(&self) -> Result<(), SectionError> {
        if !(self.floor.is_finite() && self.floor >= 0.0) {
            return Err(bad(
                "grounding.memory.floor",
                format!("{} is not a finite number >= 0", self.floor),
            ));
        }
        check_results("grounding.memory.max_results", self.max_results)?;
        if let Some(dir) = &self.dir {
            if !dir.is_dir() {
                return Err(bad(
                    "grounding.memory.dir",
                    format!("{}: not a directory", dir.display()),
                ));
            }
        }
        Ok(())
    }
}

impl HttpToolConfig {
    fn check(&self, name: &str) -> Result<(), SectionError> {
        let key = |field: &str| format!("grounding.tool.http.{name}.{field}");
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(bad(
                format!("grounding.tool.http.{name:?}"),
                "a tool name is letters, digits, _ and -",
            ));
        }
        check_url(&key("url"), &self.url)?;
        if self.pattern.is_empty() {
            return Err(bad(key("pattern"), "is empty (it would match every span)"));
        }
        regex_automata::meta::Regex::new(&self.pattern)
            .map_err(|e| bad(key("pattern"), format!("{:?}: {e}", self.pattern)))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
