use super::{inputs::scheme_len, *};
use crate::codes::FailureCode;
use proptest::prelude::*;
use serde_json::json;

pub(super) fn set(items: &[&str]) -> Option<BTreeSet<String>> {
    Some(items.iter().map(|s| (*s).to_owned()).collect())
}

/// The [`UrlKeys`] of `urls`, as a context holds them.
pub(super) fn keys(urls: &[&str]) -> Option<UrlKeys> {
    Some(url_keys(urls))
}

pub(super) fn urls(text: &str) -> Vec<String> {
    extract_urls(text).into_iter().collect()
}

pub(super) fn evidence<'a>(r: &'a SafetyCheckResult, key: &str) -> Option<&'a str> {
    r.evidence
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// A completed turn's 4 bytes, sent as produced unless `differs` names an offset.
pub(super) fn delivered(differs: Option<usize>) -> TextDelivery {
    TextDelivery {
        produced_bytes: 4,
        sent_bytes: 4,
        first_difference: differs,
        completed: true,
    }
}

pub(super) fn full_ctx() -> SafetyContext {
    SafetyContext {
        request_source_urls: keys(&["https://a.example/doc"]),
        cited_urls: keys(&["https://a.example/doc"]),
        text_delivery: Some(delivered(None)),
        identity_before: Some(ModelIdentity::new("m", "sys")),
        identity_after: Some(ModelIdentity::new("m", "sys")),
        versor_condition: None,
    }
}

// --- preserve_versor_closure -------------------------------------------------------------

#[test]
fn versor_closure_without_field_state_is_not_checkable() {
    let r = preserve_versor_closure(&SafetyContext::default());
    assert!(r.upheld && !r.runtime_checkable);
    assert_eq!(r.status(), CheckStatus::NotCheckable);
    assert!(r.reason.contains("no field state"), "{}", r.reason);
}

#[test]
fn versor_closure_below_threshold_holds_at_or_above_or_nan_violates() {
    let at = |v: f64| {
        preserve_versor_closure(&SafetyContext {
            versor_condition: Some(v),
            ..SafetyContext::default()
        })
    };
    let ok = at(1.0e-7);
    assert!(ok.upheld && ok.runtime_checkable);
    assert_eq!(evidence(&ok, "versor_condition"), Some("1e-7"));
    for bad in [VERSOR_HALT_THRESHOLD, 0.5, f64::NAN, f64::INFINITY] {
        let r = at(bad);
        assert!(!r.upheld && r.runtime_checkable, "{bad}");
        assert_eq!(r.status(), CheckStatus::Violated);
    }
}

// --- no_fabricated_source ----------------------------------------------------------------

#[test]
fn fabricated_source_subset_holds() {
    let r = no_fabricated_source(&SafetyContext {
        request_source_urls: keys(&["https://a.example/x", "https://b.example/y"]),
        cited_urls: keys(&["https://a.example/x"]),
        ..SafetyContext::default()
    });
    assert!(r.upheld && r.runtime_checkable, "{r:?}");
    assert_eq!(evidence(&r, "cited_count"), Some("1"));
    assert_eq!(evidence(&r, "request_source_count"), Some("2"));
    assert_eq!(evidence(&r, "unmatched_count"), Some("0"));
    assert_eq!(evidence(&r, "unmatched_sha256_16"), None);
}

#[test]
fn fabricated_source_outside_the_request_violates_and_names_it_by_digest() {
    let r = no_fabricated_source(&SafetyContext {
        request_source_urls: keys(&["https://a.example/x"]),
        cited_urls: keys(&["https://a.example/x", "https://evil.example/made-up"]),
        ..SafetyContext::default()
    });
    assert!(!r.upheld && r.runtime_checkable);
    assert_eq!(evidence(&r, "unmatched_count"), Some("1"));
    let digest = url_digest("https://evil.example/made-up");
    assert_eq!(digest.len(), 16);
    assert_eq!(evidence(&r, "unmatched_sha256_16"), Some(digest.as_str()));
    // No URL text in the result.
    let json = serde_json::to_string(&r).expect("serialises");
    assert!(!json.contains("evil.example"), "{json}");
}

