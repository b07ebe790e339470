//! TokenCircuit (`circuit/`, docs/tokencircuit.md): its interventions by failure class.

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

use crate::circuit::FailureClass;

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
        CircuitMetrics { trips }
    }

    /// One intervention (once per turn, never per token).
    pub fn tripped(&self, class: FailureClass) {
        self.trips.get_or_create(&ClassLabels { class }).inc();
    }
}
