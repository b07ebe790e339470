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

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufRead, Write};
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::detect::surprise::{
    default_min_tokens, max_statistic, Statistic, SurpriseConfigError, DEFAULT_WINDOW,
};
use crate::source::builtin::BuiltinModel;

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

/// One labelled token stream: a line of the labels file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LabelledStream {
    pub id: String,
    /// `true` (`"label": 1`): the detector should trip on this stream.
    #[serde(rename = "label", with = "label_01")]
    pub positive: bool,
    /// Natural-log probability per token; `None` for a token that came without one.
    pub logprobs: Vec<Option<f32>>,
    /// The tokens' text, when known (same length as `logprobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<String>>,
}

/// `label` is written and read as the number 0 or 1.
mod label_01 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(positive: &bool, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(u8::from(*positive))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        match u8::deserialize(d)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(serde::de::Error::custom(format!(
                "label {v}: must be 0 or 1"
            ))),
        }
    }
}

/// A stream left out of the calibration, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Skipped {
    /// 1-based line of the labels file, when it came from one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    pub id: String,
    #[serde(rename = "label", with = "label_01")]
    pub positive: bool,
    pub reason: String,
}

/// A labels file that cannot be read; each names its line.
#[derive(Debug, thiserror::Error)]
pub enum LabelsError {
    #[error("labels line {line}: read failed: {source}")]
    Io {
        line: usize,
        #[source]
        source: io::Error,
    },
    #[error("labels line {line}: {source}")]
    Json {
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("labels line {line}: {tokens} tokens but {logprobs} logprobs")]
    LengthMismatch {
        line: usize,
        tokens: usize,
        logprobs: usize,
    },
    #[error("labels line {line}: id {id:?} is already used on line {first}")]
    DuplicateId {
        line: usize,
        id: String,
        first: usize,
    },
}

/// One line as written (`logprobs` may be absent or `null`).
#[derive(Deserialize)]
struct LineRepr {
    id: String,
    #[serde(with = "label_01")]
    label: bool,
    #[serde(default)]
    logprobs: Option<Vec<Option<f32>>>,
    #[serde(default)]
    tokens: Option<Vec<String>>,
}

/// Reads a labels file (format in the [module docs](self)). Lines without logprobs come back
/// as [`Skipped`]; malformed lines are errors naming the line.
pub fn read_labels(
    reader: impl BufRead,
) -> Result<(Vec<LabelledStream>, Vec<Skipped>), LabelsError> {
    let mut streams = Vec::new();
    let mut skipped = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, text) in reader.lines().enumerate() {
        let line = i + 1;
        let text = text.map_err(|source| LabelsError::Io { line, source })?;
        if text.trim().is_empty() {
            continue;
        }
        let repr: LineRepr =
            serde_json::from_str(&text).map_err(|source| LabelsError::Json { line, source })?;
        if let Some(&first) = seen.get(&repr.id) {
            return Err(LabelsError::DuplicateId {
                line,
                id: repr.id,
                first,
            });
        }
        seen.insert(repr.id.clone(), line);
        let logprobs = repr.logprobs.unwrap_or_default();
        if let Some(tokens) = &repr.tokens {
            if tokens.len() != logprobs.len() && !logprobs.is_empty() {
                return Err(LabelsError::LengthMismatch {
                    line,
                    tokens: tokens.len(),
                    logprobs: logprobs.len(),
                });
            }
        }
        if logprobs.is_empty() {
            skipped.push(Skipped {
                line: Some(line),
                id: repr.id,
                positive: repr.label,
                reason: "the stream has no logprobs".to_owned(),
            });
            continue;
        }
        streams.push(LabelledStream {
            id: repr.id,
            positive: repr.label,
            logprobs,
            tokens: repr.tokens,
        });
    }
    Ok((streams, skipped))
}

