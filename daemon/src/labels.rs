//! Operator labels of incidents (`haltctl incident label STREAM_ID tp|fp`, `POST
//! /admin/incidents/{id}/label`): whether a halt was a true or a false positive, so that the
//! dashboards show TP/FP counts and the FP rate per detector and route (spec 000 §6.2).
//!
//! - **What is labelled.** A stream's incident record: the last `incident` record of that
//!   stream id in the ledger's current segment ([`find_incident`]; a stream id is used again
//!   after a restart, and the last one is the latest halt). Its ledger `seq` names it from
//!   then on.
//! - **Detector and route.** What tripped it ([`Tripper`]): the detector the incident's
//!   message names (`; detector <name>: ...`), else its trip cause (`OPERATOR_TRIP`,
//!   `HEARTBEAT_LOST`, ...). The route is the record's `route` field, else `default`.
//! - **Labelling again.** The latest label wins: the incident moves from one count to the
//!   other ([`Labels::set`]); the same label again changes no count. Every action is recorded.
//! - **Counts.** `haltd_incident_labels{detector, route, label}`: how many incidents hold each
//!   label now, a gauge (a relabel moves one series down and another up). The labels are kept
//!   in the state store (`incident_labels`), after the ledger record that states them, and a
//!   start takes back those recorded after the store's point: a restart keeps the counts.

use std::{
    collections::BTreeMap,
    fmt,
    io::BufRead,
    path::{Path, PathBuf},
    str::FromStr,
    sync::{Mutex, MutexGuard},
};

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{family::Family, gauge::Gauge},
    registry::Registry,
};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::{
    codes::FailureCode,
    detect::DetectorId,
    state::{restore::states_label, IncidentLabelRow},
};

/// The route of an incident whose record names none.
pub const DEFAULT_ROUTE: &str = "default";

/// An operator's verdict on an incident.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Label {
    /// True positive: the halt was right.
    Tp,
    /// False positive: the halt stopped a stream that was fine.
    Fp,
}

impl Label {
    pub const ALL: [Label; 2] = [Label::Tp, Label::Fp];

    pub const fn as_str(self) -> &'static str {
        match self {
            Label::Tp => "tp",
            Label::Fp => "fp",
        }
    }
}

impl EncodeLabelValue for Label {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

/// What tripped an incident: a detector, or, where none did (an operator, the watchdog, a
/// failure of haltd's own machinery), the trip cause.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tripper {
    Detector(DetectorId),
    Cause(FailureCode),
}

impl Tripper {
    /// The `detector` label: the detector's name (`latency_anomaly`) or the cause
    /// (`OPERATOR_TRIP`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Tripper::Detector(d) => d.as_str(),
            Tripper::Cause(c) => c.as_str(),
        }
    }

    /// What tripped the incident `rec` (an `incident` record): the detector its message
    /// names, else its `trip_cause`, else `WATCHDOG_TRIP` (every incident is one).
    pub fn of_incident(rec: &Value) -> Tripper {
        let named = rec["message"]
            .as_str()
            .and_then(|m| m.split_once("; detector "))
            .and_then(|(_, rest)| rest.split_once(':'))
            .and_then(|(name, _)| DetectorId::ALL.into_iter().find(|d| d.as_str() == name));
        if let Some(d) = named {
            return Tripper::Detector(d);
        }
        let cause = rec["trip_cause"].as_str().and_then(|c| c.parse().ok());
        Tripper::Cause(cause.unwrap_or(FailureCode::WatchdogTrip))
    }
}

/// Error for a `detector` value that is neither a detector nor a failure code.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} names no detector and no failure code")]
pub struct UnknownTripper(pub String);

impl FromStr for Tripper {
    type Err = UnknownTripper;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(d) = DetectorId::ALL.into_iter().find(|d| d.as_str() == s) {
            return Ok(Tripper::Detector(d));
        }
        s.parse()
            .map(Tripper::Cause)
            .map_err(|_| UnknownTripper(s.to_owned()))
    }
}

