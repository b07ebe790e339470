use std::io::Write;

use serde_json::json;

use super::*;
use crate::metrics::Metrics;

fn incident(seq: u64, stream: &str, cause: &str, message: &str) -> Value {
    json!({"seq": seq, "hash": format!("h{seq}"), "kind": "incident", "stream_id": stream,
           "trip_cause": cause, "message": message})
}

/// A ledger file holding `lines`, removed on drop.
struct Ledger(std::path::PathBuf);

impl Ledger {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn ledger(lines: &[Value]) -> Ledger {
    let path = std::env::temp_dir().join(format!("haltd-labels-{}.jsonl", rand::random::<u64>()));
    let mut f = std::fs::File::create(&path).expect("temp file");
    for l in lines {
        writeln!(f, "{l}").expect("write");
    }
    Ledger(path)
}

/// The value of one `haltd_incident_labels` series in the exposition.
fn gauge(m: &Metrics, detector: &str, route: &str, label: &str) -> Option<i64> {
    let prefix = format!(
        "haltd_incident_labels{{detector=\"{detector}\",route=\"{route}\",label=\"{label}\"}} "
    );
    m.encode().lines().find_map(|l| {
        l.strip_prefix(&prefix)
            .map(|v| v.parse().expect("a number"))
    })
}

#[test]
fn what_tripped_is_the_named_detector_else_the_cause() {
    let rec = incident(
        3,
        "hs_1",
        "TIMING_DISTRIBUTION_ANOMALY",
        "stream halted (TIMING_DISTRIBUTION_ANOMALY); terminal event delivered; detector latency_anomaly: CUSUM 9.1 > 8",
    );
    assert_eq!(
        Tripper::of_incident(&rec),
        Tripper::Detector(DetectorId::LatencyAnomaly)
    );
    let rec = incident(3, "hs_1", "OPERATOR_TRIP", "stream halted (OPERATOR_TRIP)");
    assert_eq!(
        Tripper::of_incident(&rec),
        Tripper::Cause(FailureCode::OperatorTrip)
    );
    // A detector name that is not one, and no cause: the watchdog's trip.
    let rec = json!({"message": "x; detector nonsense: y"});
    assert_eq!(
        Tripper::of_incident(&rec),
        Tripper::Cause(FailureCode::WatchdogTrip)
    );
    for t in [
        Tripper::Detector(DetectorId::Surprise),
        Tripper::Cause(FailureCode::HeartbeatLost),
    ] {
        assert_eq!(t.as_str().parse::<Tripper>().expect("parses"), t);
        let v = serde_json::to_value(t).expect("serialises");
        assert_eq!(serde_json::from_value::<Tripper>(v).expect("reads"), t);
    }
    assert!("no_such".parse::<Tripper>().is_err());
}

#[test]
fn the_last_incident_of_the_stream_is_found_with_its_route() {
    let f = ledger(&[
        incident(1, "hs_0000000000000001", "OPERATOR_TRIP", "a"),
        json!({"seq": 2, "hash": "h2", "kind": "turn", "stream_id": "hs_0000000000000001"}),
        incident(3, "hs_0000000000000002", "OPERATOR_TRIP", "b"),
        // A restart used the stream id again: the later incident is the one.
        {
            let mut r = incident(
                9,
                "hs_0000000000000001",
                "SURPRISE_THRESHOLD",
                "c; detector surprise: mean 11 bits",
            );
            r["route"] = json!("chat");
            r
        },
    ]);
    let l = find_incident(f.path(), "hs_0000000000000001", Label::Fp, None).expect("found");
    assert_eq!(l.incident_seq, 9);
    assert_eq!(l.incident_hash, "h9");
    assert_eq!(l.detector, Tripper::Detector(DetectorId::Surprise));
    assert_eq!(l.route, "chat");
    let l = find_incident(f.path(), "hs_0000000000000002", Label::Tp, None).expect("found");
    assert_eq!((l.incident_seq, l.route.as_str()), (3, DEFAULT_ROUTE));
    let e =
        find_incident(f.path(), "hs_0000000000000003", Label::Tp, None).expect_err("no incident");
    assert!(matches!(e, LabelError::NoIncident { .. }), "{e}");
    assert!(e.to_string().contains("hs_0000000000000003"), "{e}");
}

#[test]
fn a_relabel_moves_the_count_and_the_same_label_again_changes_none() {
    let m = Metrics::new();
    let labels = Labels::restored(&m.labels, &[]);
    // Every detector's series exist from the start.
    assert_eq!(gauge(&m, "latency_anomaly", "default", "fp"), Some(0));
    let l = Labelled {
        stream_id: "hs_1".to_owned(),
        incident_seq: 4,
        incident_hash: "h4".to_owned(),
        detector: Tripper::Detector(DetectorId::Surprise),
        route: "default".to_owned(),
        label: Label::Tp,
        note: None,
    };
    assert_eq!(labels.set(l.clone()), None);
    assert_eq!(gauge(&m, "surprise", "default", "tp"), Some(1));
    assert_eq!(labels.set(l.clone()), Some(Label::Tp));
    assert_eq!(gauge(&m, "surprise", "default", "tp"), Some(1));
    let fp = Labelled {
        label: Label::Fp,
        ..l.clone()
    };
    assert_eq!(labels.set(fp.clone()), Some(Label::Tp));
    assert_eq!(gauge(&m, "surprise", "default", "tp"), Some(0));
    assert_eq!(gauge(&m, "surprise", "default", "fp"), Some(1));
    // Another incident, tripped by no detector, on another route.
    let op = Labelled {
        incident_seq: 7,
        detector: Tripper::Cause(FailureCode::OperatorTrip),
        route: "chat".to_owned(),
        ..l
    };
    labels.set(op);
    assert_eq!(gauge(&m, "OPERATOR_TRIP", "chat", "tp"), Some(1));

    // What the store keeps restores the same counts.
    let rows: Vec<_> = labels.all().iter().map(Labelled::row).collect();
    let again = Metrics::new();
    let restored = Labels::restored(&again.labels, &rows);
    assert_eq!(restored.all(), labels.all());
    assert_eq!(gauge(&again, "surprise", "default", "fp"), Some(1));
    assert_eq!(gauge(&again, "surprise", "default", "tp"), Some(0));
    assert_eq!(gauge(&again, "OPERATOR_TRIP", "chat", "tp"), Some(1));
}

#[test]
fn replay_applies_given_labels_in_order_and_skips_refusals() {
    let m = Metrics::new();
    let labels = Labels::restored(&m.labels, &[]);
    let l = |label: &str, status: u16| {
        json!({"kind": "admin", "admin": {"action": "label", "status": status, "labelled": {
            "stream_id": "hs_1", "incident_seq": 5, "incident_hash": "h5",
            "detector": "exfil", "route": "default", "label": label}}})
    };
    let records = [
        l("tp", 200),
        json!({"kind": "admin", "admin": {"action": "trip", "status": 200}}),
        l("fp", 200),
        l("tp", 404),
    ];
    let applied = labels.replay(&records);
    assert_eq!(applied.len(), 2);
    assert_eq!(labels.get(5).map(|x| x.label), Some(Label::Fp));
    assert_eq!(gauge(&m, "exfil", "default", "fp"), Some(1));
    assert_eq!(gauge(&m, "exfil", "default", "tp"), Some(0));
    // Replayed again (a second start before the store moved on): nothing changes.
    assert!(labels.replay(&records[2..]).is_empty());
    assert_eq!(gauge(&m, "exfil", "default", "fp"), Some(1));
}
