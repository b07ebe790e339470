//! The surprise detector (spec 003; issue 4 point 3): trips with `SURPRISE_THRESHOLD` when
//! the rolling surprise of the stream's tokens crosses a calibrated threshold.
//!
//! - **Surprise** of token *i* is `-log2 p(token_i) = -logprob_i / ln 2` bits, from the
//!   natural-log probability the token source reported ([`surprise_bits`]).
//! - **Window.** The last `window` (W, default 16, at most [`MAX_WINDOW`]) surprises are kept
//!   in a ring ([`RollingSurprise`]); the detector's statistic is their **mean** or their
//!   **p90** (linear interpolation between closest ranks, numpy's default: position
//!   `0.9·(n−1)` in the sorted window). Both are kept up to date per token without heap
//!   allocation: a running sum for the mean, a fixed-size sorted array for the p90.
//! - **Breach** when the configured statistic is strictly above `threshold_bits` and the
//!   window holds at least `min_tokens` surprises (default W/2, so a stream's first few
//!   tokens cannot trip it on their own). Debounce and what a breach does (`hard`, `observe`,
//!   `off`) are the detector framework's ([`crate::detect`]).
//! - **No logprob, no score.** A token without a logprob is never scored as zero surprise:
//!   the detector answers [`Finding::Failed`] ("the stream has no logprobs"), which fails
//!   closed in hard mode and is reported in observe mode. A logprob that is NaN or clearly
//!   positive (a probability above 1) fails the same way.
//! - **vLLM's sentinel.** vLLM reports `-9999.0` (and some backends `-inf`) for a token whose
//!   probability underflowed. Such a logprob, and any that would give more than
//!   [`SURPRISE_CAP_BITS`] (64 bits, p < 2⁻⁶⁴), counts as exactly 64 bits: very surprising
//!   but finite, so one sentinel moves a 16-token mean by 4 bits instead of making it
//!   infinite (or, at -9999 nats ≈ 14 425 bits, swamping the window for W tokens).
//!
//! [`max_statistic`] is the score `haltctl calibrate` ranks streams by: the largest value the
//! statistic reaches over a whole stream, computed with the same [`RollingSurprise`], so a
//! stream trips under threshold *t* exactly when its score is above *t*.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::codes::FailureCode;
use crate::detect::{Detector, DetectorId, FailureKind, Finding, TokenObs};

/// Largest window the detector accepts (its buffers are fixed-size arrays of this length).
pub const MAX_WINDOW: usize = 256;

/// Default window W.
pub const DEFAULT_WINDOW: usize = 16;

/// Surprise given to a token whose logprob is vLLM's `-9999.0` sentinel, `-inf`, or anything
/// below `-64·ln 2`: the largest surprise the detector counts.
pub const SURPRISE_CAP_BITS: f32 = 64.0;

/// Logprobs at or below this are vLLM's "probability underflowed" sentinel.
pub const VLLM_SENTINEL_LOGPROB: f32 = -9999.0;

/// A logprob above 0 by more than this is a probability above 1: invalid input. Up to it,
/// rounding in the source is forgiven and the surprise is 0.
pub const LOGPROB_POSITIVE_TOLERANCE: f32 = 1e-3;

/// Default threshold, in bits. Deliberately high: it trips only on sustained garbage (a
/// 16-token window averaging p < 1/1024). Calibrate it for the model that is served
/// (`haltctl calibrate`), which also writes it into the config file.
pub const DEFAULT_THRESHOLD_BITS: f64 = 10.0;

/// Which rolling statistic of the window the threshold applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Statistic {
    /// Arithmetic mean of the window's surprises.
    #[default]
    Mean,
    /// 90th percentile of the window's surprises (linear interpolation between closest ranks).
    P90,
}

impl Statistic {
    /// The config spelling: `"mean"` or `"p90"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Statistic::Mean => "mean",
            Statistic::P90 => "p90",
        }
    }
}

