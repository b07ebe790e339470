//! From configuration to a turn's detectors: [`Detectors`] is built once at start-up from
//! the config file (and `--hard-limit`), validating every setting and compiling what can be
//! shared (the exfiltration rules, the latency baseline); [`Detectors::turn`] then gives each
//! turn its own [`TurnGovernor`], which the data plane asks about every token.
//!
//! Order of the checks on a token: HaltMonitor (its scorer), surprise, compute budget,
//! latency anomaly — then the exfiltration scanner, which decides how much of the text may be
//! released. The first hard trip wins.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{
    config::{check_names, entry, err, ConfigFileError, Entry},
    exfil::{Ahead, ExfilConfig, ExfilRules, ExfilScanner, ExfilStep},
    scorer::{Scored, Scorer, ScorerConfig, ScorerError, Woke},
    surprise::{SurpriseConfig, SurpriseDetector},
    timing::{
        ComputeBudget, ComputeBudgetConfig, LatencyAnomaly, LatencyAnomalyConfig, LatencyBaseline,
    },
    Detector, DetectorId, DetectorMode, FailureKind, Finding, Observed, TokenObs, Trip, TripKind,
    TurnDetectors,
};
use crate::{
    codes::FailureCode,
    monitor::{Decision, HaltMonitor},
    safety::{SafetyCheck, SafetyConfig, SafetyPack},
};

/// The detectors the config file knows (`[detectors.<name>]`), in the order they run.
pub const DETECTORS: [DetectorId; 5] = [
    DetectorId::HaltMonitor,
    DetectorId::Surprise,
    DetectorId::ComputeBudget,
    DetectorId::LatencyAnomaly,
    DetectorId::Exfil,
];

/// `[detectors.halt_monitor]`'s own keys.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HaltMonitorConfig {
    /// Scores below this halt (spec 001). `None`: `--hard-limit` (default 0, monitor off).
    pub hard_limit: Option<f64>,
    pub scorer: ScorerConfig,
}

/// Every detector's policy and settings, validated.
#[derive(Clone, Debug)]
pub struct DetectorsConfig {
    pub halt_monitor: Entry<HaltMonitorConfig>,
    pub surprise: Entry<SurpriseConfig>,
    pub compute_budget: Entry<ComputeBudgetConfig>,
    pub latency_anomaly: Entry<LatencyAnomalyConfig>,
    pub exfil: Entry<ExfilConfig>,
    pub safety: SafetyConfig,
}

/// The config file's top level: `[detectors.*]` and `[safety]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTop {
    #[serde(default)]
    detectors: Option<toml::Table>,
    #[serde(default)]
    safety: Option<toml::Table>,
}

impl DetectorsConfig {
    /// Reads the detector settings from a parsed config file (`None`: no file) and the
    /// `--hard-limit` flag. Defaults: HaltMonitor hard (off while the limit is 0), exfil hard,
    /// compute budget hard (unlimited until configured), surprise and latency anomaly observe
    /// (their thresholds need calibration on the deployment's traffic first), safety observe.
    pub fn load(file: Option<&toml::Table>, cli_hard_limit: f64) -> Result<Self, ConfigFileError> {
        let top: FileTop = match file {
            Some(t) => FileTop::deserialize(toml::Value::Table(t.clone()))
                .map_err(|e| err("file", e.to_string()))?,
            None => FileTop::default(),
        };
        let d = top.detectors.as_ref();
        check_names(d, &DETECTORS.map(DetectorId::as_str))?;
        let halt_monitor = halt_monitor_entry(d, cli_hard_limit)?;
        let mut surprise: Entry<SurpriseConfig> =
            entry(d, DetectorId::Surprise.as_str(), DetectorMode::Observe)?;
        surprise.cfg = surprise
            .cfg
            .clone()
            .validate()
            .map_err(|e| err("detectors.surprise", e.to_string()))?;
        let mut compute_budget: Entry<ComputeBudgetConfig> =
            entry(d, DetectorId::ComputeBudget.as_str(), DetectorMode::Hard)?;
        compute_budget.cfg = compute_budget
            .cfg
            .clone()
            .validate()
            .map_err(|e| err("detectors.compute_budget", e.to_string()))?;
        let mut latency_anomaly: Entry<LatencyAnomalyConfig> = entry(
            d,
            DetectorId::LatencyAnomaly.as_str(),
            DetectorMode::Observe,
        )?;
        latency_anomaly.cfg = latency_anomaly
            .cfg
            .clone()
            .validate()
            .map_err(|e| err("detectors.latency_anomaly", e.to_string()))?;
        let exfil: Entry<ExfilConfig> = entry(d, DetectorId::Exfil.as_str(), DetectorMode::Hard)?;
        if exfil.policy.debounce > 1 || exfil.policy.deadline_ns > 0 {
            return Err(err(
                "detectors.exfil",
                "takes no debounce or deadline_us: a secret trips at its first match, and the scanner's cost is bounded by its rules",
            ));
        }
        if exfil.policy.mode != DetectorMode::Off {
            // Compiled here too, so that a bad rule is a configuration error (exit 2) before
            // anything starts; the daemon compiles it again once (tens of ms).
            ExfilRules::new(&exfil.cfg).map_err(|e| err("detectors.exfil", e.to_string()))?;
        }
        let safety = match &top.safety {
            Some(t) => SafetyConfig::deserialize(toml::Value::Table(t.clone()))
                .map_err(|e| err("safety", e.to_string()))?,
            None => SafetyConfig::default(),
        };
        let safety = safety
            .validate()
            .map_err(|e| err(format!("safety.{}", e.key), e.reason))?;
        Ok(DetectorsConfig {
            halt_monitor,
            surprise,
            compute_budget,
            latency_anomaly,
            exfil,
            safety,
        })
    }
}

