//! The tool arm's shell-free evaluator: runs a [`Check`] with fend (arbitrary precision,
//! unit-aware, dates), no process and no network (fend's currency rates need a handler,
//! and none is set, so a currency conversion fails instead of fetching rates).
//!
//! The result is computed, not retrieved, so its snippet is stamped confidence 1.0 (spec 003:
//! a verified tool result is `observable: 1.0`). When the text states a value, the evidence
//! says whether it matches, to the precision the text gives it: "8.05 km" matches 8.04672 km
//! (within 0.005), "400" does not match 391.

use std::time::Instant;

use super::check::{Check, Stated};
use super::evidence::cap_evidence;
use super::Snippet;

/// The source of the evaluator's snippets.
pub const SOURCE: &str = "tool:evaluator";

/// Stops fend at the arm's deadline.
struct Deadline(Instant);

impl fend_core::Interrupt for Deadline {
    fn should_interrupt(&self) -> bool {
        Instant::now() >= self.0
    }
}

/// Why a check gave no snippet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    /// fend could not read or evaluate the expression.
    #[error("fend could not evaluate {expr:?}: {reason}")]
    Unreadable { expr: String, reason: String },
}

fn eval(expr: &str, deadline: Instant) -> Result<String, EvalError> {
    let mut ctx = fend_core::Context::new();
    ctx.disable_rng();
    fend_core::evaluate_with_interrupt(expr, &mut ctx, &Deadline(deadline))
        .map(|r| r.get_main_result().to_owned())
        .map_err(|reason| EvalError::Unreadable {
            expr: expr.to_owned(),
            reason,
        })
}

/// A number out of fend's answer: `approx. 8.04672 km` → 8.04672.
fn leading_number(answer: &str) -> Option<f64> {
    let s = answer.trim().trim_start_matches("approx.").trim();
    s.split_whitespace().next()?.replace(',', "").parse().ok()
}

/// Whether `computed` (in the stated unit) matches `stated` to the stated precision.
fn matches_to_precision(computed: f64, stated: &str) -> Option<bool> {
    let value: f64 = stated.parse().ok()?;
    let decimals = stated.split_once('.').map_or(0, |(_, d)| d.len());
    let decimals = i32::try_from(decimals).ok()?;
    let half_unit = 0.5 * 10f64.powi(-decimals);
    Some((computed - value).abs() <= half_unit + 1e-9 * value.abs().max(1.0))
}

/// Runs `check`: the snippet of its result, confidence 1.0.
pub fn evaluate(check: &Check, deadline: Instant) -> Result<Snippet, EvalError> {
    let shown = match &check.target {
        Some(t) => format!("{} to {t}", check.expr),
        None => check.expr.clone(),
    };
    let result = eval(&shown, deadline)?;
    let verdict = match &check.stated {
        None => None,
        Some(Stated::Number { value, unit }) => {
            let in_unit = match unit {
                Some(u) => eval(&format!("({}) to {u}", check.expr), deadline)?,
                None => result.clone(),
            };
            let written = match unit {
                Some(u) => format!("{value} {u}"),
                None => value.clone(),
            };
            leading_number(&in_unit)
                .and_then(|v| matches_to_precision(v, value))
                .map(|ok| (written, ok))
        }
        Some(Stated::Date(d)) => {
            let stated = eval(&format!("@{d}"), deadline)?;
            Some((d.clone(), stated == result))
        }
        Some(Stated::Weekday(w)) => Some((w.clone(), result.to_lowercase().starts_with(w))),
    };
    let mut evidence = format!("{shown} = {result}");
    if let Some((written, ok)) = verdict {
        let says = if ok { "matches" } else { "does not match" };
        evidence.push_str(&format!(" (the text's {written} {says})"));
    }
    Ok(Snippet {
        claim: check.fragment.clone(),
        evidence: cap_evidence(&evidence),
        confidence: 1.0,
        source: SOURCE.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::grounding::check::find;

    fn run(text: &str) -> Snippet {
        let check = find(text).expect("a check");
        evaluate(&check, Instant::now() + Duration::from_secs(5)).expect("evaluated")
    }

    #[test]
    fn arithmetic_is_computed_and_compared() {
        let s = run("so 17 × 23 = 400 in total");
        assert_eq!(s.claim, "17 × 23 = 400");
        assert_eq!(s.evidence, "17 * 23 = 391 (the text's 400 does not match)");
        assert_eq!(s.confidence, 1.0);
        assert_eq!(s.source, SOURCE);
        assert_eq!(
            run("(12 + 30) / 6 = 7").evidence,
            "(12 + 30) / 6 = 7 (the text's 7 matches)"
        );
        assert!(run("12 squared is 144").evidence.ends_with("matches)"));
    }

    #[test]
    fn conversions_match_to_the_stated_precision() {
        let s = run("5 miles is about 8.05 km");
        assert!(s.evidence.starts_with("5 miles to km = "), "{}", s.evidence);
        assert!(
            s.evidence.ends_with("(the text's 8.05 km matches)"),
            "{}",
            s.evidence
        );
        let s = run("5 miles is 9 km");
        assert!(s.evidence.ends_with("does not match)"), "{}", s.evidence);
        let s = run("212 fahrenheit in celsius");
        assert!(s.evidence.contains("= 100 °C"), "{}", s.evidence);
    }

    #[test]
    fn dates_and_weekdays() {
        let s = run("2024-01-01 plus 30 days is 2024-01-31");
        assert!(
            s.evidence.ends_with("(the text's 2024-01-31 matches)"),
            "{}",
            s.evidence
        );
        let s = run("2024-01-01 was a Tuesday");
        assert!(s.evidence.contains("Monday"), "{}", s.evidence);
        assert!(
            s.evidence.ends_with("(the text's tuesday does not match)"),
            "{}",
            s.evidence
        );
    }

    #[test]
    fn an_expression_fend_cannot_read_is_an_error() {
        let check = Check {
            kind: crate::grounding::check::CheckKind::Unit,
            fragment: "5 zorks".into(),
            expr: "5 zorks".into(),
            target: Some("km".into()),
            stated: None,
        };
        let e = evaluate(&check, Instant::now() + Duration::from_secs(5));
        assert!(matches!(e, Err(EvalError::Unreadable { .. })), "{e:?}");
    }

    #[test]
    fn a_passed_deadline_interrupts_fend() {
        let check = find("2024-01-01 plus 90000 days").expect("a check");
        assert!(evaluate(&check, Instant::now()).is_err());
    }
}