impl fmt::Display for Statistic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Statistic {
    type Err = SurpriseConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mean" => Ok(Statistic::Mean),
            "p90" => Ok(Statistic::P90),
            other => Err(SurpriseConfigError::UnknownStatistic {
                value: other.to_owned(),
            }),
        }
    }
}

/// The surprise detector's own keys of the `[detectors.surprise]` config table. Spec 003 keeps
/// the gate from acting until a threshold has been calibrated for the model served
/// (`haltctl calibrate`): set `mode = "hard"` only after that.
///
/// ```toml
/// [detectors.surprise]
/// mode = "observe"        # common keys (mode, debounce, deadline_us): the framework's,
/// debounce = 1            #   see crate::detect::config
/// window = 16             # W, 1..=256
/// statistic = "mean"      # "mean" | "p90"
/// threshold_bits = 10.0   # breach when the statistic is above this
/// min_tokens = 8          # surprises in the window before it can breach (default W/2)
/// hold_back = 16          # intervene mode: tokens held before the client sees them (default W)
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SurpriseConfig {
    /// Window length W in tokens, 1..=[`MAX_WINDOW`].
    pub window: usize,
    /// The statistic of the window compared with the threshold.
    pub statistic: Statistic,
    /// Threshold in bits; a breach is the statistic strictly above it. Finite.
    pub threshold_bits: f64,
    /// Surprises the window must hold before a breach can count, 1..=`window`; absent means
    /// `max(1, window / 2)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<usize>,
    /// Intervene mode: the last tokens held back before the client sees them, so that a
    /// grounding round can rewind them unseen, 1..=[`MAX_WINDOW`]; absent means `window`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_back: Option<usize>,
}

impl Default for SurpriseConfig {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            statistic: Statistic::Mean,
            threshold_bits: DEFAULT_THRESHOLD_BITS,
            min_tokens: None,
            hold_back: None,
        }
    }
}

/// A `[detectors.surprise]` value that cannot be used; each names its key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SurpriseConfigError {
    #[error("detectors.surprise.window = {window}: must be 1..={max}")]
    Window { window: usize, max: usize },
    #[error("detectors.surprise.min_tokens = {min_tokens}: must be 1..=window ({window})")]
    MinTokens { min_tokens: usize, window: usize },
    #[error("detectors.surprise.hold_back = {hold_back}: must be 1..={max}")]
    HoldBack { hold_back: usize, max: usize },
    #[error("detectors.surprise.threshold_bits = {threshold}: must be a finite number")]
    Threshold { threshold: f64 },
    #[error("detectors.surprise.statistic = {value:?}: must be \"mean\" or \"p90\"")]
    UnknownStatistic { value: String },
}

impl SurpriseConfig {
    /// Checks every key; the error names the first bad one.
    pub fn validate(self) -> Result<Self, SurpriseConfigError> {
        check_window(self.window)?;
        if let Some(m) = self.min_tokens {
            if m == 0 || m > self.window {
                return Err(SurpriseConfigError::MinTokens {
                    min_tokens: m,
                    window: self.window,
                });
            }
        }
        if let Some(h) = self.hold_back {
            if h == 0 || h > MAX_WINDOW {
                return Err(SurpriseConfigError::HoldBack {
                    hold_back: h,
                    max: MAX_WINDOW,
                });
            }
        }
        if !self.threshold_bits.is_finite() {
            return Err(SurpriseConfigError::Threshold {
                threshold: self.threshold_bits,
            });
        }
        Ok(self)
    }

    /// `hold_back`, or its default: the window W.
    pub fn effective_hold_back(&self) -> usize {
        self.hold_back.unwrap_or(self.window)
    }

    /// `min_tokens`, or its default `max(1, window / 2)`.
    pub fn effective_min_tokens(&self) -> usize {
        self.min_tokens
            .unwrap_or_else(|| default_min_tokens(self.window))
    }
}

/// The default `min_tokens` for a window: `max(1, window / 2)`.
pub fn default_min_tokens(window: usize) -> usize {
    (window / 2).max(1)
}