/// `[detectors.halt_monitor]`, with its limit from the file or `--hard-limit` (not both,
/// unless they agree) and its scorer validated.
fn halt_monitor_entry(
    d: Option<&toml::Table>,
    cli_hard_limit: f64,
) -> Result<Entry<HaltMonitorConfig>, ConfigFileError> {
    let mut halt_monitor: Entry<HaltMonitorConfig> =
        entry(d, DetectorId::HaltMonitor.as_str(), DetectorMode::Hard)?;
    if halt_monitor.policy.debounce > 1 {
        // Spec 001: the failing token itself is never emitted; the monitor latches, so a
        // debounce would let the failing token and the next K-1 out first.
        return Err(err(
            "detectors.halt_monitor.debounce",
            "must be 1: the HaltMonitor halts on the first failing token (spec 001)",
        ));
    }
    let limit = match (halt_monitor.cfg.hard_limit, cli_hard_limit) {
        (Some(file), cli) if cli != 0.0 && cli != file => {
            return Err(err(
                "detectors.halt_monitor.hard_limit",
                format!("{file} in the file contradicts --hard-limit {cli}; set one"),
            ))
        }
        (Some(file), _) => file,
        (None, cli) => cli,
    };
    let probability = halt_monitor.cfg.scorer == ScorerConfig::Probability;
    if !limit.is_finite() || (probability && !(0.0..=1.0).contains(&limit)) {
        return Err(err(
            "detectors.halt_monitor.hard_limit",
            format!("{limit} is not a probability in [0, 1]"),
        ));
    }
    halt_monitor.cfg.hard_limit = Some(limit);
    halt_monitor.cfg.scorer = halt_monitor
        .cfg
        .scorer
        .clone()
        .validate()
        .map_err(|e| err("detectors.halt_monitor", e.to_string()))?;
    Ok(halt_monitor)
}

/// The HaltMonitor of spec 001 as a detector: one implementation for the pure model and the
/// stream ([`crate::monitor`]), fed by a pluggable scorer.
#[derive(Debug)]
struct HaltMonitorDetector {
    monitor: HaltMonitor,
    scorer: Box<dyn Scorer>,
}

impl Detector for HaltMonitorDetector {
    fn id(&self) -> DetectorId {
        DetectorId::HaltMonitor
    }
    fn code(&self) -> FailureCode {
        FailureCode::CoherenceBelowThreshold
    }
    fn observe(&mut self, tok: &TokenObs<'_>) -> Finding {
        let scored = self.scorer.score(tok);
        self.finding(scored)
    }
    fn start(&mut self, tok: &TokenObs<'_>) -> Observed {
        match self.scorer.start(tok) {
            Scored::Done(r) => Observed::Done(self.finding(r)),
            Scored::Wait(w) => Observed::Wait(w),
        }
    }
    fn resume(&mut self, woke: Woke) -> Observed {
        match self.scorer.resume(woke) {
            Scored::Done(r) => Observed::Done(self.finding(r)),
            Scored::Wait(w) => Observed::Wait(w),
        }
    }
    fn summary(&self) -> serde_json::Value {
        serde_json::json!({"hard_limit": self.monitor.hard_limit(), "halted": self.monitor.is_halted()})
    }
}

