//! Classification: evidence of a tool result, with the tool's registry profile, gives the
//! outcome and, for a failure, its class and side-effect boundary.
//!
//! The rules, first match wins (docs/tokencircuit.md, "Classification"):
//! 1. no failure: `Success`; but an empty result of a read tool that has a verifier is
//!    `ambiguous_effect` ("valid empty" and "query probably wrong" look the same until the
//!    verifier tells them apart);
//! 2. an invariant signal (assertion, integrity or constraint error) → `invariant_violation`;
//! 3. 401/403 or a permission signal → `permission/auth`;
//! 4. 400/422 or a validation signal → `validation`;
//! 5. 404/410 or a not-found signal → `missing_resource`;
//! 6. a timeout, lost connection, unparseable reply, 408, 429 or 5xx, or a rate-limit or
//!    unavailable signal → `transient`, except for a side-effecting tool whose call was
//!    dispatched: there it is `ambiguous_effect` (the effect may have happened), unless a
//!    reply that came back whole (no timeout, lost connection or unparseable part) proves a
//!    rejection before any effect (429, a rate-limit signal or a `Retry-After`);
//! 7. anything else that failed: `invariant_violation` on a side-effecting tool (an unknown
//!    error after a possible mutation fails closed), `transient` on an idempotent one.
//!
//! The side-effect boundary (spec 002's open question) is never taken from the model: it is
//! true when the tool is side-effecting (declared, or a POST/PUT/PATCH/DELETE HTTP tool),
//! the call was dispatched (delivered to the client, and its result came back), and the
//! failure does not prove the call was rejected before acting (rules 2, 6 and 7; a 4xx of
//! rules 3–5 is a rejection).

use super::class::FailureClass;
use super::evidence::{Evidence, Signal};
use super::registry::{Effect, ToolProfile};

/// What a tool result says about its call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure {
        class: FailureClass,
        side_effect_boundary: bool,
    },
}

/// Classifies a result's evidence. `dispatched`: the call was delivered to the client and
/// its `tool_call_id` came back.
pub fn classify(ev: &Evidence, profile: &ToolProfile, dispatched: bool) -> Outcome {
    let side_effecting = profile.effect() == Effect::SideEffecting;
    let mutated_maybe = side_effecting && dispatched;
    let fail = |class, side_effect_boundary| Outcome::Failure {
        class,
        side_effect_boundary,
    };
    if !ev.is_failure() {
        let empty_read = ev.empty && !side_effecting && profile.verifier.is_some();
        return if empty_read {
            fail(FailureClass::AmbiguousEffect, false)
        } else {
            Outcome::Success
        };
    }
    let status = ev.http_status.unwrap_or(0);
    if ev.has(Signal::Invariant) {
        return fail(FailureClass::InvariantViolation, mutated_maybe);
    }
    if matches!(status, 401 | 403) || ev.has(Signal::Permission) {
        return fail(FailureClass::PermissionAuth, false);
    }
    if matches!(status, 400 | 422) || ev.has(Signal::Validation) {
        return fail(FailureClass::Validation, false);
    }
    if matches!(status, 404 | 410) || ev.has(Signal::NotFound) {
        return fail(FailureClass::MissingResource, false);
    }
    let transient_signal = [
        Signal::Timeout,
        Signal::ConnectionLost,
        Signal::Unparseable,
        Signal::RateLimited,
        Signal::Unavailable,
    ]
    .iter()
    .any(|s| ev.has(*s));
    if transient_signal || matches!(status, 408 | 429 | 500..=599) {
        // A reply that timed out, was cut or cannot be read says nothing about whether the
        // call acted, whatever else it carries: a rejection is proved only by a reply that
        // came back whole.
        let outcome_unknown = [Signal::Timeout, Signal::ConnectionLost, Signal::Unparseable]
            .iter()
            .any(|s| ev.has(*s));
        let rejected_first = !outcome_unknown
            && (status == 429 || ev.has(Signal::RateLimited) || ev.retry_after.is_some());
        return if mutated_maybe && !rejected_first {
            fail(FailureClass::AmbiguousEffect, true)
        } else {
            fail(FailureClass::Transient, false)
        };
    }
    if side_effecting {
        fail(FailureClass::InvariantViolation, mutated_maybe)
    } else {
        fail(FailureClass::Transient, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::circuit::registry::HttpMethod;

    fn class_of(content: &str, profile: &ToolProfile, dispatched: bool) -> Outcome {
        classify(&Evidence::read(content), profile, dispatched)
    }

    fn failure(class: FailureClass, side_effect_boundary: bool) -> Outcome {
        Outcome::Failure {
            class,
            side_effect_boundary,
        }
    }

    #[test]
    fn read_tools_classify_by_status_and_signal() {
        let read = ToolProfile::default();
        let cases = [
            (r#"{"status": 403}"#, FailureClass::PermissionAuth),
            ("PermissionError: denied", FailureClass::PermissionAuth),
            (
                r#"{"error": "ValidationError: limit must be int"}"#,
                FailureClass::Validation,
            ),
            ("HTTP 404", FailureClass::MissingResource),
            (
                "requests.exceptions.ReadTimeout: timed out",
                FailureClass::Transient,
            ),
            (r#"{"error": "boom"}"#, FailureClass::Transient),
            (
                "AssertionError: balance < 0",
                FailureClass::InvariantViolation,
            ),
        ];
        for (content, class) in cases {
            assert_eq!(
                class_of(content, &read, true),
                failure(class, false),
                "{content}"
            );
        }
        assert_eq!(class_of(r#"{"rows": []}"#, &read, true), Outcome::Success);
    }

    #[test]
    fn an_empty_read_with_a_verifier_is_ambiguous() {
        let read = ToolProfile {
            verifier: Some("count_rows".into()),
            ..ToolProfile::default()
        };
        assert_eq!(
            class_of("[]", &read, true),
            failure(FailureClass::AmbiguousEffect, false)
        );
    }

    #[test]
    fn a_dispatched_write_that_timed_out_is_ambiguous_never_transient() {
        let write = ToolProfile {
            method: Some(HttpMethod::Post),
            ..ToolProfile::default()
        };
        for content in [
            "timed out",
            "ConnectionResetError",
            r#"{"id": "#,
            "HTTP 502",
        ] {
            assert_eq!(
                class_of(content, &write, true),
                failure(FailureClass::AmbiguousEffect, true),
                "{content}"
            );
        }
        // Not dispatched, or rejected before acting: transient.
        assert_eq!(
            class_of("timed out", &write, false),
            failure(FailureClass::Transient, false)
        );
        assert_eq!(
            class_of(r#"{"status": 429}"#, &write, true),
            failure(FailureClass::Transient, false)
        );
        // A timeout stays ambiguous even when the reply also asks to retry later: only a
        // whole reply proves the rejection.
        for content in [
            r#"{"status": 429, "error": "ReadTimeout: timed out"}"#,
            r#"{"error": "connection reset by peer", "retry_after": 5}"#,
        ] {
            assert_eq!(
                class_of(content, &write, true),
                failure(FailureClass::AmbiguousEffect, true),
                "{content}"
            );
        }
        // An unknown error after a possible mutation fails closed.
        assert_eq!(
            class_of(r#"{"error": "weird"}"#, &write, true),
            failure(FailureClass::InvariantViolation, true)
        );
        // A 4xx rejection did not mutate.
        assert_eq!(
            class_of(r#"{"status": 422}"#, &write, true),
            failure(FailureClass::Validation, false)
        );
    }
}