fn check_window(window: usize) -> Result<(), SurpriseConfigError> {
    if window == 0 || window > MAX_WINDOW {
        return Err(SurpriseConfigError::Window {
            window,
            max: MAX_WINDOW,
        });
    }
    Ok(())
}

/// Why a logprob cannot be turned into a surprise.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum InvalidLogprob {
    #[error("logprob is NaN")]
    NaN,
    #[error("logprob {0} is above 0 (a probability above 1)")]
    Positive(f32),
}

/// Surprise in bits of a token with natural-log probability `logprob`: `-logprob / ln 2`,
/// capped at [`SURPRISE_CAP_BITS`] (vLLM's `-9999.0` sentinel and `-inf` included); a logprob
/// in `(0, LOGPROB_POSITIVE_TOLERANCE]` gives 0.
pub fn surprise_bits(logprob: f32) -> Result<f32, InvalidLogprob> {
    if logprob.is_nan() {
        return Err(InvalidLogprob::NaN);
    }
    if logprob > LOGPROB_POSITIVE_TOLERANCE {
        return Err(InvalidLogprob::Positive(logprob));
    }
    if logprob >= 0.0 {
        return Ok(0.0);
    }
    if logprob <= VLLM_SENTINEL_LOGPROB {
        return Ok(SURPRISE_CAP_BITS);
    }
    Ok((-logprob / std::f32::consts::LN_2).min(SURPRISE_CAP_BITS))
}

/// The last W surprises with their mean and p90, updated in O(W) per token without
/// allocating: a ring for eviction order, a sorted copy for the percentile, a running sum for
/// the mean (re-summed from the ring once per W pushes so rounding cannot accumulate). Both
/// are W long, allocated once per turn: every open stream carries one (issue 11's memory per
/// stream; a fixed [`MAX_WINDOW`] array was 2 KiB of it).
#[derive(Clone)]
pub struct RollingSurprise {
    ring: Box<[f32]>,
    sorted: Box<[f32]>,
    window: usize,
    len: usize,
    /// Next slot of `ring` to write.
    head: usize,
    sum: f64,
    /// Pushes since the last exact re-summation.
    since_resum: usize,
}

impl fmt::Debug for RollingSurprise {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RollingSurprise")
            .field("window", &self.window)
            .field("len", &self.len)
            .field("mean", &self.mean())
            .field("p90", &self.p90())
            .finish()
    }
}

impl RollingSurprise {
    /// An empty window of `window` (1..=[`MAX_WINDOW`]) surprises.
    pub fn new(window: usize) -> Result<Self, SurpriseConfigError> {
        check_window(window)?;
        Ok(Self {
            ring: vec![0.0; window].into_boxed_slice(),
            sorted: vec![0.0; window].into_boxed_slice(),
            window,
            len: 0,
            head: 0,
            sum: 0.0,
            since_resum: 0,
        })
    }

    /// The window length W.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Surprises held now (at most W).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Empties the window.
    pub fn clear(&mut self) {
        self.len = 0;
        self.head = 0;
        self.sum = 0.0;
        self.since_resum = 0;
    }

    /// Adds one surprise (bits, finite and ≥ 0 as [`surprise_bits`] gives them), evicting the
    /// oldest when the window is full. A value outside `[0, SURPRISE_CAP_BITS]` (or NaN) is
    /// clamped into it, so the window's order and sums stay sound whatever the caller passes.
    pub fn push(&mut self, bits: f32) {
        let bits = if bits.is_nan() {
            SURPRISE_CAP_BITS
        } else {
            bits.clamp(0.0, SURPRISE_CAP_BITS)
        };
        if self.len == self.window {
            let old = self.ring[self.head];
            self.sum -= f64::from(old);
            self.remove_sorted(old);
        } else {
            self.len += 1;
        }
        self.ring[self.head] = bits;
        self.head = (self.head + 1) % self.window;
        self.sum += f64::from(bits);
        self.insert_sorted(bits);
        self.since_resum += 1;
        if self.since_resum >= self.window {
            self.since_resum = 0;
            self.sum = self.ring[..self.len].iter().map(|&b| f64::from(b)).sum();
        }
    }

