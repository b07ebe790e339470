use std::time::Duration;

use super::*;

/// An empty directory of this test's own (process and thread in its name).
fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "haltd-grounding-{name}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test dir");
    dir
}

/// A store of three notes in a fresh directory.
pub(crate) fn store() -> PathBuf {
    let dir = fresh_dir("memory");
    std::fs::create_dir_all(dir.join("rivers")).expect("test dir");
    std::fs::write(
        dir.join("rivers/danube.md"),
        "# The Danube\n\nThe Danube flows through ten countries and is 2850 km long.\n\
         It rises in the Black Forest.\n\nUnrelated paragraph about boats.\n",
    )
    .expect("write");
    std::fs::write(
        dir.join("haltd.txt"),
        "haltd halts a token stream within B tokens after a trip.\n",
    )
    .expect("write");
    std::fs::write(dir.join("ignored.json"), "{\"Danube\": \"ignored\"}").expect("write");
    dir
}

fn query(span: &str) -> SpanQuery {
    SpanQuery {
        span: span.into(),
        context: String::new(),
        prompt: String::new(),
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

#[test]
fn files_become_passages_with_their_first_line() {
    assert_eq!(
        passages("a\nb\n\n\nc\n"),
        [(1, "a b".to_owned()), (5, "c".to_owned())]
    );
    // Headings label every passage of their section (the first one opens at the heading's
    // line); a heading line inside a paragraph stays where it is.
    assert_eq!(
        passages("# Title\n\n## Part\n\nThe fact.\n\nMore\n# not alone\n\n# End\n"),
        [
            (1, "Title / Part: The fact.".to_owned()),
            (7, "Title / Part: More # not alone".to_owned()),
            (10, "End".to_owned())
        ]
    );
    // A heading closes the sections of its level and deeper; one with nothing under it is
    // a passage of its own.
    assert_eq!(
        passages("# A\n\n## B\n\none\n\n## C\n\n### D\n\n## E\n\ntwo\n\n# F\nthree\n"),
        [
            (1, "A / B: one".to_owned()),
            (9, "A / C / D".to_owned()),
            (11, "A / E: two".to_owned()),
            (15, "F: three".to_owned())
        ]
    );
    let long = "word ".repeat(PASSAGE_CHARS / 5 + 10);
    let cut = passages(&format!("{long}\n{long}\n"));
    assert_eq!(cut.len(), 2, "a passage past PASSAGE_CHARS is split");
}

#[test]
fn finds_the_passage_with_its_path() {
    let dir = store();
    let arm = MemoryArm::open(&dir, 0.5, 3).expect("indexed");
    // Three passages: "# The Danube" opens the first; the .json file is not indexed.
    assert_eq!(arm.passages(), 3);
    let got = arm
        .search(
            &query("the Danube is 2850 km long"),
            SpanClass::EntityShaped,
            soon(),
        )
        .expect("searched");
    assert!(!got.is_empty());
    assert_eq!(
        got[0].source, "rivers/danube.md:1",
        "the passage opens at its heading"
    );
    assert!(got[0]
        .evidence
        .starts_with("The Danube: The Danube flows through ten countries"));
    assert_eq!(got[0].claim, "the Danube is 2850 km long");
    assert!(got[0].confidence > 0.5 && got[0].confidence < 1.0);
    assert!(got.windows(2).all(|w| w[0].confidence >= w[1].confidence));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_floor_keeps_weak_matches_out() {
    let dir = store();
    let low = MemoryArm::open(&dir, 0.0, 3).expect("indexed");
    let high = MemoryArm::open(&dir, 1000.0, 3).expect("indexed");
    let q = query("boats");
    assert!(!low
        .search(&q, SpanClass::Other, soon())
        .expect("searched")
        .is_empty());
    assert!(high
        .search(&q, SpanClass::Other, soon())
        .expect("searched")
        .is_empty());
    // The store's "through" and "after" (of "flows through", "after a trip") are function
    // words, as are "has" and "which".
    for unrelated in [
        "quantum chromodynamics",
        "it is in the and of the",
        "what has it done through all of this, after which",
    ] {
        assert!(
            low.search(&query(unrelated), SpanClass::Other, soon())
                .expect("searched")
                .is_empty(),
            "{unrelated}: stop words are not evidence"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn query_syntax_in_the_span_is_plain_text() {
    let dir = store();
    let arm = MemoryArm::open(&dir, 0.0, 3).expect("indexed");
    for span in ["body:Danube AND (", "\"unclosed", "-haltd +[x TO", ""] {
        arm.search(&query(span), SpanClass::Other, soon())
            .expect("no query error");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_missing_store_is_an_error() {
    let e = MemoryArm::open(Path::new("/nonexistent/haltd-store"), 1.0, 3).expect_err("no dir");
    assert!(
        e.to_string()
            .starts_with("reading /nonexistent/haltd-store"),
        "{e}"
    );
}

/// A store with a timetable of two departures and a note on boats.
fn timetable() -> PathBuf {
    let dir = fresh_dir("timetable");
    std::fs::write(
        dir.join("ferry.txt"),
        "The ferry leaves the harbour at 07:45 every weekday.\n\n\
         The ferry leaves the harbour at 09:10 on Sundays.\n\n\
         Boats are moored in the harbour over the winter.\n",
    )
    .expect("write");
    dir
}

#[test]
fn numbers_alone_are_not_evidence() {
    let dir = timetable();
    let arm = MemoryArm::open(&dir, 0.0, 3).expect("indexed");
    // The question shares only "45" (of 07:45) and "20" with the timetable; a span of
    // numbers alone finds nothing, even the passage that holds them.
    for span in [
        "45 days after 2024-01-20",
        "What is 45 times 20?",
        "07:45 = 07 45",
    ] {
        let got = arm
            .search(&query(span), SpanClass::Computable, soon())
            .expect("searched");
        assert!(got.is_empty(), "{span}: {got:?}");
    }
    // Words find the passages; a matching number ranks its passage first.
    let got = arm
        .search(
            &query("the ferry leaves the harbour at 09:10"),
            SpanClass::EntityShaped,
            soon(),
        )
        .expect("searched");
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(got[0].evidence.contains("09:10"), "{got:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_floor_is_reached_by_words_not_numbers() {
    let dir = timetable();
    let scores = |arm: &MemoryArm, text: &str| -> Vec<f32> {
        let hits = arm.hits(text).expect("searched");
        hits.iter().map(|h| h.0).collect()
    };
    let zero = MemoryArm::open(&dir, 0.0, 1).expect("indexed");
    let words = scores(&zero, "sundays")[0];
    let both = scores(&zero, "sundays 09 10")[0];
    assert!(
        both > words,
        "the numbers add to the score: {both} > {words}"
    );
    // A floor between the two: the passage's words alone do not reach it.
    let arm = MemoryArm::open(&dir, (words + both) / 2.0, 1).expect("indexed");
    assert!(scores(&arm, "sundays 09 10").is_empty());
    let arm = MemoryArm::open(&dir, words, 1).expect("indexed");
    assert_eq!(scores(&arm, "sundays 09 10"), [both], "ranked by both");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_passage_is_found_by_its_section_heading() {
    let dir = fresh_dir("sections");
    std::fs::write(
        dir.join("bridge.md"),
        "# Harlow Bridge\n\nThe Harlow Bridge crosses the Teme at Ludford. The Harlow Bridge \
         has three arches.\n\nIts chief engineer was Mary Pell.\n\n# Other\n\nThe engineer \
         of the mill was Tom Hale.\n",
    )
    .expect("write");
    let arm = MemoryArm::open(&dir, 0.0, 3).expect("indexed");
    // The question names the bridge and the engineer: the paragraph about the bridge's
    // engineer, not the one naming the bridge most, nor the other engineer.
    let got = arm
        .search(
            &query("Who was the chief engineer of the Harlow Bridge"),
            SpanClass::EntityShaped,
            soon(),
        )
        .expect("searched");
    assert_eq!(
        got[0].evidence, "Harlow Bridge: Its chief engineer was Mary Pell.",
        "{got:?}"
    );
    assert_eq!(got[0].source, "bridge.md:5");
    let _ = std::fs::remove_dir_all(dir);
}