#[test]
fn fabricated_source_compares_normalised_urls() {
    let r = no_fabricated_source(&SafetyContext {
        request_source_urls: keys(&["https://Docs.Example.COM:443/Guide/#intro"]),
        cited_urls: keys(&[
            "HTTPS://docs.example.com/Guide",
            "https://docs.example.com/Guide?",
        ]),
        ..SafetyContext::default()
    });
    assert!(r.upheld && r.runtime_checkable, "{r:?}");
    // Path case matters.
    let r = no_fabricated_source(&SafetyContext {
        request_source_urls: keys(&["https://docs.example.com/Guide"]),
        cited_urls: keys(&["https://docs.example.com/guide"]),
        ..SafetyContext::default()
    });
    assert!(!r.upheld);
}

#[test]
fn fabricated_source_edge_sets() {
    // Nothing cited: holds, and that is evidence.
    let r = no_fabricated_source(&SafetyContext {
        request_source_urls: keys(&[]),
        cited_urls: keys(&[]),
        ..SafetyContext::default()
    });
    assert!(r.upheld && r.runtime_checkable);
    // Citing when the request gave no source violates.
    let r = no_fabricated_source(&SafetyContext {
        request_source_urls: keys(&[]),
        cited_urls: keys(&["https://x.example"]),
        ..SafetyContext::default()
    });
    assert!(!r.upheld && r.runtime_checkable);
}

#[test]
fn fabricated_source_missing_inputs_are_named() {
    for (ctx, name) in [
        (
            SafetyContext {
                cited_urls: keys(&["https://x.example"]),
                ..SafetyContext::default()
            },
            "request_source_urls not provided",
        ),
        (
            SafetyContext {
                request_source_urls: keys(&[]),
                ..SafetyContext::default()
            },
            "cited_urls not provided",
        ),
        (
            SafetyContext::default(),
            "request_source_urls and cited_urls not provided",
        ),
    ] {
        let r = no_fabricated_source(&ctx);
        assert!(r.upheld && !r.runtime_checkable);
        assert!(r.reason.contains(name), "{}", r.reason);
    }
}

#[test]
fn unmatched_digests_are_capped_but_counted() {
    let cited: Vec<String> = (0..40).map(|i| format!("https://x.example/{i}")).collect();
    let r = no_fabricated_source(&SafetyContext {
        request_source_urls: keys(&[]),
        cited_urls: Some(url_keys(cited)),
        ..SafetyContext::default()
    });
    assert_eq!(evidence(&r, "unmatched_count"), Some("40"));
    let listed = evidence(&r, "unmatched_sha256_16").expect("digests");
    assert_eq!(listed.split(',').count(), MAX_EVIDENCE_URLS);
}

// --- no_silent_correction ----------------------------------------------------------------

#[test]
fn silent_correction_follows_the_text_delivered() {
    let with = |v| {
        no_silent_correction(&SafetyContext {
            text_delivery: v,
            ..SafetyContext::default()
        })
    };
    let r = with(Some(delivered(None)));
    assert!(r.upheld && r.runtime_checkable);
    let r = with(Some(delivered(Some(2))));
    assert!(!r.upheld && r.runtime_checkable);
    assert_eq!(evidence(&r, "sent_bytes"), Some("4"));
    let r = with(None);
    assert!(r.upheld && !r.runtime_checkable);
    assert!(r.reason.contains("text_delivery"));
}

// --- no_identity_override ----------------------------------------------------------------

