use super::builtin::BUILTIN_LEN;
use super::config_file::{civil_date, today_utc};
use super::roc::{roc_curve, threshold_between};
use super::*;
use proptest::prelude::*;

/// Natural-log probability of a token with `bits` of surprise.
fn lp(bits: f32) -> Option<f32> {
    Some(-bits * std::f32::consts::LN_2)
}

fn naive_auroc(scored: &[(Option<f64>, bool)]) -> Option<f64> {
    let r = |s: Option<f64>| s.unwrap_or(f64::NEG_INFINITY);
    let (mut sum, mut pairs) = (0.0, 0usize);
    for &(sp, _) in scored.iter().filter(|x| x.1) {
        for &(sn, _) in scored.iter().filter(|x| !x.1) {
            pairs += 1;
            sum += if r(sp) > r(sn) {
                1.0
            } else if r(sp) == r(sn) {
                0.5
            } else {
                0.0
            };
        }
    }
    (pairs > 0).then(|| sum / pairs as f64)
}

fn pairs(pos: &[f64], neg: &[f64]) -> Vec<(Option<f64>, bool)> {
    pos.iter()
        .map(|&s| (Some(s), true))
        .chain(neg.iter().map(|&s| (Some(s), false)))
        .collect()
}

/// A stream whose score (mean of a 4-token window, min_tokens 2) is exactly `bits`.
fn flat(id: &str, positive: bool, bits: f32) -> LabelledStream {
    LabelledStream {
        id: id.to_owned(),
        positive,
        logprobs: vec![lp(bits); 6],
        tokens: None,
    }
}

fn small_opts() -> CalibrateOptions {
    CalibrateOptions {
        window: 4,
        ..CalibrateOptions::default()
    }
}

#[test]
fn auroc_known_cases() {
    assert_eq!(auroc(&pairs(&[3.0, 4.0], &[1.0, 2.0])), Some(1.0));
    assert_eq!(auroc(&pairs(&[1.0, 2.0], &[3.0, 4.0])), Some(0.0));
    assert_eq!(auroc(&pairs(&[2.0, 2.0], &[2.0])), Some(0.5));
    // Pairs: (1,2)=0 (1,0)=1 (2,2)=½ (2,0)=1 (3,2)=1 (3,0)=1 → 4.5/6.
    assert_eq!(auroc(&pairs(&[1.0, 2.0, 3.0], &[2.0, 0.0])), Some(0.75));
    // A stream that can never trip ranks lowest, tied with its kind.
    let s = vec![(None, true), (None, false), (Some(0.0), false)];
    assert_eq!(auroc(&s), Some(0.25));
    assert_eq!(auroc(&pairs(&[1.0], &[])), None);
}

proptest! {
    #[test]
    fn auroc_matches_the_naive_reference(
        scored in proptest::collection::vec(
            (proptest::option::weighted(0.9, 0u8..8), any::<bool>()),
            0..60,
        )
    ) {
        let scored: Vec<(Option<f64>, bool)> =
            scored.into_iter().map(|(s, p)| (s.map(f64::from), p)).collect();
        let a = auroc(&scored);
        let b = naive_auroc(&scored);
        prop_assert_eq!(a.is_some(), b.is_some());
        if let (Some(a), Some(b)) = (a, b) {
            prop_assert!((a - b).abs() < 1e-12, "{} vs {}", a, b);
        }
    }

    #[test]
    fn roc_thresholds_flag_exactly_their_streams(
        scored in proptest::collection::vec(
            (proptest::option::weighted(0.9, 0.0f64..20.0), any::<bool>()),
            1..60,
        )
    ) {
        let scored: Vec<(Option<f64>, bool)> = scored
            .into_iter()
            .map(|(s, p)| (s.map(|x| (x * 4.0).round() / 4.0), p))
            .collect();
        let p_total = scored.iter().filter(|x| x.1).count();
        prop_assume!(p_total > 0 && p_total < scored.len());
        let roc = roc_curve(&scored);
        for pt in &roc {
            let tp = scored.iter().filter(|(s, p)| *p && s.is_some_and(|s| s > pt.threshold_bits)).count();
            let fp = scored.iter().filter(|(s, p)| !*p && s.is_some_and(|s| s > pt.threshold_bits)).count();
            prop_assert_eq!((tp, fp), (pt.tp, pt.fp), "threshold {}", pt.threshold_bits);
        }
        prop_assert!(roc.windows(2).all(|w| w[0].threshold_bits > w[1].threshold_bits));
    }
}

