//! The tool arm (spec 003's Act): the built-in evaluator ([`super::evaluator`]: arithmetic,
//! dates, unit conversions, stamped confidence 1.0) and the operator's HTTP tools.
//!
//! An HTTP tool is a name, an `http://` URL and a pattern: it is called for spans whose
//! focus text ([`super::classify::focus`]) the pattern matches, with `GET url?q=<text>` or
//! `POST url` and `{"span", "context", "prompt"}`, and answers JSON: one object or a list of
//! objects `{"evidence": "...", "claim": "...", "confidence": 0.9}` (`evidence` required;
//! `claim` defaults to the span, `confidence` to 1.0: the operator registered the tool as an
//! authority on what it answers, so its answer is an observation). Snippets come out capped
//! ([`super::arm::cap_evidence`]) whatever the tool sends.
//!
//! The evaluator runs first; the tools in name order; the first that gives evidence ends the
//! arm. With no evidence, the arm fails with the first error if anything failed, and is
//! empty otherwise.

use std::time::Instant;

use regex_automata::meta::Regex;
use serde::Deserialize;

use super::arm::{cap_evidence, Arm, ArmError};
use super::classify::{check_of, focus};
use super::config::{HttpMethod, ToolConfig};
use super::{evaluator, http, ArmKind, Snippet, SpanClass, SpanQuery};

/// An HTTP tool's pattern that does not compile (the config check compiles it first, so
/// this is only reached by a config built in code).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{tool}: pattern: {reason}")]
pub struct PatternError {
    pub tool: String,
    pub reason: String,
}

/// One operator-registered HTTP tool.
#[derive(Debug)]
pub struct HttpTool {
    pub name: String,
    url: String,
    method: HttpMethod,
    pattern: Regex,
}

/// One item of a tool's answer.
#[derive(Debug, Deserialize)]
struct Item {
    evidence: String,
    #[serde(default)]
    claim: Option<String>,
    #[serde(default)]
    confidence: Option<f32>,
}

/// A tool's answer: one item or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Answer {
    One(Item),
    Many(Vec<Item>),
}

impl HttpTool {
    fn call(
        &self,
        agent: &ureq::Agent,
        query: &SpanQuery,
        text: &str,
        deadline: Instant,
    ) -> Result<Vec<Snippet>, ArmError> {
        let what = format!("tool {}", self.name);
        let answer: Answer = match self.method {
            HttpMethod::Get => http::get_json(agent, &what, &self.url, &[("q", text)], deadline)?,
            HttpMethod::Post => {
                let body = serde_json::json!({
                    "span": query.span,
                    "context": query.context,
                    "prompt": query.prompt,
                });
                http::post_json(agent, &what, &self.url, &body, deadline)?
            }
        };
        let items = match answer {
            Answer::One(item) => vec![item],
            Answer::Many(items) => items,
        };
        Ok(items
            .into_iter()
            .filter(|i| !i.evidence.trim().is_empty())
            .map(|i| Snippet {
                claim: cap_evidence(i.claim.as_deref().unwrap_or(&query.span)),
                evidence: cap_evidence(&i.evidence),
                confidence: i
                    .confidence
                    .filter(|c| c.is_finite())
                    .unwrap_or(1.0)
                    .clamp(0.0, 1.0),
                source: format!("tool:{}", self.name),
            })
            .collect())
    }
}

/// The tool arm.
#[derive(Debug)]
pub struct ToolArm {
    evaluator: bool,
    tools: Vec<HttpTool>,
    agent: ureq::Agent,
}

impl ToolArm {
    /// From `[grounding.tool]` (validated: the patterns compile). `None` when it has
    /// nothing to run (the evaluator off and no HTTP tool).
    pub fn new(cfg: &ToolConfig, agent: ureq::Agent) -> Result<Option<Self>, PatternError> {
        let tools = cfg
            .http
            .iter()
            .map(|(name, t)| {
                Ok(HttpTool {
                    name: name.clone(),
                    url: t.url.clone(),
                    method: t.method,
                    pattern: Regex::new(&t.pattern).map_err(|e| PatternError {
                        tool: name.clone(),
                        reason: e.to_string(),
                    })?,
                })
            })
            .collect::<Result<Vec<_>, PatternError>>()?;
        Ok((cfg.evaluator || !tools.is_empty()).then_some(ToolArm {
            evaluator: cfg.evaluator,
            tools,
            agent,
        }))
    }
}

impl Arm for ToolArm {
    fn kind(&self) -> ArmKind {
        ArmKind::Tool
    }

    fn search(
        &self,
        query: &SpanQuery,
        _class: SpanClass,
        deadline: Instant,
    ) -> Result<Vec<Snippet>, ArmError> {
        let text = focus(query);
        let mut first_error = None;
        if let Some(check) = check_of(&text).filter(|_| self.evaluator) {
            match evaluator::evaluate(&check, deadline) {
                Ok(snippet) => return Ok(vec![snippet]),
                Err(e) => first_error = Some(ArmError::Evaluator(e)),
            }
        }
        for tool in self.tools.iter().filter(|t| t.pattern.is_match(&text)) {
            match tool.call(&self.agent, query, &text, deadline) {
                Ok(found) if !found.is_empty() => return Ok(found),
                Ok(_) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(Vec::new()), Err)
    }
}

#[cfg(test)]
mod tests;
