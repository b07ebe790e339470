//! Each built-in rule, custom patterns, configuration and the hold-back.

use super::*;

const PEM: &str = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun\nVTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxK\n-----END RSA PRIVATE KEY-----\n";

#[test]
fn private_key_block() {
    assert_secret(
        &format!("Here is the key:\n{PEM}"),
        "-----BEGIN RSA",
        "private_key_block",
    );
    let openssh = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n";
    assert_secret(openssh, openssh, "private_key_block");
    let enc = "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,3F17F5316E2BAC89\n\nMIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun\n";
    assert_secret(enc, enc, "private_key_block");
    // Public keys, and the header line alone in prose, are not secrets.
    assert_innocent("-----BEGIN PUBLIC KEY-----\nMIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEAu1SU1LfVLPHCozMxH2Mo\n");
    assert_innocent(
        "A key file starts with -----BEGIN RSA PRIVATE KEY----- and ends with an END line.",
    );
    assert_innocent("-----BEGIN PRIVATE KEY-----\n<your key here>\n-----END PRIVATE KEY-----");
}

#[test]
fn aws_access_key_id() {
    assert_secret(
        "export AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\n",
        "AKIAIOSFODNN7EXAMPLE",
        "aws_access_key_id",
    );
    assert_secret(
        "session ASIAY34FZKBOKMUTVV7A.",
        "ASIAY34FZKBOKMUTVV7A",
        "aws_access_key_id",
    );
    // At the very end of the turn (decided by `finish`).
    assert_secret(
        "AKIAIOSFODNN7EXAMPLE",
        "AKIAIOSFODNN7EXAMPLE",
        "aws_access_key_id",
    );
    assert_innocent("Access key ids start with AKIA or ASIA, followed by 16 characters.");
    assert_innocent("AKIAIOSFODNN7EXAMPL is one short, xAKIAIOSFODNN7EXAMPLE is glued, AKIAIOSFODNN7EXAMPLEX too long");
}

#[test]
fn aws_secret_access_key() {
    let s = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    assert_secret(
        &format!("AWS_SECRET_ACCESS_KEY={s}\n"),
        "AWS_SECRET",
        "aws_secret_access_key",
    );
    assert_secret(
        &format!("aws_secret_access_key = {s}"),
        "aws_secret",
        "aws_secret_access_key",
    );
    assert_secret(
        &format!("Your AWS secret key is {s}."),
        "AWS secret",
        "aws_secret_access_key",
    );
    assert_innocent("Set aws_secret_access_key in ~/.aws/credentials, never in code.");
}

#[test]
fn gcp_service_account() {
    let json = "{\n  \"type\": \"service_account\",\n  \"project_id\": \"demo\",\n  \"private_key_id\": \"2f6a1b3c4d5e6f708192a3b4c5d6e7f801234567\",\n  \"private_key\": \"-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\\n\"\n}";
    assert_secret(json, "\"private_key_id\"", "gcp_service_account_key");
    let only_key = "{\"private_key\": \"-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQ\\n\"}";
    assert_secret(only_key, "\"private_key\"", "gcp_service_account_key");
    assert_innocent("{\"type\": \"service_account\", \"private_key\": \"<redacted>\"}");
}

#[test]
fn azure_storage_key() {
    let cs = "DefaultEndpointsProtocol=https;AccountName=demo;AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==;EndpointSuffix=core.windows.net";
    assert_secret(cs, "AccountKey=", "azure_storage_key");
    assert_innocent("The connection string has AccountName=demo;AccountKey=<key>;EndpointSuffix=core.windows.net");
}

#[test]
fn github_tokens() {
    let t = "ghp_16C7e42F292c6912E7710c838347Ae178B4a";
    assert_eq!(t.len(), 40);
    assert_secret(&format!("token {t} ok"), t, "github_token");
    let o = "gho_16C7e42F292c6912E7710c838347Ae178B4a";
    assert_secret(o, o, "github_token");
    let pat = "github_pat_11ABCDEFG0123456789abc_abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTU";
    assert_secret(pat, pat, "github_token");
    assert_innocent("Classic tokens start with ghp_ and fine-grained ones with github_pat_; ghp_short is not one.");
}

