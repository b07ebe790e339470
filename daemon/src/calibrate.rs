//! Calibration of the surprise detector (spec 003 "Threshold calibration"; issue 4 point 3):
//! the pure logic behind `haltctl calibrate`.
//!
//! # Labels file
//!
//! JSON Lines: one labelled token stream per line, UTF-8, blank lines ignored.
//!
//! ```text
//! {"id": "qa-0017", "label": 1, "logprobs": [-0.12, -3.9, -9999.0, ...], "tokens": [" The", " river", ...]}
//! ```
//!
//! | key | required | meaning |
//! |-----|----------|---------|
//! | `id` | yes | a string unique in the file, used in reports |
//! | `label` | yes | `1`: the detector *should* trip on this stream (hallucinated, garbled); `0`: it should not |
//! | `logprobs` | no | the natural-log probability of each generated token, as the backend reported it (OpenAI `logprobs.content[].logprob`); an entry may be `null` for a token that came without one |
//! | `tokens` | no | the tokens' text, for people reading the file; when present it must have as many entries as `logprobs` |
//!
//! Other keys (a prompt, a source, notes) are ignored. vLLM's `-9999.0` sentinel is accepted
//! and counts as [`SURPRISE_CAP_BITS`](crate::detect::surprise::SURPRISE_CAP_BITS), as in the
//! detector.
//!
//! **Streams without logprobs are never scored as zero surprise.** A line whose `logprobs` is
//! missing, `null` or empty is reported by [`read_labels`] as [`Skipped`] and excluded; a
//! stream with a `null` entry or an invalid value (NaN, a positive logprob) is reported by
//! [`calibrate`] as unscorable and excluded: the detector would answer `Failed` on it, not a
//! score. Both lists appear in the report, with their labels, so a biased exclusion shows.
//!
//! # Score, ROC, AUROC
//!
//! A stream's **score** is the largest value the rolling statistic (mean or p90 of the last
//! W surprises, counted once the window holds `min_tokens`) reaches over the stream
//! ([`max_statistic`], the detector's own code), so under threshold *t* the detector breaches
//! somewhere in the stream exactly when the score is above *t*. A stream shorter than
//! `min_tokens` can never breach: it has no score and counts as flagged at no threshold
//! (ranked below every scored stream, tied with the other such streams).
//!
//! **AUROC** is the Mann–Whitney statistic: P(score of a positive > score of a negative) plus
//! half P(equal), computed exactly from counts. Its **confidence interval** is a percentile
//! bootstrap: `bootstrap` (default 1000) resamples, each drawing the positives and the
//! negatives with replacement *separately* (stratified, so every resample has both classes
//! and the same class sizes), from a seeded RNG (`rand`'s `StdRng`), so the same input, seed
//! and build give the same interval.
//!
//! The **ROC** lists one point per distinct score: flagging the streams whose score is at or
//! above it. Each point's `threshold_bits` is a value the detector can be configured with to
//! flag exactly those streams: the shortest decimal in `[next lower score, this score)` near
//! their midpoint (below the lowest score: 0.5 bits below it).
//!
//! # Operating point
//!
//! Spec 003: "the operating point that maximizes intervention precision at recall ≥ 0.5".
//! Among the ROC points with recall ≥ `min_recall` (default 0.5) the one with the highest
//! precision (compared exactly, as fractions); ties go to the higher recall, then to the lower
//! threshold. None exists when fewer than `min_recall` of the positives can be flagged at all
//! (too many positives too short ever to trip).
//!
//! # Config file
//!
//! [`write_threshold`] writes the operating point into haltd's TOML config file, section
//! `[detectors.surprise]`, with `toml_edit`, so every other key, comment and the layout stay
//! as they were.
//!
//! # Files
//!
//! - [`labels`]: the labels file, read and written;
//! - `roc`: AUROC, its bootstrap interval, the ROC curve and the operating point;
//! - `report`: the report as people read it;
//! - [`config_file`]: the threshold written into haltd's config file;
//! - [`builtin`]: a labelled set from the built-in model.

use serde::Serialize;

use crate::detect::surprise::{
    default_min_tokens, max_statistic, Statistic, SurpriseConfigError, DEFAULT_WINDOW,
};