#[test]
fn thresholds_are_short_and_inside_their_interval() {
    assert_eq!(threshold_between(2.0, 4.0), 3.0);
    assert_eq!(threshold_between(2.61, 2.67), 2.64);
    assert_eq!(threshold_between(2.0, 2.0625), 2.0);
    assert_eq!(threshold_between(f64::NEG_INFINITY, 3.2), 3.0);
    assert_eq!(threshold_between(f64::NEG_INFINITY, 3.0), 2.5);
    let t = threshold_between(1.000_000_1, 1.000_000_2);
    assert!((1.000_000_1..1.000_000_2).contains(&t));
}

#[test]
fn perfect_and_inverted_separation() {
    let streams: Vec<_> = (0..10)
        .map(|i| flat(&format!("s{i}"), i >= 5, i as f32))
        .collect();
    let r = calibrate(&streams, &small_opts()).expect("calibrates");
    assert_eq!(r.auroc, 1.0);
    let ci = r.auroc_ci.as_ref().expect("bootstrap");
    assert_eq!((ci.low, ci.high), (1.0, 1.0));
    let op = r.operating_point.as_ref().expect("operating point");
    // Precision 1 at recall 1 (the higher recall among precision-1 points): the cut
    // between 4 (the top negative) and 5 (the lowest positive).
    assert_eq!((op.precision, op.recall, op.fpr), (1.0, 1.0, 0.0));
    assert!(op.threshold_bits >= 4.0 && op.threshold_bits < 5.0);
    assert_eq!(op.threshold_bits, 4.5);

    let inverted: Vec<_> = (0..10)
        .map(|i| flat(&format!("s{i}"), i < 5, i as f32))
        .collect();
    let r = calibrate(&inverted, &small_opts()).expect("calibrates");
    assert_eq!(r.auroc, 0.0);
    let op = r.operating_point.expect("operating point");
    // Every cut reaching recall 0.5 is worse than flagging everything (precision ½).
    assert_eq!((op.tp, op.fp), (5, 5));
}

#[test]
fn operating_point_on_a_hand_made_case() {
    // Scores (label): 9(1) 8(0) 7(1) 6(1) 5(0) 4(1) 3(0) 2(0); 4 positives.
    // Cuts with recall ≥ ½: at 7: tp 2, fp 1 → ⅔; at 6: 3/4 = .75; at 5: 3/5; at 4:
    // 4/6 = ⅔; at 3: 4/7; at 2: 4/8. The best is the cut at 6: threshold in [5, 6).
    let spec = [
        (9.0, true),
        (8.0, false),
        (7.0, true),
        (6.0, true),
        (5.0, false),
        (4.0, true),
        (3.0, false),
        (2.0, false),
    ];
    let streams: Vec<_> = spec
        .iter()
        .enumerate()
        .map(|(i, &(s, p))| flat(&format!("s{i}"), p, s))
        .collect();
    let r = calibrate(&streams, &small_opts()).expect("calibrates");
    let op = r.operating_point.as_ref().expect("operating point");
    assert_eq!((op.tp, op.fp, op.tn, op.fn_), (3, 1, 3, 1));
    assert_eq!(op.precision, 0.75);
    assert_eq!(op.recall, 0.75);
    assert_eq!(op.fpr, 0.25);
    assert_eq!(op.threshold_bits, 5.5);
    // Mann–Whitney by hand, negatives each positive beats: 9: 4, 7: 3, 6: 3, 4: 2 → 12/16.
    assert_eq!(r.auroc, 0.75);
    assert_eq!(r.roc.len(), 9);

    // Scores 5(1) 4(1) 3(0) 2(1) 1(1): the cut at 5 has precision 1 but recall ¼, below
    // the floor; the cut at 4 has precision 1 at recall ½: chosen, threshold in [3, 4).
    let spec = [
        (5.0, true),
        (4.0, true),
        (3.0, false),
        (2.0, true),
        (1.0, true),
    ];
    let streams: Vec<_> = spec
        .iter()
        .enumerate()
        .map(|(i, &(s, p))| flat(&format!("t{i}"), p, s))
        .collect();
    let r = calibrate(&streams, &small_opts()).expect("calibrates");
    let op = r.operating_point.expect("operating point");
    assert_eq!((op.tp, op.fp), (2, 0));
    assert_eq!(op.threshold_bits, 3.5);
}

