use std::io::Write;

use serde_json::json;

use super::*;

/// A fresh directory of this test's own, removed when dropped.
struct TestDir(PathBuf);

impl TestDir {
    fn new(name: &str) -> TestDir {
        let dir = std::env::temp_dir().join(format!("haltd-show-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test I/O");
        TestDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn incident() -> Value {
    json!({"seq": 7, "ts": "2026-12-02T03:12:44.584Z", "kind": "incident",
           "stream_id": "hs_0000000100000001", "trip_cause": "OPERATOR_TRIP",
           "trip_token_index": 9, "halt_tokens_post_trip": 2, "tokens_emitted": 11,
           "outcome": null, "message": "stream halted (OPERATOR_TRIP); terminal event sent"})
}

fn admin() -> Value {
    json!({"seq": 8, "ts": "2026-12-02T03:12:44.590Z", "kind": "admin",
           "stream_id": "hs_0000000100000001",
           "admin": {"action": "trip", "cause": "OPERATOR_TRIP", "status": 200,
                     "actor": {"transport": "unix", "uid": 0, "gid": 0, "pid": 4242}}})
}

fn turn(seq: u64, stream: &str) -> Value {
    json!({"seq": seq, "ts": "2026-12-02T03:12:45.000Z", "kind": "turn", "stream_id": stream,
           "outcome": "completed", "tokens_emitted": 30, "conversation": "e72e41f66462b7fb",
           "runtime_mode": "full", "turn_status": "committed"})
}

#[test]
fn an_incident_row_names_its_stream_cause_and_bound() {
    let row = table_row(&incident());
    for want in [
        "7",
        "2026-12-02T03:12:44.584Z",
        "incident",
        "hs_0000000100000001",
        "OPERATOR_TRIP",
        "9",
        "2",
        "11",
        "stream halted (OPERATOR_TRIP)",
    ] {
        assert!(row.contains(want), "{want:?} missing in {row:?}");
    }
    // The row lines up under the header: DETAIL starts in the same column.
    let header = table_header();
    assert_eq!(
        row.find("stream halted"),
        header.find("DETAIL"),
        "{header}\n{row}"
    );
}

#[test]
fn an_admin_row_says_who_acted_and_what_was_answered() {
    let row = table_row(&admin());
    assert!(row.contains("trip"), "{row}");
    assert!(row.contains("OPERATOR_TRIP"), "{row}");
    assert!(row.contains("by uid 0 pid 4242: answered 200"), "{row}");
    assert!(!row.contains("no degrade"), "{row}");
    let mut opted_out = admin();
    opted_out["admin"]["degrade"] = false.into();
    let row = table_row(&opted_out);
    assert!(row.contains("answered 200 (no degrade)"), "{row}");
}

#[test]
fn a_turn_row_shows_the_conversation_mode_and_status() {
    let row = table_row(&turn(3, "hs_0000000100000002"));
    assert!(
        row.contains("conv e72e41f66462b7fb · full · committed"),
        "{row}"
    );
    assert!(row.contains("completed"), "{row}");
}

#[test]
fn missing_fields_are_dashes_and_long_details_are_cut() {
    let long = "é".repeat(300);
    let row = table_row(&json!({"kind": "lifecycle", "message": long}));
    assert!(row.trim_start().starts_with('-'), "{row}");
    assert!(row.ends_with('…'), "{row}");
    assert_eq!(row.chars().filter(|&c| c == 'é').count(), DETAIL_MAX);
}

#[test]
fn a_selection_keeps_one_stream_and_one_kind() {
    let by_stream = Selection {
        stream: Some("hs_0000000100000001".to_owned()),
        kind: None,
    };
    assert!(by_stream.matches(&incident()));
    assert!(!by_stream.matches(&turn(3, "hs_0000000100000002")));
    let by_kind = Selection {
        stream: None,
        kind: Some(RecordKind::Admin),
    };
    assert!(by_kind.matches(&admin()));
    assert!(!by_kind.matches(&incident()));
    assert!(Selection::default().matches(&incident()));
}

fn write_lines(path: &Path, lines: &[String]) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("test I/O");
    for l in lines {
        writeln!(f, "{l}").expect("test I/O");
    }
}

#[test]
fn the_last_lines_keep_order_and_report_a_torn_line() {
    let dir = TestDir::new("last");
    let path = dir.path().join("ledger.jsonl");
    let recs: Vec<String> = (0..10)
        .map(|i| turn(i, "hs_0000000100000002").to_string())
        .collect();
    write_lines(&path, &recs);
    std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .expect("test I/O")
        .write_all(b"{\"seq\": 10, \"ki")
        .expect("test I/O");
    let last = last_lines(&path, 3, |_| true).expect("test I/O");
    let seqs: Vec<String> = last
        .iter()
        .map(|l| match l {
            Line::Record(_, v, _) => v["seq"].to_string(),
            Line::NotARecord(n, why) => format!("line {n}: {why}"),
        })
        .collect();
    assert_eq!(seqs[..2], ["8", "9"]);
    assert!(
        seqs[2].starts_with("line 11: not JSON"),
        "the torn line is reported by number: {seqs:?}"
    );
}

fn seqs(lines: &[Line]) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|l| match l {
            Line::Record(_, v, _) => v["seq"].as_u64(),
            Line::NotARecord(..) => None,
        })
        .collect()
}

#[test]
fn a_follower_sees_whole_appended_lines_and_follows_a_rotation() {
    let dir = TestDir::new("follow");
    let path = dir.path().join("ledger.jsonl");
    write_lines(&path, &[turn(0, "hs_a").to_string()]);
    let mut f = Follower::at_end(&path).expect("test I/O");
    assert!(
        f.poll().expect("test I/O").lines.is_empty(),
        "what was there is not repeated"
    );

    // A record written in two pieces shows once it is whole.
    let rec = turn(1, "hs_a").to_string();
    let (a, b) = rec.split_at(20);
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .expect("test I/O");
    file.write_all(a.as_bytes()).expect("test I/O");
    assert!(f.poll().expect("test I/O").lines.is_empty());
    file.write_all(format!("{b}\n").as_bytes())
        .expect("test I/O");
    let p = f.poll().expect("test I/O");
    assert_eq!(seqs(&p.lines), [1]);
    assert!(
        matches!(p.lines[0], Line::Record(2, ..)),
        "line numbers go on"
    );

    // logrotate: the old file gets one more record before it is moved, then a new one starts.
    write_lines(&path, &[turn(2, "hs_a").to_string()]);
    std::fs::rename(&path, dir.path().join("ledger.jsonl.1")).expect("test I/O");
    write_lines(&path, &[turn(0, "hs_b").to_string()]);
    let p = f.poll().expect("test I/O");
    assert!(p.rotated);
    assert_eq!(
        seqs(&p.lines),
        [2, 0],
        "the old file's last record, then the new file"
    );
    write_lines(&path, &[turn(1, "hs_b").to_string()]);
    let p = f.poll().expect("test I/O");
    assert!(!p.rotated);
    assert_eq!(seqs(&p.lines), [1]);
}
