//! The flight recorder's sampling policy (spec 000 §6.2: "100 % of incidents (including
//! watchdog trips); 1–5 % of normal runs, with privacy filters, hash-linked to FHR").
//!
//! Every `incident` and `lifecycle` record is written, always. A `turn` record is written
//! always when the turn was not normal ([`always_reason`]: halted, failed, an upstream
//! failure, a detector finding in any mode, a SafetyCheck verdict that is not upheld, degraded
//! safe mode); the record of a normal turn — committed cleanly, nothing found — is written
//! with probability `turn_sample_rate` (default 5 %). Either way the turn's metrics and its
//! TURN-ACID commit happen; only the ledger line is sampled. Records that are written stay in
//! the one hash chain, and each sampled turn record states the rate it was sampled at, so the
//! population it stands for can be estimated (each stands for `1 / rate` normal turns).
//!
//! Privacy filter: records never carry the text a turn produced unless `record_token_text`
//! is on (then turn records carry the first [`MAX_RECORDED_TEXT`] bytes of it). Text quoted
//! from the upstream's error messages is replaced by its length and SHA-256 ([`withheld`]).

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use rand::Rng;
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::ledger::Record;

/// Share of normal turns recorded when nothing is configured: the top of the spec's 1–5 %.
pub const DEFAULT_TURN_SAMPLE_RATE: f64 = 0.05;
/// Smallest rate accepted (the bottom of the spec's 1–5 %).
pub const MIN_TURN_SAMPLE_RATE: f64 = 0.01;
/// The top of the spec's range: a larger rate is accepted (audits, tests) with a warning.
pub const SPEC_MAX_TURN_SAMPLE_RATE: f64 = 0.05;
/// Most output text a turn record carries with `record_token_text` (bytes).
pub const MAX_RECORDED_TEXT: usize = 64 * 1024;

/// What the flight recorder keeps, validated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingPolicy {
    /// Probability that a normal turn's record is written, in `[0.01, 1]`.
    pub turn_sample_rate: f64,
    /// Turn records carry the turn's output text.
    pub record_token_text: bool,
}

impl Default for SamplingPolicy {
    fn default() -> Self {
        SamplingPolicy {
            turn_sample_rate: DEFAULT_TURN_SAMPLE_RATE,
            record_token_text: false,
        }
    }
}

/// The `[flight_recorder]` table of the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSection {
    pub turn_sample_rate: Option<f64>,
    pub record_token_text: Option<bool>,
}

/// Checks a sample rate; the error says what is accepted.
pub fn check_rate(rate: f64) -> Result<f64, String> {
    if rate.is_finite() && (MIN_TURN_SAMPLE_RATE..=1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err(format!(
            "{rate} is not a fraction in [{MIN_TURN_SAMPLE_RATE}, 1] (spec 000 §6.2 records \
             1–5 % of normal turns, 0.01 to 0.05; 1 records every turn; incidents are always \
             recorded)"
        ))
    }
}

impl SamplingPolicy {
    /// Whether the rate records more normal turns than the spec's 1–5 % (stated at start).
    pub fn above_spec(&self) -> bool {
        self.turn_sample_rate > SPEC_MAX_TURN_SAMPLE_RATE
    }
}

/// What became of one turn's record (the `decision` label of `haltd_turn_records_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Not a normal turn: always written; the reason goes into `sampling.reason`.
    Always(&'static str),
    /// A normal turn drawn by the sample.
    Sampled,
    /// A normal turn not drawn: no record.
    Skipped,
}

/// A [`Decision`] without its reason: the `decision` label of `haltd_turn_records_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecisionKind {
    Always,
    Sampled,
    Skipped,
}

impl DecisionKind {
    /// Every kind, each a series from the start.
    pub const ALL: [DecisionKind; 3] = [
        DecisionKind::Always,
        DecisionKind::Sampled,
        DecisionKind::Skipped,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            DecisionKind::Always => "always",
            DecisionKind::Sampled => "sampled",
            DecisionKind::Skipped => "skipped",
        }
    }
}

impl EncodeLabelValue for DecisionKind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl Decision {
    pub fn kind(self) -> DecisionKind {
        match self {
            Decision::Always(_) => DecisionKind::Always,
            Decision::Sampled => DecisionKind::Sampled,
            Decision::Skipped => DecisionKind::Skipped,
        }
    }

    /// The record's `sampling` field (`None` for a skipped turn, which has no record).
    pub fn field(self, rate: f64) -> Option<Value> {
        match self {
            Decision::Always(reason) => Some(serde_json::json!({"rate": 1.0, "reason": reason})),
            Decision::Sampled => Some(serde_json::json!({ "rate": rate })),
            Decision::Skipped => None,
        }
    }
}

