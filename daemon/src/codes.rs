//! Failure codes (docs/spec.md "Failure codes"): the spec's names plus the ones haltd adds.
//!
//! They appear verbatim in terminal events, flight-recorder records and metric labels.

use std::fmt;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use serde::{Deserialize, Serialize};

/// Why a stream was halted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
#[repr(u32)]
pub enum FailureCode {
    TigBreach = 1,
    IoIntegrityAlert = 2,
    ExfilAlert = 3,
    WatchdogTrip = 4,
    TimingCovertChannel = 5,
    TimingDistributionAnomaly = 6,
    ComputeBudgetExceeded = 7,
    CoherenceBelowThreshold = 8,
    SurpriseThreshold = 9,
    SafetyBoundaryViolated = 10,
    OperatorTrip = 11,
    HeartbeatLost = 12,
    UpstreamFailure = 13,
    /// The flight recorder cannot write: nothing may stream unrecorded (G3, G7).
    RecorderFailure = 14,
    /// A hard detector could not judge a token (an error, missing input, a missed deadline):
    /// fail closed.
    DetectorFailure = 15,
    /// haltd stopped (SIGTERM/SIGINT) and the stream was still open when the drain timeout
    /// ran out. Nothing was breached: it degrades nobody.
    ServiceShutdown = 16,
    /// TokenCircuit (spec 002): the model emitted a tool call its equivalence key's budget
    /// forbids; the call never reached the client. Not a breach: it degrades nobody (the
    /// circuit, not the conversation, is open).
    ToolCircuitOpen = 17,
    /// The client stopped reading: bytes waited in its socket and it acknowledged none for
    /// `--send-stall-timeout-ms`. Its connection is reset and its slot freed. Nothing was
    /// breached: it degrades nobody.
    ClientStalled = 18,
}

impl FailureCode {
    pub const ALL: [FailureCode; 18] = [
        FailureCode::TigBreach,
        FailureCode::IoIntegrityAlert,
        FailureCode::ExfilAlert,
        FailureCode::WatchdogTrip,
        FailureCode::TimingCovertChannel,
        FailureCode::TimingDistributionAnomaly,
        FailureCode::ComputeBudgetExceeded,
        FailureCode::CoherenceBelowThreshold,
        FailureCode::SurpriseThreshold,
        FailureCode::SafetyBoundaryViolated,
        FailureCode::OperatorTrip,
        FailureCode::HeartbeatLost,
        FailureCode::UpstreamFailure,
        FailureCode::RecorderFailure,
        FailureCode::DetectorFailure,
        FailureCode::ServiceShutdown,
        FailureCode::ToolCircuitOpen,
        FailureCode::ClientStalled,
    ];

    /// The code as written on the wire and in records.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureCode::TigBreach => "TIG_BREACH",
            FailureCode::IoIntegrityAlert => "IO_INTEGRITY_ALERT",
            FailureCode::ExfilAlert => "EXFIL_ALERT",
            FailureCode::WatchdogTrip => "WATCHDOG_TRIP",
            FailureCode::TimingCovertChannel => "TIMING_COVERT_CHANNEL",
            FailureCode::TimingDistributionAnomaly => "TIMING_DISTRIBUTION_ANOMALY",
            FailureCode::ComputeBudgetExceeded => "COMPUTE_BUDGET_EXCEEDED",
            FailureCode::CoherenceBelowThreshold => "COHERENCE_BELOW_THRESHOLD",
            FailureCode::SurpriseThreshold => "SURPRISE_THRESHOLD",
            FailureCode::SafetyBoundaryViolated => "SAFETY_BOUNDARY_VIOLATED",
            FailureCode::OperatorTrip => "OPERATOR_TRIP",
            FailureCode::HeartbeatLost => "HEARTBEAT_LOST",
            FailureCode::UpstreamFailure => "UPSTREAM_FAILURE",
            FailureCode::RecorderFailure => "RECORDER_FAILURE",
            FailureCode::DetectorFailure => "DETECTOR_FAILURE",
            FailureCode::ServiceShutdown => "SERVICE_SHUTDOWN",
            FailureCode::ToolCircuitOpen => "TOOL_CIRCUIT_OPEN",
            FailureCode::ClientStalled => "CLIENT_STALLED",
        }
    }

    /// The numeric form kept in BPF maps and atomics.
    pub const fn as_u32(self) -> u32 {
        self as u32
    }

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_u32() == v)
    }
}

impl fmt::Display for FailureCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error for a failure-code name that is not one of [`FailureCode::ALL`].
#[derive(Debug, thiserror::Error)]
#[error("unknown failure code {0:?} (expected one of TIG_BREACH, IO_INTEGRITY_ALERT, EXFIL_ALERT, WATCHDOG_TRIP, TIMING_COVERT_CHANNEL, TIMING_DISTRIBUTION_ANOMALY, COMPUTE_BUDGET_EXCEEDED, COHERENCE_BELOW_THRESHOLD, SURPRISE_THRESHOLD, SAFETY_BOUNDARY_VIOLATED, OPERATOR_TRIP, HEARTBEAT_LOST, UPSTREAM_FAILURE, RECORDER_FAILURE, DETECTOR_FAILURE, SERVICE_SHUTDOWN, TOOL_CIRCUIT_OPEN, CLIENT_STALLED)")]
pub struct UnknownFailureCode(pub String);

impl std::str::FromStr for FailureCode {
    type Err = UnknownFailureCode;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|c| c.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownFailureCode(s.to_owned()))
    }
}

impl EncodeLabelValue for FailureCode {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_str_serde_and_u32() {
        for code in FailureCode::ALL {
            assert_eq!(code.as_str().parse::<FailureCode>().ok(), Some(code));
            assert_eq!(FailureCode::from_u32(code.as_u32()), Some(code));
            let json = serde_json::to_string(&code).expect("serialises");
            assert_eq!(json, format!("\"{}\"", code.as_str()));
        }
        assert!("NOT_A_CODE".parse::<FailureCode>().is_err());
        assert_eq!(FailureCode::from_u32(0), None);
    }
}
