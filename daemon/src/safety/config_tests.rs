//! `[safety]` keys of issue 37: v1 boundaries never removed, declarative predicates, alias
//! groups, the verdict's record of replacements and inputs, a record judged again.

use serde::Deserialize;
use serde_json::json;

use super::{tests::full_ctx, *};

fn cfg(toml_text: &str) -> Result<SafetyConfig, SafetyConfigError> {
    let t: toml::Table = toml::from_str(toml_text).expect("toml");
    SafetyConfig::deserialize(toml::Value::Table(t))
        .map_err(|e| SafetyConfigError {
            key: "parse".into(),
            reason: e.to_string(),
        })?
        .validate()
}

fn err(toml_text: &str) -> SafetyConfigError {
    cfg(toml_text).expect_err("refused")
}

#[test]
fn a_config_that_drops_a_v1_boundary_is_refused_naming_the_key() {
    let e = err("boundaries = [\"no_fabricated_source\", \"no_silent_correction\"]\n");
    assert_eq!(e.key, "boundaries");
    for id in [
        NO_HOT_PATH_REPAIR,
        NO_IDENTITY_OVERRIDE,
        PRESERVE_VERSOR_CLOSURE,
    ] {
        assert!(e.reason.contains(id), "{}", e.reason);
    }
    // A key that would disable one does not exist.
    assert_eq!(
        err("disabled_boundaries = [\"no_hot_path_repair\"]\n").key,
        "parse"
    );
    // Adding a boundary is fine.
    let mut ids: Vec<String> = V1_BOUNDARIES.iter().map(|s| format!("{s:?}")).collect();
    ids.push("\"robot_speed\"".into());
    let c = cfg(&format!("boundaries = [{}]\n", ids.join(", "))).expect("valid");
    assert!(c.pack().boundary_ids.contains("robot_speed"));
}

#[test]
fn declarative_predicates_are_validated_like_user_input() {
    let one = |body: &str| format!("[[predicates]]\n{body}\n");
    let cases = [
        ("name = \"a\"\nfield = \"modle\"\nop = \"equals\"\nvalue = \"x\"", "predicates[0].field", "unknown field \"modle\""),
        ("name = \"a\"\nfield = \"model_answered\"\nop = \"like\"\nvalue = \"x\"", "predicates[0].op", "unknown op"),
        ("name = \"a\"\nfield = \"model_answered\"\nop = \"max\"\nvalue = 3", "predicates[0].op", "max does not apply to model_answered"),
        ("name = \"a\"\nfield = \"cited_url_count\"\nop = \"max\"\nvalue = \"3\"", "predicates[0].value", "takes a number"),
        ("name = \"a\"\nfield = \"model_answered\"\nop = \"matches\"\nvalue = \"(\"", "predicates[0].value", "bad regex"),
        ("name = \"a b\"\nfield = \"model_answered\"\nop = \"equals\"\nvalue = \"x\"", "predicates[0].name", "contains ' '"),
        ("name = \"no_identity_override\"\nfield = \"model_answered\"\nop = \"equals\"\nvalue = \"x\"", "predicates[0].name", "set replace = true"),
        ("name = \"mine\"\nreplace = true\nfield = \"model_answered\"\nop = \"equals\"\nvalue = \"x\"", "predicates[0].replace", "nothing to replace"),
    ];
    for (body, key, needle) in cases {
        let e = err(&one(body));
        assert_eq!(e.key, key, "{body}: {e}");
        assert!(e.reason.contains(needle), "{body}: {e}");
    }
    let dup = format!(
        "{}{}",
        one("name = \"a\"\nfield = \"sent_bytes\"\nop = \"max\"\nvalue = 10"),
        one("name = \"a\"\nfield = \"sent_bytes\"\nop = \"min\"\nvalue = 1")
    );
    let e = err(&dup);
    assert_eq!(e.key, "predicates[1].name");
    assert!(e.reason.contains("earlier predicate"), "{e}");
}

fn check_of(toml_text: &str) -> (SafetyCheck, SafetyPack) {
    let c = cfg(toml_text).expect("valid");
    (c.safety_check().expect("registry"), c.pack())
}