#[test]
fn slack_stripe_openai() {
    let x = "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx";
    assert_secret(&format!("SLACK_BOT_TOKEN={x}"), x, "slack_token");
    let s = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
    assert_secret(&format!("stripe.api_key = \"{s}\""), s, "stripe_live_key");
    let o = "sk-proj-Ab3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5bC7d";
    assert_secret(&format!("OPENAI_API_KEY={o}\n"), o, "openai_api_key");
    let legacy = "sk-4fK9sLq2Xw8ZpR7vT1mN6bY3cH5jD0gE9aU2iO8kW4eQ7rS1";
    assert_secret(legacy, legacy, "openai_api_key");
    // Test keys, slugs and short strings are not.
    assert_innocent("use sk_test_4eC39HqLyjWDarjtT1zdp7dc in the sandbox");
    assert_innocent("pip install scikit-learn; see sk-learn-compatible-estimator-interface docs");
    assert_innocent("sk-1234 and xoxb-short");
}

#[test]
fn bearer_and_basic() {
    let tok = "mF_9.B5f-4.1JqM7xR2pLk9Zs3Qw";
    assert_secret(
        &format!("Authorization: Bearer {tok}\r\n"),
        "Bearer",
        "bearer_token",
    );
    assert_secret(
        &format!("curl -H 'Authorization: Basic dXNlcjpwYXNzd29yZA==' {tok}"),
        "Authorization",
        "basic_auth",
    );
    assert_innocent("The bearer of this letter is a friend. Bearer tokens are sent in a header.");
    assert_innocent("Authorization: Bearer YOUR_ACCESS_TOKEN_GOES_HERE");
    assert_innocent("Authorization: Bearer $TOKEN");
}

#[test]
fn jwt() {
    let j = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c";
    assert_secret(&format!("Here it is: {j}"), j, "jwt");
    // One segment (base64 of a JSON object) is not a JWT.
    assert_innocent(
        "eyJhbGciOiJIUzI1NiJ9 is just a base64url JSON header. eyJ. eyJhbGciOiJIUzI1NiJ9. eyJ",
    );
}

#[test]
fn keyword_entropy() {
    assert_secret(
        "password=Xk9#mP2vR7qL4wZ8tN3s\n",
        "password",
        "keyword_entropy",
    );
    assert_secret(
        "{\"client_secret\": \"8f14e45fceea167a5a36dedd4bea2543\"}",
        "secret",
        "keyword_entropy",
    );
    assert_secret(
        "DB_PASSWORD: 'Tr0ub4dor&3-Tr0ub4dor&3'",
        "PASSWORD",
        "keyword_entropy",
    );
    assert_secret(
        "The password is ThisIsMyPassword2024!",
        "password",
        "keyword_entropy",
    );
    assert_secret(
        "api_key := \"123e4567-e89b-12d3-a456-426614174000\"",
        "api_key",
        "keyword_entropy",
    );
    // A value longer than VALUE_MAX is judged on its first VALUE_MAX bytes.
    let long: String = "aB3$dE6^gH9*jK2!mN5@pQ8#".repeat(20);
    assert_secret(&format!("token={long}"), "token", "keyword_entropy");
    // End of turn decides the last value.
    assert_secret("secret: a8Kd93LmQ2xZ7pR4vW1n", "secret", "keyword_entropy");
}

#[test]
fn keyword_lookalikes_are_innocent() {
    assert_innocent("password=hunter2");
    assert_innocent("password = correcthorsebatterystaple"); // no digit or symbol
    assert_innocent("let secret = get_secret_from_vault_manager();");
    assert_innocent("api_key = YOUR_API_KEY_GOES_HERE");
    assert_innocent("token_count = 12345678901234567890123");
    assert_innocent("password: aaaaaaaaaaaaaaaaaaaaaaaa1");
    assert_innocent("The tokenizer splits text into tokens; the token is the unit of generation.");
    assert_innocent("secret = os.environ[\"DJANGO_SECRET_KEY\"]");
    assert_innocent("token = ${GITHUB_TOKEN}");
}

