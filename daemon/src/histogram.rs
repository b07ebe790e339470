//! A lock-free histogram of durations for the per-token path.

use std::sync::{
    atomic::{AtomicU64, Ordering::Relaxed},
    Arc,
};

use prometheus_client::{
    encoding::{EncodeMetric, MetricEncoder, NoLabelSet},
    metrics::{MetricType, TypedMetric},
};

/// A histogram of durations for the per-token path. prometheus-client's `Histogram` takes a
/// mutex per observation; this one is lock-free and allocation-free: an observation is two
/// relaxed atomic adds (its bucket and the sum, in integer ns). A scrape reads the buckets one
/// by one, so one taken during observations may be a few observations behind in some buckets
/// (`_count` is always the sum of the buckets it read). Clones share the counts.
#[derive(Clone, Debug)]
pub struct NsHistogram {
    inner: Arc<NsInner>,
}

#[derive(Debug)]
struct NsInner {
    /// Upper bounds (inclusive), ascending.
    bounds_ns: Box<[u64]>,
    /// One count per bound, then the +Inf bucket (not cumulative).
    counts: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
}

impl NsHistogram {
    pub fn new(bounds_ns: &[u64]) -> Self {
        debug_assert!(
            bounds_ns.windows(2).all(|w| w[0] < w[1]),
            "ascending bounds"
        );
        NsHistogram {
            inner: Arc::new(NsInner {
                bounds_ns: bounds_ns.into(),
                counts: (0..=bounds_ns.len()).map(|_| AtomicU64::new(0)).collect(),
                sum_ns: AtomicU64::new(0),
            }),
        }
    }

    /// Records one duration.
    pub fn observe_ns(&self, ns: u64) {
        let i = self.inner.bounds_ns.partition_point(|&b| b < ns);
        self.inner.counts[i].fetch_add(1, Relaxed);
        self.inner.sum_ns.fetch_add(ns, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.inner.counts.iter().map(|c| c.load(Relaxed)).sum()
    }
}

impl TypedMetric for NsHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for NsHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // At scrape time, not per token: allocating here is fine.
        let buckets: Vec<(f64, u64)> = self
            .inner
            .bounds_ns
            .iter()
            .map(|&b| b as f64 / 1e9)
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.inner.counts.iter().map(|c| c.load(Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.inner.sum_ns.load(Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}
