//! A grounding round's rewind, as an ordinary user: no ring, no BPF, no socket, no grounder.
//!
//! A built-in turn in intervene mode (its hold-back window of W tokens, a history of W + 1)
//! goes through the pipeline's own steps with the driver of `turn/pipeline/tests.rs`. Once the
//! source has given a chosen number of tokens, a round answers with evidence between two
//! steps, and the turn is rewound as `Step::rewind` does it: `rewind_point`, the source's
//! `resume`, `apply_rewind`. Then it goes on. Proptest schedules the round's moment, the
//! window, sends whole or short, trips before or after it, and closes. What the client got
//! must be what the model says after the same rewind, in order, once each: the kept prefix,
//! then the resumed text (the evidence read first), never a token the rewind dropped; and,
//! as for every turn, the slot's delivered tokens are the wire's, no token after a trip, then
//! exactly one terminal, nothing sent after close.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::{apply_rewind, rewind_point};
use crate::{
    dataplane::turn::{
        pipeline::tests::{body, check, client_view, drive_with, Driver, Schedule},
        TurnSource,
    },
    grounding::Snippet,
    source::{
        resume::{BuiltinSource, History},
        Polled, TokenSource,
    },
    wire::{BuiltinTurn, ClientRequest, Endpoint},
};

/// Where the round rewound the turn: the tokens its source had given, and how many of them
/// the rewind took back.
#[derive(Debug, Clone, Copy)]
struct Rewound {
    polled: u64,
    dropped: usize,
}

fn evidence(text: &str) -> [Snippet; 1] {
    [Snippet {
        claim: "the tides".into(),
        evidence: text.into(),
        confidence: 0.9,
        source: "test".into(),
    }]
}

/// The built-in source of an intervene-mode turn with window `w`, as `start_builtin_turn`
/// opens it.
fn source(req: &BuiltinTurn, w: usize) -> BuiltinSource {
    let mut b = BuiltinSource::for_turn(req, false);
    b.history = History::with_capacity(w + 1);
    b
}

/// Runs the turn of `s` (whose `hold_back` is the window), grounded with `text` once its
/// source gave `at` tokens (if the text has not ended by then); returns the driver, what the
/// model says after the same rewind, and the rewind.
fn grounded_run(s: &Schedule, at: u64, text: &str) -> (Driver, Vec<String>, Option<Rewound>) {
    let w = s.hold_back.expect("intervene mode has a window");
    let req = ClientRequest::parse(Endpoint::Chat, body(s.tokens).as_bytes())
        .and_then(|r| r.builtin_turn("builtin"))
        .expect("a valid request");
    let snippets = evidence(text);
    let source_of_turn = TurnSource::Builtin(source(&req, w));
    let mut d = Driver::open(s, source_of_turn, &req.ask, VecDeque::new());
    let mut rewound = None;
    drive_with(s, &mut d, |d| {
        let polled = d.texts_polled;
        let turn = d.conn.turn.as_mut().expect("a turn");
        if rewound.is_some() || turn.hold.ending || polled < at {
            return;
        }
        let Some((keep, dropped)) = rewind_point(turn) else {
            return;
        };
        let TurnSource::Builtin(b) = &mut turn.source else {
            unreachable!("a built-in turn");
        };
        if !b.resume(dropped, &snippets) {
            return;
        }
        apply_rewind(turn, keep).expect("the kept text passes the scanner");
        rewound = Some(Rewound { polled, dropped });
    });
    let mut reference = source(&req, w);
    let mut expected: Vec<String> = Vec::new();
    let mut polled = 0u64;
    let mut resumed = false;
    loop {
        if let Some(r) = rewound.filter(|r| !resumed && r.polled == polled) {
            expected.truncate(expected.len() - r.dropped);
            assert!(
                reference.resume(r.dropped, &snippets),
                "resumes as the turn did"
            );
            resumed = true;
        }
        let Polled::Text(t) = reference.poll() else {
            break;
        };
        expected.push(t.text.into_owned());
        polled += 1;
    }
    (d, expected, rewound)
}

/// How many tokens the model says for `s` without a round.
fn plain_len(s: &Schedule) -> u64 {
    let req = ClientRequest::parse(Endpoint::Chat, body(s.tokens).as_bytes())
        .and_then(|r| r.builtin_turn("builtin"))
        .expect("a valid request");
    let mut plain = BuiltinSource::for_turn(&req, false);
    let mut n = 0;
    while let Polled::Text(_) = plain.poll() {
        n += 1;
    }
    n
}

fn grounded_schedule() -> impl Strategy<Value = (Schedule, u64)> {
    (
        8u32..40,
        prop::collection::vec(1u8..=8, 1..6),
        (prop::option::weighted(0.3, 0u64..40), any::<bool>()),
        prop::option::weighted(0.1, 0u32..120),
        (0u32..6, 1usize..6),
        0u64..40,
    )
        .prop_map(
            |(tokens, takes, (trip_at, trip_mid_step), close_at, (budget, w), at)| {
                let s = Schedule {
                    tokens,
                    takes,
                    trip_at,
                    trip_mid_step,
                    close_at,
                    hold_back: Some(w),
                    budget,
                };
                (s, at)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A grounded turn under random send completions, trips and closes: the client's text is
    /// the model's after the same rewind.
    #[test]
    fn a_rewound_turn_sends_the_kept_prefix_then_the_resumed_text(
        (s, at) in grounded_schedule(),
        text in prop::sample::select(vec!["The moon pulls the sea.", "Tides: twice a day", "x"]),
    ) {
        let (d, expected, rewound) = grounded_run(&s, at, text);
        check(&s, &d, &expected);
        if s.trip_at.is_none() && s.close_at.is_none() && at < plain_len(&s) {
            prop_assert!(rewound.is_some(), "the round came mid-text: the turn is rewound");
        }
    }
}

#[test]
fn the_tokens_a_round_rewinds_never_reach_the_client() {
    let s = Schedule {
        tokens: 30,
        takes: vec![8],
        trip_at: None,
        trip_mid_step: false,
        close_at: None,
        hold_back: Some(4),
        budget: 5,
    };
    let (d, expected, rewound) = grounded_run(&s, 12, "The moon pulls the sea.");
    let r = rewound.expect("rewound mid-text");
    assert!(r.dropped > 0, "the window held tokens to drop: {r:?}");
    check(&s, &d, &expected);
    // The model's own text without the round: the client got something else after the kept
    // prefix, and none of the dropped tokens.
    let (texts, _) = client_view(&d.wire);
    let req = ClientRequest::parse(Endpoint::Chat, body(s.tokens).as_bytes())
        .and_then(|r| r.builtin_turn("builtin"))
        .expect("a valid request");
    let mut plain = source(&req, 4);
    let mut unground = Vec::new();
    while let Polled::Text(t) = plain.poll() {
        unground.push(t.text.into_owned());
    }
    let kept = r.polled as usize - r.dropped;
    assert_eq!(texts[..kept], unground[..kept], "the kept prefix");
    assert_ne!(
        texts[kept..kept + r.dropped],
        unground[kept..kept + r.dropped],
        "the dropped tokens were replaced"
    );
    assert!(
        texts.concat().contains("The moon"),
        "the evidence is read: {texts:?}"
    );
}