pub mod builtin;
pub mod config_file;
pub mod labels;
mod report;
mod roc;

pub use builtin::builtin_labelled_set;
pub use config_file::{update_config_text, write_threshold, ConfigWriteError, UpdateError};
pub use labels::{read_labels, write_labels, LabelledStream, LabelsError, Skipped};
pub use roc::auroc;
use roc::{auroc_sorted, bootstrap_ci, choose_operating_point, roc_curve};

/// Bootstrap resamples by default.
pub const DEFAULT_BOOTSTRAP: usize = 1000;
/// Confidence level of the AUROC interval by default.
pub const DEFAULT_CONFIDENCE: f64 = 0.95;
/// Seed of the bootstrap (and of [`builtin_labelled_set`]) by default.
pub const DEFAULT_SEED: u64 = 20_251_129;
/// Spec 003's recall floor for the operating point.
pub const DEFAULT_MIN_RECALL: f64 = 0.5;
/// The first words of the comment [`write_threshold`] puts above `threshold_bits`; a line
/// starting with them is replaced on the next calibration.
pub const COMMENT_MARK: &str = "# haltctl calibrate";

/// What to calibrate and how.
#[derive(Clone, Debug, PartialEq)]
pub struct CalibrateOptions {
    /// Window W of the detector being calibrated.
    pub window: usize,
    pub statistic: Statistic,
    /// `None`: the detector's default, `max(1, W / 2)`.
    pub min_tokens: Option<usize>,
    /// Bootstrap resamples for the AUROC interval; 0 skips the interval.
    pub bootstrap: usize,
    /// Confidence level of the interval, in (0, 1).
    pub confidence: f64,
    pub seed: u64,
    /// Recall floor of the operating point, in (0, 1].
    pub min_recall: f64,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            statistic: Statistic::Mean,
            min_tokens: None,
            bootstrap: DEFAULT_BOOTSTRAP,
            confidence: DEFAULT_CONFIDENCE,
            seed: DEFAULT_SEED,
            min_recall: DEFAULT_MIN_RECALL,
        }
    }
}

/// Why a calibration could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrateError {
    #[error(transparent)]
    Detector(#[from] SurpriseConfigError),
    #[error("confidence {0} must be between 0 and 1")]
    Confidence(f64),
    #[error("min_recall {0} must be in (0, 1]")]
    MinRecall(f64),
    #[error(
        "no scorable positive stream (label 1): {negatives} negatives scored, {unscorable} \
         streams unscorable; AUROC needs both classes"
    )]
    NoPositives { negatives: usize, unscorable: usize },
    #[error(
        "no scorable negative stream (label 0): {positives} positives scored, {unscorable} \
         streams unscorable; AUROC needs both classes"
    )]
    NoNegatives { positives: usize, unscorable: usize },
}

/// An interval for the AUROC.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ConfidenceInterval {
    /// Confidence level, e.g. 0.95.
    pub level: f64,
    pub low: f64,
    pub high: f64,
    /// Standard deviation of the bootstrap AUROCs.
    pub std_error: f64,
    pub resamples: usize,
    pub seed: u64,
    /// How it was made: `"percentile bootstrap, stratified by label"`.
    pub method: &'static str,
}

/// One point of the ROC curve: flag the streams whose score is above `threshold_bits`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RocPoint {
    pub threshold_bits: f64,
    /// Flagged positives and negatives.
    pub tp: usize,
    pub fp: usize,
    pub tpr: f64,
    pub fpr: f64,
    /// `tp / (tp + fp)`; `None` when nothing is flagged.
    pub precision: Option<f64>,
}

/// The chosen threshold and how the labelled set fares under it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OperatingPoint {
    pub threshold_bits: f64,
    pub precision: f64,
    pub recall: f64,
    pub fpr: f64,
    pub tp: usize,
    pub fp: usize,
    pub tn: usize,
    #[serde(rename = "fn")]
    pub fn_: usize,
}