#[test]
fn identity_override_compares_digests() {
    let same = no_identity_override(&full_ctx());
    assert!(same.upheld && same.runtime_checkable);
    let r = no_identity_override(&SafetyContext {
        identity_after: Some(ModelIdentity::new("other-model", "sys")),
        ..full_ctx()
    });
    assert!(!r.upheld && r.runtime_checkable);
    assert_eq!(
        evidence(&r, "identity_after"),
        Some(ModelIdentity::new("other-model", "sys").digest().as_str())
    );
    for (ctx, name) in [
        (
            SafetyContext {
                identity_before: None,
                ..full_ctx()
            },
            "identity_before not provided",
        ),
        (
            SafetyContext {
                identity_after: None,
                ..full_ctx()
            },
            "identity_after not provided",
        ),
        (
            SafetyContext::default(),
            "identity_before and identity_after not provided",
        ),
    ] {
        let r = no_identity_override(&ctx);
        assert!(r.upheld && !r.runtime_checkable);
        assert!(r.reason.contains(name), "{}", r.reason);
    }
}

#[test]
fn identity_digest_separates_model_and_system_prompt() {
    let d = ModelIdentity::new("m", "sys").digest();
    assert_eq!(d.len(), 64);
    assert_eq!(d, ModelIdentity::new("m", "sys").digest());
    assert_ne!(d, ModelIdentity::new("m2", "sys").digest());
    assert_ne!(d, ModelIdentity::new("m", "sys2").digest());
    // Length prefixes: moving bytes between the fields changes the digest.
    assert_ne!(identity_digest("ab", "c"), identity_digest("a", "bc"));
}

#[test]
fn system_prompt_takes_system_and_developer_messages() {
    let body = json!({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": [{"type": "text", "text": "no tools"}]},
        {"role": "assistant", "content": "hello"}
    ]});
    assert_eq!(system_prompt(&body), "be brief\nno tools");
    assert_eq!(system_prompt(&json!({"prompt": "x"})), "");
}

// --- no_hot_path_repair ------------------------------------------------------------------

#[test]
fn hot_path_repair_is_never_runtime_checkable() {
    for ctx in [SafetyContext::default(), full_ctx()] {
        let r = no_hot_path_repair(&ctx);
        assert!(r.upheld && !r.runtime_checkable);
        assert_eq!(r.status(), CheckStatus::NotCheckable);
        assert!(r.reason.contains("static analysis and code review"));
    }
}

// --- the registry ------------------------------------------------------------------------

#[test]
fn absent_inputs_uphold_everything_with_no_evidence() {
    let v = SafetyCheck::new().check(&SafetyContext::default(), &SafetyPack::v1());
    assert!(v.upheld);
    assert_eq!(v.runtime_checkable_count, 0);
    assert!(v.violated_boundaries.is_empty() && v.unknown_boundaries.is_empty());
    assert_eq!(v.results.len(), 5);
    assert!(v
        .results
        .iter()
        .all(|r| r.status() == CheckStatus::NotCheckable));
}

#[test]
fn default_pack_with_full_context() {
    let v = SafetyCheck::new().check(&full_ctx(), &SafetyPack::v1());
    assert!(v.upheld);
    assert_eq!(v.pack_id, DEFAULT_PACK_ID);
    // Three of five are checkable in haltd; versor closure and hot-path repair are not.
    assert_eq!(v.runtime_checkable_count, 3);
    let ids: Vec<&str> = v.results.iter().map(|r| r.boundary_id.as_str()).collect();
    assert_eq!(ids, V1_BOUNDARIES);
}

#[test]
fn unknown_boundary_is_recorded_upheld_and_not_checkable() {
    let pack = SafetyPack::new("p", ["custom_boundary", NO_SILENT_CORRECTION]);
    let v = SafetyCheck::new().check(&full_ctx(), &pack);
    assert!(v.upheld);
    assert_eq!(
        v.unknown_boundaries,
        set(&["custom_boundary"]).expect("set")
    );
    let r = v.result("custom_boundary").expect("result");
    assert!(r.upheld && !r.runtime_checkable);
    assert_eq!(r.reason, NO_PREDICATE_REASON);
    assert_eq!(v.runtime_checkable_count, 1);
}

