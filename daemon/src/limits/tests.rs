use super::*;
use crate::{identity::KeyId, scope::ScopeKind};

const S: u64 = 1_000_000_000;

fn scope(n: u64) -> Scope {
    Scope {
        kind: ScopeKind::Addr,
        id: KeyId(n),
    }
}

#[test]
fn concurrency_holds_under_a_burst_and_a_dropped_place_is_given_back() {
    let t = LimitTable::new(Limits {
        concurrency: 3,
        ..Limits::default()
    });
    let burst: Vec<Result<Place, Refused>> =
        (0..10).map(|_| t.admit(scope(1), t.limits(), 0)).collect();
    let admitted = burst.iter().filter(|r| r.is_ok()).count();
    assert_eq!(admitted, 3);
    let refused = burst.iter().find_map(|r| r.as_ref().err()).copied();
    assert_eq!(
        refused,
        Some(Refused {
            limit: Limit::Concurrency,
            value: 3,
            retry_after_s: 1
        })
    );
    // Another scope is not affected.
    assert!(t.admit(scope(2), t.limits(), 0).is_ok());
    drop(burst);
    assert!(
        t.admit(scope(1), t.limits(), 0).is_ok(),
        "the places were given back"
    );
}

#[test]
fn requests_per_minute_refuse_until_the_window_ends() {
    let t = LimitTable::new(Limits {
        requests_per_minute: 5,
        ..Limits::default()
    });
    let admitted = (0..20)
        .filter(|i| t.admit(scope(1), t.limits(), i * S).is_ok())
        .count();
    assert_eq!(admitted, 5);
    let r = t.admit(scope(1), t.limits(), 40 * S).expect_err("over");
    assert_eq!((r.limit, r.retry_after_s), (Limit::RequestsPerMinute, 20));
    let r = t.admit(scope(1), t.limits(), 59 * S + 1).expect_err("over");
    assert_eq!(r.retry_after_s, 1);
    assert!(
        t.admit(scope(1), t.limits(), 60 * S).is_ok(),
        "a new window"
    );
}

#[test]
fn tokens_per_minute_count_what_ended_turns_used() {
    let t = LimitTable::new(Limits {
        tokens_per_minute: 100,
        ..Limits::default()
    });
    let first = t.admit(scope(1), t.limits(), 0).expect("first");
    t.charge(first.scope(), 60, S);
    drop(first);
    assert!(t.admit(scope(1), t.limits(), 2 * S).is_ok(), "60 of 100");
    t.charge(scope(1), 40, 3 * S);
    let r = t
        .admit(scope(1), t.limits(), 4 * S)
        .expect_err("100 of 100");
    assert_eq!(
        (r.limit, r.value, r.retry_after_s),
        (Limit::TokensPerMinute, 100, 56)
    );
    assert!(
        r.message().contains("100 tokens per minute"),
        "{}",
        r.message()
    );
    assert!(t.admit(scope(1), t.limits(), 61 * S).is_ok());
}

#[test]
fn no_limits_admit_everything_and_the_sweep_forgets_idle_scopes() {
    let t = LimitTable::new(Limits::default());
    assert!(t.limits().is_none());
    let places: Vec<Place> = (0..1000)
        .map(|i| t.admit(scope(i % 7), t.limits(), 0).expect("no limit"))
        .collect();
    t.sweep(120 * S);
    assert_eq!(t.view(120 * S).len(), 7, "scopes with turns in flight stay");
    drop(places);
    t.sweep(120 * S);
    assert!(t.view(120 * S).is_empty());
}

#[test]
fn admission_sweeps_once_the_table_doubles() {
    let t = LimitTable::new(Limits {
        requests_per_minute: 1,
        ..Limits::default()
    });
    let key = Scope {
        kind: ScopeKind::Apikey,
        id: KeyId(u64::MAX - 1),
    };
    drop(t.admit(key, t.limits(), 0));
    for i in 1..SWEEP_FLOOR as u64 {
        drop(t.admit(scope(i), t.limits(), 0));
    }
    assert_eq!(t.view(0).len(), SWEEP_FLOOR);
    // A minute later the next admission finds a full table and sweeps the idle scopes, but
    // not a key of the store, whose totals are kept.
    drop(t.admit(scope(u64::MAX), t.limits(), 61 * S));
    let left: Vec<Scope> = t.view(61 * S).into_iter().map(|(s, _)| s).collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.contains(&key));
}

#[test]
fn a_window_kept_in_the_store_goes_on_after_a_restart() {
    let t = LimitTable::new(Limits {
        requests_per_minute: 3,
        ..Limits::default()
    });
    for _ in 0..3 {
        drop(t.admit(scope(1), t.limits(), 100 * S));
    }
    let used = t.charge(scope(1), 40, 110 * S);
    assert_eq!((used.requests_total, used.tokens_total), (3, 40));
    // Stored at wall-clock 1,000,000 ms, 10 s into the window.
    let kept = LimitTable::stored(&used, 110 * S, 1_000_000);
    assert_eq!(kept.window_start_unix_ms, 990_000);
    // Another process, 20 s later by the wall clock, 5 s after its own monotonic start.
    let again = LimitTable::new(t.limits());
    again.restore(scope(1), &kept, 5 * S, 1_020_000);
    let r = again
        .admit(scope(1), again.limits(), 5 * S)
        .expect_err("the window goes on");
    assert_eq!((r.limit, r.retry_after_s), (Limit::RequestsPerMinute, 30));
    // A window long over is not restored as a refusal.
    let later = LimitTable::new(t.limits());
    later.restore(scope(1), &kept, 5 * S, 2_000_000);
    assert!(later.admit(scope(1), later.limits(), 5 * S).is_ok());
    assert_eq!(later.view(5 * S)[0].1.requests_total, 4);
}