#[test]
fn precision_ties_go_to_higher_recall() {
    // The cut at 4 (tp 2, fp 1) and the cut at 1 (tp 4, fp 2) both have precision ⅔:
    // the one with the higher recall wins.
    let spec = [
        (6.0, true),
        (5.0, false),
        (4.0, true),
        (3.0, false),
        (2.0, true),
        (1.0, true),
        (0.5, false),
        (0.25, false),
        (0.125, false),
        (0.0625, false),
    ];
    let streams: Vec<_> = spec
        .iter()
        .enumerate()
        .map(|(i, &(s, p))| flat(&format!("u{i}"), p, s))
        .collect();
    let r = calibrate(&streams, &small_opts()).expect("calibrates");
    // Cuts with recall ≥ ½ (tp ≥ 2): at 4: 2/3; at 3: 2/4; at 2: 3/5; at 1: 4/6; lower: worse.
    let op = r.operating_point.expect("operating point");
    assert_eq!((op.tp, op.fp), (4, 2));
    assert_eq!(op.recall, 1.0);
}

#[test]
fn bootstrap_is_reproducible_and_contains_the_estimate() {
    let streams = builtin_labelled_set(120, 7);
    let opts = CalibrateOptions {
        bootstrap: 300,
        ..CalibrateOptions::default()
    };
    let a = calibrate(&streams, &opts).expect("calibrates");
    let b = calibrate(&streams, &opts).expect("calibrates");
    assert_eq!(a, b);
    let ci = a.auroc_ci.as_ref().expect("bootstrap");
    assert!(
        ci.low <= a.auroc && a.auroc <= ci.high,
        "{ci:?} vs {}",
        a.auroc
    );
    assert!(ci.low < ci.high);
    assert_eq!(ci.resamples, 300);
    let c = calibrate(
        &streams,
        &CalibrateOptions {
            seed: opts.seed + 1,
            ..opts.clone()
        },
    )
    .expect("calibrates");
    assert_eq!(c.auroc, a.auroc);
    assert_ne!(c.auroc_ci, a.auroc_ci);
    let none = calibrate(
        &streams,
        &CalibrateOptions {
            bootstrap: 0,
            ..opts
        },
    )
    .expect("calibrates");
    assert!(none.auroc_ci.is_none());
}

#[test]
fn unscorable_streams_are_excluded_never_zero() {
    let mut streams = vec![
        flat("a", true, 9.0),
        flat("b", false, 1.0),
        flat("c", true, 8.0),
    ];
    let mut holey = flat("d", true, 0.0);
    holey.logprobs[2] = None;
    streams.push(holey);
    let mut bad = flat("e", false, 0.0);
    bad.logprobs[0] = Some(f32::NAN);
    streams.push(bad);
    // One token: shorter than min_tokens, scored as "never trips".
    streams.push(LabelledStream {
        id: "f".into(),
        positive: false,
        logprobs: vec![lp(30.0)],
        tokens: None,
    });
    let mut r = calibrate(&streams, &small_opts()).expect("calibrates");
    assert_eq!((r.positives, r.negatives), (2, 2));
    assert_eq!(r.too_short_negatives, 1);
    assert_eq!(r.unscorable.len(), 2);
    assert_eq!(r.unscorable[0].id, "d");
    assert!(r.unscorable[0].reason.contains("token 2 has no logprob"));
    assert!(r.unscorable[1].reason.contains("NaN"));
    assert_eq!(r.auroc, 1.0);
    r.add_skipped([Skipped {
        line: Some(3),
        id: "g".into(),
        positive: true,
        reason: "the stream has no logprobs".into(),
    }]);
    assert_eq!(r.unscorable.len(), 3);
    assert_eq!(r.unscorable[0].id, "g");
    let text = r.to_string();
    assert!(text.contains("unscorable (excluded): 3"), "{text}");
    assert!(text.contains("line 3, id \"g\", label 1: the stream has no logprobs"));
    let json = serde_json::to_value(&r).expect("serialises");
    assert_eq!(json["unscorable"][0]["label"], 1);
    assert_eq!(json["operating_point"]["fn"], 0);

    // Only one class left: an error, not a number.
    let err = calibrate(&streams[..1], &small_opts()).expect_err("one class");
    assert!(matches!(
        err,
        CalibrateError::NoNegatives { positives: 1, .. }
    ));
    let err = calibrate(&[], &small_opts()).expect_err("empty");
    assert!(matches!(err, CalibrateError::NoPositives { .. }));
    let err = calibrate(
        &streams,
        &CalibrateOptions {
            window: 300,
            ..small_opts()
        },
    )
    .expect_err("bad window");
    assert!(err.to_string().contains("window"));
}