#[test]
fn a_declarative_predicate_judges_its_field_and_joins_the_pack() {
    let (check, pack) = check_of(
        "[[predicates]]\nname = \"short_answers\"\nfield = \"produced_bytes\"\nop = \"max\"\nvalue = 3\n",
    );
    assert!(pack.boundary_ids.contains("short_answers"));
    let v = check.check(&full_ctx(), &pack);
    let r = v.result("short_answers").expect("result");
    assert!(!r.upheld && r.runtime_checkable, "{r:?}");
    assert_eq!(r.predicate, PredicateOrigin::Config);
    assert!(
        r.reason.contains("produced_bytes 4 is not at most 3"),
        "{}",
        r.reason
    );
    assert_eq!(
        v.violated_boundaries.iter().collect::<Vec<_>>(),
        ["short_answers"]
    );
    // Without the field, not checkable.
    let v = check.check(&SafetyContext::default(), &pack);
    let r = v.result("short_answers").expect("result");
    assert_eq!(r.status(), CheckStatus::NotCheckable);
    assert!(
        r.reason.contains("produced_bytes not provided"),
        "{}",
        r.reason
    );
}

#[test]
fn every_op_on_its_field_type() {
    let ctx = full_ctx(); // model "m", 4 bytes produced and sent, completed
    for (field, op, value, holds) in [
        ("sent_bytes", "max", "4", true),
        ("sent_bytes", "min", "5", false),
        ("text_completed", "equals", "true", true),
        ("system_prompt_changed", "equals", "true", false),
        ("model_answered", "not_equals", "\"m\"", false),
        ("model_answered", "matches", "\"^m$\"", true),
        ("model_answered", "not_matches", "\"^m\"", false),
        ("model_requested", "contains", "\"m\"", true),
        ("model_requested", "not_contains", "\"m\"", false),
        ("unmatched_source_count", "equals", "0", true),
        ("cited_url_count", "max", "0", false),
        ("request_source_count", "min", "1", true),
        ("versor_condition", "max", "1e-6", true),
    ] {
        let (check, pack) = check_of(&format!(
            "[[predicates]]\nname = \"p\"\nfield = \"{field}\"\nop = \"{op}\"\nvalue = {value}\n"
        ));
        let r = check
            .check(&ctx, &pack)
            .result("p")
            .cloned()
            .expect("result");
        if field == "versor_condition" {
            assert_eq!(r.status(), CheckStatus::NotCheckable, "{r:?}");
            continue;
        }
        assert_eq!(r.upheld, holds, "{field} {op} {value}: {r:?}");
        assert!(r.runtime_checkable);
    }
}

#[test]
fn a_replaced_v1_boundary_is_recorded_in_the_verdict() {
    let (check, pack) = check_of(
        "[[predicates]]\nname = \"no_identity_override\"\nreplace = true\nfield = \"model_answered\"\nop = \"matches\"\nvalue = \"^gpt-4o\"\n",
    );
    assert_eq!(pack, SafetyPack::v1());
    let ctx = SafetyContext {
        identity_before: Some(ModelIdentity::new("gpt-4o", "")),
        identity_after: Some(ModelIdentity::new("gpt-4o-mini", "other prompt")),
        ..SafetyContext::default()
    };
    let v = check.check(&ctx, &pack);
    let r = v.result(NO_IDENTITY_OVERRIDE).expect("result");
    assert!(
        r.upheld && r.runtime_checkable,
        "the operator's predicate judged: {r:?}"
    );
    assert_eq!(r.predicate, PredicateOrigin::Config);
    let j = serde_json::to_value(&v).expect("json");
    assert_eq!(j["replaced_boundaries"], json!([NO_IDENTITY_OVERRIDE]));
    let r = j["results"]
        .as_array()
        .expect("results")
        .iter()
        .find(|r| r["boundary_id"] == NO_IDENTITY_OVERRIDE)
        .cloned();
    assert_eq!(r.expect("result")["predicate"], "config");
    // The defaults say so too.
    let v = SafetyCheck::new().check(&ctx, &pack);
    assert!(v.replaced_boundaries.is_empty());
    assert_eq!(
        v.result(NO_IDENTITY_OVERRIDE).expect("r").predicate,
        PredicateOrigin::V1
    );
}

