//! `haltctl ledger verify` over a hand-over pair.

use std::path::{Path, PathBuf};

use super::*;
use crate::ledger::{
    testing::{open, open_linked, state_dir},
    Record, RecordKind, SegmentLink,
};

/// A directory of its own under the system temp dir, removed on drop.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rec(handover: Option<serde_json::Value>) -> Record {
    Record {
        kind: RecordKind::Lifecycle,
        kernel_gate: "enforcing".to_owned(),
        handover,
        ..Record::default()
    }
}

/// Blue: records 0 and 1, its hand-over record 2, its drain 3 and 4. Green: 3 (its first) and 4.
fn pair(dir: &Path) -> (PathBuf, PathBuf) {
    let (blue, green) = (
        dir.join("ledger-blue.jsonl"),
        dir.join("ledger-green.jsonl"),
    );
    let a = open(&blue, true).expect("open blue");
    a.append_sync(rec(None)).expect("append");
    a.append_sync(rec(None)).expect("append");
    let to = serde_json::json!({"to_pid": 2, "to_segment": green.display().to_string()});
    let w = a.append_sync_written(rec(Some(to))).expect("hand-over");
    let link = SegmentLink {
        segment: blue.clone(),
        seq: w.seq,
        hash: w.hash,
        from_pid: 1,
    };
    let (b, _) = open_linked(&green, &link).expect("open green");
    a.append_sync(rec(None)).expect("drain");
    a.append_sync(rec(None)).expect("drain");
    b.append_sync(rec(None)).expect("append");
    (blue, green)
}

#[test]
fn a_hand_over_pair_names_its_link_and_checks_the_old_end() {
    let dir = Dir(std::env::temp_dir().join(format!("haltd-ctl-handover-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    std::fs::create_dir_all(&dir.0).expect("dir");
    let (blue, green) = pair(&dir.0);
    let state = state_dir(&blue);
    let paths = [blue.clone(), green.clone()];
    let req = VerifyRequest {
        state_dir: &state,
        paths: &paths,
        head: None,
        no_end_check: false,
    };
    let o = run(&req);
    assert_eq!(o.verdict, Verdict::Intact, "{}", o.message);
    let (b, g) = (blue.display(), green.display());
    assert_eq!(
        o.message,
        format!(
            "ok: 7 records, chain intact, matches its head\nsegment {g} continues {b} from its \
             hand-over record seq 2; {b} went on to seq 4 (its drain), where its own head says"
        )
    );
    assert_eq!(o.handovers.len(), 1);
    let json = serde_json::to_value(&o).expect("json");
    assert_eq!(json["handovers"][0]["from_seq"], 2);

    // The drain's last record cut off: blue no longer ends at its own head.
    let text = std::fs::read_to_string(&blue).expect("read");
    let cut: Vec<&str> = text.lines().collect();
    std::fs::write(&blue, format!("{}\n", cut[..cut.len() - 1].join("\n"))).expect("write");
    let o = run(&req);
    assert_eq!(o.verdict, Verdict::Broken, "{}", o.message);
    assert!(
        o.message.ends_with(&format!(
            "(its drain)\nBROKEN: {b} does not end at its own head: file behind its head: the \
             chain ends before seq 4, the head says 5 records were written (records cut off or \
             the file replaced)"
        )),
        "{}",
        o.message
    );
}
