//! Who initiated a trip: the `initiator` label of `haltd_watchdog_trips_total`, the access
//! log's `initiator` field.
//!
//! The failure code says why a stream halted, not who decided it: an operator may trip with a
//! detector's cause (`haltctl trip --cause EXFIL_ALERT`), and the kernel gate's drops are
//! recorded as `WATCHDOG_TRIP` or `HEARTBEAT_LOST`, so dashboards and alerts need to tell them
//! apart. The initiator is fixed in the trip's window, next to the cause, and never changes
//! after.

use std::fmt;

use crate::codes::FailureCode;

/// Who tripped a stream.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Initiator {
    /// The admin API (`haltctl trip`).
    Operator,
    /// A detector, the exfiltration scanner or SafetyCheck, on the stream's own tokens.
    Detector,
    /// The watchdog: a lost heartbeat.
    Watchdog,
    /// The kernel gate (a send it dropped that userspace had not tripped) or a gate policy
    /// that could not be written.
    Kernel,
    /// haltd stopping: streams still open when the drain ran out.
    Shutdown,
    /// The upstream failed after the client's response began.
    Upstream,
    /// The flight recorder failed.
    Recorder,
    /// The client: it stopped reading (`CLIENT_STALLED`).
    Client,
}

impl Initiator {
    /// Every initiator, in the order of their codes.
    pub const ALL: [Initiator; 8] = [
        Initiator::Operator,
        Initiator::Detector,
        Initiator::Watchdog,
        Initiator::Kernel,
        Initiator::Shutdown,
        Initiator::Upstream,
        Initiator::Recorder,
        Initiator::Client,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Initiator::Operator => "operator",
            Initiator::Detector => "detector",
            Initiator::Watchdog => "watchdog",
            Initiator::Kernel => "kernel",
            Initiator::Shutdown => "shutdown",
            Initiator::Upstream => "upstream",
            Initiator::Recorder => "recorder",
            Initiator::Client => "client",
        }
    }

    /// The code kept in the slot (0: no trip).
    pub const fn as_u8(self) -> u8 {
        match self {
            Initiator::Operator => 1,
            Initiator::Detector => 2,
            Initiator::Watchdog => 3,
            Initiator::Kernel => 4,
            Initiator::Shutdown => 5,
            Initiator::Upstream => 6,
            Initiator::Recorder => 7,
            Initiator::Client => 8,
        }
    }

    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|i| i.as_u8() == v)
    }

    /// Who trips with `cause` when the caller does not say: what the cause normally means.
    pub const fn of(cause: FailureCode) -> Self {
        match cause {
            FailureCode::OperatorTrip => Initiator::Operator,
            FailureCode::HeartbeatLost | FailureCode::WatchdogTrip => Initiator::Watchdog,
            FailureCode::ServiceShutdown => Initiator::Shutdown,
            FailureCode::UpstreamFailure => Initiator::Upstream,
            FailureCode::RecorderFailure => Initiator::Recorder,
            FailureCode::ClientStalled => Initiator::Client,
            FailureCode::TigBreach
            | FailureCode::IoIntegrityAlert
            | FailureCode::ExfilAlert
            | FailureCode::TimingCovertChannel
            | FailureCode::TimingDistributionAnomaly
            | FailureCode::ComputeBudgetExceeded
            | FailureCode::CoherenceBelowThreshold
            | FailureCode::SurpriseThreshold
            | FailureCode::SafetyBoundaryViolated
            | FailureCode::DetectorFailure
            | FailureCode::ToolCircuitOpen => Initiator::Detector,
        }
    }
}

impl fmt::Display for Initiator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_zero_is_none() {
        for i in Initiator::ALL {
            assert_eq!(Initiator::from_u8(i.as_u8()), Some(i));
        }
        assert_eq!(Initiator::from_u8(0), None);
    }

    #[test]
    fn a_cause_alone_names_its_usual_initiator() {
        assert_eq!(
            Initiator::of(FailureCode::OperatorTrip),
            Initiator::Operator
        );
        assert_eq!(
            Initiator::of(FailureCode::HeartbeatLost),
            Initiator::Watchdog
        );
        assert_eq!(
            Initiator::of(FailureCode::ServiceShutdown),
            Initiator::Shutdown
        );
        assert_eq!(Initiator::of(FailureCode::ExfilAlert), Initiator::Detector);
    }
}
