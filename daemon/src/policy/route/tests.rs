use super::*;

fn file(text: &str) -> toml::Table {
    text.parse::<toml::Table>().expect("toml")
}

fn routes(text: &str) -> Result<Vec<RouteConfig>, ConfigFileError> {
    load(Some(&file(text)), 0.0, 1000)
}

#[test]
fn a_route_reads_its_match_and_settings() {
    let r = routes(
        "[detectors.surprise]\nwindow = 8\nthreshold_bits = 9.0\n\
         [[routes]]\nname = \"sensitive\"\nmodel = \"gpt-4o*\"\nsurface = \"chat\"\n\
         key_id = \"00c0ffee00c0ffee\"\nbudget = 0\nbatch_only = true\nturn_sample_rate = 1.0\n\
         profiles = [\"mkp\"]\ntool_circuit_budgets = { transient = 1 }\n\
         [routes.detectors.surprise]\nmode = \"hard\"\nthreshold_bits = 6.0\n",
    )
    .expect("valid");
    let r = &r[0];
    assert_eq!(r.name, "sensitive");
    assert_eq!(r.budget, Some(0));
    assert!(r.batch_only);
    assert_eq!(r.profiles, vec![Profile::Mkp]);
    assert!(!r.applies_in(Profile::Full));
    // Merged key by key: the route's mode and threshold, the file's window.
    assert_eq!(
        r.detectors.surprise.policy.mode,
        crate::detect::DetectorMode::Hard
    );
    assert!((r.detectors.surprise.cfg.threshold_bits - 6.0).abs() < 1e-9);
    assert_eq!(r.detectors.surprise.cfg.window, 8);
    let key = |endpoint, model: &'static str, key| TurnKey {
        endpoint,
        model,
        key: KeyId(key),
    };
    assert!(r.matcher.matches(&key(
        Endpoint::Chat,
        "gpt-4o-2024-08-06",
        0x00c0_ffee_00c0_ffee
    )));
    assert!(!r
        .matcher
        .matches(&key(Endpoint::Messages, "gpt-4o", 0x00c0_ffee_00c0_ffee)));
    assert!(!r
        .matcher
        .matches(&key(Endpoint::Chat, "gpt-4", 0x00c0_ffee_00c0_ffee)));
    assert!(!r.matcher.matches(&key(Endpoint::Chat, "gpt-4o", 1)));
    let b = r
        .circuit_budgets
        .expect("set")
        .over(crate::circuit::Budgets::default());
    assert_eq!(b.transient, 1);
    assert_eq!(b.validation, crate::circuit::Budgets::default().validation);
}

#[test]
fn a_path_matches_the_governed_path() {
    let r = routes("[[routes]]\nname = \"msgs\"\npath = \"/v1/messages\"\n").expect("valid");
    let t = |endpoint| TurnKey {
        endpoint,
        model: "m",
        key: KeyId(0),
    };
    assert!(r[0].matcher.matches(&t(Endpoint::Messages)));
    assert!(!r[0].matcher.matches(&t(Endpoint::Chat)));
}

#[test]
fn mistakes_name_their_key() {
    for (text, at) in [
        ("routes = 3\n", "routes"),
        ("[[routes]]\nname = \"a\"\nmodel = \"m\"\nbudgt = 1\n", "routes[0]"),
        ("[[routes]]\nname = \"default\"\nmodel = \"m\"\n", "routes.default.name"),
        ("[[routes]]\nname = \"a b\"\nmodel = \"m\"\n", "routes.a b.name"),
        ("[[routes]]\nname = \"a\"\n", "routes.a.name"),
        ("[[routes]]\nname = \"a\"\nsurface = \"chats\"\n", "routes.a.surface"),
        ("[[routes]]\nname = \"a\"\npath = \"/v1/embeddings\"\n", "routes.a.path"),
        ("[[routes]]\nname = \"a\"\nkey_id = \"alice\"\n", "routes.a.key_id"),
        ("[[routes]]\nname = \"a\"\nmodel = \"m\"\nbudget = 1001\n", "routes.a.budget"),
        ("[[routes]]\nname = \"a\"\nmodel = \"m\"\nbudget = -1\n", "routes.a.budget"),
        ("[[routes]]\nname = \"a\"\nmodel = \"m\"\nturn_sample_rate = 2.0\n", "routes.a.turn_sample_rate"),
        ("[[routes]]\nname = \"a\"\nmodel = \"m\"\nprofiles = [\"max\"]\n", "routes.a.profiles"),
        (
            "[[routes]]\nname = \"a\"\nmodel = \"m\"\ntool_circuit_budgets = { transient = 101 }\n",
            "routes.a.tool_circuit_budgets",
        ),
        (
            "[[routes]]\nname = \"a\"\nmodel = \"m\"\n[routes.detectors.surprise]\nwindow = 0\n",
            "routes.a.detectors.surprise",
        ),
        (
            "[[routes]]\nname = \"a\"\nmodel = \"m\"\n[routes.detectors.surprize]\nmode = \"hard\"\n",
            "routes.a.detectors.surprize",
        ),
        (
            "[[routes]]\nname = \"a\"\nmodel = \"m\"\n[[routes]]\nname = \"a\"\nmodel = \"n\"\n",
            "routes.a",
        ),
    ] {
        let e = routes(text).expect_err(text);
        assert_eq!(e.at, at, "{text}: {e}");
    }
}

#[test]
fn a_routes_own_hard_limit_replaces_the_flag() {
    let f = file(
        "[[routes]]\nname = \"strict\"\nmodel = \"m\"\n\
         [routes.detectors.halt_monitor]\nhard_limit = 0.2\n\
         [[routes]]\nname = \"plain\"\nmodel = \"n\"\n",
    );
    let r = load(Some(&f), 0.05, 1000).expect("valid");
    assert_eq!(r[0].detectors.halt_monitor.cfg.hard_limit, Some(0.2));
    assert_eq!(r[1].detectors.halt_monitor.cfg.hard_limit, Some(0.05));
}
