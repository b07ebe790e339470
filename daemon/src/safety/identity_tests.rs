//! What counts as the same model for `no_identity_override` (see `identity.rs`).

use super::{identity::*, SafetyContext};

fn rule(req: &str, ans: &str) -> Option<AliasRule> {
    alias_rule(req, ans, &ModelAliases::default())
}

#[test]
fn real_alias_pairs_are_one_model() {
    for (req, ans, want) in [
        ("gpt-4o", "gpt-4o", AliasRule::Exact),
        ("gpt-4o", "gpt-4o-2024-08-06", AliasRule::DatedSnapshot),
        (
            "gpt-4o-mini",
            "gpt-4o-mini-2024-07-18",
            AliasRule::DatedSnapshot,
        ),
        (
            "claude-3-5-sonnet",
            "claude-3-5-sonnet-20241022",
            AliasRule::DatedSnapshot,
        ),
        ("llama3", "llama3:latest", AliasRule::OllamaLatest),
        ("tiny", "/models/tiny-q8_0.gguf", AliasRule::GgufFile),
        ("tiny", "/models/tiny.gguf", AliasRule::GgufFile),
        (
            "Llama-3.2-1B-Instruct",
            "/srv/Llama-3.2-1B-Instruct-Q4_K_M.gguf",
            AliasRule::GgufFile,
        ),
        (
            "qwen2.5-7b-instruct",
            "qwen2.5-7b-instruct-q4_k_m.gguf",
            AliasRule::GgufFile,
        ),
        ("phi3", "C:\\models\\phi3.IQ2_XS.gguf", AliasRule::GgufFile),
        ("m", "m-bf16.gguf", AliasRule::GgufFile),
    ] {
        assert_eq!(rule(req, ans), Some(want), "{req} -> {ans}");
    }
}

#[test]
fn other_models_are_not_aliases() {
    for (req, ans) in [
        ("gpt-4o", "gpt-4o-mini"),
        ("gpt-4o", "gpt-4"),
        ("gpt-4o-2024-08-06", "gpt-4o-2024-05-13"),
        ("gpt-4o-2024-08-06", "gpt-4o"),
        ("gpt-4o", "gpt-4o-2024-8-6"),
        ("gpt-4o", "GPT-4O"),
        ("llama3:8b", "llama3:8b:latest"),
        ("llama3", "llama3:70b"),
        ("tiny", "/models/tiny-evil.gguf"),
        ("tiny", "/models/tinyllama-q8_0.gguf"),
        ("tiny", "/models/tiny-q8_0.bin"),
        ("tiny", "/models/big-q8_0.gguf"),
        ("", "/models/q8_0.gguf"),
        ("", "-2024-08-06"),
        ("prod-chat", "meta-llama/Llama-3-8B-Instruct"),
    ] {
        assert_eq!(rule(req, ans), None, "{req} -> {ans}");
    }
}

#[test]
fn configured_groups_make_served_names_one_model() {
    let aliases = ModelAliases::new(&[
        vec!["meta-llama/Llama-3-8B-Instruct".into(), "prod-chat".into()],
        vec!["x".into(), "y".into()],
    ]);
    assert_eq!(
        alias_rule("prod-chat", "meta-llama/Llama-3-8B-Instruct", &aliases),
        Some(AliasRule::Configured)
    );
    assert_eq!(alias_rule("prod-chat", "x", &aliases), None);
}

#[test]
fn an_override_fires_on_another_model_or_system_prompt() {
    let ctx = |req: &str, sys_req: &str, ans: &str, sys_ans: &str| SafetyContext {
        identity_before: Some(ModelIdentity::new(req, sys_req)),
        identity_after: Some(ModelIdentity::new(ans, sys_ans)),
        ..SafetyContext::default()
    };
    let none = ModelAliases::default();
    let r = no_identity_override(
        &ctx("gpt-4o", "be kind", "gpt-4o-2024-08-06", "be kind"),
        &none,
    );
    assert!(r.upheld && r.runtime_checkable, "{r:?}");
    let r = no_identity_override(
        &ctx("gpt-4o", "be kind", "gpt-4o-2024-08-06", "be evil"),
        &none,
    );
    assert!(!r.upheld && r.reason.contains("system prompt"), "{r:?}");
    let r = no_identity_override(&ctx("tiny", "", "/models/other-q8_0.gguf", ""), &none);
    assert!(
        !r.upheld && r.reason.contains("neither the one requested"),
        "{r:?}"
    );
    assert!(r
        .evidence
        .contains(&("model_answered".into(), "/models/other-q8_0.gguf".into())));
}
