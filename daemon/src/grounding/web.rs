//! The web arm (spec 003's Observe): the operator's search endpoint, speaking SearxNG's JSON
//! API (`GET {endpoint}/search?q=<text>&format=json`, answering
//! `{"results": [{"title", "url", "content"}, ...]}`). Off unless `[grounding.web] endpoint`
//! is set.
//!
//! The first `max_results` results with content become snippets: evidence `title: content`
//! (capped), source the result's URL, confidence by rank (0.6 for the first, 0.1 less for
//! each next, at least 0.1): a search rank says how the engine ordered pages, not whether
//! they are right, so web evidence never outranks a computed result (1.0).

use std::time::Instant;

use serde::Deserialize;

use super::arm::{cap_evidence, Arm, ArmError};
use super::classify::focus;
use super::{http, ArmKind, Snippet, SpanClass, SpanQuery};

/// The confidence of the first result; each next one has 0.1 less.
pub const TOP_CONFIDENCE: f32 = 0.6;

#[derive(Debug, Deserialize)]
struct SearchAnswer {
    #[serde(default)]
    results: Vec<SearchResult>,
}

#[derive(Debug, Deserialize)]
struct SearchResult {
    #[serde(default)]
    title: String,
    #[serde(default)]
    url: String,
    #[serde(default)]
    content: String,
}

/// The web arm.
#[derive(Debug)]
pub struct WebArm {
    search_url: String,
    max_results: usize,
    agent: ureq::Agent,
}

impl WebArm {
    /// For the endpoint's base URL (validated: `http://` with a host).
    pub fn new(endpoint: &str, max_results: usize, agent: ureq::Agent) -> Self {
        WebArm {
            search_url: format!("{}/search", endpoint.trim_end_matches('/')),
            max_results,
            agent,
        }
    }
}

impl Arm for WebArm {
    fn kind(&self) -> ArmKind {
        ArmKind::Web
    }

    fn search(
        &self,
        query: &SpanQuery,
        _class: SpanClass,
        deadline: Instant,
    ) -> Result<Vec<Snippet>, ArmError> {
        let text = focus(query);
        let answer: SearchAnswer = http::get_json(
            &self.agent,
            "search endpoint",
            &self.search_url,
            &[("q", &text), ("format", "json")],
            deadline,
        )?;
        Ok(answer
            .results
            .into_iter()
            .filter(|r| !r.content.trim().is_empty())
            .take(self.max_results)
            .zip(0u8..)
            .map(|(r, rank)| Snippet {
                claim: cap_evidence(&query.span),
                evidence: cap_evidence(&format!("{}: {}", r.title.trim(), r.content.trim())),
                confidence: (TOP_CONFIDENCE - 0.1 * f32::from(rank)).max(0.1),
                source: r.url,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests;