impl HaltMonitorDetector {
    /// The monitor's verdict on a token's score (or on the scorer's failure).
    fn finding(&mut self, scored: Result<f64, ScorerError>) -> Finding {
        match scored {
            Ok(score) => match self.monitor.check(score) {
                Decision::Emit => Finding::Clear,
                Decision::Halt => Finding::Breach {
                    detail: format!(
                        "score {score:.4} below hard_limit {}",
                        self.monitor.hard_limit()
                    ),
                },
            },
            // No logprob to score: the monitor halts on an unscorable token (a NaN score),
            // as spec 001's model does for a failing one.
            Err(e) if e.kind() == FailureKind::Unscorable => {
                let _ = self.monitor.check(f64::NAN);
                Finding::Unscorable {
                    detail: format!("unscorable: {e}"),
                }
            }
            Err(e) => Finding::Failed {
                kind: e.kind(),
                detail: e.to_string(),
            },
        }
    }
}

impl Drop for HaltMonitorDetector {
    fn drop(&mut self) {
        self.scorer.end_turn();
    }
}

/// Start-up product of the configuration: what every turn's detectors are built from.
#[derive(Debug)]
pub struct Detectors {
    pub cfg: DetectorsConfig,
    exfil_rules: Option<Arc<ExfilRules>>,
    baseline: Arc<LatencyBaseline>,
    pub safety: SafetyCheck,
    pub safety_pack: SafetyPack,
}

impl Detectors {
    pub fn new(cfg: DetectorsConfig) -> Result<Self, ConfigFileError> {
        let exfil_rules = if cfg.exfil.policy.mode == DetectorMode::Off {
            None
        } else {
            Some(Arc::new(
                ExfilRules::new(&cfg.exfil.cfg)
                    .map_err(|e| err("detectors.exfil", e.to_string()))?,
            ))
        };
        // Building the scorer checks its settings once here, not at the first turn.
        cfg.halt_monitor
            .cfg
            .scorer
            .build()
            .map_err(|e| err("detectors.halt_monitor.scorer", e.to_string()))?;
        let safety = cfg
            .safety
            .safety_check()
            .map_err(|e| err(format!("safety.{}", e.key), e.reason))?;
        let safety_pack = cfg.safety.pack();
        Ok(Detectors {
            exfil_rules,
            baseline: Arc::new(LatencyBaseline::new()),
            safety,
            safety_pack,
            cfg,
        })
    }

    /// The detectors of a reloaded configuration, keeping what `previous` learnt from the
    /// node's traffic (the latency baseline), so a SIGHUP does not reset it.
    pub fn reloaded(cfg: DetectorsConfig, previous: &Detectors) -> Result<Self, ConfigFileError> {
        let mut next = Detectors::new(cfg)?;
        next.baseline = Arc::clone(&previous.baseline);
        Ok(next)
    }

    /// Whether the HaltMonitor runs at all (a probability limit of 0 passes every token).
    pub fn halt_monitor_on(&self) -> bool {
        let h = &self.cfg.halt_monitor;
        h.policy.mode != DetectorMode::Off
            && (h.cfg.hard_limit.unwrap_or(0.0) > 0.0 || h.cfg.scorer != ScorerConfig::Probability)
    }

    /// The detectors of a new turn. An external scorer that cannot be reached fails the turn
    /// closed (`Err`: trip it before its first token).
    pub fn turn(&self, turn_id: &str, start_ns: u64) -> Result<TurnGovernor, Trip> {
        let c = &self.cfg;
        let mut set = TurnDetectors::new();
        if self.halt_monitor_on() {
            let mut scorer = c
                .halt_monitor
                .cfg
                .scorer
                .build()
                .map_err(|e| halt_monitor_failed(FailureKind::Setup, e.to_string()))?;
            if let Err(e) = scorer.begin_turn(turn_id) {
                if c.halt_monitor.policy.mode == DetectorMode::Hard {
                    return Err(halt_monitor_failed(e.kind(), e.to_string()));
                }
            }
            let monitor = HaltMonitor::new(c.halt_monitor.cfg.hard_limit.unwrap_or(0.0))
                .map_err(|e| halt_monitor_failed(FailureKind::Setup, e.to_string()))?;
            set.add(
                Box::new(HaltMonitorDetector { monitor, scorer }),
                c.halt_monitor.policy,
            );
        }
        if c.surprise.policy.mode != DetectorMode::Off {
            if let Ok(d) = SurpriseDetector::new(&c.surprise.cfg) {
                set.add(Box::new(d), c.surprise.policy);
            }
        }
        if c.compute_budget.policy.mode != DetectorMode::Off && !c.compute_budget.cfg.is_unlimited()
        {
            set.add(
                Box::new(ComputeBudget::starting_at(&c.compute_budget.cfg, start_ns)),
                c.compute_budget.policy,
            );
        }
        if c.latency_anomaly.policy.mode != DetectorMode::Off {
            set.add(
                Box::new(LatencyAnomaly::new(
                    &c.latency_anomaly.cfg,
                    Arc::clone(&self.baseline),
                )),
                c.latency_anomaly.policy,
            );
        }
        let exfil = self
            .exfil_rules
            .as_ref()
            .map(|r| (ExfilScanner::new(Arc::clone(r)), c.exfil.policy.mode));
        Ok(TurnGovernor {
            set,
            exfil,
            exfil_hits: 0,
            held_max: 0,
        })
    }
}

