use super::*;

/// Breaches on tokens whose text is "bad", fails on "err".
#[derive(Debug)]
struct Words;

impl Detector for Words {
    fn id(&self) -> DetectorId {
        DetectorId::Surprise
    }
    fn code(&self) -> FailureCode {
        FailureCode::ExfilAlert
    }
    fn observe(&mut self, tok: &TokenObs<'_>) -> Finding {
        match tok.text {
            "bad" => Finding::Breach {
                detail: "bad word".into(),
            },
            "err" => Finding::Failed {
                kind: FailureKind::ScorerIo,
                detail: "broken".into(),
            },
            _ => Finding::Clear,
        }
    }
}

fn tok(text: &str) -> TokenObs<'_> {
    TokenObs {
        index: 0,
        text,
        logprob: None,
        now_ns: 0,
    }
}

fn set(mode: DetectorMode, debounce: u32) -> TurnDetectors {
    let mut d = TurnDetectors::new();
    d.add(
        Box::new(Words),
        Policy {
            mode,
            debounce,
            deadline_ns: 0,
        },
    );
    d
}

/// Waits on every token (as an external scorer does); judges it when resumed: clear when
/// its socket is ready, a scorer timeout when the wait timed out.
#[derive(Debug)]
struct Waits(std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>);

impl Detector for Waits {
    fn id(&self) -> DetectorId {
        DetectorId::HaltMonitor
    }
    fn code(&self) -> FailureCode {
        FailureCode::CoherenceBelowThreshold
    }
    fn observe(&mut self, _tok: &TokenObs<'_>) -> Finding {
        Finding::Clear
    }
    fn start(&mut self, _tok: &TokenObs<'_>) -> Observed {
        self.0.lock().expect("log").push("wait");
        let (a, _b) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        Observed::Wait(ScoreWait {
            fd: a.into(),
            interest: scorer::Interest::Readable,
            deadline: std::time::Instant::now(),
        })
    }
    fn resume(&mut self, woke: Woke) -> Observed {
        self.0.lock().expect("log").push("resumed");
        Observed::Done(match woke {
            Woke::Ready(_) => Finding::Clear,
            _ => Finding::Failed {
                kind: FailureKind::ScorerTimeout,
                detail: "late".into(),
            },
        })
    }
}

/// Logs each token it sees, after the detector before it.
#[derive(Debug)]
struct After(std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>, Words);

impl Detector for After {
    fn id(&self) -> DetectorId {
        self.1.id()
    }
    fn code(&self) -> FailureCode {
        self.1.code()
    }
    fn observe(&mut self, tok: &TokenObs<'_>) -> Finding {
        self.0.lock().expect("log").push("after");
        self.1.observe(tok)
    }
}

#[test]
fn a_waiting_detector_parks_the_token_and_the_rest_run_after_it_in_order() {
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut d = TurnDetectors::new();
    d.add(Box::new(Waits(log.clone())), Policy::default());
    d.add(Box::new(After(log.clone(), Words)), Policy::default());
    let Step::Wait(w) = d.begin(&tok("bad"), || 0) else {
        panic!("the first detector waits");
    };
    assert_eq!(
        *log.lock().expect("log"),
        ["wait"],
        "nothing after it ran yet"
    );
    // The wait ended in time: the second detector judges the same token (a breach, hard).
    let Step::Done(Some(t)) = d.resume(&tok("bad"), Woke::Ready(w.fd), || 0) else {
        panic!("the second detector trips");
    };
    assert_eq!(t.code, FailureCode::ExfilAlert);
    assert_eq!(*log.lock().expect("log"), ["wait", "resumed", "after"]);
    // Timed out: the first detector's failure is the trip, and the second still ran.
    let Step::Wait(w) = d.begin(&tok("ok"), || 0) else {
        panic!("waits again");
    };
    let Step::Done(Some(t)) = d.resume(&tok("ok"), Woke::TimedOut(w.fd), || 0) else {
        panic!("fails closed");
    };
    assert_eq!(t.detector, DetectorId::HaltMonitor);
    assert_eq!(t.kind, TripKind::Failed(FailureKind::ScorerTimeout));
    assert_eq!(log.lock().expect("log").len(), 6);
    assert_eq!(log.lock().expect("log")[5], "after");
}

#[test]
fn hard_trips_after_k_consecutive_breaches() {
    let mut d = set(DetectorMode::Hard, 2);
    assert_eq!(d.observe(&tok("bad"), || 0), None);
    assert_eq!(d.observe(&tok("ok"), || 0), None, "streak resets");
    assert_eq!(d.observe(&tok("bad"), || 0), None);
    let t = d.observe(&tok("bad"), || 0).expect("second in a row trips");
    assert_eq!(t.code, FailureCode::ExfilAlert);
}

#[test]
fn failures_trip_at_once_with_their_own_code_even_debounced() {
    let mut d = set(DetectorMode::Hard, 5);
    let t = d.observe(&tok("err"), || 0).expect("fail closed");
    assert_eq!(t.code, FailureCode::DetectorFailure);
    assert_eq!(t.kind, TripKind::Failed(FailureKind::ScorerIo));
}

