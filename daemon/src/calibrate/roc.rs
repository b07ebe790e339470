//! The figures of a calibration (method in the [module docs](super)): the AUROC, its
//! bootstrap interval, the ROC curve and the operating point on it.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{CalibrateOptions, ConfidenceInterval, OperatingPoint, RocPoint};

/// AUROC (Mann–Whitney) of ascending `pos` and `neg` scores: P(pos > neg) + ½ P(pos = neg).
/// Exact: twice the U statistic is counted in integers. Both must be non-empty.
pub(super) fn auroc_sorted(pos: &[f64], neg: &[f64]) -> f64 {
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
pub(super) fn bootstrap_ci(
    pos: &[f64],
    neg: &[f64],
    opts: &CalibrateOptions,
) -> ConfidenceInterval {
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
pub(super) fn threshold_between(lo: f64, hi: f64) -> f64 {
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
pub(super) fn roc_curve(scored: &[(Option<f64>, bool)]) -> Vec<RocPoint> {
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
pub(super) fn choose_operating_point(
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