    /// Removes one copy of `old` from `sorted[..len]`, leaving `sorted[..len - 1]` sorted
    /// (`insert_sorted` then restores `len` values).
    fn remove_sorted(&mut self, old: f32) {
        let n = self.len;
        let s = &mut self.sorted[..n];
        let pos = s.partition_point(|&x| x < old);
        // `old` is in the window, so it is at `pos`; the guard only protects against a bug.
        if pos < n {
            s.copy_within(pos + 1..n, pos);
        }
    }

    /// Inserts `bits` into `sorted[..len - 1]`, giving `sorted[..len]`.
    fn insert_sorted(&mut self, bits: f32) {
        let n = self.len - 1;
        let pos = self.sorted[..n].partition_point(|&x| x <= bits);
        self.sorted.copy_within(pos..n, pos + 1);
        self.sorted[pos] = bits;
    }

    /// The surprises held, oldest first (allocates: for tests and diagnostics).
    pub fn values(&self) -> Vec<f32> {
        let start = (self.head + self.window - self.len) % self.window;
        (0..self.len)
            .map(|i| self.ring[(start + i) % self.window])
            .collect()
    }

    /// Mean of the window; `None` when empty.
    pub fn mean(&self) -> Option<f64> {
        (self.len > 0).then(|| self.sum / self.len as f64)
    }

    /// 90th percentile of the window (linear interpolation at position `0.9·(n−1)` of the
    /// sorted values); `None` when empty.
    pub fn p90(&self) -> Option<f64> {
        quantile_sorted(&self.sorted[..self.len], 0.9)
    }

    /// The configured statistic; `None` when empty.
    pub fn statistic(&self, statistic: Statistic) -> Option<f64> {
        match statistic {
            Statistic::Mean => self.mean(),
            Statistic::P90 => self.p90(),
        }
    }
}

/// Quantile `q` of ascending `sorted` by linear interpolation between closest ranks (numpy's
/// default): position `q·(n−1)`. `None` when empty.
pub fn quantile_sorted(sorted: &[f32], q: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let pos = q.clamp(0.0, 1.0) * (n - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    let frac = pos - lo as f64;
    let a = f64::from(sorted[lo]);
    let b = f64::from(sorted[hi]);
    Some(a + (b - a) * frac)
}

/// Why a whole stream cannot be scored.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Unscorable {
    #[error("the stream has no logprobs")]
    NoLogprobs,
    #[error("token {index} has no logprob")]
    MissingLogprob { index: usize },
    #[error("token {index}: {source}")]
    InvalidLogprob {
        index: usize,
        #[source]
        source: InvalidLogprob,
    },
}

/// The score of a whole stream: the largest value `statistic` reaches over a `window`-token
/// rolling window, counting only positions where the window holds at least `min_tokens`
/// surprises. `Ok(None)` for a stream too short ever to hold `min_tokens`: the detector can
/// never breach on it. A stream with no tokens, or a token with no (or an invalid) logprob,
/// is [`Unscorable`], never scored as zero surprise.
pub fn max_statistic(
    logprobs: &[Option<f32>],
    window: usize,
    statistic: Statistic,
    min_tokens: usize,
) -> Result<Result<Option<f64>, Unscorable>, SurpriseConfigError> {
    let mut w = RollingSurprise::new(window)?;
    if min_tokens == 0 || min_tokens > window {
        return Err(SurpriseConfigError::MinTokens { min_tokens, window });
    }
    if logprobs.is_empty() {
        return Ok(Err(Unscorable::NoLogprobs));
    }
    let mut best: Option<f64> = None;
    for (index, lp) in logprobs.iter().enumerate() {
        let Some(lp) = *lp else {
            return Ok(Err(Unscorable::MissingLogprob { index }));
        };
        match surprise_bits(lp) {
            Ok(bits) => w.push(bits),
            Err(source) => return Ok(Err(Unscorable::InvalidLogprob { index, source })),
        }
        if w.len() >= min_tokens {
            if let Some(v) = w.statistic(statistic) {
                best = Some(best.map_or(v, |b| b.max(v)));
            }
        }
    }
    Ok(Ok(best))
}