/// Why a finished turn's record must be written whatever the rate, judged from the record as
/// built; `None` for a normal turn. In order: `incident` (tripped/halted), `failed` (did not
/// commit: client gone, upstream failure before the response, refused), `upstream` (an
/// upstream failure or cancellation), `tool_calls` (a call needs reconciliation), `detector`
/// (a breach or a failed check in any mode, an exfiltration hit, a timing breach),
/// `safety` (the SafetyCheck verdict is not upheld, or missing), `degraded` (served in
/// degraded safe mode).
pub fn always_reason(rec: &Record) -> Option<&'static str> {
    if rec.trip_cause.is_some()
        || rec.watchdog_trip
        || !rec.timing_incidents.is_empty()
        || rec.outcome.as_deref() == Some("halted")
    {
        return Some("incident");
    }
    if rec.outcome.as_deref() != Some("completed")
        || rec.turn_status.as_deref() != Some("committed")
        || !rec.failure_codes.is_empty()
    {
        return Some("failed");
    }
    if let Some(up) = &rec.upstream {
        if !up["failure"].is_null() || up["cancelled"] == true {
            return Some("upstream");
        }
    }
    if rec
        .tool_calls
        .iter()
        .any(|c| !c["reconciliation"].is_null() || c["status"] != "committed")
    {
        return Some("tool_calls");
    }
    if rec
        .grounding
        .as_ref()
        .and_then(|g| g["rounds"].as_array())
        .is_some_and(|r| !r.is_empty())
    {
        return Some("grounding");
    }
    if rec.tig_breach || rec.rts_mode == "breach" || detectors_found_something(rec) {
        return Some("detector");
    }
    if rec
        .safety_verdict
        .as_ref()
        .is_none_or(|v| v["upheld"] != true)
    {
        return Some("safety");
    }
    if rec.runtime_mode != "full" {
        return Some("degraded");
    }
    None
}

/// Any detector of the turn breached or failed (observe mode included), or the exfiltration
/// scanner matched.
fn detectors_found_something(rec: &Record) -> bool {
    let Some(Value::Object(m)) = &rec.detectors else {
        return false;
    };
    let count = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64).unwrap_or(0);
    m.iter().any(|(name, v)| match name.as_str() {
        "observed" => v.as_array().is_some_and(|a| !a.is_empty()),
        _ => count(v, "breaches") > 0 || count(v, "failures") > 0 || count(v, "hits") > 0,
    })
}

/// The decision for a finished turn's record: always written unless the turn is normal, else
/// drawn with probability `rate` using `uniform`, a sample from `[0, 1)`.
pub fn decide(rec: &Record, rate: f64, uniform: f64) -> Decision {
    match always_reason(rec) {
        Some(reason) => Decision::Always(reason),
        None if uniform < rate => Decision::Sampled,
        None => Decision::Skipped,
    }
}

/// [`decide`] with the thread's RNG (once per turn, never per token).
pub fn decide_now(rec: &Record, rate: f64) -> Decision {
    decide(rec, rate, rand::rng().random::<f64>())
}

/// The turn's text for its record: at most [`MAX_RECORDED_TEXT`] bytes, cut at a character
/// boundary; `true` when that (or the data plane's own bound) left something out.
pub fn text_excerpt(text: &str, already_truncated: bool) -> (String, bool) {
    if text.len() <= MAX_RECORDED_TEXT {
        return (text.to_owned(), already_truncated);
    }
    let mut end = MAX_RECORDED_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (text[..end].to_owned(), true)
}