/// Writes streams as a labels file (one JSON object per line).
pub fn write_labels(mut w: impl Write, streams: &[LabelledStream]) -> io::Result<()> {
    for s in streams {
        serde_json::to_writer(&mut w, s)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

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

/// AUROC (Mann–Whitney) of ascending `pos` and `neg` scores: P(pos > neg) + ½ P(pos = neg).
/// Exact: twice the U statistic is counted in integers. Both must be non-empty.
fn auroc_sorted(pos: &[f64], neg: &[f64]) -> f64 {
    // For each positive, negatives strictly below (`lo`) and at most equal (`hi`); both
    // pointers only move forward as the positives rise.
    let (mut lo, mut hi) = (0usize, 0usize);
    let mut twice_u: u128 = 0;
    for &p in pos {
        while lo < neg.len() && neg[lo] < p {
            lo += 1;
        }
        hi = hi.max(lo);
        while hi < neg.len() && neg[hi] <= p {
            hi += 1;
        }
        twice_u += (lo + hi) as u128; // 2·below + equal
    }
    twice_u as f64 / (2.0 * pos.len() as f64 * neg.len() as f64)
}

/// AUROC of `(score, positive)` pairs (`None` scores rank lowest); `None` without both
/// classes.
pub fn auroc(scored: &[(Option<f64>, bool)]) -> Option<f64> {
    let rank = |s: Option<f64>| s.unwrap_or(f64::NEG_INFINITY);
    let mut pos: Vec<f64> = scored.iter().filter(|x| x.1).map(|x| rank(x.0)).collect();
    let mut neg: Vec<f64> = scored.iter().filter(|x| !x.1).map(|x| rank(x.0)).collect();
    if pos.is_empty() || neg.is_empty() {
        return None;
    }
    pos.sort_by(f64::total_cmp);
    neg.sort_by(f64::total_cmp);
    Some(auroc_sorted(&pos, &neg))
}

/// Stratified percentile bootstrap of the AUROC of ascending `pos`, `neg`.
fn bootstrap_ci(pos: &[f64], neg: &[f64], opts: &CalibrateOptions) -> ConfidenceInterval {
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut idx_p = vec![0usize; pos.len()];
    let mut idx_n = vec![0usize; neg.len()];
    let mut sp = vec![0.0; pos.len()];
    let mut sn = vec![0.0; neg.len()];
    let mut aucs = Vec::with_capacity(opts.bootstrap);
    for _ in 0..opts.bootstrap {
        for (idx, src, dst) in [(&mut idx_p, pos, &mut sp), (&mut idx_n, neg, &mut sn)] {
            for i in idx.iter_mut() {
                *i = rng.random_range(0..src.len());
            }
            // The sources are sorted, so sorted indices give sorted samples.
            idx.sort_unstable();
            for (d, &i) in dst.iter_mut().zip(idx.iter()) {
                *d = src[i];
            }
        }
        aucs.push(auroc_sorted(&sp, &sn));
    }
    aucs.sort_by(f64::total_cmp);
    let alpha = 1.0 - opts.confidence;
    let mean = aucs.iter().sum::<f64>() / aucs.len() as f64;
    let var = aucs.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / aucs.len() as f64;
    ConfidenceInterval {
        level: opts.confidence,
        low: quantile(&aucs, alpha / 2.0),
        high: quantile(&aucs, 1.0 - alpha / 2.0),
        std_error: var.sqrt(),
        resamples: opts.bootstrap,
        seed: opts.seed,
        method: "percentile bootstrap, stratified by label",
    }
}

/// Quantile of ascending, non-empty `sorted` by linear interpolation (position `q·(n−1)`).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let n = sorted.len();
    let pos = q.clamp(0.0, 1.0) * (n - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// A short decimal `t` with `lo <= t < hi` (the detector flags scores above `t`: all those
/// at or above `hi`, none at or below `lo`), as close to the midpoint as a few digits allow.
fn threshold_between(lo: f64, hi: f64) -> f64 {
    let mid = if lo.is_finite() {
        lo + (hi - lo) / 2.0
    } else {
        hi - 0.5
    };
    for digits in 0..=12 {
        let scale = 10f64.powi(digits);
        let t = (mid * scale).round() / scale;
        if lo <= t && t < hi {
            return t;
        }
    }
    if lo <= mid && mid < hi {
        mid
    } else {
        lo
    }
}

/// The ROC from the highest threshold (nothing flagged) down to flagging every stream that
/// can trip.
fn roc_curve(scored: &[(Option<f64>, bool)]) -> Vec<RocPoint> {
    let p_total = scored.iter().filter(|x| x.1).count();
    let n_total = scored.len() - p_total;
    let mut with_score: Vec<(f64, bool)> = scored
        .iter()
        .filter_map(|&(s, p)| s.map(|s| (s, p)))
        .collect();
    with_score.sort_by(|a, b| b.0.total_cmp(&a.0));
    let point = |threshold_bits: f64, tp: usize, fp: usize| RocPoint {
        threshold_bits,
        tp,
        fp,
        tpr: tp as f64 / p_total as f64,
        fpr: fp as f64 / n_total as f64,
        precision: (tp + fp > 0).then(|| tp as f64 / (tp + fp) as f64),
    };
    let mut roc = Vec::with_capacity(with_score.len() + 1);
    let top = with_score.first().map_or(0.0, |x| x.0);
    roc.push(point(top, 0, 0));
    let (mut tp, mut fp) = (0, 0);
    let mut i = 0;
    while i < with_score.len() {
        let s = with_score[i].0;
        while i < with_score.len() && with_score[i].0 == s {
            if with_score[i].1 {
                tp += 1;
            } else {
                fp += 1;
            }
            i += 1;
        }
        let next_lower = with_score.get(i).map_or(f64::NEG_INFINITY, |x| x.0);
        roc.push(point(threshold_between(next_lower, s), tp, fp));
    }
    roc
}

/// Highest precision at recall ≥ `min_recall`; ties: higher recall, then lower threshold.
fn choose_operating_point(
    roc: &[RocPoint],
    positives: usize,
    negatives: usize,
    min_recall: f64,
) -> Option<OperatingPoint> {
    let mut best: Option<&RocPoint> = None;
    for p in roc
        .iter()
        .filter(|p| p.tp + p.fp > 0 && p.tpr >= min_recall)
    {
        let better = match best {
            None => true,
            Some(b) => {
                // Precision as exact fractions: p.tp / (p.tp + p.fp) vs b.tp / (b.tp + b.fp).
                let lhs = p.tp as u128 * (b.tp + b.fp) as u128;
                let rhs = b.tp as u128 * (p.tp + p.fp) as u128;
                lhs > rhs
                    || (lhs == rhs
                        && (p.tp > b.tp || (p.tp == b.tp && p.threshold_bits < b.threshold_bits)))
            }
        };
        if better {
            best = Some(p);
        }
    }
    best.map(|p| OperatingPoint {
        threshold_bits: p.threshold_bits,
        precision: p.precision.unwrap_or(0.0),
        recall: p.tpr,
        fpr: p.fpr,
        tp: p.tp,
        fp: p.fp,
        tn: negatives - p.fp,
        fn_: positives - p.tp,
    })
}

impl fmt::Display for CalibrationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "surprise detector: {} of the last {} tokens' surprise, min_tokens {}",
            self.statistic, self.window, self.min_tokens
        )?;
        writeln!(
            f,
            "streams scored: {} ({} positive, {} negative); too short ever to trip: {} \
             positive, {} negative; unscorable (excluded): {}",
            self.scored(),
            self.positives,
            self.negatives,
            self.too_short_positives,
            self.too_short_negatives,
            self.unscorable.len()
        )?;
        match &self.auroc_ci {
            Some(ci) => writeln!(
                f,
                "AUROC {:.3} ({:.0}% CI {:.3}–{:.3}; {}, {} resamples, seed {})",
                self.auroc,
                ci.level * 100.0,
                ci.low,
                ci.high,
                ci.method,
                ci.resamples,
                ci.seed
            )?,
            None => writeln!(f, "AUROC {:.3} (no bootstrap interval)", self.auroc)?,
        }
        match &self.operating_point {
            Some(op) => {
                writeln!(
                    f,
                    "operating point (highest precision at recall ≥ {}): threshold_bits = {}",
                    self.min_recall, op.threshold_bits
                )?;
                writeln!(
                    f,
                    "  precision {:.3} ({} of {} flagged), recall {:.3} ({} of {} positives), \
                     FPR {:.3} ({} of {} negatives)",
                    op.precision,
                    op.tp,
                    op.tp + op.fp,
                    op.recall,
                    op.tp,
                    self.positives,
                    op.fpr,
                    op.fp,
                    self.negatives
                )?;
            }
            None => writeln!(
                f,
                "no operating point: no threshold reaches recall ≥ {} ({} of {} positives are \
                 too short ever to trip)",
                self.min_recall, self.too_short_positives, self.positives
            )?,
        }
        for s in &self.unscorable {
            let at = s.line.map(|l| format!("line {l}, ")).unwrap_or_default();
            writeln!(
                f,
                "  unscorable: {at}id {:?}, label {}: {}",
                s.id,
                u8::from(s.positive),
                s.reason
            )?;
        }
        Ok(())
    }
}