impl Serialize for Tripper {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Tripper {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl EncodeLabelValue for Tripper {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

/// One labelled incident: the body of its state-store row, the `labelled` object of the
/// label's `admin` record, and the answer of `POST /admin/incidents/{id}/label`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Labelled {
    pub stream_id: String,
    /// The incident record's `seq` and `hash`.
    pub incident_seq: u64,
    pub incident_hash: String,
    pub detector: Tripper,
    pub route: String,
    pub label: Label,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Labelled {
    /// The state store's row.
    pub fn row(&self) -> IncidentLabelRow {
        IncidentLabelRow {
            incident_seq: self.incident_seq,
            body: serde_json::to_value(self).unwrap_or(Value::Null),
        }
    }
}

/// Why a label could not be given.
#[derive(Debug, thiserror::Error)]
pub enum LabelError {
    #[error("no incident record of stream {stream_id} in the ledger {}: the stream never tripped, its halt is not recorded yet, or its incident is in an earlier (rotated) segment", ledger.display())]
    NoIncident { stream_id: String, ledger: PathBuf },
    #[error("reading the ledger {}: {source}", ledger.display())]
    Read {
        ledger: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the incident record of stream {stream_id} (seq {seq}) has no hash")]
    Unhashed { stream_id: String, seq: u64 },
}

/// The incident `label` refers to, labelled with it: the last `incident` record of
/// `stream_id` in the ledger segment at `ledger`. Reads the whole segment (an admin action,
/// on the blocking pool); only lines that mention the stream are parsed.
pub fn find_incident(
    ledger: &Path,
    stream_id: &str,
    label: Label,
    note: Option<String>,
) -> Result<Labelled, LabelError> {
    let read = |source| LabelError::Read {
        ledger: ledger.to_owned(),
        source,
    };
    let file = std::fs::File::open(ledger).map_err(read)?;
    let mut last = None;
    for line in std::io::BufReader::new(file).lines() {
        let line = line.map_err(read)?;
        if !line.contains(stream_id) || !line.contains(r#""kind":"incident""#) {
            continue;
        }
        let Ok(rec) = serde_json::from_str::<Value>(&line) else {
            continue; // a torn last line: haltd cut it at start; not a record
        };
        if rec["kind"] == "incident" && rec["stream_id"] == stream_id {
            last = Some(rec);
        }
    }
    let rec = last.ok_or_else(|| LabelError::NoIncident {
        stream_id: stream_id.to_owned(),
        ledger: ledger.to_owned(),
    })?;
    let seq = rec["seq"].as_u64().unwrap_or(0);
    let hash = rec["hash"].as_str().ok_or(LabelError::Unhashed {
        stream_id: stream_id.to_owned(),
        seq,
    })?;
    Ok(Labelled {
        stream_id: stream_id.to_owned(),
        incident_seq: seq,
        incident_hash: hash.to_owned(),
        detector: Tripper::of_incident(&rec),
        route: rec["route"].as_str().unwrap_or(DEFAULT_ROUTE).to_owned(),
        label,
        note,
    })
}

/// The labels of `haltd_incident_labels`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LabelSeries {
    pub detector: Tripper,
    pub route: String,
    pub label: Label,
}

impl LabelSeries {
    fn of(l: &Labelled) -> Self {
        LabelSeries {
            detector: l.detector,
            route: l.route.clone(),
            label: l.label,
        }
    }
}

/// `haltd_incident_labels{detector, route, label}`.
#[derive(Clone, Debug, Default)]
pub struct LabelMetrics {
    pub incidents: Family<LabelSeries, Gauge>,
}

impl LabelMetrics {
    /// Registers on `reg` (prefix `haltd`). Every detector's series on the default route
    /// exist from the start, at 0: a rate over them is 0 before the first label, not a gap.
    pub fn register(reg: &mut Registry) -> Self {
        let incidents = Family::<LabelSeries, Gauge>::default();
        reg.register(
            "incident_labels",
            "Incidents an operator labelled (haltctl incident label), by what tripped them (a detector, else the trip cause), route and label (tp, fp); a relabel moves an incident from one label to the other",
            incidents.clone(),
        );
        for detector in DetectorId::ALL {
            for label in Label::ALL {
                drop(incidents.get_or_create(&LabelSeries {
                    detector: Tripper::Detector(detector),
                    route: DEFAULT_ROUTE.to_owned(),
                    label,
                }));
            }
        }
        LabelMetrics { incidents }
    }
}

/// The labelled incidents, by incident seq, and their counts in `/metrics`.
#[derive(Debug)]
pub struct Labels {
    held: Mutex<BTreeMap<u64, Labelled>>,
    /// Held across a label action (its record, then the change): actions apply in the order
    /// the ledger states them.
    serial: Mutex<()>,
    gauges: Family<LabelSeries, Gauge>,
}

impl Labels {
    /// The labels `kept` (the state store's rows; one that does not read is skipped, logged:
    /// counts are not governance), counted into `metrics`.
    pub fn restored(metrics: &LabelMetrics, kept: &[IncidentLabelRow]) -> Self {
        let labels = Labels {
            held: Mutex::new(BTreeMap::new()),
            serial: Mutex::new(()),
            gauges: metrics.incidents.clone(),
        };
        for row in kept {
            match serde_json::from_value::<Labelled>(row.body.clone()) {
                Ok(l) => {
                    labels.set(l);
                }
                Err(e) => {
                    tracing::warn!(incident_seq = row.incident_seq, error = %e, "a stored incident label does not read; it is not counted");
                }
            }
        }
        labels
    }

    /// Serialises label actions (held while one is recorded and applied).
    pub fn serial(&self) -> MutexGuard<'_, ()> {
        self.serial.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn held(&self) -> MutexGuard<'_, BTreeMap<u64, Labelled>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The label the incident `seq` holds now.
    pub fn get(&self, seq: u64) -> Option<Labelled> {
        self.held().get(&seq).cloned()
    }

    /// Labels an incident: the latest label wins, and its count moves. Returns the label it
    /// held before.
    pub fn set(&self, labelled: Labelled) -> Option<Label> {
        let series = LabelSeries::of(&labelled);
        let before = self.held().insert(labelled.incident_seq, labelled);
        if let Some(b) = &before {
            self.gauges.get_or_create(&LabelSeries::of(b)).dec();
        }
        self.gauges.get_or_create(&series).inc();
        before.map(|b| b.label)
    }

    /// Every label held, by incident seq.
    pub fn all(&self) -> Vec<Labelled> {
        self.held().values().cloned().collect()
    }

    /// Applies the labels that `records` (ledger records after the state store's point, in
    /// order) state, and returns them for the store: a crash between a label's record and
    /// its store write loses no label.
    pub fn replay(&self, records: &[Value]) -> Vec<Labelled> {
        let mut applied = Vec::new();
        for rec in records.iter().filter(|r| states_label(r)) {
            let Some(l) = rec
                .pointer("/admin/labelled")
                .and_then(|v| serde_json::from_value::<Labelled>(v.clone()).ok())
            else {
                continue;
            };
            if self.get(l.incident_seq).as_ref() != Some(&l) {
                self.set(l.clone());
                applied.push(l);
            }
        }
        applied
    }
}

#[cfg(test)]
mod tests;