#[test]
fn no_operating_point_when_positives_cannot_trip() {
    let streams = vec![
        LabelledStream {
            id: "short".into(),
            positive: true,
            logprobs: vec![lp(40.0)],
            tokens: None,
        },
        LabelledStream {
            id: "short2".into(),
            positive: true,
            logprobs: vec![lp(40.0)],
            tokens: None,
        },
        flat("long", true, 9.0),
        flat("neg", false, 1.0),
    ];
    let r = calibrate(
        &streams,
        &CalibrateOptions {
            min_recall: 0.6,
            ..small_opts()
        },
    )
    .expect("calibrates");
    assert!(r.operating_point.is_none());
    assert!(r.to_string().contains("no operating point"));
    assert!(matches!(
        update_config_text("", &r, "2026-01-01"),
        Err(UpdateError::NoOperatingPoint)
    ));
}

#[test]
fn read_labels_format_and_errors() {
    let text = concat!(
        r#"{"id": "a", "label": 1, "logprobs": [-0.5, -9999.0, null], "tokens": [" x", " y", " z"]}"#,
        "\n\n",
        r#"{"id": "b", "label": 0, "logprobs": [-0.1], "prompt": "ignored"}"#,
        "\n",
        r#"{"id": "c", "label": 0}"#,
        "\n",
        r#"{"id": "d", "label": 1, "logprobs": null, "tokens": ["q"]}"#,
        "\n",
        r#"{"id": "e", "label": 0, "logprobs": []}"#,
        "\n",
    );
    let (streams, skipped) = read_labels(text.as_bytes()).expect("reads");
    assert_eq!(streams.len(), 2);
    assert_eq!(streams[0].logprobs, vec![Some(-0.5), Some(-9999.0), None]);
    assert!(streams[0].positive);
    assert!(!streams[1].positive);
    assert_eq!(
        skipped
            .iter()
            .map(|s| (s.line, s.id.as_str()))
            .collect::<Vec<_>>(),
        vec![(Some(4), "c"), (Some(5), "d"), (Some(6), "e")]
    );
    assert!(skipped
        .iter()
        .all(|s| s.reason == "the stream has no logprobs"));

    let err = |t: &str| read_labels(t.as_bytes()).expect_err("invalid").to_string();
    let ok = r#"{"id": "a", "label": 1, "logprobs": [-1.0]}"#;
    assert!(err(&format!("{ok}\nnot json\n")).starts_with("labels line 2:"));
    let e = err(&format!(
        "{ok}\n{}\n",
        r#"{"id": "b", "label": 2, "logprobs": [-1]}"#
    ));
    assert!(
        e.starts_with("labels line 2:") && e.contains("must be 0 or 1"),
        "{e}"
    );
    let e = err(&format!("\n{}\n", r#"{"label": 1, "logprobs": [-1]}"#));
    assert!(e.starts_with("labels line 2:") && e.contains("id"), "{e}");
    let e = err(&format!("{ok}\n{ok}\n"));
    assert_eq!(e, "labels line 2: id \"a\" is already used on line 1");
    let e = err(r#"{"id": "a", "label": 1, "logprobs": [-1.0], "tokens": ["a", "b"]}"#);
    assert_eq!(e, "labels line 1: 2 tokens but 1 logprobs");
    let e = err(r#"{"id": "a", "label": 1, "logprobs": ["x"]}"#);
    assert!(e.starts_with("labels line 1:"), "{e}");
}

#[test]
fn write_labels_round_trips() {
    let streams = builtin_labelled_set(6, 3);
    let mut buf = Vec::new();
    write_labels(&mut buf, &streams).expect("writes");
    let text = String::from_utf8(buf.clone()).expect("utf-8");
    assert_eq!(text.lines().count(), 6);
    assert!(text.lines().all(|l| l.contains("\"label\":")));
    let (back, skipped) = read_labels(buf.as_slice()).expect("reads");
    assert!(skipped.is_empty());
    assert_eq!(back, streams);
}

fn sample_report() -> CalibrationReport {
    let streams: Vec<_> = (0..10)
        .map(|i| flat(&format!("s{i}"), i >= 5, i as f32))
        .collect();
    calibrate(
        &streams,
        &CalibrateOptions {
            statistic: Statistic::P90,
            ..small_opts()
        },
    )
    .expect("calibrates")
}

#[test]
fn write_threshold_preserves_the_rest_of_the_file() {
    let report = sample_report();
    let original = r#"# haltd config
listen = "0.0.0.0:8080" # data plane

[detectors.exfil]
mode = "hard"

# The surprise gate.
[detectors.surprise]
mode = "observe"   # turned on by hand
# bits; calibrated below
threshold_bits = 99.0  # keep this note
debounce = 2

[other]
x = [1, 2, 3]
"#;
    let out = update_config_text(original, &report, "2026-11-29").expect("updates");
    // Everything but the four keys is byte-identical, comments included.
    for line in [
        "# haltd config",
        "listen = \"0.0.0.0:8080\" # data plane",
        "[detectors.exfil]",
        "# The surprise gate.",
        "mode = \"observe\"   # turned on by hand",
        "# bits; calibrated below",
        "threshold_bits = 4.5  # keep this note",
        "debounce = 2",
        "[other]",
        "x = [1, 2, 3]",
    ] {
        assert!(out.contains(line), "lost {line:?} in\n{out}");
    }
    assert!(out.contains("window = 4\n"), "{out}");
    assert!(out.contains("statistic = \"p90\"\n"), "{out}");
    assert!(out.contains("min_tokens = 2\n"), "{out}");
    let comment = out
        .lines()
        .find(|l| l.starts_with(COMMENT_MARK))
        .expect("comment");
    assert!(comment.contains("2026-11-29"), "{comment}");
    assert!(
        comment.contains("AUROC 1.000 (95% CI 1.000-1.000)"),
        "{comment}"
    );
    assert!(
        comment.contains("precision 1.000, recall 1.000, FPR 0.000"),
        "{comment}"
    );
    // The comment sits right above the key, after the operator's own comment.
    let idx = |needle: &str| out.find(needle).expect("present");
    assert!(idx("# bits; calibrated below") < idx(COMMENT_MARK));
    assert!(idx(COMMENT_MARK) < idx("threshold_bits ="));

    // Round trip through toml_edit: the values read back.
    let doc: toml_edit::DocumentMut = out.parse().expect("valid TOML");
    let s = &doc["detectors"]["surprise"];
    assert_eq!(s["threshold_bits"].as_float(), Some(4.5));
    assert_eq!(s["window"].as_integer(), Some(4));
    assert_eq!(s["statistic"].as_str(), Some("p90"));
    assert_eq!(s["mode"].as_str(), Some("observe"));
    assert_eq!(s["debounce"].as_integer(), Some(2));
    assert_eq!(doc["other"]["x"].as_array().map(|a| a.len()), Some(3));

    // Calibrating again replaces the comment instead of stacking another.
    let again = update_config_text(&out, &report, "2026-12-01").expect("updates");
    assert_eq!(again.matches(COMMENT_MARK).count(), 1);
    assert!(again.contains("2026-12-01") && !again.contains("2026-11-29"));
    assert_eq!(again.replace("2026-12-01", "2026-11-29"), out);
}

#[test]
fn write_threshold_creates_the_section_and_file() {
    let report = sample_report();
    let out = update_config_text("", &report, "2026-11-29").expect("updates");
    assert!(!out.contains("[detectors]\n"), "{out}");
    assert!(out.contains("[detectors.surprise]\n"), "{out}");
    let doc: toml_edit::DocumentMut = out.parse().expect("valid TOML");
    assert_eq!(
        doc["detectors"]["surprise"]["threshold_bits"].as_float(),
        Some(4.5)
    );

    let with_other = "[server]\nport = 1\n";
    let out = update_config_text(with_other, &report, "2026-11-29").expect("updates");
    assert!(out.starts_with(with_other), "{out}");

    // An inline table is updated in place (no comment: inline tables cannot hold one).
    let inline = "detectors = { surprise = { window = 8, mode = \"hard\" } }\n";
    let out = update_config_text(inline, &report, "2026-11-29").expect("updates");
    let doc: toml_edit::DocumentMut = out.parse().expect("valid TOML");
    assert_eq!(doc["detectors"]["surprise"]["window"].as_integer(), Some(4));
    assert_eq!(doc["detectors"]["surprise"]["mode"].as_str(), Some("hard"));

    assert!(matches!(
        update_config_text("detectors = 3\n", &report, "x"),
        Err(UpdateError::NotATable("detectors"))
    ));
    assert!(matches!(
        update_config_text("[detectors]\nsurprise = 1\n", &report, "x"),
        Err(UpdateError::NotATable("detectors.surprise"))
    ));
    assert!(matches!(
        update_config_text("x = = 1", &report, "x"),
        Err(UpdateError::Parse(_))
    ));

    // Through the file system.
    let dir = std::env::temp_dir().join(format!("haltd-calibrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("haltd.toml");
    std::fs::write(&path, "# mine\n[detectors.surprise]\nmode = \"off\"\n").expect("write");
    write_threshold(&path, &report).expect("writes");
    let text = std::fs::read_to_string(&path).expect("read");
    assert!(
        text.starts_with("# mine\n[detectors.surprise]\nmode = \"off\"\n"),
        "{text}"
    );
    assert!(text.contains("threshold_bits = 4.5"));
    assert!(!dir.join("haltd.toml.haltctl-tmp").exists());
    let fresh = dir.join("new.toml");
    write_threshold(&fresh, &report).expect("creates");
    assert!(std::fs::read_to_string(&fresh)
        .expect("read")
        .contains("[detectors.surprise]"));
    std::fs::write(&path, "not = = toml").expect("write");
    let e = write_threshold(&path, &report).expect_err("bad toml");
    assert!(
        e.to_string().contains("haltd.toml is not valid TOML"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn civil_dates() {
    assert_eq!(civil_date(0), "1970-01-01");
    assert_eq!(civil_date(11_016), "2000-02-29");
    assert_eq!(civil_date(20_000), "2024-10-04");
    assert_eq!(today_utc().len(), 10);
}

#[test]
fn builtin_set_is_deterministic_balanced_and_separable() {
    let a = builtin_labelled_set(40, 11);
    assert_eq!(a, builtin_labelled_set(40, 11));
    assert_ne!(a, builtin_labelled_set(40, 12));
    assert_eq!(a.iter().filter(|s| s.positive).count(), 20);
    for s in &a {
        let n = s.logprobs.len();
        assert!(BUILTIN_LEN.contains(&(n as u32)), "{} tokens", n);
        assert!(s.logprobs.iter().all(|l| l.is_some_and(|l| l <= 0.0)));
        assert_eq!(s.tokens.as_ref().map(Vec::len), Some(n));
    }
    let r = calibrate(&a, &CalibrateOptions::default()).expect("calibrates");
    assert!(r.auroc > 0.6, "AUROC {}", r.auroc);
    assert!(r.unscorable.is_empty());
}
