use super::*;

fn inputs(text: &str, budget: u32) -> PolicyInputs {
    let file = text.parse::<toml::Table>().expect("toml");
    let mut top = file.clone();
    top.remove("routes");
    PolicyInputs {
        profile: Profile::Full,
        detectors: DetectorsConfig::load(Some(&top), 0.0).expect("detectors"),
        routes: route::load(Some(&file), 0.0, 1000).expect("routes"),
        budget,
        circuit: Some(Arc::new(CircuitPolicy::default())),
        kernel_gate: true,
        watchdog: true,
        overrides: Overrides::default(),
    }
}

const TWO: &str = "[[routes]]\nname = \"strict\"\nmodel = \"tiny\"\nbudget = 0\nbatch_only = true\n\
                   tool_circuit_budgets = { transient = 0 }\n\
                   [[routes]]\nname = \"wide\"\nsurface = \"messages\"\nbudget = 8\nprofiles = [\"full\"]\n";

fn turn(model: &'static str, endpoint: crate::wire::endpoint::Endpoint) -> TurnKey<'static> {
    TurnKey {
        endpoint,
        model,
        key: crate::identity::KeyId(7),
    }
}

#[test]
fn the_first_matching_route_takes_the_turn() {
    use crate::wire::endpoint::Endpoint::{Chat, Messages};
    let set = inputs(TWO, 5).build(None).expect("builds");
    assert_eq!(&*set.route(&turn("tiny", Messages)).name, "strict");
    assert_eq!(&*set.route(&turn("big", Messages)).name, "wide");
    let d = set.route(&turn("big", Chat));
    assert_eq!((&*d.name, d.budget, d.batch_only), ("default", 5, false));
    let s = set.named("strict").expect("strict");
    assert_eq!((s.budget, s.batch_only), (0, true));
    assert_eq!(s.circuit.as_ref().expect("on").budgets.transient, 0);
}

#[test]
fn mkp_refuses_a_route_above_five_and_drops_full_only_routes() {
    let mut i = inputs(TWO, 5);
    i.profile = Profile::Mkp;
    // "wide" applies only under full: mkp builds without it.
    let set = i.build(None).expect("mkp without the full-only route");
    assert!(set.named("wide").is_none());
    i.routes[1].profiles.clear();
    let e = i.build(None).expect_err("B = 8 under mkp");
    assert!(
        e.to_string().starts_with("routes.wide.budget: B = 8"),
        "{e}"
    );
    let mut i = inputs(TWO, 6);
    i.overrides.profile = Some(Profile::Mkp);
    let e = i.build(None).expect_err("--budget 6 under mkp");
    assert!(e.to_string().starts_with("budget: B = 6"), "{e}");
    let mut i = inputs("", 5);
    i.kernel_gate = false;
    i.profile = Profile::Mkp;
    let e = i.build(None).expect_err("no gate under mkp");
    assert!(e.to_string().starts_with("no-kernel-gate"), "{e}");
}

#[test]
fn a_runtime_mode_applies_per_route_or_everywhere() {
    use crate::detect::{DetectorId::Surprise, DetectorMode};
    let mut i = inputs(TWO, 5);
    i.overrides
        .set_mode(Surprise, Some("strict"), DetectorMode::Hard);
    let set = i.build(None).expect("builds");
    let mode = |set: &PolicySet, r: &str| {
        set.named(r)
            .expect("route")
            .detectors
            .cfg
            .surprise
            .policy
            .mode
    };
    assert_eq!(mode(&set, "strict"), DetectorMode::Hard);
    assert_eq!(mode(&set, "default"), DetectorMode::Observe);
    // Every route: replaces the per-route one.
    i.overrides.set_mode(Surprise, None, DetectorMode::Observe);
    assert_eq!(i.overrides.modes.len(), 1);
    let set = i.build(None).expect("builds");
    assert_eq!(mode(&set, "strict"), DetectorMode::Observe);
    i.overrides
        .set_mode(Surprise, Some("nope"), DetectorMode::Hard);
    assert_eq!(i.unknown_routes(), vec!["nope".to_owned()]);
    i.build(None)
        .expect("a switch for a route the config dropped applies to nothing");
}

#[test]
fn the_lock_names_every_loosening() {
    use crate::detect::{DetectorId::Exfil, DetectorMode};
    let now = inputs(TWO, 5).build(None).expect("builds");
    assert!(lock::loosenings(&now, &now).is_empty());
    let mut i = inputs(TWO, 5);
    i.routes[0].budget = Some(3);
    i.routes[0].batch_only = false;
    i.overrides.set_mode(Exfil, None, DetectorMode::Observe);
    let next = i.build(None).expect("builds");
    let found = lock::loosenings(&now, &next);
    for want in [
        "route strict: budget 0 -> 3",
        "route strict: batch_only true -> false",
        "route default: exfil: mode hard -> observe",
    ] {
        assert!(found.iter().any(|f| f == want), "{want} not in {found:?}");
    }
    // Tightening is not loosening.
    let mut i = inputs(TWO, 4);
    i.overrides.set_mode(
        crate::detect::DetectorId::Surprise,
        None,
        DetectorMode::Hard,
    );
    let tighter = i.build(None).expect("builds");
    assert!(
        lock::loosenings(&now, &tighter).is_empty(),
        "{:?}",
        lock::loosenings(&now, &tighter)
    );
    // A threshold that trips later, and leaving mkp.
    let looser = inputs(
        "[detectors.surprise]\nthreshold_bits = 30.0\n[detectors.halt_monitor]\nhard_limit = 0.0\n",
        5,
    )
    .build(None)
    .expect("builds");
    let strict = inputs(
        "[detectors.surprise]\nthreshold_bits = 10.0\n[detectors.halt_monitor]\nhard_limit = 0.1\n",
        5,
    );
    let mut mkp = strict.clone();
    mkp.profile = Profile::Mkp;
    let found = lock::loosenings(&mkp.build(None).expect("mkp"), &looser);
    for want in [
        "profile mkp -> full",
        "route default: surprise.threshold_bits 10 -> 30",
        "route default: halt_monitor.hard_limit 0.1 -> 0",
    ] {
        assert!(found.iter().any(|f| f == want), "{want} not in {found:?}");
    }
    // A route that disappears.
    let none = inputs("", 5).build(None).expect("builds");
    assert!(lock::loosenings(&now, &none)
        .iter()
        .any(|f| f == "route strict removed"));
}

#[test]
fn switches_replay_from_their_records_idempotently() {
    use crate::detect::{DetectorId::Surprise, DetectorMode};
    let recs = [
        serde_json::json!({"admin": {"action": "detector_mode", "detector": "surprise",
            "request": {"mode": "hard", "route": "strict"}, "status": 200}}),
        serde_json::json!({"admin": {"action": "detector_mode", "detector": "surprise",
            "request": {"mode": "observe", "route": null}, "status": 200}}),
        serde_json::json!({"admin": {"action": "profile", "request": {"profile": "mkp"},
            "status": 200}}),
    ];
    let mut o = Overrides::default();
    for r in &recs {
        o.replay(r).expect("a switch");
    }
    assert_eq!(o.mode(Surprise, "strict"), Some(DetectorMode::Observe));
    assert_eq!(o.profile, Some(Profile::Mkp));
    // The store held the end state already: replaying the same records changes nothing.
    let held = o.clone();
    for r in &recs {
        o.replay(r).expect("a switch");
    }
    assert_eq!(o, held);
    let bad = serde_json::json!({"admin": {"action": "detector_mode", "detector": "nope",
        "request": {"mode": "hard"}}});
    assert!(o.replay(&bad).is_err());
}
