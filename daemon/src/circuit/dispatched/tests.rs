use serde_json::json;

use super::*;
use crate::circuit::conversation::IdSource;

fn conv(id: &str) -> ConversationId {
    ConversationId {
        key: "00000000000000aa".to_owned(),
        id: id.to_owned(),
        source: IdSource::Header,
    }
}

fn call(reference: &str, conversation: &str, args: &str, delivered: u64) -> DispatchedCall {
    DispatchedCall {
        reference: reference.to_owned(),
        key: "00000000000000aa".to_owned(),
        conversation: Some(conv(conversation)),
        call_id: format!("call_{reference}"),
        tool: "send_email".to_owned(),
        arguments_sha256: arguments_digest(args),
        delivered_unix_ms: delivered,
        stream_id: "hs_1".to_owned(),
        outcome: None,
        reconciled_unix_ms: None,
        reconciled_by: None,
        retried: false,
    }
}

#[test]
fn a_retry_waits_for_the_outcome_and_not_done_allows_it_once() {
    let d = Dispatched::default();
    let changes = d.add(vec![call("r1", "c", r#"{"to":"a","n":1}"#, 5_000)]);
    assert_eq!(changes.len(), 1);
    assert!(
        d.add(vec![call("r1", "c", "{}", 9)]).is_empty(),
        "held once"
    );
    assert_eq!(d.gauges.unreconciled.get(), 1);
    assert_eq!(d.gauges.oldest_delivered_seconds.get(), 5);
    // Reordered and re-spaced arguments are the same call.
    let same = arguments_digest(r#"{ "n": 1, "to": "a" }"#);
    let g = d.guard(&conv("c"), "send_email", &same);
    assert!(
        matches!(g, Guard::Refused(ref c) if c.reference == "r1"),
        "{g:?}"
    );
    assert_eq!(d.guard(&conv("other"), "send_email", &same), Guard::Clear);
    assert_eq!(d.guard(&conv("c"), "send_sms", &same), Guard::Clear);
    assert_eq!(
        d.guard(&conv("c"), "send_email", &arguments_digest("{}")),
        Guard::Clear
    );

    let c = d
        .reconcile("r1", Outcome::NotDone, json!("uid:0"), 7_000)
        .expect("held");
    assert_eq!(
        (c.outcome, c.reconciled_unix_ms),
        (Some(Outcome::NotDone), Some(7_000))
    );
    assert_eq!(d.gauges.unreconciled.get(), 0);
    assert_eq!(d.gauges.oldest_delivered_seconds.get(), 0);
    assert_eq!(
        d.reconcile("r1", Outcome::Done, json!("uid:0"), 8_000),
        Err(ReconcileError::Already {
            reference: "r1".to_owned(),
            outcome: "not_done"
        })
    );
    assert_eq!(
        d.reconcile("nope", Outcome::Done, json!("uid:0"), 8_000),
        Err(ReconcileError::Unknown("nope".to_owned()))
    );
    assert_eq!(
        d.guard(&conv("c"), "send_email", &same),
        Guard::RetryOnce("r1".to_owned())
    );
    d.retried("r1");
    assert_eq!(
        d.guard(&conv("c"), "send_email", &same),
        Guard::Clear,
        "once only"
    );
    assert!(d.list(false).is_empty());
    assert_eq!(d.list(true).len(), 1);
}

#[test]
fn done_and_compensated_keep_refusing_and_everything_survives_a_restore() {
    let d = Dispatched::default();
    let mut rows = Vec::new();
    for (r, args) in [("a", "1"), ("b", "2"), ("u", "3")] {
        for ch in d.add(vec![call(r, "c", args, 1_000)]) {
            let Change::Dispatched(row) = ch else {
                panic!("a dispatched row");
            };
            rows.push(row);
        }
    }
    for (r, o) in [("a", Outcome::Done), ("b", Outcome::Compensated)] {
        let c = d.reconcile(r, o, json!({"uid": 0}), 2_000).expect("held");
        let Change::Dispatched(row) = Dispatched::change(&c) else {
            panic!("a dispatched row");
        };
        rows.retain(|x| x.reference != r);
        rows.push(row);
    }
    let back = Dispatched::new(DispatchedGauges::default(), None, &rows).expect("rows");
    assert_eq!(back.list(true), d.list(true));
    assert_eq!(back.gauges.unreconciled.get(), 1);
    for (r, args) in [("a", "1"), ("b", "2"), ("u", "3")] {
        let g = back.guard(&conv("c"), "send_email", &arguments_digest(args));
        assert!(
            matches!(g, Guard::Refused(ref c) if c.reference == r),
            "{r}: {g:?}"
        );
    }
    let bad = DispatchedRow {
        reference: "x".to_owned(),
        body: json!({"ref": "x"}),
    };
    assert!(Dispatched::new(DispatchedGauges::default(), None, &[bad]).is_err());
}

#[test]
fn references_and_outcomes() {
    assert_eq!(reference("hs_1", "c", 5).len(), 12);
    assert_ne!(reference("hs_1", "c", 5), reference("hs_1", "c", 6));
    for o in Outcome::ALL {
        assert_eq!(Outcome::parse(o.as_str()), Some(o));
    }
    assert_eq!(Outcome::parse("maybe"), None);
}

/// A crash between a record and the store's write: the ledger's records after the store's
/// point give the calls and outcomes back, once.
#[test]
fn the_ledger_replays_what_the_store_missed() {
    let call = call("abc", "c", "{}", 3_000);
    let turn = json!({"kind": "turn", "stream_id": "hs_1", "conversation": call.key,
        "tool_calls": [
            {"index": 0, "id": call.call_id, "name": "send_email", "status": "dispatched",
             "reconciliation": "required", "ref": "abc", "delivered_unix_ms": 3_000,
             "arguments_sha256": call.arguments_sha256, "conversation": conv("c")},
            {"index": 1, "id": "x", "name": "t", "status": "committed"}]});
    let d = Dispatched::default();
    assert_eq!(d.replay(std::slice::from_ref(&turn)).len(), 1);
    assert_eq!(d.list(false), std::slice::from_ref(&call));
    assert!(
        d.replay(std::slice::from_ref(&turn)).is_empty(),
        "idempotent"
    );
    let mut done = call.clone();
    done.outcome = Some(Outcome::NotDone);
    done.reconciled_by = Some(json!("uid:0"));
    let admin = json!({"kind": "admin", "admin": {"action": "reconcile", "call": done}});
    let refused = json!({"kind": "admin", "admin": {"action": "reconcile", "call": null}});
    assert_eq!(d.replay(&[turn.clone(), refused, admin.clone()]).len(), 1);
    assert_eq!(d.list(true), [done]);
    assert!(d.replay(&[turn, admin]).is_empty(), "idempotent");
    assert_eq!(d.gauges.unreconciled.get(), 0);
}