/// The outcome of [`calibrate`]: serialises to JSON, displays for people.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CalibrationReport {
    pub window: usize,
    pub statistic: Statistic,
    pub min_tokens: usize,
    /// Scored streams by label (streams too short to trip included).
    pub positives: usize,
    pub negatives: usize,
    /// Scored streams shorter than `min_tokens` (they can never trip), by label.
    pub too_short_positives: usize,
    pub too_short_negatives: usize,
    /// Streams left out, with why (from [`read_labels`] and from scoring).
    pub unscorable: Vec<Skipped>,
    pub auroc: f64,
    pub auroc_ci: Option<ConfidenceInterval>,
    pub min_recall: f64,
    pub operating_point: Option<OperatingPoint>,
    /// From the highest threshold (nothing flagged) down.
    pub roc: Vec<RocPoint>,
}

impl CalibrationReport {
    /// Adds streams that were left out before scoring (the `Skipped` of [`read_labels`]).
    pub fn add_skipped(&mut self, skipped: impl IntoIterator<Item = Skipped>) {
        let mut all: Vec<Skipped> = skipped.into_iter().collect();
        all.append(&mut self.unscorable);
        all.sort_by_key(|s| s.line.unwrap_or(usize::MAX));
        self.unscorable = all;
    }

    /// Scored streams.
    pub fn scored(&self) -> usize {
        self.positives + self.negatives
    }
}

/// Calibrates the detector on labelled streams (method in the [module docs](self)).
pub fn calibrate(
    streams: &[LabelledStream],
    opts: &CalibrateOptions,
) -> Result<CalibrationReport, CalibrateError> {
    let min_tokens = opts
        .min_tokens
        .unwrap_or_else(|| default_min_tokens(opts.window));
    if !(opts.confidence > 0.0 && opts.confidence < 1.0) {
        return Err(CalibrateError::Confidence(opts.confidence));
    }
    if !(opts.min_recall > 0.0 && opts.min_recall <= 1.0) {
        return Err(CalibrateError::MinRecall(opts.min_recall));
    }
    let mut scored: Vec<(Option<f64>, bool)> = Vec::with_capacity(streams.len());
    let mut unscorable = Vec::new();
    for s in streams {
        match max_statistic(&s.logprobs, opts.window, opts.statistic, min_tokens)? {
            Ok(score) => scored.push((score, s.positive)),
            Err(why) => unscorable.push(Skipped {
                line: None,
                id: s.id.clone(),
                positive: s.positive,
                reason: why.to_string(),
            }),
        }
    }
    let positives = scored.iter().filter(|(_, p)| *p).count();
    let negatives = scored.len() - positives;
    if positives == 0 {
        return Err(CalibrateError::NoPositives {
            negatives,
            unscorable: unscorable.len(),
        });
    }
    if negatives == 0 {
        return Err(CalibrateError::NoNegatives {
            positives,
            unscorable: unscorable.len(),
        });
    }
    let too_short_positives = scored.iter().filter(|(s, p)| s.is_none() && *p).count();
    let too_short_negatives = scored.iter().filter(|(s, p)| s.is_none() && !*p).count();

    // Streams that can never trip rank below everything.
    let rank = |s: Option<f64>| s.unwrap_or(f64::NEG_INFINITY);
    let mut pos: Vec<f64> = scored
        .iter()
        .filter(|(_, p)| *p)
        .map(|(s, _)| rank(*s))
        .collect();
    let mut neg: Vec<f64> = scored
        .iter()
        .filter(|(_, p)| !*p)
        .map(|(s, _)| rank(*s))
        .collect();
    pos.sort_by(f64::total_cmp);
    neg.sort_by(f64::total_cmp);
    let auroc = auroc_sorted(&pos, &neg);
    let auroc_ci = (opts.bootstrap > 0).then(|| bootstrap_ci(&pos, &neg, opts));

    let roc = roc_curve(&scored);
    let operating_point = choose_operating_point(&roc, positives, negatives, opts.min_recall);

    Ok(CalibrationReport {
        window: opts.window,
        statistic: opts.statistic,
        min_tokens,
        positives,
        negatives,
        too_short_positives,
        too_short_negatives,
        unscorable,
        auroc,
        auroc_ci,
        min_recall: opts.min_recall,
        operating_point,
        roc,
    })
}

#[cfg(test)]
mod tests;
