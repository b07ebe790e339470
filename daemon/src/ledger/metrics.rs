//! The flight recorder: failed and written records, what it did with each turn's record,
//! and the crashes of an earlier haltd it recorded at this start.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::sampling::DecisionKind;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub decision: DecisionKind,
}

/// `haltd_ledger_*`, `haltd_turn_records_total`, `haltd_crashes_recovered_total`.
#[derive(Debug)]
pub struct LedgerMetrics {
    pub errors: Counter,
    pub records: Gauge,
    pub turn_records: Family<DecisionLabels, Counter>,
    pub crashes_recovered: Counter,
}

impl LedgerMetrics {
    /// Registers on `reg` (prefix `haltd`); the ledger's own families on its `ledger_`
    /// sub-registry.
    pub fn register(reg: &mut Registry) -> Self {
        let ledger = reg.sub_registry_with_prefix("ledger");
        let errors = Counter::default();
        ledger.register(
            "errors",
            "Flight-recorder records that could not be written",
            errors.clone(),
        );
        let records = Gauge::default();
        ledger.register(
            "records",
            "Flight-recorder records written since start (compare with the file to spot a cut-off tail)",
            records.clone(),
        );
        let turn_records = Family::<DecisionLabels, Counter>::default();
        reg.register(
            "turn_records",
            "Finished turns by what the flight recorder did with their record: always (not a normal turn: incident, failure, finding), sampled (a normal turn drawn at --turn-sample-rate), skipped (a normal turn not drawn: no record)",
            turn_records.clone(),
        );
        for decision in DecisionKind::ALL {
            drop(turn_records.get_or_create(&DecisionLabels { decision }));
        }
        let crashes_recovered = Counter::default();
        reg.register(
            "crashes_recovered",
            "Uncontained panics of an earlier haltd on this ledger (each ended that process at once), recorded at this start from the crash file",
            crashes_recovered.clone(),
        );
        LedgerMetrics {
            errors,
            records,
            turn_records,
            crashes_recovered,
        }
    }

    /// What the recorder did with a finished turn's record.
    pub fn turn_record(&self, decision: DecisionKind) {
        self.turn_records
            .get_or_create(&DecisionLabels { decision })
            .inc();
    }
}
