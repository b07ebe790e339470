//! Look-ahead: held text that the next token rules out is released with the current token.

use super::*;

#[test]
fn a_tail_cleared_by_the_next_token_is_released_without_waiting() {
    let mut sc = ExfilScanner::new(Arc::clone(&RULES));
    // " A" could begin `AKIA...`, `aws...`: held by the push alone.
    assert_eq!(sc.push("the id is A"), ExfilStep::Release(10));
    assert_eq!(sc.held_bytes(), 1);
    // The next token rules it out: released now, before that token is pushed.
    assert_eq!(sc.look_ahead(Ahead::Text("KIA is a prefix")), 1);
    assert_eq!((sc.held_bytes(), sc.released_bytes()), (0, 11));
    // Looking again releases nothing more; the push then releases only its own text.
    assert_eq!(sc.look_ahead(Ahead::Text("KIA is a prefix")), 0);
    assert_eq!(sc.push("KIA is a prefix"), ExfilStep::Release(15));
    assert_eq!(sc.held_bytes(), 0);
    // The article " a" (`api_key`, `aws`) and " to" (`token`), the common cases.
    for (token, next) in [(" a", " river"), (" to", " the"), (" to", "day")] {
        sc.reset();
        let ExfilStep::Release(n) = sc.push(token) else {
            panic!("{token:?}")
        };
        assert!(n < token.len(), "{token:?} is held");
        assert_eq!(sc.look_ahead(Ahead::Text(next)), token.len() - n);
        assert_eq!(sc.held_bytes(), 0);
        assert_eq!(sc.push(next), ExfilStep::Release(next.len()));
    }
    // The end of the text rules out what is no match at its end.
    sc.reset();
    assert_eq!(sc.push("say a"), ExfilStep::Release(4));
    assert_eq!(sc.look_ahead(Ahead::End), 1);
    assert_eq!(sc.finish(), ExfilStep::Release(0));
    assert_eq!(sc.released_bytes(), 5);
}

#[test]
fn a_tail_the_next_token_may_continue_into_a_secret_stays_held() {
    let mut sc = ExfilScanner::new(Arc::clone(&RULES));
    assert_eq!(sc.push("the id "), ExfilStep::Release(7));
    assert_eq!(sc.push("AKIA"), ExfilStep::Release(0));
    // Still a candidate at the end of the next token: held.
    assert_eq!(sc.look_ahead(Ahead::Text("IOSFODNN7EXA")), 0);
    assert_eq!(sc.push("IOSFODNN7EXA"), ExfilStep::Release(0));
    // A complete match within the next token: held (the push decides it).
    assert_eq!(sc.look_ahead(Ahead::Text("MPLE and")), 0);
    let ExfilStep::Breach(hit) = sc.push("MPLE and") else {
        panic!("no breach")
    };
    assert_eq!((hit.start, hit.len), (7, 20));
    assert_eq!(sc.released_bytes(), 7);

    // A complete match at the end of the text so far: held even when the next token would
    // make it innocent (a key needs a word boundary after it), since the turn may end before
    // that token is pushed.
    sc.reset();
    assert_eq!(sc.push("AKIAIOSFODNN7EXAMPLE"), ExfilStep::Release(0));
    assert_eq!(sc.look_ahead(Ahead::Text("X and")), 0);
    assert_eq!(sc.look_ahead(Ahead::End), 0);
    assert!(matches!(sc.finish(), ExfilStep::Breach(_)));
    // Pushed, that token does make it innocent.
    sc.reset();
    assert_eq!(sc.push("AKIAIOSFODNN7EXAMPLE"), ExfilStep::Release(0));
    assert_eq!(sc.push("X and"), ExfilStep::Release(25));
}

#[test]
fn a_look_ahead_releases_only_up_to_the_first_candidate_it_cannot_rule_out() {
    let mut sc = ExfilScanner::new(Arc::clone(&RULES));
    // Two candidates held: an AWS key from "AKIA" and the custom `ACME-[0-9]{8}` from "ACME".
    assert_eq!(sc.push("the AKIA1ACME"), ExfilStep::Release(4));
    assert_eq!(sc.held_bytes(), 9);
    // The next token ends the first ('-' is no key character) and completes the second: the
    // release stops at the second's start.
    assert_eq!(sc.look_ahead(Ahead::Text("-12345678 x")), 5);
    assert_eq!(sc.held_bytes(), 4);
    let ExfilStep::Breach(hit) = sc.push("-12345678 x") else {
        panic!("no breach")
    };
    assert_eq!((hit.rule.as_str(), hit.start), ("custom[0]", 9));
    assert_eq!(sc.released_bytes(), 9);
    // Nothing is released while a breach is being reported (the rest of the token is not
    // scanned yet).
    assert_eq!(sc.look_ahead(Ahead::Text(".")), 0);
    assert_eq!(sc.released_bytes(), 9);
}
