//! TokenCircuit (`circuit/`, docs/tokencircuit.md): its interventions by failure class.

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

use crate::circuit::{dispatched::DispatchedGauges, store::StoreCounters, FailureClass};

impl EncodeLabelValue for FailureClass {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    pub class: FailureClass,
}

/// `haltd_tool_circuit_trips_total{class}`.
#[derive(Clone, Debug)]
pub struct CircuitMetrics {
    trips: Family<ClassLabels, Counter>,
    /// `haltd_tool_circuit_tokens_saved_total`.
    tokens_saved: Counter,
    /// The conversation store's own (`circuit::store::StoreCounters`).
    pub store: StoreCounters,
    /// The dispatched calls of failed turns (`circuit::dispatched`).
    pub dispatched: DispatchedGauges,
}

impl CircuitMetrics {
    pub fn register(reg: &mut Registry) -> Self {
        let trips = Family::<ClassLabels, Counter>::default();
        reg.register(
            "tool_circuit_trips",
            "TokenCircuit interventions by failure class: a tool call halted in the stream (TOOL_CIRCUIT_OPEN), or a request answered without the model (permission/auth, invariant_violation)",
            trips.clone(),
        );
        // Every class from the start: an alert on invariant_violation sees a zero, not a gap.
        for class in FailureClass::ALL {
            drop(trips.get_or_create(&ClassLabels { class }));
        }
        let tokens_saved = Counter::default();
        reg.register(
            "tool_circuit_tokens_saved",
            "Tokens the model did not generate because TokenCircuit answered a looping conversation's request without it (estimate: the conversation's mean tokens per turn)",
            tokens_saved.clone(),
        );
        let store = StoreCounters::default();
        reg.register(
            "tool_circuit_refusals_retained",
            "Conversations TokenCircuit evicted while one of their keys was refused, kept (their failed calls of that key's tool) so that eviction does not re-open the key; at most 4096 (docs/tokencircuit.md section 1a)",
            store.retained.clone(),
        );
        reg.register(
            "tool_circuit_refusals_forgotten",
            "Evicted conversations whose refused keys TokenCircuit forgot because the set of retained ones was full (a refused key that may re-open)",
            store.forgotten.clone(),
        );
        let dispatched = DispatchedGauges::default();
        reg.register(
            "tool_circuit_unreconciled_calls",
            "Tool calls that failed turns delivered to the client and no operator has reconciled yet (haltctl reconcile); a retry of one is refused meanwhile",
            dispatched.unreconciled.clone(),
        );
        reg.register(
            "tool_circuit_unreconciled_oldest_delivered_seconds",
            "Unix time (s) the oldest unreconciled tool call was delivered; 0 with none",
            dispatched.oldest_delivered_seconds.clone(),
        );
        reg.register(
            "tool_circuit_reconcile_alert_after_seconds",
            "The age past which an unreconciled tool call alerts ([tool_circuit] reconcile_alert_after_s)",
            dispatched.alert_after_seconds.clone(),
        );
        CircuitMetrics {
            trips,
            tokens_saved,
            store,
            dispatched,
        }
    }

    /// Tokens saved by one answer without the model.
    pub fn saved(&self, tokens: u64) {
        self.tokens_saved.inc_by(tokens);
    }

    /// One intervention (once per turn, never per token).
    pub fn tripped(&self, class: FailureClass) {
        self.trips.get_or_create(&ClassLabels { class }).inc();
    }
}
