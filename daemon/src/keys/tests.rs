use super::*;

fn key(name: &str) -> (ClientKey, String) {
    let id = new_id(|_| false);
    let s = new_secret(id);
    (
        ClientKey {
            id,
            name: name.into(),
            created_unix_ms: 1,
            revoked_unix_ms: None,
            secrets: vec![s.hash],
            limits: KeyLimits::default(),
        },
        s.token,
    )
}

#[test]
fn a_key_verifies_and_nothing_else_does() {
    let (k, token) = key("ci");
    assert!(
        token.starts_with("hk-") && token.len() == 3 + 16 + 1 + 64,
        "{token}"
    );
    let store = KeyStore::new(vec![k.clone()]);
    let ok = store.verify(Some(&token), 5).expect("verifies");
    assert_eq!((ok.id, ok.name.as_str()), (k.id, "ci"));
    assert_eq!(store.verify(None, 5), Err(KeyRefusal::Missing));
    assert_eq!(
        store.verify(Some("sk-other"), 5),
        Err(KeyRefusal::Malformed)
    );
    let upper = token.to_uppercase().replacen("HK-", "hk-", 1);
    assert_ne!(upper, token);
    assert!(
        store.verify(Some(&upper), 5).is_err(),
        "hex case is part of the secret"
    );
    let mut wrong = token.clone();
    wrong.pop();
    wrong.push(if token.ends_with('0') { '1' } else { '0' });
    assert_eq!(store.verify(Some(&wrong), 5), Err(KeyRefusal::Unknown));
    let (_, other_token) = key("other");
    assert_eq!(
        store.verify(Some(&other_token), 5),
        Err(KeyRefusal::Unknown)
    );
}

#[test]
fn a_revoked_key_is_refused() {
    let (mut k, token) = key("ci");
    k.revoked_unix_ms = Some(3);
    let store = KeyStore::new(vec![k.clone()]);
    assert_eq!(store.verify(Some(&token), 5), Err(KeyRefusal::Revoked));
    assert_eq!(k.view(5).state, "revoked");
    assert_eq!(k.view(5).secrets_active, 0);
}

#[test]
fn a_rotation_overlaps_then_ends_the_old_secret() {
    let (k, old) = key("ci");
    let (next, new) = rotated(&k, 1_000, 10_000);
    let store = KeyStore::new(vec![next.clone()]);
    for (t, old_ok) in [(10_000, true), (10_999, true), (11_000, false)] {
        assert_eq!(store.verify(Some(&old), t).is_ok(), old_ok, "old at {t}");
        assert!(store.verify(Some(&new), t).is_ok(), "new at {t}");
    }
    assert_eq!(next.view(10_500).state, "rotating");
    assert_eq!(next.view(10_500).overlap_ends_unix_ms, Some(11_000));
    assert_eq!(next.view(11_000).state, "active");
    // A second rotation keeps only the secrets that still work, and never extends an end.
    let (again, newest) = rotated(&next, 5_000, 10_500);
    assert_eq!(again.secrets.len(), 3);
    assert_eq!(again.secrets[0].not_after_unix_ms, Some(11_000));
    let (now_only, _) = rotated(&again, 0, 20_000);
    assert_eq!(now_only.secrets.len(), 2, "expired secrets are dropped");
    assert_eq!(
        now_only.view(20_000).secrets_active,
        1,
        "overlap 0 ends the old at once"
    );
    assert!(KeyStore::new(vec![now_only])
        .verify(Some(&newest), 20_000)
        .is_err());
}

#[test]
fn the_stored_form_round_trips_and_holds_no_secret() {
    let (k, token) = key("ci");
    let text = serde_json::to_string(&k).expect("json");
    let secret = token.rsplit('-').next().expect("secret");
    assert!(!text.contains(secret), "{text}");
    assert_eq!(serde_json::from_str::<ClientKey>(&text).expect("back"), k);
    let view = serde_json::to_string(&k.view(2)).expect("view");
    assert!(!view.contains("sha256") && !view.contains(secret), "{view}");
}

#[test]
fn a_key_s_own_limits_override_the_node_s() {
    let node = Limits {
        concurrency: 4,
        requests_per_minute: 60,
        tokens_per_minute: 0,
    };
    let own = KeyLimits {
        requests_per_minute: Some(5),
        ..KeyLimits::default()
    };
    assert_eq!(
        own.over(node),
        Limits {
            concurrency: 4,
            requests_per_minute: 5,
            tokens_per_minute: 0
        }
    );
}