/// Writing the threshold into the config file failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigWriteError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not valid TOML: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml_edit::TomlError>,
    },
    #[error("{path}: `{key}` is not a table")]
    NotATable { path: PathBuf, key: &'static str },
    #[error("the calibration has no operating point: nothing to write")]
    NoOperatingPoint,
}

/// Sets `detectors.surprise.threshold_bits`, `window`, `statistic` and `min_tokens` in the
/// TOML config file at `path` (created when missing) to the report's operating point, with a
/// comment line above `threshold_bits` saying when and how well it was calibrated. Every other
/// key and comment stays as it was; `mode` is not touched (the operator turns the gate on).
/// The file is replaced atomically (written beside it, then renamed).
pub fn write_threshold(path: &Path, report: &CalibrationReport) -> Result<(), ConfigWriteError> {
    let existing = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(source) => {
            return Err(ConfigWriteError::Io {
                op: "reading",
                path: path.to_owned(),
                source,
            })
        }
    };
    let updated = update_config_text(&existing, report, &today_utc()).map_err(|e| match e {
        UpdateError::Parse(source) => ConfigWriteError::Parse {
            path: path.to_owned(),
            source: Box::new(source),
        },
        UpdateError::NotATable(key) => ConfigWriteError::NotATable {
            path: path.to_owned(),
            key,
        },
        UpdateError::NoOperatingPoint => ConfigWriteError::NoOperatingPoint,
    })?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".haltctl-tmp");
    let tmp = PathBuf::from(tmp);
    let io_err = |op, p: &Path| {
        let p = p.to_owned();
        move |source| ConfigWriteError::Io {
            op,
            path: p,
            source,
        }
    };
    std::fs::write(&tmp, updated).map_err(io_err("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err("renaming into place", path))
}

/// Why [`update_config_text`] failed.
#[derive(Debug)]
pub enum UpdateError {
    Parse(toml_edit::TomlError),
    NotATable(&'static str),
    NoOperatingPoint,
}

impl fmt::Display for UpdateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpdateError::Parse(e) => write!(f, "not valid TOML: {e}"),
            UpdateError::NotATable(k) => write!(f, "`{k}` is not a table"),
            UpdateError::NoOperatingPoint => f.write_str("no operating point"),
        }
    }
}

impl std::error::Error for UpdateError {}

/// [`write_threshold`] on text: returns the updated TOML; `date` goes into the comment.
pub fn update_config_text(
    existing: &str,
    report: &CalibrationReport,
    date: &str,
) -> Result<String, UpdateError> {
    use toml_edit::{DocumentMut, Item, Table, Value};

    let op = report
        .operating_point
        .as_ref()
        .ok_or(UpdateError::NoOperatingPoint)?;
    let mut doc: DocumentMut = existing.parse().map_err(UpdateError::Parse)?;
    let root = doc.as_table_mut();
    if !root.contains_key("detectors") {
        let mut t = Table::new();
        t.set_implicit(true);
        root.insert("detectors", Item::Table(t));
    }
    let detectors = root
        .get_mut("detectors")
        .and_then(Item::as_table_like_mut)
        .ok_or(UpdateError::NotATable("detectors"))?;
    if !detectors.contains_key("surprise") {
        detectors.insert("surprise", Item::Table(Table::new()));
    }
    let surprise_item = detectors
        .get_mut("surprise")
        .ok_or(UpdateError::NotATable("detectors.surprise"))?;
    let inline = surprise_item.is_inline_table();
    let surprise = surprise_item
        .as_table_like_mut()
        .ok_or(UpdateError::NotATable("detectors.surprise"))?;

    /// Replaces a value keeping its key's comments and its own decor (a trailing comment).
    fn set(t: &mut dyn toml_edit::TableLike, key: &str, mut v: Value) {
        if let Some((_, item)) = t.get_key_value_mut(key) {
            if let Some(old) = item.as_value() {
                *v.decor_mut() = old.decor().clone();
            }
            *item = Item::Value(v);
        } else {
            t.insert(key, Item::Value(v));
        }
    }
    set(surprise, "window", Value::from(report.window as i64));
    set(
        surprise,
        "statistic",
        Value::from(report.statistic.as_str()),
    );
    set(
        surprise,
        "min_tokens",
        Value::from(report.min_tokens as i64),
    );
    set(surprise, "threshold_bits", Value::from(op.threshold_bits));

    if !inline {
        let ci = report
            .auroc_ci
            .as_ref()
            .map(|ci| {
                format!(
                    " ({:.0}% CI {:.3}-{:.3})",
                    ci.level * 100.0,
                    ci.low,
                    ci.high
                )
            })
            .unwrap_or_default();
        let comment = format!(
            "{COMMENT_MARK} {date}: AUROC {:.3}{ci}; at this threshold precision {:.3}, recall \
             {:.3}, FPR {:.3}; {} streams ({} positive), {} of {} tokens, min_tokens {}\n",
            report.auroc,
            op.precision,
            op.recall,
            op.fpr,
            report.scored(),
            report.positives,
            report.statistic,
            report.window,
            report.min_tokens,
        );
        if let Some(mut key) = surprise.key_mut("threshold_bits") {
            let decor = key.leaf_decor_mut();
            let old = decor
                .prefix()
                .and_then(|p| p.as_str())
                .unwrap_or("")
                .to_owned();
            // Keep every other line of the prefix (comments, blank lines); drop an earlier
            // calibration comment.
            let mut prefix: String = old
                .split_inclusive('\n')
                .filter(|l| !l.trim_start().starts_with(COMMENT_MARK))
                .collect();
            if !prefix.is_empty() && !prefix.ends_with('\n') {
                // Indentation after the last newline belongs to the key line itself.
                let cut = prefix.rfind('\n').map_or(0, |i| i + 1);
                let indent = prefix.split_off(cut);
                prefix.push_str(&comment);
                prefix.push_str(&indent);
            } else {
                prefix.push_str(&comment);
            }
            decor.set_prefix(prefix);
        }
    }
    Ok(doc.to_string())
}