#[test]
fn enforce_with_require_runtime_checkable_needs_the_never_checkable_ones_replaced() {
    let base = "mode = \"enforce\"\nrequire_runtime_checkable = true\n";
    assert_eq!(err(base).key, "require_runtime_checkable");
    let replaced = format!(
        "{base}[[predicates]]\nname = \"no_hot_path_repair\"\nreplace = true\nfield = \"text_completed\"\nop = \"equals\"\nvalue = true\n\
         [[predicates]]\nname = \"preserve_versor_closure\"\nreplace = true\nfield = \"sent_bytes\"\nop = \"min\"\nvalue = 0\n"
    );
    cfg(&replaced).expect("valid once both are replaced");
}

#[test]
fn alias_groups_reach_no_identity_override() {
    let ctx = SafetyContext {
        identity_before: Some(ModelIdentity::new("prod-chat", "s")),
        identity_after: Some(ModelIdentity::new("llama-3-8b", "s")),
        ..SafetyContext::default()
    };
    let (check, pack) = check_of("");
    assert!(!check.check(&ctx, &pack).upheld);
    let (check, pack) = check_of("model_aliases = [[\"llama-3-8b\", \"prod-chat\"]]\n");
    let v = check.check(&ctx, &pack);
    assert!(v.upheld, "{v:?}");
    let r = v.result(NO_IDENTITY_OVERRIDE).expect("r");
    assert!(r
        .evidence
        .contains(&("alias".to_owned(), "configured".to_owned())));
    assert_eq!(
        err("model_aliases = [[\"solo\"]]\n").key,
        "model_aliases[0]"
    );
}

#[test]
fn a_turn_record_is_judged_again_from_its_recorded_inputs() {
    let (check, pack) = check_of("");
    let ctx = SafetyContext {
        identity_after: Some(ModelIdentity::new("other", "sys")),
        ..full_ctx()
    };
    let v = check.check(&ctx, &pack);
    assert_eq!(
        v.violated_boundaries.iter().collect::<Vec<_>>(),
        [NO_IDENTITY_OVERRIDE]
    );
    let record = json!({"kind": "turn", "stream_id": "s", "safety_verdict": v});
    let back = context_from_record(record.to_string().as_bytes()).expect("context");
    assert_eq!(back, ctx);
    assert_eq!(check.check(&back, &pack), v);
}

#[test]
fn what_is_not_a_turn_record_is_refused_precisely() {
    let bad = |b: &str| {
        context_from_record(b.as_bytes())
            .expect_err("refused")
            .to_string()
    };
    assert!(
        bad("{\"kind\":").starts_with("body is not JSON: EOF while parsing"),
        "{}",
        bad("{\"kind\":")
    );
    assert_eq!(bad("[1]"), "body is not a turn record: not a JSON object");
    assert_eq!(
        bad("{\"kind\":\"incident\"}"),
        "body is not a turn record: \"kind\" is \"incident\", not \"turn\""
    );
    assert_eq!(
        bad("{\"kind\":\"turn\"}"),
        "turn record has no \"safety_verdict\" object"
    );
    assert!(bad("{\"kind\":\"turn\",\"safety_verdict\":{}}").contains("no \"inputs\""));
    let e =
        bad("{\"kind\":\"turn\",\"safety_verdict\":{\"inputs\":{\"cited_urls\":[\"https://x\"]}}}");
    assert!(
        e.contains("cited_urls: \"https://x\" is not a URL key"),
        "{e}"
    );
    let e = bad(
        "{\"kind\":\"turn\",\"safety_verdict\":{\"inputs\":{\"identity_after\":{\"model\":1}}}}",
    );
    assert!(
        e.starts_with("turn record's safety_verdict.inputs: "),
        "{e}"
    );
}

#[test]
fn the_v1_registry_states_each_not_checkable_reason() {
    let ids: Vec<&str> = V1_REGISTRY.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, V1_BOUNDARIES);
    for (id, c) in V1_REGISTRY {
        let r = SafetyCheck::new().check(&full_ctx(), &SafetyPack::v1());
        let r = r.result(id).expect("result");
        match c {
            Checkability::NotCheckable(reason) => {
                assert_eq!(r.status(), CheckStatus::NotCheckable, "{id}");
                assert_eq!(r.reason, reason);
            }
            Checkability::Runtime => assert!(r.runtime_checkable, "{id}: {r:?}"),
        }
    }
}
