//! The kernel gate: its verdicts (summed from per-CPU BPF counters at scrape time), halt
//! events, whether it is enabled, and what userspace could not do with it.
//!
//! BPF is the only writer of the verdict counters: a scrape sums them and adds the difference
//! since the last scrape to these counters, so they stay monotonic.

use std::sync::Mutex;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// A kernel verdict's name, as `haltd_common::verdict::NAMES` spells it (the egress check's
/// without its `egress_` prefix, the adoption program's as `adopted` / `failed`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    pub verdict: &'static str,
}

/// `haltd_kernel_*`, `haltd_gate_errors_total`, `haltd_ungovernable_connections_total`.
#[derive(Debug)]
pub struct GateMetrics {
    pub frames: Family<VerdictLabels, Counter>,
    pub segments: Family<VerdictLabels, Counter>,
    pub adoptions: Family<VerdictLabels, Counter>,
    pub halt_events: Counter,
    pub enabled: Gauge,
    pub errors: Counter,
    pub ungovernable_connections: Counter,
    /// One handle per BPF verdict index, built at registration, and the last total read
    /// from BPF for it (to turn totals into increments).
    verdicts: Mutex<Vec<(Counter, u64)>>,
}

impl GateMetrics {
    /// Registers on `reg` (prefix `haltd`); the kernel's own families on its `kernel_`
    /// sub-registry.
    pub fn register(reg: &mut Registry) -> Self {
        let kernel = reg.sub_registry_with_prefix("kernel");
        let frames = Family::<VerdictLabels, Counter>::default();
        kernel.register(
            "frames",
            "Sends seen by the kernel halt gate, by verdict (summed BPF per-CPU counters)",
            frames.clone(),
        );
        let segments = Family::<VerdictLabels, Counter>::default();
        kernel.register(
            "segments",
            "TCP segments of governed sockets judged by the kernel egress check, by verdict: pass, drop_ceiling (ends beyond the stream's post-trip byte ceiling; each retransmission counts), drop_unparsed (a tripped stream's segment whose TCP header could not be read)",
            segments.clone(),
        );
        let adoptions = Family::<VerdictLabels, Counter>::default();
        kernel.register(
            "adoptions",
            "Connections on the client port the kernel governed at establishment (adopted), or could not (failed: its socket map was full; haltd refuses those)",
            adoptions.clone(),
        );
        let halt_events = Counter::default();
        kernel.register(
            "halt_events",
            "Sockets on which the kernel gate dropped a send",
            halt_events.clone(),
        );
        let enabled = Gauge::default();
        kernel.register(
            "gate_enabled",
            "1 when the kernel halt gate enforces budgets; 0 under --no-kernel-gate",
            enabled.clone(),
        );
        let errors = Counter::default();
        reg.register(
            "gate_errors",
            "Failed kernel gate operations (each one halts or refuses its stream)",
            errors.clone(),
        );
        let ungovernable_connections = Counter::default();
        reg.register(
            "ungovernable_connections",
            "Accepted connections the kernel gate could not govern (its socket map full, or the connection no longer established); each is reset, never served",
            ungovernable_connections.clone(),
        );
        // Every verdict is a series from the start (zeros, not gaps), and its handle is
        // looked up once, here.
        let verdicts = (0..haltd_common::verdict::COUNT)
            .map(|i| {
                let (family, verdict) = kernel_counter(&frames, &segments, &adoptions, i);
                (
                    (*family.get_or_create(&VerdictLabels { verdict })).clone(),
                    0,
                )
            })
            .collect();
        GateMetrics {
            frames,
            segments,
            adoptions,
            halt_events,
            enabled,
            errors,
            ungovernable_connections,
            verdicts: Mutex::new(verdicts),
        }
    }

    /// Folds fresh BPF verdict totals (one per verdict index) into the verdict counters.
    pub fn observe_kernel_totals(&self, totals: &[u64]) {
        let mut verdicts = self.verdicts.lock().unwrap_or_else(|p| p.into_inner());
        for (&now, (counter, prev)) in totals.iter().zip(verdicts.iter_mut()) {
            if now > *prev {
                counter.inc_by(now - *prev);
            }
            *prev = now.max(*prev);
        }
    }
}

/// Which metric family and label a kernel counter index belongs to: send verdicts go to
/// `haltd_kernel_frames_total`, egress verdicts to `haltd_kernel_segments_total`, adoptions
/// to `haltd_kernel_adoptions_total`.
fn kernel_counter<'a>(
    frames: &'a Family<VerdictLabels, Counter>,
    segments: &'a Family<VerdictLabels, Counter>,
    adoptions: &'a Family<VerdictLabels, Counter>,
    index: u32,
) -> (&'a Family<VerdictLabels, Counter>, &'static str) {
    use haltd_common::verdict;
    let name = verdict::NAMES
        .get(index as usize)
        .copied()
        .unwrap_or("unknown");
    match index {
        verdict::EGRESS_PASS | verdict::EGRESS_DROP_CEILING | verdict::EGRESS_DROP_UNPARSED => {
            (segments, name.trim_start_matches("egress_"))
        }
        verdict::ADOPTED => (adoptions, "adopted"),
        verdict::ADOPT_FAILED => (adoptions, "failed"),
        _ => (frames, name),
    }
}