/// Today's date (UTC) as `YYYY-MM-DD`.
fn today_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    civil_date(secs / 86_400)
}

/// `YYYY-MM-DD` of a day count since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_date(days: u64) -> String {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Prompts for [`builtin_labelled_set`] (the built-in model only uses them to seed).
const BUILTIN_PROMPTS: &[&str] = &[
    "Tell me about the river.",
    "Describe the node.",
    "What happened at the station?",
    "Write a short paragraph.",
    "Explain how the valley was mapped.",
    "Summarise the report.",
];

/// Tokens per generated stream: uniform in this range (the same for both labels, so length
/// does not give the label away).
const BUILTIN_LEN: std::ops::RangeInclusive<u32> = 48..=160;
/// Length of the garbled span in a positive stream.
const BUILTIN_SPAN: std::ops::RangeInclusive<u32> = 16..=48;
/// Sampling temperature inside the garbled span.
const BUILTIN_TEMPERATURE: std::ops::RangeInclusive<f64> = 1.5..=3.0;

/// A labelled set from the built-in model: `n` streams, `n / 2` of them positive.
///
/// **What it measures.** Negatives (label 0) are the model's ordinary generations. Positives
/// (label 1) are generations where one contiguous span of 16–48 tokens, at a random place, is
/// sampled at a raised temperature (1.5–3.0, [`BuiltinStream::set_temperature`]): the text
/// there is garbled, while the reported logprobs stay the model's own untempered ones, as a
/// backend reports them. Both run with `ignore_eos` to a length drawn from the same 48–160
/// range. A calibration on this set therefore measures how well the detector tells garbled
/// spans from this model's normal output; it says nothing about hallucination in a real
/// model, for which a labelled set from that model is needed.
///
/// Deterministic in `(n, seed)`.
///
/// [`BuiltinStream::set_temperature`]: crate::source::builtin::BuiltinStream::set_temperature
pub fn builtin_labelled_set(n: usize, seed: u64) -> Vec<LabelledStream> {
    let model = BuiltinModel::get();
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let positive = i % 2 == 1;
            let prompt = BUILTIN_PROMPTS[rng.random_range(0..BUILTIN_PROMPTS.len())];
            let len = rng.random_range(BUILTIN_LEN);
            let stream_seed: u64 = rng.random();
            let (span_start, span_end, temperature) = if positive {
                let span = rng.random_range(BUILTIN_SPAN).min(len);
                let start = rng.random_range(0..=len - span);
                (start, start + span, rng.random_range(BUILTIN_TEMPERATURE))
            } else {
                (0, 0, 1.0)
            };
            let mut stream = model
                .stream(prompt, Some(stream_seed), len)
                .with_ignore_eos(true);
            let mut logprobs = Vec::with_capacity(len as usize);
            let mut tokens = Vec::with_capacity(len as usize);
            for k in 0..len {
                stream.set_temperature(if (span_start..span_end).contains(&k) {
                    temperature
                } else {
                    1.0
                });
                let Some(tok) = stream.next_token(0) else {
                    break;
                };
                logprobs.push(Some(tok.logprob));
                tokens.push(tok.text.to_owned());
            }
            LabelledStream {
                id: if positive {
                    format!("builtin-{seed}-{i}-garbled-{span_start}..{span_end}-t{temperature:.2}")
                } else {
                    format!("builtin-{seed}-{i}-normal")
                },
                positive,
                logprobs,
                tokens: Some(tokens),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Natural-log probability of a token with `bits` of surprise.
    fn lp(bits: f32) -> Option<f32> {
        Some(-bits * std::f32::consts::LN_2)
    }

    fn naive_auroc(scored: &[(Option<f64>, bool)]) -> Option<f64> {
        let r = |s: Option<f64>| s.unwrap_or(f64::NEG_INFINITY);
        let (mut sum, mut pairs) = (0.0, 0usize);
        for &(sp, _) in scored.iter().filter(|x| x.1) {
            for &(sn, _) in scored.iter().filter(|x| !x.1) {
                pairs += 1;
                sum += if r(sp) > r(sn) {
                    1.0
                } else if r(sp) == r(sn) {
                    0.5
                } else {
                    0.0
                };
            }
        }
        (pairs > 0).then(|| sum / pairs as f64)
    }

    fn pairs(pos: &[f64], neg: &[f64]) -> Vec<(Option<f64>, bool)> {
        pos.iter()
            .map(|&s| (Some(s), true))
            .chain(neg.iter().map(|&s| (Some(s), false)))
            .collect()
    }

    /// A stream whose score (mean of a 4-token window, min_tokens 2) is exactly `bits`.
    fn flat(id: &str, positive: bool, bits: f32) -> LabelledStream {
        LabelledStream {
            id: id.to_owned(),
            positive,
            logprobs: vec![lp(bits); 6],
            tokens: None,
        }
    }

    fn small_opts() -> CalibrateOptions {
        CalibrateOptions {
            window: 4,
            ..CalibrateOptions::default()
        }
    }

    #[test]
    fn auroc_known_cases() {
        assert_eq!(auroc(&pairs(&[3.0, 4.0], &[1.0, 2.0])), Some(1.0));
        assert_eq!(auroc(&pairs(&[1.0, 2.0], &[3.0, 4.0])), Some(0.0));
        assert_eq!(auroc(&pairs(&[2.0, 2.0], &[2.0])), Some(0.5));
        // Pairs: (1,2)=0 (1,0)=1 (2,2)=½ (2,0)=1 (3,2)=1 (3,0)=1 → 4.5/6.
        assert_eq!(auroc(&pairs(&[1.0, 2.0, 3.0], &[2.0, 0.0])), Some(0.75));
        // A stream that can never trip ranks lowest, tied with its kind.
        let s = vec![(None, true), (None, false), (Some(0.0), false)];
        assert_eq!(auroc(&s), Some(0.25));
        assert_eq!(auroc(&pairs(&[1.0], &[])), None);
    }

    proptest! {
        #[test]
        fn auroc_matches_the_naive_reference(
            scored in proptest::collection::vec(
                (proptest::option::weighted(0.9, 0u8..8), any::<bool>()),
                0..60,
            )
        ) {
            let scored: Vec<(Option<f64>, bool)> =
                scored.into_iter().map(|(s, p)| (s.map(f64::from), p)).collect();
            let a = auroc(&scored);
            let b = naive_auroc(&scored);
            prop_assert_eq!(a.is_some(), b.is_some());
            if let (Some(a), Some(b)) = (a, b) {
                prop_assert!((a - b).abs() < 1e-12, "{} vs {}", a, b);
            }
        }

        #[test]
        fn roc_thresholds_flag_exactly_their_streams(
            scored in proptest::collection::vec(
                (proptest::option::weighted(0.9, 0.0f64..20.0), any::<bool>()),
                1..60,
            )
        ) {
            let scored: Vec<(Option<f64>, bool)> = scored
                .into_iter()
                .map(|(s, p)| (s.map(|x| (x * 4.0).round() / 4.0), p))
                .collect();
            let p_total = scored.iter().filter(|x| x.1).count();
            prop_assume!(p_total > 0 && p_total < scored.len());
            let roc = roc_curve(&scored);
            for pt in &roc {
                let tp = scored.iter().filter(|(s, p)| *p && s.is_some_and(|s| s > pt.threshold_bits)).count();
                let fp = scored.iter().filter(|(s, p)| !*p && s.is_some_and(|s| s > pt.threshold_bits)).count();
                prop_assert_eq!((tp, fp), (pt.tp, pt.fp), "threshold {}", pt.threshold_bits);
            }
            prop_assert!(roc.windows(2).all(|w| w[0].threshold_bits > w[1].threshold_bits));
        }
    }

    #[test]
    fn thresholds_are_short_and_inside_their_interval() {
        assert_eq!(threshold_between(2.0, 4.0), 3.0);
        assert_eq!(threshold_between(2.61, 2.67), 2.64);
        assert_eq!(threshold_between(2.0, 2.0625), 2.0);
        assert_eq!(threshold_between(f64::NEG_INFINITY, 3.2), 3.0);
        assert_eq!(threshold_between(f64::NEG_INFINITY, 3.0), 2.5);
        let t = threshold_between(1.000_000_1, 1.000_000_2);
        assert!((1.000_000_1..1.000_000_2).contains(&t));
    }

    #[test]
    fn perfect_and_inverted_separation() {
        let streams: Vec<_> = (0..10)
            .map(|i| flat(&format!("s{i}"), i >= 5, i as f32))
            .collect();
        let r = calibrate(&streams, &small_opts()).expect("calibrates");
        assert_eq!(r.auroc, 1.0);
        let ci = r.auroc_ci.as_ref().expect("bootstrap");
        assert_eq!((ci.low, ci.high), (1.0, 1.0));
        let op = r.operating_point.as_ref().expect("operating point");
        // Precision 1 at recall 1 (the higher recall among precision-1 points): the cut
        // between 4 (the top negative) and 5 (the lowest positive).
        assert_eq!((op.precision, op.recall, op.fpr), (1.0, 1.0, 0.0));
        assert!(op.threshold_bits >= 4.0 && op.threshold_bits < 5.0);
        assert_eq!(op.threshold_bits, 4.5);

        let inverted: Vec<_> = (0..10)
            .map(|i| flat(&format!("s{i}"), i < 5, i as f32))
            .collect();
        let r = calibrate(&inverted, &small_opts()).expect("calibrates");
        assert_eq!(r.auroc, 0.0);
        let op = r.operating_point.expect("operating point");
        // Every cut reaching recall 0.5 is worse than flagging everything (precision ½).
        assert_eq!((op.tp, op.fp), (5, 5));
    }

    #[test]
    fn operating_point_on_a_hand_made_case() {
        // Scores (label): 9(1) 8(0) 7(1) 6(1) 5(0) 4(1) 3(0) 2(0); 4 positives.
        // Cuts with recall ≥ ½: at 7: tp 2, fp 1 → ⅔; at 6: 3/4 = .75; at 5: 3/5; at 4:
        // 4/6 = ⅔; at 3: 4/7; at 2: 4/8. The best is the cut at 6: threshold in [5, 6).
        let spec = [
            (9.0, true),
            (8.0, false),
            (7.0, true),
            (6.0, true),
            (5.0, false),
            (4.0, true),
            (3.0, false),
            (2.0, false),
        ];
        let streams: Vec<_> = spec
            .iter()
            .enumerate()
            .map(|(i, &(s, p))| flat(&format!("s{i}"), p, s))
            .collect();
        let r = calibrate(&streams, &small_opts()).expect("calibrates");
        let op = r.operating_point.as_ref().expect("operating point");
        assert_eq!((op.tp, op.fp, op.tn, op.fn_), (3, 1, 3, 1));
        assert_eq!(op.precision, 0.75);
        assert_eq!(op.recall, 0.75);
        assert_eq!(op.fpr, 0.25);
        assert_eq!(op.threshold_bits, 5.5);
        // Mann–Whitney by hand, negatives each positive beats: 9: 4, 7: 3, 6: 3, 4: 2 → 12/16.
        assert_eq!(r.auroc, 0.75);
        assert_eq!(r.roc.len(), 9);

        // Scores 5(1) 4(1) 3(0) 2(1) 1(1): the cut at 5 has precision 1 but recall ¼, below
        // the floor; the cut at 4 has precision 1 at recall ½: chosen, threshold in [3, 4).
        let spec = [
            (5.0, true),
            (4.0, true),
            (3.0, false),
            (2.0, true),
            (1.0, true),
        ];
        let streams: Vec<_> = spec
            .iter()
            .enumerate()
            .map(|(i, &(s, p))| flat(&format!("t{i}"), p, s))
            .collect();
        let r = calibrate(&streams, &small_opts()).expect("calibrates");
        let op = r.operating_point.expect("operating point");
        assert_eq!((op.tp, op.fp), (2, 0));
        assert_eq!(op.threshold_bits, 3.5);
    }

    #[test]
    fn precision_ties_go_to_higher_recall() {
        // The cut at 4 (tp 2, fp 1) and the cut at 1 (tp 4, fp 2) both have precision ⅔:
        // the one with the higher recall wins.
        let spec = [
            (6.0, true),
            (5.0, false),
            (4.0, true),
            (3.0, false),
            (2.0, true),
            (1.0, true),
            (0.5, false),
            (0.25, false),
            (0.125, false),
            (0.0625, false),
        ];
        let streams: Vec<_> = spec
            .iter()
            .enumerate()
            .map(|(i, &(s, p))| flat(&format!("u{i}"), p, s))
            .collect();
        let r = calibrate(&streams, &small_opts()).expect("calibrates");
        // Cuts with recall ≥ ½ (tp ≥ 2): at 4: 2/3; at 3: 2/4; at 2: 3/5; at 1: 4/6; lower: worse.
        let op = r.operating_point.expect("operating point");
        assert_eq!((op.tp, op.fp), (4, 2));
        assert_eq!(op.recall, 1.0);
    }

    #[test]
    fn bootstrap_is_reproducible_and_contains_the_estimate() {
        let streams = builtin_labelled_set(120, 7);
        let opts = CalibrateOptions {
            bootstrap: 300,
            ..CalibrateOptions::default()
        };
        let a = calibrate(&streams, &opts).expect("calibrates");
        let b = calibrate(&streams, &opts).expect("calibrates");
        assert_eq!(a, b);
        let ci = a.auroc_ci.as_ref().expect("bootstrap");
        assert!(
            ci.low <= a.auroc && a.auroc <= ci.high,
            "{ci:?} vs {}",
            a.auroc
        );
        assert!(ci.low < ci.high);
        assert_eq!(ci.resamples, 300);
        let c = calibrate(
            &streams,
            &CalibrateOptions {
                seed: opts.seed + 1,
                ..opts.clone()
            },
        )
        .expect("calibrates");
        assert_eq!(c.auroc, a.auroc);
        assert_ne!(c.auroc_ci, a.auroc_ci);
        let none = calibrate(
            &streams,
            &CalibrateOptions {
                bootstrap: 0,
                ..opts
            },
        )
        .expect("calibrates");
        assert!(none.auroc_ci.is_none());
    }

    #[test]
    fn unscorable_streams_are_excluded_never_zero() {
        let mut streams = vec![
            flat("a", true, 9.0),
            flat("b", false, 1.0),
            flat("c", true, 8.0),
        ];
        let mut holey = flat("d", true, 0.0);
        holey.logprobs[2] = None;
        streams.push(holey);
        let mut bad = flat("e", false, 0.0);
        bad.logprobs[0] = Some(f32::NAN);
        streams.push(bad);
        // One token: shorter than min_tokens, scored as "never trips".
        streams.push(LabelledStream {
            id: "f".into(),
            positive: false,
            logprobs: vec![lp(30.0)],
            tokens: None,
        });
        let mut r = calibrate(&streams, &small_opts()).expect("calibrates");
        assert_eq!((r.positives, r.negatives), (2, 2));
        assert_eq!(r.too_short_negatives, 1);
        assert_eq!(r.unscorable.len(), 2);
        assert_eq!(r.unscorable[0].id, "d");
        assert!(r.unscorable[0].reason.contains("token 2 has no logprob"));
        assert!(r.unscorable[1].reason.contains("NaN"));
        assert_eq!(r.auroc, 1.0);
        r.add_skipped([Skipped {
            line: Some(3),
            id: "g".into(),
            positive: true,
            reason: "the stream has no logprobs".into(),
        }]);
        assert_eq!(r.unscorable.len(), 3);
        assert_eq!(r.unscorable[0].id, "g");
        let text = r.to_string();
        assert!(text.contains("unscorable (excluded): 3"), "{text}");
        assert!(text.contains("line 3, id \"g\", label 1: the stream has no logprobs"));
        let json = serde_json::to_value(&r).expect("serialises");
        assert_eq!(json["unscorable"][0]["label"], 1);
        assert_eq!(json["operating_point"]["fn"], 0);

        // Only one class left: an error, not a number.
        let err = calibrate(&streams[..1], &small_opts()).expect_err("one class");
        assert!(matches!(
            err,
            CalibrateError::NoNegatives { positives: 1, .. }
        ));
        let err = calibrate(&[], &small_opts()).expect_err("empty");
        assert!(matches!(err, CalibrateError::NoPositives { .. }));
        let err = calibrate(
            &streams,
            &CalibrateOptions {
                window: 300,
                ..small_opts()
            },
        )
        .expect_err("bad window");
        assert!(err.to_string().contains("window"));
    }

    #[test]
    fn no_operating_point_when_positives_cannot_trip() {
        let streams = vec![
            LabelledStream {
                id: "short".into(),
                positive: true,
                logprobs: vec![lp(40.0)],
                tokens: None,
            },
            LabelledStream {
                id: "short2".into(),
                positive: true,
                logprobs: vec![lp(40.0)],
                tokens: None,
            },
            flat("long", true, 9.0),
            flat("neg", false, 1.0),
        ];
        let r = calibrate(
            &streams,
            &CalibrateOptions {
                min_recall: 0.6,
                ..small_opts()
            },
        )
        .expect("calibrates");
        assert!(r.operating_point.is_none());
        assert!(r.to_string().contains("no operating point"));
        assert!(matches!(
            update_config_text("", &r, "2026-01-01"),
            Err(UpdateError::NoOperatingPoint)
        ));
    }

    #[test]
    fn read_labels_format_and_errors() {
        let text = concat!(
            r#"{"id": "a", "label": 1, "logprobs": [-0.5, -9999.0, null], "tokens": [" x", " y", " z"]}"#,
            "\n\n",
            r#"{"id": "b", "label": 0, "logprobs": [-0.1], "prompt": "ignored"}"#,
            "\n",
            r#"{"id": "c", "label": 0}"#,
            "\n",
            r#"{"id": "d", "label": 1, "logprobs": null, "tokens": ["q"]}"#,
            "\n",
            r#"{"id": "e", "label": 0, "logprobs": []}"#,
            "\n",
        );
        let (streams, skipped) = read_labels(text.as_bytes()).expect("reads");
        assert_eq!(streams.len(), 2);
        assert_eq!(streams[0].logprobs, vec![Some(-0.5), Some(-9999.0), None]);
        assert!(streams[0].positive);
        assert!(!streams[1].positive);
        assert_eq!(
            skipped
                .iter()
                .map(|s| (s.line, s.id.as_str()))
                .collect::<Vec<_>>(),
            vec![(Some(4), "c"), (Some(5), "d"), (Some(6), "e")]
        );
        assert!(skipped
            .iter()
            .all(|s| s.reason == "the stream has no logprobs"));

        let err = |t: &str| read_labels(t.as_bytes()).expect_err("invalid").to_string();
        let ok = r#"{"id": "a", "label": 1, "logprobs": [-1.0]}"#;
        assert!(err(&format!("{ok}\nnot json\n")).starts_with("labels line 2:"));
        let e = err(&format!(
            "{ok}\n{}\n",
            r#"{"id": "b", "label": 2, "logprobs": [-1]}"#
        ));
        assert!(
            e.starts_with("labels line 2:") && e.contains("must be 0 or 1"),
            "{e}"
        );
        let e = err(&format!("\n{}\n", r#"{"label": 1, "logprobs": [-1]}"#));
        assert!(e.starts_with("labels line 2:") && e.contains("id"), "{e}");
        let e = err(&format!("{ok}\n{ok}\n"));
        assert_eq!(e, "labels line 2: id \"a\" is already used on line 1");
        let e = err(r#"{"id": "a", "label": 1, "logprobs": [-1.0], "tokens": ["a", "b"]}"#);
        assert_eq!(e, "labels line 1: 2 tokens but 1 logprobs");
        let e = err(r#"{"id": "a", "label": 1, "logprobs": ["x"]}"#);
        assert!(e.starts_with("labels line 1:"), "{e}");
    }

    #[test]
    fn write_labels_round_trips() {
        let streams = builtin_labelled_set(6, 3);
        let mut buf = Vec::new();
        write_labels(&mut buf, &streams).expect("writes");
        let text = String::from_utf8(buf.clone()).expect("utf-8");
        assert_eq!(text.lines().count(), 6);
        assert!(text.lines().all(|l| l.contains("\"label\":")));
        let (back, skipped) = read_labels(buf.as_slice()).expect("reads");
        assert!(skipped.is_empty());
        assert_eq!(back, streams);
    }

    fn sample_report() -> CalibrationReport {
        let streams: Vec<_> = (0..10)
            .map(|i| flat(&format!("s{i}"), i >= 5, i as f32))
            .collect();
        calibrate(
            &streams,
            &CalibrateOptions {
                statistic: Statistic::P90,
                ..small_opts()
            },
        )
        .expect("calibrates")
    }

    #[test]
    fn write_threshold_preserves_the_rest_of_the_file() {
        let report = sample_report();
        let original = r#"# haltd config
listen = "0.0.0.0:8080" # data plane

[detectors.exfil]
mode = "hard"

# The surprise gate.
[detectors.surprise]
mode = "observe"   # turned on by hand
# bits; calibrated below
threshold_bits = 99.0  # keep this note
debounce = 2

[other]
x = [1, 2, 3]
"#;
        let out = update_config_text(original, &report, "2026-11-29").expect("updates");
        // Everything but the four keys is byte-identical, comments included.
        for line in [
            "# haltd config",
            "listen = \"0.0.0.0:8080\" # data plane",
            "[detectors.exfil]",
            "# The surprise gate.",
            "mode = \"observe\"   # turned on by hand",
            "# bits; calibrated below",
            "threshold_bits = 4.5  # keep this note",
            "debounce = 2",
            "[other]",
            "x = [1, 2, 3]",
        ] {
            assert!(out.contains(line), "lost {line:?} in\n{out}");
        }
        assert!(out.contains("window = 4\n"), "{out}");
        assert!(out.contains("statistic = \"p90\"\n"), "{out}");
        assert!(out.contains("min_tokens = 2\n"), "{out}");
        let comment = out
            .lines()
            .find(|l| l.starts_with(COMMENT_MARK))
            .expect("comment");
        assert!(comment.contains("2026-11-29"), "{comment}");
        assert!(
            comment.contains("AUROC 1.000 (95% CI 1.000-1.000)"),
            "{comment}"
        );
        assert!(
            comment.contains("precision 1.000, recall 1.000, FPR 0.000"),
            "{comment}"
        );
        // The comment sits right above the key, after the operator's own comment.
        let idx = |needle: &str| out.find(needle).expect("present");
        assert!(idx("# bits; calibrated below") < idx(COMMENT_MARK));
        assert!(idx(COMMENT_MARK) < idx("threshold_bits ="));

        // Round trip through toml_edit: the values read back.
        let doc: toml_edit::DocumentMut = out.parse().expect("valid TOML");
        let s = &doc["detectors"]["surprise"];
        assert_eq!(s["threshold_bits"].as_float(), Some(4.5));
        assert_eq!(s["window"].as_integer(), Some(4));
        assert_eq!(s["statistic"].as_str(), Some("p90"));
        assert_eq!(s["mode"].as_str(), Some("observe"));
        assert_eq!(s["debounce"].as_integer(), Some(2));
        assert_eq!(doc["other"]["x"].as_array().map(|a| a.len()), Some(3));

        // Calibrating again replaces the comment instead of stacking another.
        let again = update_config_text(&out, &report, "2026-12-01").expect("updates");
        assert_eq!(again.matches(COMMENT_MARK).count(), 1);
        assert!(again.contains("2026-12-01") && !again.contains("2026-11-29"));
        assert_eq!(again.replace("2026-12-01", "2026-11-29"), out);
    }

    #[test]
    fn write_threshold_creates_the_section_and_file() {
        let report = sample_report();
        let out = update_config_text("", &report, "2026-11-29").expect("updates");
        assert!(!out.contains("[detectors]\n"), "{out}");
        assert!(out.contains("[detectors.surprise]\n"), "{out}");
        let doc: toml_edit::DocumentMut = out.parse().expect("valid TOML");
        assert_eq!(
            doc["detectors"]["surprise"]["threshold_bits"].as_float(),
            Some(4.5)
        );

        let with_other = "[server]\nport = 1\n";
        let out = update_config_text(with_other, &report, "2026-11-29").expect("updates");
        assert!(out.starts_with(with_other), "{out}");

        // An inline table is updated in place (no comment: inline tables cannot hold one).
        let inline = "detectors = { surprise = { window = 8, mode = \"hard\" } }\n";
        let out = update_config_text(inline, &report, "2026-11-29").expect("updates");
        let doc: toml_edit::DocumentMut = out.parse().expect("valid TOML");
        assert_eq!(doc["detectors"]["surprise"]["window"].as_integer(), Some(4));
        assert_eq!(doc["detectors"]["surprise"]["mode"].as_str(), Some("hard"));

        assert!(matches!(
            update_config_text("detectors = 3\n", &report, "x"),
            Err(UpdateError::NotATable("detectors"))
        ));
        assert!(matches!(
            update_config_text("[detectors]\nsurprise = 1\n", &report, "x"),
            Err(UpdateError::NotATable("detectors.surprise"))
        ));
        assert!(matches!(
            update_config_text("x = = 1", &report, "x"),
            Err(UpdateError::Parse(_))
        ));

        // Through the file system.
        let dir = std::env::temp_dir().join(format!("haltd-calibrate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("haltd.toml");
        std::fs::write(&path, "# mine\n[detectors.surprise]\nmode = \"off\"\n").expect("write");
        write_threshold(&path, &report).expect("writes");
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(
            text.starts_with("# mine\n[detectors.surprise]\nmode = \"off\"\n"),
            "{text}"
        );
        assert!(text.contains("threshold_bits = 4.5"));
        assert!(!dir.join("haltd.toml.haltctl-tmp").exists());
        let fresh = dir.join("new.toml");
        write_threshold(&fresh, &report).expect("creates");
        assert!(std::fs::read_to_string(&fresh)
            .expect("read")
            .contains("[detectors.surprise]"));
        std::fs::write(&path, "not = = toml").expect("write");
        let e = write_threshold(&path, &report).expect_err("bad toml");
        assert!(
            e.to_string().contains("haltd.toml is not valid TOML"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
        assert_eq!(civil_date(20_000), "2024-10-04");
        assert_eq!(today_utc().len(), 10);
    }

    #[test]
    fn builtin_set_is_deterministic_balanced_and_separable() {
        let a = builtin_labelled_set(40, 11);
        assert_eq!(a, builtin_labelled_set(40, 11));
        assert_ne!(a, builtin_labelled_set(40, 12));
        assert_eq!(a.iter().filter(|s| s.positive).count(), 20);
        for s in &a {
            let n = s.logprobs.len();
            assert!(BUILTIN_LEN.contains(&(n as u32)), "{} tokens", n);
            assert!(s.logprobs.iter().all(|l| l.is_some_and(|l| l <= 0.0)));
            assert_eq!(s.tokens.as_ref().map(Vec::len), Some(n));
        }
        let r = calibrate(&a, &CalibrateOptions::default()).expect("calibrates");
        assert!(r.auroc > 0.6, "AUROC {}", r.auroc);
        assert!(r.unscorable.is_empty());
    }
}