/// The surprise detector: one per turn.
#[derive(Debug, Clone)]
pub struct SurpriseDetector {
    window: RollingSurprise,
    statistic: Statistic,
    threshold_bits: f64,
    min_tokens: usize,
    scored: u64,
    unscored: u64,
    /// Tokens that came with vLLM's sentinel (or `-inf`) and counted as the cap.
    sentinels: u64,
    breaches: u64,
    max_mean: Option<f64>,
    max_p90: Option<f64>,
}

impl SurpriseDetector {
    /// A detector for one turn. The config is validated here too.
    pub fn new(cfg: &SurpriseConfig) -> Result<Self, SurpriseConfigError> {
        let cfg = cfg.clone().validate()?;
        Ok(Self {
            window: RollingSurprise::new(cfg.window)?,
            statistic: cfg.statistic,
            threshold_bits: cfg.threshold_bits,
            min_tokens: cfg.effective_min_tokens(),
            scored: 0,
            unscored: 0,
            sentinels: 0,
            breaches: 0,
            max_mean: None,
            max_p90: None,
        })
    }

    /// The rolling window as it stands.
    pub fn window(&self) -> &RollingSurprise {
        &self.window
    }
}

fn fmax(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

impl Detector for SurpriseDetector {
    fn id(&self) -> DetectorId {
        DetectorId::Surprise
    }

    fn code(&self) -> FailureCode {
        FailureCode::SurpriseThreshold
    }

    fn observe(&mut self, tok: &TokenObs<'_>) -> Finding {
        let Some(lp) = tok.logprob else {
            self.unscored += 1;
            return Finding::Failed {
                kind: FailureKind::Unscorable,
                detail: format!(
                    "token {} has no logprob: the stream has no logprobs, so surprise cannot be \
                     scored",
                    tok.index
                ),
            };
        };
        let bits = match surprise_bits(lp) {
            Ok(b) => b,
            Err(e) => {
                self.unscored += 1;
                return Finding::Failed {
                    kind: FailureKind::Unscorable,
                    detail: format!("token {}: {e}: surprise cannot be scored", tok.index),
                };
            }
        };
        if lp <= VLLM_SENTINEL_LOGPROB {
            self.sentinels += 1;
        }
        self.scored += 1;
        self.window.push(bits);
        if self.window.len() < self.min_tokens {
            return Finding::Clear;
        }
        let mean = self.window.mean();
        let p90 = self.window.p90();
        self.max_mean = fmax(self.max_mean, mean);
        self.max_p90 = fmax(self.max_p90, p90);
        let value = match self.statistic {
            Statistic::Mean => mean,
            Statistic::P90 => p90,
        };
        match value {
            Some(v) if v > self.threshold_bits => {
                self.breaches += 1;
                Finding::Breach {
                    detail: format!(
                        "{} surprise {v:.2} bits over the last {} tokens is above the threshold \
                         {:.2} bits",
                        self.statistic,
                        self.window.len(),
                        self.threshold_bits
                    ),
                }
            }
            _ => Finding::Clear,
        }
    }

    fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "tokens_scored": self.scored,
            "unscored": self.unscored,
            "sentinels": self.sentinels,
            "breaches": self.breaches,
            "max_mean_bits": self.max_mean,
            "max_p90_bits": self.max_p90,
            "threshold_bits": self.threshold_bits,
            "statistic": self.statistic.as_str(),
            "window": self.window.window(),
            "min_tokens": self.min_tokens,
        })
    }

    /// The rewound tokens' surprises leave the window: the resumed text is judged afresh.
    fn rewind(&mut self) {
        self.window.clear();
    }
}

#[cfg(test)]
mod tests;