/// The HaltMonitor cannot start the turn: a `DETECTOR_FAILURE` trip before its first token.
fn halt_monitor_failed(kind: FailureKind, detail: String) -> Trip {
    Trip {
        detector: DetectorId::HaltMonitor,
        code: FailureCode::DetectorFailure,
        kind: TripKind::Failed(kind),
        detail,
    }
}

/// What the governor says about a token.
#[derive(Clone, Debug, PartialEq)]
pub enum Gate {
    /// Trip the stream: this token and everything held are never emitted.
    Trip(Trip),
    /// This many more bytes of the turn's text (held text first, then this token's) may be
    /// released now.
    Release(usize),
}

/// One turn's detectors and exfiltration scanner.
#[derive(Debug)]
pub struct TurnGovernor {
    pub set: TurnDetectors,
    exfil: Option<(ExfilScanner, DetectorMode)>,
    exfil_hits: u64,
    held_max: usize,
}

impl TurnGovernor {
    /// A governor with no detectors (for a turn that is tripped before its first token).
    pub fn empty() -> Self {
        TurnGovernor {
            set: TurnDetectors::new(),
            exfil: None,
            exfil_hits: 0,
            held_max: 0,
        }
    }

    /// What each detector did in the turn, for the per-route counters
    /// ([`TurnDetectors::judged`]), the exfiltration scanner included: its findings are its
    /// hits.
    pub fn judged(
        &self,
        tripped_by: Option<DetectorId>,
    ) -> impl Iterator<Item = (DetectorId, DetectorMode, u64, bool)> + '_ {
        let exfil = self.exfil.as_ref().map(|(_, mode)| {
            let id = DetectorId::Exfil;
            (id, *mode, self.exfil_hits, tripped_by == Some(id))
        });
        self.set.judged(tripped_by).chain(exfil)
    }

    /// Judges the next token (and its text, which joins the scanner's window).
    pub fn on_token(&mut self, tok: &TokenObs<'_>, clock: impl Fn() -> u64) -> Gate {
        if let Some(t) = self.set.observe(tok, clock) {
            return Gate::Trip(t);
        }
        self.scan(tok.text)
    }

    /// Text that is scanned but is no token of the detectors (a tool call's arguments).
    pub fn scan(&mut self, text: &str) -> Gate {
        let Some((scanner, mode)) = self.exfil.as_mut() else {
            return Gate::Release(text.len());
        };
        crate::progress::running(crate::progress::Check::Exfil);
        if self.set.hang == Some(DetectorId::Exfil) {
            crate::progress::hang_once(crate::progress::Check::Exfil);
        }
        let step = scanner.push(text);
        crate::progress::running(crate::progress::Check::None);
        self.held_max = self.held_max.max(scanner.held_bytes());
        match step {
            ExfilStep::Release(n) => Gate::Release(n),
            ExfilStep::Breach(hit) => {
                self.exfil_hits += 1;
                let detail = format!(
                    "rule {} matched {} bytes at offset {} (fingerprint {:08x})",
                    hit.rule, hit.len, hit.start, hit.fingerprint
                );
                if *mode == DetectorMode::Hard {
                    Gate::Trip(Trip {
                        detector: DetectorId::Exfil,
                        code: FailureCode::ExfilAlert,
                        kind: TripKind::Breach,
                        detail,
                    })
                } else {
                    // Observe mode: reported; the match now counts as decided, and the
                    // scanner releases it with what follows (or at the end of the turn).
                    Gate::Release(0)
                }
            }
        }
    }

    /// The text after the last token judged, known before it is judged (the built-in
    /// model's next token, or the end of its text): how many more bytes of the held text may
    /// be released now, because that text rules out every candidate that held them
    /// ([`ExfilScanner::look_ahead`]). Judges nothing and never trips: the detectors, the
    /// scanner included, see that text when its token comes ([`Self::on_token`],
    /// [`Self::scan`]), which must then bring exactly this text (or the turn ends).
    pub fn look_ahead(&mut self, next: Ahead<'_>) -> usize {
        self.exfil
            .as_mut()
            .map_or(0, |(scanner, _)| scanner.look_ahead(next))
    }

    /// The turn's last tokens were dropped unsent (a grounding round's rewind): the
    /// detectors forget them, and the scanner, which saw them too, starts over on `held`,
    /// the kept text it had not released yet. What it says about `held` is the answer.
    pub fn rewound(&mut self, held: &str) -> Gate {
        self.set.rewound();
        if let Some((scanner, _)) = self.exfil.as_mut() {
            scanner.reset();
        }
        self.scan(held)
    }

    /// The end of the turn's text: everything still held is decided.
    pub fn on_end(&mut self, now_ns: u64) -> Gate {
        if let Some(t) = self.set.end_of_turn(now_ns) {
            return Gate::Trip(t);
        }
        let Some((scanner, mode)) = self.exfil.as_mut() else {
            return Gate::Release(usize::MAX);
        };
        match scanner.finish() {
            ExfilStep::Release(n) => Gate::Release(n),
            ExfilStep::Breach(hit) => {
                self.exfil_hits += 1;
                if *mode == DetectorMode::Hard {
                    Gate::Trip(Trip {
                        detector: DetectorId::Exfil,
                        code: FailureCode::ExfilAlert,
                        kind: TripKind::Breach,
                        detail: format!(
                            "rule {} matched {} bytes at offset {} (fingerprint {:08x})",
                            hit.rule, hit.len, hit.start, hit.fingerprint
                        ),
                    })
                } else {
                    Gate::Release(usize::MAX)
                }
            }
        }
    }

    /// `detector_refs[]` entries of the turn.
    pub fn refs(&self) -> Vec<String> {
        let mut v: Vec<String> = self.set.refs().collect();
        if let Some((_, mode)) = &self.exfil {
            v.push(format!(
                "exfil:{}",
                if *mode == DetectorMode::Hard {
                    "hard"
                } else {
                    "observe"
                }
            ));
        }
        v
    }

    /// The detectors' summaries for the turn record.
    pub fn summary(&self) -> serde_json::Value {
        let mut s = self.set.summary();
        if let (Some((scanner, mode)), Some(m)) = (self.exfil.as_ref(), s.as_object_mut()) {
            m.insert(
                DetectorId::Exfil.as_str().to_owned(),
                serde_json::json!({
                    "mode": mode,
                    "hits": self.exfil_hits,
                    "held_max_bytes": self.held_max.max(scanner.peak_held_bytes()),
                    "released_bytes": scanner.released_bytes(),
                }),
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str, cli: f64) -> Result<DetectorsConfig, ConfigFileError> {
        let t: toml::Table = text.parse().expect("toml");
        DetectorsConfig::load(Some(&t), cli)
    }

    #[test]
    fn defaults_fail_closed_where_they_can() {
        let c = DetectorsConfig::load(None, 0.0).expect("defaults");
        assert_eq!(c.exfil.policy.mode, DetectorMode::Hard);
        assert_eq!(c.halt_monitor.policy.mode, DetectorMode::Hard);
        assert_eq!(c.surprise.policy.mode, DetectorMode::Observe);
        let d = Detectors::new(c).expect("builds");
        assert!(!d.halt_monitor_on(), "a limit of 0 passes every token");
        let gov = d.turn("t", 0).expect("turn");
        assert!(gov.refs().iter().any(|r| r == "exfil:hard"));
    }

    #[test]
    fn hard_limit_from_the_flag_or_the_file_but_not_both_differently() {
        assert_eq!(
            load("", 0.2).expect("flag").halt_monitor.cfg.hard_limit,
            Some(0.2)
        );
        let file = "[halt_monitor]\nhard_limit = 0.3\n";
        let file = format!("[detectors.{}", &file[1..]);
        assert_eq!(
            load(&file, 0.0).expect("file").halt_monitor.cfg.hard_limit,
            Some(0.3)
        );
        assert_eq!(
            load(&file, 0.4).expect_err("conflict").at,
            "detectors.halt_monitor.hard_limit"
        );
        assert!(load("[detectors.halt_monitor]\nhard_limit = 1.5\n", 0.0).is_err());
    }

    #[test]
    fn settings_that_would_weaken_a_guarantee_are_refused() {
        for (text, at) in [
            (
                "[detectors.halt_monitor]\ndebounce = 2\n",
                "detectors.halt_monitor.debounce",
            ),
            ("[detectors.exfil]\ndebounce = 2\n", "detectors.exfil"),
            (
                "[detectors.exfil]\nextra_patterns = [\"a+\"]\n",
                "detectors.exfil",
            ),
            ("[detectors.surprise]\nwindow = 0\n", "detectors.surprise"),
            ("[safety]\nmode = \"loud\"\n", "safety"),
            ("[nonsense]\n", "file"),
        ] {
            let e = load(text, 0.0).expect_err(text);
            assert!(e.at.starts_with(at), "{text}: {e}");
        }
    }

    #[test]
    fn an_unscorable_token_is_a_typed_halt_monitor_breach() {
        let d = Detectors::new(DetectorsConfig::load(None, 0.5).expect("limit")).expect("ok");
        let mut gov = d.turn("t", 0).expect("turn");
        let obs = TokenObs {
            index: 0,
            text: "x",
            logprob: None,
            now_ns: 0,
        };
        match gov.on_token(&obs, || 0) {
            Gate::Trip(t) => {
                assert_eq!(t.detector, DetectorId::HaltMonitor);
                assert_eq!(t.kind, TripKind::Unscorable);
                assert_eq!(t.code, FailureCode::CoherenceBelowThreshold);
            }
            other => panic!("expected a trip, got {other:?}"),
        }
    }

    #[test]
    fn the_governor_holds_a_secret_and_trips_on_it() {
        let d = Detectors::new(DetectorsConfig::load(None, 0.0).expect("defaults")).expect("ok");
        let mut gov = d.turn("t", 0).expect("turn");
        let mut released = 0;
        for (i, piece) in ["The key is ", "AKIA", "IOSFODNN", "7EXAMPLE", " ok"]
            .iter()
            .enumerate()
        {
            let obs = TokenObs {
                index: i as u64,
                text: piece,
                logprob: Some(-0.1),
                now_ns: i as u64 * 20_000_000,
            };
            match gov.on_token(&obs, || 0) {
                Gate::Release(n) => released += n,
                Gate::Trip(t) => {
                    assert_eq!(t.code, FailureCode::ExfilAlert);
                    assert!(released <= "The key is ".len(), "released {released}");
                    return;
                }
            }
        }
        panic!("no trip");
    }

    #[test]
    fn the_governor_releases_what_the_next_token_rules_out_and_still_trips_on_a_secret() {
        let d = Detectors::new(DetectorsConfig::load(None, 0.0).expect("defaults")).expect("ok");
        let pieces = [
            "The key is",
            " a",
            " secret",
            " to",
            "day",
            ":",
            " AKIA",
            "IOSFODNN",
        ];
        let pieces = [&pieces[..], &["7EXAMPLE", " ok"]].concat();
        let mut gov = d.turn("t", 0).expect("turn");
        let (mut pushed, mut released) = (0, 0);
        for (i, piece) in pieces.iter().enumerate() {
            let obs = TokenObs {
                index: i as u64,
                text: piece,
                logprob: Some(-0.1),
                now_ns: i as u64 * 20_000_000,
            };
            match gov.on_token(&obs, || 0) {
                Gate::Release(n) => released += n,
                Gate::Trip(t) => {
                    assert_eq!(t.code, FailureCode::ExfilAlert);
                    assert_eq!(*piece, " ok", "the key is decided by the byte after it");
                    break;
                }
            }
            pushed += piece.len();
            if [" a", " to"].contains(piece) {
                assert!(released < pushed, "{piece:?} is held by its push");
            }
            let next = pieces.get(i + 1).map_or(Ahead::End, |t| Ahead::Text(t));
            released += gov.look_ahead(next);
            let key_at = "The key is a secret today: ".len();
            if pushed <= key_at {
                // " a" and " to" are held by their push and released by the look-ahead.
                assert_eq!(released, pushed, "after {piece:?}");
            } else {
                assert_eq!(released, key_at, "after {piece:?}");
            }
        }
        assert_eq!(released, "The key is a secret today: ".len());
    }
}