#[test]
fn custom_predicates_register_and_replace() {
    let mut check = SafetyCheck::new();
    assert!(!check.is_registered("robot_speed"));
    let old = check.register("robot_speed", |ctx: &SafetyContext| {
        if ctx.versor_condition.is_some_and(|v| v > 1.0) {
            SafetyCheckResult::violated("robot_speed", "too fast")
        } else {
            SafetyCheckResult::upheld("robot_speed", "slow enough")
        }
    });
    assert!(old.is_none());
    // Replacing a default.
    let old = check.register(NO_HOT_PATH_REPAIR, |_: &SafetyContext| {
        SafetyCheckResult::upheld(NO_HOT_PATH_REPAIR, "audited build")
    });
    assert!(old.is_some());
    assert_eq!(check.boundary_ids().count(), 6);

    let pack = SafetyPack::new("robots", ["robot_speed", NO_HOT_PATH_REPAIR]);
    let fast = SafetyContext {
        versor_condition: Some(2.0),
        ..SafetyContext::default()
    };
    let v = check.check(&fast, &pack);
    assert!(!v.upheld);
    assert_eq!(v.violated_boundaries, set(&["robot_speed"]).expect("set"));
    let hot = v.result(NO_HOT_PATH_REPAIR).expect("result");
    assert!(hot.upheld && hot.runtime_checkable && hot.reason == "audited build");
    assert!(check.check(&SafetyContext::default(), &pack).upheld);
    // The other defaults stay registered.
    for id in V1_BOUNDARIES {
        assert!(check.is_registered(id));
    }
}

#[test]
fn results_for_another_boundary_are_rebound_and_the_bug_stays_visible() {
    let mut check = SafetyCheck::empty();
    check.register("mine", |_: &SafetyContext| {
        SafetyCheckResult::violated("someone_else", "bad")
    });
    let v = check.check(&SafetyContext::default(), &SafetyPack::new("p", ["mine"]));
    let r = &v.results[0];
    assert_eq!(r.boundary_id, "mine");
    assert!(!r.upheld);
    assert_eq!(evidence(r, "rebound_from"), Some("someone_else"));
    assert_eq!(v.violated_boundaries, set(&["mine"]).expect("set"));
}

#[test]
fn a_panicking_predicate_is_a_violation() {
    let mut check = SafetyCheck::new();
    check.register("fragile", |_: &SafetyContext| -> SafetyCheckResult {
        panic!("boom")
    });
    let v = check.check(
        &full_ctx(),
        &SafetyPack::new("p", ["fragile", NO_SILENT_CORRECTION]),
    );
    assert!(!v.upheld);
    let r = v.result("fragile").expect("result");
    assert!(!r.upheld && !r.runtime_checkable);
    assert!(r.reason.contains("panicked: boom"), "{}", r.reason);
    assert!(v.result(NO_SILENT_CORRECTION).expect("result").upheld);
}

#[test]
fn aggregation_lex_order_violations_and_counts() {
    let ctx = SafetyContext {
        request_source_urls: keys(&[]),
        cited_urls: keys(&["https://made.up/x"]),
        text_delivery: Some(delivered(Some(0))),
        identity_before: Some(ModelIdentity::new("a", "")),
        identity_after: Some(ModelIdentity::new("a", "")),
        versor_condition: None,
    };
    let pack = SafetyPack::new(
        "p",
        [
            PRESERVE_VERSOR_CLOSURE,
            "zz_custom",
            NO_SILENT_CORRECTION,
            NO_FABRICATED_SOURCE,
            NO_SILENT_CORRECTION,
            "aa_custom",
            NO_IDENTITY_OVERRIDE,
        ],
    );
    let v = SafetyCheck::new().check(&ctx, &pack);
    let ids: Vec<&str> = v.results.iter().map(|r| r.boundary_id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "aa_custom",
            NO_FABRICATED_SOURCE,
            NO_IDENTITY_OVERRIDE,
            NO_SILENT_CORRECTION,
            PRESERVE_VERSOR_CLOSURE,
            "zz_custom"
        ]
    );
    assert!(!v.upheld);
    assert_eq!(
        v.violated_boundaries,
        set(&[NO_FABRICATED_SOURCE, NO_SILENT_CORRECTION]).expect("set")
    );
    assert_eq!(v.runtime_checkable_count, 3);
    assert_eq!(
        v.unknown_boundaries,
        set(&["aa_custom", "zz_custom"]).expect("set")
    );
    assert_eq!(v.upheld, v.results.iter().all(|r| r.upheld));
    // An empty pack is vacuously upheld.
    let v = SafetyCheck::new().check(&ctx, &SafetyPack::new("p", Vec::<String>::new()));
    assert!(v.upheld && v.results.is_empty());
}