#[test]
fn observe_mode_records_and_never_trips() {
    let mut d = set(DetectorMode::Observe, 1);
    for w in ["bad", "err", "bad"] {
        assert_eq!(d.observe(&tok(w), || 0), None);
    }
    assert_eq!(d.observed().len(), 3);
    assert_eq!(d.summary()["surprise"]["breaches"], 2);
}

#[test]
fn intervene_mode_asks_for_a_round_instead_of_tripping_once_per_debounced_breach() {
    let mut d = set(DetectorMode::Intervene, 2);
    assert!(d.intervenes());
    assert_eq!(d.observe(&tok("bad"), || 0), None);
    assert_eq!(
        d.take_intervention(),
        None,
        "debounced: one breach is not enough"
    );
    assert_eq!(d.observe(&tok("bad"), || 0), None, "never a trip");
    let t = d.take_intervention().expect("two in a row ask for a round");
    assert_eq!(
        (t.detector, t.kind),
        (DetectorId::Surprise, TripKind::Breach)
    );
    assert_eq!(d.take_intervention(), None, "taken once");
    // The streak starts again after a request.
    assert_eq!(d.observe(&tok("bad"), || 0), None);
    assert_eq!(d.take_intervention(), None);
    assert_eq!(d.refs().collect::<Vec<_>>(), ["surprise:intervene"]);
    assert_eq!(
        d.observed().len(),
        1,
        "recorded like an observe-mode breach"
    );
}

#[test]
fn an_intervene_mode_failure_is_recorded_and_changes_nothing() {
    // A backend without logprobs: the surprise detector fails on every token; in
    // intervene mode that neither trips nor asks for a round (spec 003's no-op).
    let mut d = set(DetectorMode::Intervene, 1);
    for _ in 0..3 {
        assert_eq!(d.observe(&tok("err"), || 0), None);
    }
    assert_eq!(d.take_intervention(), None);
    assert_eq!(d.observed().len(), 3);
    assert_eq!(d.summary()["surprise"]["failures"], 3);
}

#[test]
fn a_rewind_drops_a_pending_request_and_the_streak() {
    let mut d = set(DetectorMode::Intervene, 2);
    assert_eq!(d.observe(&tok("bad"), || 0), None);
    d.rewound();
    assert_eq!(d.observe(&tok("bad"), || 0), None);
    assert_eq!(
        d.take_intervention(),
        None,
        "the streak began again at the rewind"
    );
}

#[test]
fn detector_ids_are_spelled_alike_in_json_and_config() {
    for id in DetectorId::ALL {
        assert_eq!(
            serde_json::to_value(id).expect("json"),
            serde_json::Value::from(id.as_str())
        );
        assert_eq!(id.to_string(), id.as_str());
    }
    assert_eq!(DetectorId::HaltMonitor.as_str(), "halt_monitor");
}

#[test]
fn off_detectors_do_not_run() {
    let d = set(DetectorMode::Off, 1);
    assert!(d.is_empty());
}

#[test]
fn a_missed_deadline_is_a_failure() {
    let mut d = TurnDetectors::new();
    d.add(
        Box::new(Words),
        Policy {
            mode: DetectorMode::Hard,
            debounce: 1,
            deadline_ns: 1_000,
        },
    );
    let ticks = std::cell::Cell::new(0u64);
    let clock = || {
        ticks.set(ticks.get() + 5_000);
        ticks.get()
    };
    let t = d.observe(&tok("ok"), clock).expect("too slow");
    assert_eq!(t.code, FailureCode::DetectorFailure);
    assert_eq!(t.kind, TripKind::Failed(FailureKind::DeadlineMissed));
    assert!(t.detail.contains("deadline"), "{}", t.detail);
}

#[test]
fn the_timing_fields_follow_the_budget_breach_in_observe_mode() {
    use timing::{ComputeBudget, ComputeBudgetConfig, RtsMode};
    let cfg = ComputeBudgetConfig {
        max_tokens: 2,
        max_wall_ms: 0,
    };
    let mut d = TurnDetectors::new();
    d.add(
        Box::new(ComputeBudget::starting_at(&cfg, 0)),
        Policy {
            mode: DetectorMode::Observe,
            ..Policy::default()
        },
    );
    let first = d
        .timing_if_changed()
        .expect("the first call hands the fields out");
    assert_eq!((first.rts_mode, first.tig_breach), (RtsMode::Off, false));
    assert!(first.incidents.is_empty());
    for i in 0..2 {
        let t = TokenObs {
            index: i,
            ..tok("ok")
        };
        assert!(matches!(d.begin(&t, || 0), Step::Done(None)));
        assert!(
            d.timing_if_changed().is_none(),
            "nothing changed at token {i}"
        );
    }
    let t = TokenObs {
        index: 2,
        ..tok("ok")
    };
    assert!(
        matches!(d.begin(&t, || 0), Step::Done(None)),
        "observe mode"
    );
    let now = d.timing_if_changed().expect("a breach changes them");
    assert_eq!((now.rts_mode, now.tig_breach), (RtsMode::Breach, true));
    assert_eq!(now.incidents, vec![FailureCode::ComputeBudgetExceeded]);
    assert_eq!(
        now.incidents_field(true),
        vec!["COMPUTE_BUDGET_EXCEEDED", "WATCHDOG_TRIP"]
    );
}