#[test]
fn innocent_lookalikes() {
    assert_innocent("commit 3f9a2c1 fixed issue #42; build id a1b2c3d4e5f6.");
    assert_innocent("request id 123e4567-e89b-12d3-a456-426614174000 completed");
    // base64 of ordinary words, not after a key word
    assert_innocent(
        "dGhlIHF1aWNrIGJyb3duIGZveCBqdW1wcyBvdmVyIHRoZSBsYXp5IGRvZw== decodes to a pangram",
    );
    assert_innocent("SHA-256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    assert_innocent("Größe: 12 µs, 東京, naïve café — ünïcödé is fine");
}

#[test]
fn custom_pattern() {
    assert_secret("ticket ACME-12345678 leaked", "ACME-12345678", "custom[0]");
    assert_innocent("ticket ACME-1234 is short");
}

#[test]
fn bad_user_patterns_are_errors_naming_them() {
    for (pat, why) in [
        ("foo(", "unclosed group"),
        ("secret-\\w+", "no upper bound"),
        ("a?", "empty string"),
        ("x{600}", "more than max_holdback_bytes"),
        (r"\bkey\b", "(?-u:\\b)"),
    ] {
        let cfg = ExfilConfig {
            extra_patterns: vec!["ok[0-9]{4}".to_owned(), pat.to_owned()],
            ..ExfilConfig::default()
        };
        let err = ExfilRules::new(&cfg).expect_err(pat).to_string();
        assert!(err.contains("extra_patterns[1]"), "{err}");
        assert!(
            err.contains(pat) || err.contains(&format!("{pat:?}")),
            "{err}"
        );
        assert!(err.contains(why), "{pat}: {err}");
    }
    // The ASCII word boundary is fine.
    let cfg = ExfilConfig {
        extra_patterns: vec![r"(?-u:\b)key-[0-9]{4}(?-u:\b)".to_owned()],
        ..ExfilConfig::default()
    };
    let rules = Arc::new(ExfilRules::new(&cfg).expect("ascii \\b"));
    let out = scan_chunks(&rules, ["a key-", "1234 b"]);
    assert_eq!(out.hits.len(), 1);
    assert_eq!(out.hits[0].rule, "custom[0]");
    let out = scan_chunks(&rules, ["a key-", "12345 b"]);
    assert!(out.hits.is_empty());
}

#[test]
fn config() {
    let cfg: ExfilConfig = serde_json::from_str("{}").expect("defaults");
    assert_eq!(cfg, ExfilConfig::default());
    let cfg: ExfilConfig =
        serde_json::from_str(r#"{"extra_patterns":["x{3}"],"max_holdback_bytes":1024}"#)
            .expect("partial");
    assert_eq!(cfg.max_holdback_bytes, 1024);
    assert!(serde_json::from_str::<ExfilConfig>(r#"{"max_holdback":1}"#).is_err());
    // Too small a bound for a built-in rule, unless that rule is disabled.
    let small = ExfilConfig {
        max_holdback_bytes: 100,
        ..ExfilConfig::default()
    };
    let err = ExfilRules::new(&small).expect_err("too small").to_string();
    assert!(err.contains("max_holdback_bytes"), "{err}");
    let only = ExfilConfig {
        max_holdback_bytes: 64,
        disabled_rules: builtin_rule_names()
            .filter(|n| *n != "aws_access_key_id")
            .map(str::to_owned)
            .collect(),
        ..ExfilConfig::default()
    };
    let rules = ExfilRules::new(&only).expect("one rule");
    assert_eq!(
        rules.rule_names().collect::<Vec<_>>(),
        ["aws_access_key_id"]
    );
    assert_eq!(rules.max_match_len(), 20);
    let unknown = ExfilConfig {
        disabled_rules: vec!["nope".to_owned()],
        ..ExfilConfig::default()
    };
    assert!(ExfilRules::new(&unknown).is_err());
    let bits = ExfilConfig {
        entropy_min_bits_per_char: f64::NAN,
        ..ExfilConfig::default()
    };
    assert!(ExfilRules::new(&bits).is_err());
    // The default bound holds every built-in rule.
    assert!(RULES.max_match_len() <= 512);
}

#[test]
fn rules_that_begin_with_a_letter_start_only_after_a_non_letter() {
    let secret = "Xk9#mP2vR7qL4wZ8tN3s";
    // A word ending in a letter that could begin a rule (`s` of `sk_live_`, `r` of
    // `rk_live_`, `e` of `eyJ`, `t` of `token`) holds nothing back.
    for word in [" rivers", " river", " more", " that"] {
        let mut sc = ExfilScanner::new(Arc::clone(&RULES));
        assert_eq!(sc.push(word), ExfilStep::Release(word.len()), "{word:?}");
    }
    // A key word after `_`, a quote, a space, or at the start of the turn is one.
    for text in [
        format!("DB_PASSWORD={secret} "),
        format!("{{\"token\": \"{secret}\"}}"),
        format!("the secret is {secret} "),
        format!("password: {secret} "),
        "x Bearer eyZa9Kq2Lm8Np4Rs7Tu1Vw3Xy5 ".to_owned(),
    ] {
        let out = scan_chunks(&RULES, [text.as_str()]);
        assert_eq!(out.hits.len(), 1, "{text:?}: {:?}", out.hits);
    }
    // Glued to the letters before it, it is not (the price of the look-behind).
    let out = scan_chunks(&RULES, [format!("mypassword={secret} ").as_str()]);
    assert!(out.hits.is_empty(), "{:?}", out.hits);
    // A user pattern is not affected: it may start anywhere.
    let out = scan_chunks(&RULES, ["xACME-12345678 "]);
    assert_eq!(out.hits.len(), 1, "{:?}", out.hits);
}

#[test]
fn holdback_is_exact_and_prompt() {
    let mut sc = ExfilScanner::new(Arc::clone(&RULES));
    // No rule can start in plain words: everything is released at once.
    assert_eq!(sc.push("hello world, "), ExfilStep::Release(13));
    // "AKIA" could start a key: held.
    assert_eq!(sc.push("the id AKIA"), ExfilStep::Release(7));
    assert_eq!(sc.held_bytes(), 4);
    assert_eq!(sc.push("IOSFODNN7EXAMPLE"), ExfilStep::Release(0));
    assert_eq!(sc.held_bytes(), 20);
    // The next byte decides (a word boundary ends the key).
    let ExfilStep::Breach(hit) = sc.push(" and") else {
        panic!("no breach")
    };
    assert_eq!(
        (hit.rule.as_str(), hit.start, hit.len),
        ("aws_access_key_id", 20, 20)
    );
    // Observe mode: keep going; the decided match is released with what follows.
    // The final "e" follows a letter, so it cannot start a JWT (`eyJ`): nothing is held.
    assert_eq!(sc.push(" more"), ExfilStep::Release(29));
    assert_eq!(sc.held_bytes(), 0);
    // After a space it could: held until the next byte rules it out.
    assert_eq!(sc.push(" e"), ExfilStep::Release(1));
    assert_eq!(sc.held_bytes(), 1);
    assert_eq!(sc.push("."), ExfilStep::Release(2));
    assert_eq!(sc.released_bytes(), 52);
    assert_eq!(sc.finish(), ExfilStep::Release(0));

    // A look-alike is released as soon as it is ruled out.
    sc.reset();
    assert_eq!(sc.push("AKIA"), ExfilStep::Release(0));
    // ("x" follows a letter: it cannot start a Slack token.)
    assert_eq!(sc.push(" is a prefix"), ExfilStep::Release(16));
    assert_eq!(sc.push("."), ExfilStep::Release(1));
    assert_eq!(sc.finish(), ExfilStep::Release(0));
    assert!(sc.peak_held_bytes() >= 4);
}

#[test]
fn several_breaches_in_one_token_are_all_reported() {
    let text = "AKIAIOSFODNN7EXAMPLE ghp_16C7e42F292c6912E7710c838347Ae178B4a";
    let out = scan_all(text);
    let rules: Vec<_> = out.hits.iter().map(|h| h.rule.as_str()).collect();
    assert_eq!(rules, ["aws_access_key_id", "github_token"]);
    assert_eq!(out.released_total, text.len());
    // Same secret, same fingerprint; different secret, different one.
    let a = scan_all("AKIAIOSFODNN7EXAMPLE").hits[0].fingerprint;
    let b = scan_all("x AKIAIOSFODNN7EXAMPLE").hits[0].fingerprint;
    let c = scan_all("AKIAIOSFODNN7EXAMPLF").hits[0].fingerprint;
    assert_eq!(a, b);
    assert_ne!(a, c);
}