#[test]
fn require_runtime_checkable_turns_unchecked_boundaries_into_violations() {
    let check = SafetyCheck::new().with_require_runtime_checkable(true);
    let mut pack = SafetyPack::v1();
    pack.boundary_ids.insert("custom".to_owned());
    let v = check.check(&full_ctx(), &pack);
    assert!(v.require_runtime_checkable);
    assert!(!v.upheld);
    assert_eq!(
        v.violated_boundaries,
        set(&["custom", NO_HOT_PATH_REPAIR, PRESERVE_VERSOR_CLOSURE]).expect("set")
    );
    let unknown = v.result("custom").expect("result");
    assert!(unknown.reason.starts_with("require_runtime_checkable"));
    assert!(unknown.reason.contains(NO_PREDICATE_REASON));
    assert_eq!(unknown.status(), CheckStatus::Violated);
    // Checkable, upheld boundaries are unaffected.
    assert!(v.result(NO_SILENT_CORRECTION).expect("result").upheld);
    assert_eq!(v.runtime_checkable_count, 3);
    // A missing input counts too.
    let v = check.check(
        &SafetyContext::default(),
        &SafetyPack::new("p", [NO_SILENT_CORRECTION]),
    );
    assert!(!v.upheld);
    assert!(v.results[0].reason.contains("text_delivery"));
}

#[test]
fn verdict_serialises_for_the_turn_record() {
    let v = SafetyCheck::new().check(
        &full_ctx(),
        &SafetyPack::new("p", [NO_SILENT_CORRECTION, NO_HOT_PATH_REPAIR, "x"]),
    );
    let j = serde_json::to_value(&v).expect("serialises");
    assert_eq!(j["pack_id"], "p");
    assert_eq!(j["upheld"], true);
    assert_eq!(j["runtime_checkable_count"], 1);
    assert_eq!(j["violated_boundaries"], json!([]));
    assert_eq!(j["unknown_boundaries"], json!(["x"]));
    assert_eq!(j["require_runtime_checkable"], false);
    assert_eq!(j["results"][0]["boundary_id"], NO_HOT_PATH_REPAIR);
    assert_eq!(j["results"][0]["status"], "not_checkable");
    assert_eq!(j["results"][1]["boundary_id"], NO_SILENT_CORRECTION);
    assert_eq!(j["results"][1]["status"], "upheld");
    assert_eq!(j["results"][1]["runtime_checkable"], true);
    assert_eq!(
        j["results"][1]["evidence"],
        json!([
            ["produced_bytes", "4"],
            ["sent_bytes", "4"],
            ["completed", "true"]
        ])
    );
    assert_eq!(j["results"][2]["reason"], NO_PREDICATE_REASON);
}

// --- configuration -----------------------------------------------------------------------

#[test]
fn config_defaults_and_serde() {
    let c: SafetyConfig = serde_json::from_value(json!({})).expect("defaults");
    assert_eq!(c, SafetyConfig::default());
    assert_eq!(c.mode, SafetyMode::Observe);
    assert!(!c.require_runtime_checkable);
    assert_eq!(c.pack(), SafetyPack::v1());
    let c = c.validate().expect("valid");
    assert!(
        !c.safety_check()
            .expect("registry")
            .require_runtime_checkable
    );

    let c: SafetyConfig =
        serde_json::from_value(json!({"mode": "enforce", "boundaries": ["no_fabricated_source"]}))
            .expect("parses");
    assert_eq!(c.mode, SafetyMode::Enforce);
    assert!(serde_json::from_value::<SafetyConfig>(json!({"mode": "hard"})).is_err());
    assert!(serde_json::from_value::<SafetyConfig>(json!({"modes": "observe"})).is_err());
}