/// What a record says instead of a withheld text: its length and SHA-256, so that someone
/// who holds the text can show it is the one recorded (hash-linked) without the record
/// carrying it.
pub fn withheld(text: &str) -> String {
    format!(
        "[withheld: {} bytes, sha256 {}]",
        text.len(),
        hex::encode(Sha256::digest(text.as_bytes()))
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A committed, clean turn record as `record_turn` builds it.
    fn normal() -> Record {
        Record {
            outcome: Some("completed".into()),
            turn_status: Some("committed".into()),
            rts_mode: "warming_up".into(),
            safety_verdict: Some(json!({"upheld": true, "violated_boundaries": []})),
            detectors: Some(json!({
                "surprise": {"mode": "observe", "breaches": 0, "failures": 0, "summary": {}},
                "exfil": {"mode": "hard", "hits": 0, "held_max_bytes": 3, "released_bytes": 40},
            })),
            kernel_gate: "enforcing".into(),
            ..Record::default()
        }
    }

    #[test]
    fn rates_outside_one_to_a_hundred_percent_are_refused() {
        for ok in [0.01, 0.05, 0.5, 1.0] {
            assert_eq!(check_rate(ok), Ok(ok));
        }
        for bad in [0.0, -0.05, 0.005, 1.01, f64::NAN, f64::INFINITY] {
            let e = check_rate(bad).expect_err("refused");
            assert!(e.contains("[0.01, 1]"), "{e}");
        }
        assert!(!SamplingPolicy::default().above_spec());
        assert!(SamplingPolicy {
            turn_sample_rate: 0.06,
            record_token_text: false
        }
        .above_spec());
    }

    #[test]
    fn a_clean_committed_turn_is_normal() {
        let rec = normal();
        assert_eq!(always_reason(&rec), None);
        assert_eq!(decide(&rec, 0.05, 0.049), Decision::Sampled);
        assert_eq!(decide(&rec, 0.05, 0.05), Decision::Skipped);
        assert_eq!(decide(&rec, 1.0, 0.999_999), Decision::Sampled);
        // Committed tool calls and a normal upstream exchange keep it normal.
        let mut rec = normal();
        rec.tool_calls = vec![json!({"index": 0, "id": "c", "name": "f", "status": "committed"})];
        rec.upstream = Some(json!({"failure": null, "cancelled": false, "status": 200}));
        assert_eq!(always_reason(&rec), None);
    }

    #[test]
    fn everything_else_is_always_recorded_with_its_reason() {
        type Edit = fn(&mut Record);
        let cases: [(Edit, &str); 16] = [
            (
                |r| {
                    r.trip_cause = Some("OPERATOR_TRIP".into());
                    r.watchdog_trip = true;
                },
                "incident",
            ),
            (|r| r.outcome = Some("halted".into()), "incident"),
            (
                |r| {
                    r.outcome = Some("client_gone".into());
                    r.turn_status = Some("failed".into());
                },
                "failed",
            ),
            (|r| r.outcome = Some("upstream_failed".into()), "failed"),
            (|r| r.turn_status = Some("failed".into()), "failed"),
            (
                |r| r.failure_codes = vec!["UPSTREAM_FAILURE".into()],
                "failed",
            ),
            (
                |r| r.upstream = Some(json!({"failure": {"kind": "missing_logprobs"}})),
                "upstream",
            ),
            (
                |r| r.upstream = Some(json!({"failure": null, "cancelled": true})),
                "upstream",
            ),
            (
                |r| {
                    r.tool_calls =
                        vec![json!({"status": "dispatched", "reconciliation": "required"})]
                },
                "tool_calls",
            ),
            (|r| r.tig_breach = true, "detector"),
            (|r| r.rts_mode = "breach".into(), "detector"),
            (
                |r| {
                    r.detectors = Some(json!({"surprise": {"breaches": 2, "failures": 0}}));
                },
                "detector",
            ),
            (
                |r| {
                    r.detectors = Some(json!({"observed": [{"detector": "surprise"}]}));
                },
                "detector",
            ),
            (
                |r| r.detectors = Some(json!({"exfil": {"hits": 1}})),
                "detector",
            ),
            (
                |r| r.safety_verdict = Some(json!({"upheld": false})),
                "safety",
            ),
            (|r| r.runtime_mode = "degraded".into(), "degraded"),
        ];
        for (edit, want) in cases {
            let mut rec = normal();
            edit(&mut rec);
            assert_eq!(always_reason(&rec), Some(want), "{rec:?}");
            // Whatever the draw.
            assert_eq!(decide(&rec, 0.01, 0.99), Decision::Always(want));
        }
        let mut rec = normal();
        rec.safety_verdict = None;
        assert_eq!(always_reason(&rec), Some("safety"));
        let mut rec = normal();
        rec.detectors = Some(json!({"halt_monitor": {"failures": 1}}));
        assert_eq!(always_reason(&rec), Some("detector"));
    }

    #[test]
    fn the_sampling_field_states_rate_and_reason() {
        assert_eq!(
            Decision::Always("incident").field(0.05),
            Some(json!({"rate": 1.0, "reason": "incident"}))
        );
        assert_eq!(Decision::Sampled.field(0.05), Some(json!({"rate": 0.05})));
        assert_eq!(Decision::Skipped.field(0.05), None);
        assert_eq!(
            DecisionKind::ALL.map(DecisionKind::as_str),
            ["always", "sampled", "skipped"]
        );
        assert_eq!(Decision::Always("x").kind(), DecisionKind::Always);
    }

    #[test]
    fn the_draw_keeps_about_the_rate() {
        let rec = normal();
        let n = 20_000;
        let kept = (0..n)
            .filter(|_| decide_now(&rec, 0.05) == Decision::Sampled)
            .count() as f64;
        // Binomial(20000, 0.05): sd ≈ 30.8; 6 sd either side.
        assert!((kept - 1000.0).abs() < 185.0, "kept {kept} of {n}");
    }

    #[test]
    fn text_is_cut_at_a_character_boundary_and_withheld_text_is_hashed() {
        assert_eq!(text_excerpt("héllo", false), ("héllo".to_owned(), false));
        assert_eq!(text_excerpt("x", true), ("x".to_owned(), true));
        let long = "é".repeat(MAX_RECORDED_TEXT); // 2 bytes each
        let (cut, truncated) = text_excerpt(&long, false);
        assert!(truncated && cut.len() == MAX_RECORDED_TEXT && cut.chars().all(|c| c == 'é'));
        let odd = format!("a{long}");
        let (cut, _) = text_excerpt(&odd, false);
        assert_eq!(cut.len(), MAX_RECORDED_TEXT - 1);
        assert_eq!(
            withheld("abc"),
            "[withheld: 3 bytes, sha256 ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad]"
        );
    }
}
