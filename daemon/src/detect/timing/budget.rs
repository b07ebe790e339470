//! The compute budget: a turn may take at most so many tokens, or so much wall time.

use serde::{Deserialize, Serialize};

use crate::{
    codes::FailureCode,
    detect::{
        timing::common::{TimingConfigError, NS_PER_MS},
        Detector, DetectorId, Finding, TokenObs,
    },
};

/// `[detectors.compute_budget]`: the per-turn compute budget. `0` means unlimited.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ComputeBudgetConfig {
    /// Most tokens a turn may generate; token `max_tokens + 1` breaches. Default 0
    /// (unlimited).
    pub max_tokens: u64,
    /// Most wall time, in ms, from the turn's start (its first token unless the data plane
    /// gives the request's arrival) to a token; the first token later than that breaches.
    /// Default 0 (unlimited).
    pub max_wall_ms: u64,
}

impl ComputeBudgetConfig {
    /// Largest `max_wall_ms` whose value in ns fits a `u64` (about 584 years).
    pub const MAX_WALL_MS: u64 = u64::MAX / NS_PER_MS;

    pub fn validate(self) -> Result<Self, TimingConfigError> {
        if self.max_wall_ms > Self::MAX_WALL_MS {
            return Err(TimingConfigError {
                key: "detectors.compute_budget.max_wall_ms",
                value: self.max_wall_ms.to_string(),
                expected: "at most 18446744073709 (u64 nanoseconds); 0 means unlimited",
            });
        }
        Ok(self)
    }

    /// Whether neither limit is set (the detector can never breach).
    pub fn is_unlimited(&self) -> bool {
        self.max_tokens == 0 && self.max_wall_ms == 0
    }
}

/// Which limit a compute budget breach passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetLimit {
    Tokens,
    WallTime,
}

/// What [`ComputeBudget`] saw in a turn.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BudgetSummary {
    pub max_tokens: u64,
    pub max_wall_ms: u64,
    /// Tokens observed.
    pub tokens: u64,
    /// From the start to the last token observed; `None` before the first token.
    pub wall_ms: Option<f64>,
    pub breached: bool,
    pub breach_limit: Option<BudgetLimit>,
    pub breach_token_index: Option<u64>,
}

/// Per-turn compute budget in tokens and wall time (`COMPUTE_BUDGET_EXCEEDED`).
#[derive(Debug, Clone)]
pub struct ComputeBudget {
    max_tokens: u64,
    max_wall_ms: u64,
    /// `max_wall_ms` in ns; 0 = unlimited.
    max_wall_ns: u64,
    start_ns: Option<u64>,
    tokens: u64,
    last_ns: Option<u64>,
    breach: Option<(BudgetLimit, u64)>,
}

impl ComputeBudget {
    /// A budget whose wall time runs from the turn's first token.
    pub fn new(cfg: &ComputeBudgetConfig) -> Self {
        Self {
            max_tokens: cfg.max_tokens,
            max_wall_ms: cfg.max_wall_ms,
            max_wall_ns: cfg.max_wall_ms.saturating_mul(NS_PER_MS),
            start_ns: None,
            tokens: 0,
            last_ns: None,
            breach: None,
        }
    }

    /// A budget whose wall time runs from `start_ns` (`CLOCK_MONOTONIC`, e.g. when the
    /// request arrived), so time to the first token counts.
    pub fn starting_at(cfg: &ComputeBudgetConfig, start_ns: u64) -> Self {
        Self {
            start_ns: Some(start_ns),
            ..Self::new(cfg)
        }
    }

    /// The last instant (`CLOCK_MONOTONIC` ns) a token may arrive within the wall budget;
    /// `None` when unlimited or not started yet. For a caller that wants a timer too.
    pub fn deadline_ns(&self) -> Option<u64> {
        if self.max_wall_ns == 0 {
            return None;
        }
        self.start_ns.map(|s| s.saturating_add(self.max_wall_ns))
    }

    pub fn budget_summary(&self) -> BudgetSummary {
        let wall_ms = match (self.start_ns, self.last_ns) {
            (Some(s), Some(l)) => Some(l.saturating_sub(s) as f64 / NS_PER_MS as f64),
            _ => None,
        };
        BudgetSummary {
            max_tokens: self.max_tokens,
            max_wall_ms: self.max_wall_ms,
            tokens: self.tokens,
            wall_ms,
            breached: self.breach.is_some(),
            breach_limit: self.breach.map(|(l, _)| l),
            breach_token_index: self.breach.map(|(_, i)| i),
        }
    }

    fn detail(&self, limit: BudgetLimit, index: u64, now_ns: u64) -> String {
        match limit {
            BudgetLimit::Tokens => format!(
                "token budget: token {} is past max_tokens {}",
                index.saturating_add(1),
                self.max_tokens
            ),
            BudgetLimit::WallTime => {
                let elapsed = now_ns.saturating_sub(self.start_ns.unwrap_or(now_ns));
                format!(
                    "wall-time budget: token {} arrived {:.3} ms after the turn's start, past \
                     max_wall_ms {}",
                    index.saturating_add(1),
                    elapsed as f64 / NS_PER_MS as f64,
                    self.max_wall_ms
                )
            }
        }
    }
}

impl Detector for ComputeBudget {
    fn id(&self) -> DetectorId {
        DetectorId::ComputeBudget
    }

    fn code(&self) -> FailureCode {
        FailureCode::ComputeBudgetExceeded
    }

    fn observe(&mut self, tok: &TokenObs<'_>) -> Finding {
        self.tokens = self.tokens.saturating_add(1);
        self.last_ns = Some(tok.now_ns);
        let start = *self.start_ns.get_or_insert(tok.now_ns);
        if let Some((limit, index)) = self.breach {
            // The condition holds for every later token of the turn.
            return Finding::Breach {
                detail: self.detail(limit, index.max(tok.index), tok.now_ns),
            };
        }
        let limit = if self.max_tokens != 0 && tok.index >= self.max_tokens {
            BudgetLimit::Tokens
        } else if self.max_wall_ns != 0 && tok.now_ns.saturating_sub(start) > self.max_wall_ns {
            BudgetLimit::WallTime
        } else {
            return Finding::Clear;
        };
        self.breach = Some((limit, tok.index));
        Finding::Breach {
            detail: self.detail(limit, tok.index, tok.now_ns),
        }
    }

    fn summary(&self) -> serde_json::Value {
        serde_json::to_value(self.budget_summary()).unwrap_or(serde_json::Value::Null)
    }

    fn timing_state(&self) -> Option<super::TimingState> {
        Some(super::TimingState::Budget {
            breached: self.breach.is_some(),
        })
    }
}
