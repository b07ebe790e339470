//! The data plane's own trips of the streams it serves (a detector, an open tool circuit, a
//! lost heartbeat, an upstream failure, a kernel drop, a stalled client, a policy that could
//! not be written), with every answer of the stream table handled: none is thrown away.

use crate::{
    codes::FailureCode,
    halt::HaltCore,
    stream::{Initiator, TripError},
    wire::stream_id::StreamId,
};

/// What the data plane's trip of its own stream came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::dataplane) enum OwnTrip {
    /// Tripped now, with the cause asked for.
    Tripped,
    /// Someone tripped it first (an operator, the watchdog, another check): the first cause
    /// stands, and the halt goes on under it.
    AlreadyTripped(FailureCode),
    /// Its last frame was committed before this trip: nothing more goes out and nothing is
    /// left to halt; the caller closes as it would have.
    Finished,
    /// The table does not know the stream: its slot was released under a live connection.
    /// A defect, logged at ERROR; the caller goes on to halt or close the connection, which
    /// is what a trip would have led to.
    Unknown,
}

/// Trips stream `id` with `cause` on behalf of `by`, and says what came of it.
pub(in crate::dataplane) fn trip_own(
    shared: &HaltCore,
    id: StreamId,
    cause: FailureCode,
    by: Initiator,
) -> OwnTrip {
    match shared.trip_by(id, cause, by) {
        Ok(_) => OwnTrip::Tripped,
        Err(TripError::AlreadyTripped { cause: first, .. }) => {
            tracing::debug!(stream_id = %id, cause = %cause, first = %first, "already tripped: the first cause stands");
            OwnTrip::AlreadyTripped(first)
        }
        Err(TripError::Finished(_)) => {
            tracing::debug!(stream_id = %id, cause = %cause, "already finished: nothing left to halt");
            OwnTrip::Finished
        }
        Err(TripError::Unknown(_)) => {
            tracing::error!(stream_id = %id, cause = %cause, "the data plane tripped a stream the table does not know: its slot was released under a live connection");
            OwnTrip::Unknown
        }
    }
}
