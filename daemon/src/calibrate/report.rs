//! The calibration report as `haltctl calibrate` prints it for people.

use std::fmt;

use super::CalibrationReport;

impl fmt::Display for CalibrationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "surprise detector: {} of the last {} tokens' surprise, min_tokens {}",
            self.statistic, self.window, self.min_tokens
        )?;
        writeln!(
            f,
            "streams scored: {} ({} positive, {} negative); too short ever to trip: {} \
             positive, {} negative; unscorable (excluded): {}",
            self.scored(),
            self.positives,
            self.negatives,
            self.too_short_positives,
            self.too_short_negatives,
            self.unscorable.len()
        )?;
        match &self.auroc_ci {
            Some(ci) => writeln!(
                f,
                "AUROC {:.3} ({:.0}% CI {:.3}–{:.3}; {}, {} resamples, seed {})",
                self.auroc,
                ci.level * 100.0,
                ci.low,
                ci.high,
                ci.method,
                ci.resamples,
                ci.seed
            )?,
            None => writeln!(f, "AUROC {:.3} (no bootstrap interval)", self.auroc)?,
        }
        match &self.operating_point {
            Some(op) => {
                writeln!(
                    f,
                    "operating point (highest precision at recall ≥ {}): threshold_bits = {}",
                    self.min_recall, op.threshold_bits
                )?;
                writeln!(
                    f,
                    "  precision {:.3} ({} of {} flagged), recall {:.3} ({} of {} positives), \
                     FPR {:.3} ({} of {} negatives)",
                    op.precision,
                    op.tp,
                    op.tp + op.fp,
                    op.recall,
                    op.tp,
                    self.positives,
                    op.fpr,
                    op.fp,
                    self.negatives
                )?;
            }
            None => writeln!(
                f,
                "no operating point: no threshold reaches recall ≥ {} ({} of {} positives are \
                 too short ever to trip)",
                self.min_recall, self.too_short_positives, self.positives
            )?,
        }
        for s in &self.unscorable {
            let at = s.line.map(|l| format!("line {l}, ")).unwrap_or_default();
            writeln!(
                f,
                "  unscorable: {at}id {:?}, label {}: {}",
                s.id,
                u8::from(s.positive),
                s.reason
            )?;
        }
        Ok(())
    }
}