#[test]
fn config_validation_names_the_key() {
    let bad = |c: SafetyConfig| c.validate().expect_err("invalid");
    let e = bad(SafetyConfig {
        boundaries: vec![],
        ..SafetyConfig::default()
    });
    assert_eq!(e.key, "boundaries");
    assert!(e.to_string().starts_with("invalid safety.boundaries: "));
    let e = bad(SafetyConfig {
        boundaries: vec!["a".into(), "a".into()],
        ..SafetyConfig::default()
    });
    assert!(e.reason.contains("twice"));
    let e = bad(SafetyConfig {
        boundaries: vec!["has space".into()],
        ..SafetyConfig::default()
    });
    assert_eq!(e.key, "boundaries");
    let e = bad(SafetyConfig {
        pack_id: String::new(),
        ..SafetyConfig::default()
    });
    assert_eq!(e.key, "pack_id");
    let e = bad(SafetyConfig {
        mode: SafetyMode::Enforce,
        require_runtime_checkable: true,
        ..SafetyConfig::default()
    });
    assert_eq!(e.key, "require_runtime_checkable");
    assert!(e.reason.contains(NO_HOT_PATH_REPAIR) && e.reason.contains(PRESERVE_VERSOR_CLOSURE));
    // Fine in observe mode (enforce with both replaced: config_tests.rs).
    SafetyConfig {
        require_runtime_checkable: true,
        ..SafetyConfig::default()
    }
    .validate()
    .expect("valid");
}

#[test]
fn enforce_trips_with_safety_boundary_violated_observe_never() {
    let violated = SafetyCheck::new().check(
        &SafetyContext {
            text_delivery: Some(delivered(Some(1))),
            ..SafetyContext::default()
        },
        &SafetyPack::v1(),
    );
    let clean = SafetyCheck::new().check(&full_ctx(), &SafetyPack::v1());
    let enforce = SafetyConfig {
        mode: SafetyMode::Enforce,
        ..SafetyConfig::default()
    };
    assert_eq!(
        enforce.trip_code(&violated),
        Some(FailureCode::SafetyBoundaryViolated)
    );
    assert_eq!(enforce.trip_code(&clean), None);
    assert_eq!(SafetyConfig::default().trip_code(&violated), None);
}

proptest! {
    #[test]
    fn prop_extract_urls_is_total_and_well_formed(
        text in "(https?://|HTTP://|[ .,;:!?()\\[\\]<>\"'*_a-z0-9/#?=&]|\\PC){0,120}",
    ) {
        for u in extract_urls(&text) {
            prop_assert!(text.contains(&u));
            prop_assert!(scheme_len(&u).is_some());
            prop_assert!(!u.contains(char::is_whitespace));
            prop_assert!(!u.ends_with(['.', ',', ';', ':', '!', '?']));
        }
    }

    #[test]
    fn prop_urls_inside_prose_are_found(
        host in "[a-z]{1,10}\\.[a-z]{2,5}",
        path in "(/[A-Za-z0-9_-]{0,7}[A-Za-z0-9]){0,3}",
        before in "[ (\"\\[]",
        after in "[ .,;:!?)\"]?",
    ) {
        let url = format!("https://{host}{path}");
        let text = format!("see{before}{url}{after} more");
        let got = extract_urls(&text);
        prop_assert!(got.contains(&url), "{:?} in {:?}", got, text);
    }

    #[test]
    fn prop_normalize_is_idempotent(text in "([A-Za-z0-9@:/?#.]|:80|:443|\\PC){0,60}") {
        for u in extract_urls(&format!("x https://{text}")) {
            let n = normalize_url(&u);
            prop_assert_eq!(normalize_url(&n), n.clone());
        }
    }
}
