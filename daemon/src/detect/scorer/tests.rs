//! Tests of the scorers: the probability scorer, the config form, the Unix scorer against a
//! scripted server (round trip, deadline, bad replies, connect failures).

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::{UnixListener, UnixStream},
    sync::{
        atomic::{AtomicU32, Ordering},
        mpsc, Arc,
    },
    thread,
};

use proptest::prelude::*;
use serde_json::{json, Value};

use std::{
    io,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::{unix::parse_reply, *};
use crate::detect::TokenObs;

fn tok(index: u64, text: &str, logprob: Option<f32>) -> TokenObs<'_> {
    TokenObs {
        index,
        text,
        logprob,
        now_ns: 0,
    }
}

/// A fresh socket path in the temp dir, removed on drop.
struct SockPath(PathBuf);

impl SockPath {
    fn new(tag: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!(
            "haltd-scorer-{}-{n}-{tag}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        Self(p)
    }
}

impl Drop for SockPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Per request: the parsed request line and the connection; `false` closes it.
type Handler = dyn Fn(&Value, &mut UnixStream) -> bool + Send + Sync;

/// A std scorer server on `path`: a thread per connection, `handler` per request line.
fn serve(path: &Path, handler: Arc<Handler>) {
    let listener = UnixListener::bind(path).expect("bind test socket");
    thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let handler = Arc::clone(&handler);
            thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().expect("clone stream"));
                let mut line = String::new();
                loop {
                    line.clear();
                    match reader.read_line(&mut line) {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    let req: Value = serde_json::from_str(&line).expect("request is JSON");
                    if !handler(&req, &mut conn) {
                        return;
                    }
                }
            });
        }
    });
}

fn reply(conn: &mut UnixStream, line: &str) -> bool {
    conn.write_all(line.as_bytes()).is_ok()
}

fn unix(path: &Path, deadline_us: u64) -> UnixScorer {
    UnixScorer::new(path.to_owned(), deadline_us).expect("valid scorer config")
}

// --- ProbabilityScorer ------------------------------------------------------------------

#[test]
fn probability_is_exp_logprob() {
    let mut s = ProbabilityScorer;
    s.begin_turn("t").expect("no-op");
    let p = s.score(&tok(0, "a", Some(0.5f32.ln()))).expect("scored");
    assert!((p - 0.5).abs() < 1e-6, "{p}");
    assert_eq!(s.score(&tok(1, "a", Some(0.0))).expect("scored"), 1.0);
    assert_eq!(
        s.score(&tok(2, "a", Some(f32::NEG_INFINITY)))
            .expect("scored"),
        0.0
    );
    assert!(matches!(
        s.score(&tok(3, "a", None)),
        Err(ScorerError::NoLogprob { index: 3 })
    ));
    for bad in [f32::NAN, 0.1, f32::INFINITY] {
        let err = s.score(&tok(4, "a", Some(bad))).expect_err("not a logprob");
        assert!(
            matches!(err, ScorerError::BadLogprob { index: 4, .. }),
            "{err}"
        );
    }
}

// --- Configuration ----------------------------------------------------------------------

#[test]
fn config_representation() {
    let parse = |v: Value| serde_json::from_value::<ScorerConfig>(v);
    assert_eq!(
        parse(json!("probability")).expect("ok"),
        ScorerConfig::Probability
    );
    assert_eq!(ScorerConfig::default(), ScorerConfig::Probability);
    let unix = ScorerConfig::Unix {
        path: "/run/haltd/scorer.sock".into(),
        deadline_us: DEFAULT_DEADLINE_US,
    };
    assert_eq!(
        parse(json!({"unix": "/run/haltd/scorer.sock"})).expect("ok"),
        unix
    );
    let fast = parse(json!({"deadline_us": 500, "unix": "/s.sock"})).expect("ok");
    assert_eq!(
        fast,
        ScorerConfig::Unix {
            path: "/s.sock".into(),
            deadline_us: 500
        }
    );
    // Serializes to the same shape it reads.
    for c in [ScorerConfig::Probability, unix, fast] {
        let v = serde_json::to_value(&c).expect("serializes");
        assert_eq!(parse(v).expect("round trip"), c);
    }
    assert_eq!(
        serde_json::to_value(ScorerConfig::Unix {
            path: "/a".into(),
            deadline_us: 7
        })
        .expect("serializes"),
        json!({"unix": "/a", "deadline_us": 7})
    );

    let err = |v: Value| parse(v).expect_err("refused").to_string();
    assert!(err(json!("unix")).contains(r#""probability" or { unix"#));
    assert!(err(json!("Probability")).contains("invalid value"));
    assert!(err(json!({"unix": "/s", "deadline": 5})).contains("unknown field `deadline`"));
    assert!(err(json!({"deadline_us": 5})).contains("missing field `unix`"));
    assert!(err(json!({"unix": "/s", "deadline_us": -1})).contains("invalid value"));
    assert!(err(json!({"probability": {}})).contains("unknown field `probability`"));
    assert!(err(json!(3)).contains("expected \"probability\""));
    let dup = serde_json::from_str::<ScorerConfig>(r#"{"unix":"/a","unix":"/b"}"#);
    assert!(dup
        .expect_err("refused")
        .to_string()
        .contains("duplicate field `unix`"));
}

#[test]
fn config_validation() {
    let u = |path: &str, deadline_us| ScorerConfig::Unix {
        path: path.into(),
        deadline_us,
    };
    assert!(ScorerConfig::Probability.validate().is_ok());
    assert!(u("/run/haltd/scorer.sock", 1).validate().is_ok());
    assert!(u("/run/haltd/scorer.sock", MAX_DEADLINE_US)
        .validate()
        .is_ok());
    let long_ok = format!("/{}", "a".repeat(MAX_SOCKET_PATH_BYTES - 1));
    assert!(u(&long_ok, 2000).validate().is_ok());
    let long = format!("/{}", "a".repeat(MAX_SOCKET_PATH_BYTES));

    let cases = [
        (
            u("/s", 0),
            "scorer.deadline_us must be between 1 and 1000000, got 0",
        ),
        (u("/s", MAX_DEADLINE_US + 1), "got 1000001"),
        (u("scorer.sock", 10), "not absolute"),
        (u("/a\0b", 10), "NUL byte"),
        (u(&long, 10), "is 108 bytes long, the limit is 107"),
    ];
    for (cfg, msg) in cases {
        let e = cfg.clone().validate().expect_err("invalid").to_string();
        assert!(e.contains(msg), "{cfg:?}: {e}");
        assert!(cfg.build().is_err());
    }
    let built = u("/run/haltd/scorer.sock", 2000).build().expect("builds");
    assert!(format!("{built:?}").contains("connected: false"));
}

// --- UnixScorer --------------------------------------------------------------------------

#[test]
fn unix_round_trip() {
    let sock = SockPath::new("rt");
    let (tx, rx) = mpsc::channel();
    serve(
        &sock.0,
        Arc::new(move |req, conn| {
            let _ = tx.send(req.clone());
            let text = req["text"].as_str().unwrap_or_default();
            let score = if text.contains("bad") { 0.0 } else { 0.75 };
            reply(conn, &format!("{{\"score\": {score}}}\r\n"))
        }),
    );
    let mut s = unix(&sock.0, MAX_DEADLINE_US);
    assert!(!s.is_connected());
    s.begin_turn("turn-1").expect("connects");
    assert!(s.is_connected());
    assert_eq!(s.score(&tok(0, "The", Some(-0.5))).expect("scored"), 0.75);
    let odd = " bad \"quoted\"\n\u{1F600}\\";
    assert_eq!(s.score(&tok(1, odd, None)).expect("scored"), 0.0);
    let ninf = tok(2, "x", Some(f32::NEG_INFINITY));
    assert_eq!(s.score(&ninf).expect("scored"), 0.75);
    let req = |turn: &str, index: u64, text: &str, logprob: Value| json!({"turn_id": turn, "index": index, "text": text, "logprob": logprob});
    assert_eq!(rx.recv().ok(), Some(req("turn-1", 0, "The", json!(-0.5))));
    assert_eq!(rx.recv().ok(), Some(req("turn-1", 1, odd, Value::Null)));
    assert_eq!(rx.recv().ok(), Some(req("turn-1", 2, "x", json!(-9999.0))));

    s.end_turn();
    assert!(!s.is_connected());
    s.begin_turn("turn-2").expect("connects");
    assert_eq!(s.score(&tok(0, "a", Some(-1.0))).expect("scored"), 0.75);
    assert_eq!(rx.recv().ok(), Some(req("turn-2", 0, "a", json!(-1.0))));

    // Without begin_turn the first token connects (turn id as last set).
    s.end_turn();
    assert_eq!(s.score(&tok(1, "b", None)).expect("scored"), 0.75);
    assert_eq!(rx.recv().ok(), Some(req("turn-2", 1, "b", Value::Null)));
}

#[test]
fn unix_deadline_bounds_the_wait_and_drops_the_late_reply() {
    // Wide enough that a loaded CI machine still answers the fast tokens (which reconnect and
    // wait for a new server thread) in time; the slow reply comes six deadlines late.
    const DEADLINE_US: u64 = 100_000;
    const SLACK: Duration = Duration::from_millis(100);
    let sock = SockPath::new("deadline");
    serve(
        &sock.0,
        Arc::new(|req, conn| {
            let index = req["index"].as_u64().unwrap_or_default();
            if index == 0 {
                thread::sleep(Duration::from_millis(600));
            }
            reply(conn, &format!("{{\"score\":{index}}}\n"))
        }),
    );
    let mut s = unix(&sock.0, DEADLINE_US);
    s.begin_turn("t").expect("connects");
    let start = Instant::now();
    let err = s
        .score(&tok(0, "slow", None))
        .expect_err("misses the deadline");
    let took = start.elapsed();
    assert!(
        matches!(
            err,
            ScorerError::Deadline {
                index: 0,
                deadline_us: DEADLINE_US,
                ..
            }
        ),
        "{err}"
    );
    let deadline = Duration::from_micros(DEADLINE_US);
    assert!(took >= deadline && took < deadline + SLACK, "took {took:?}");
    assert!(
        err.to_string().contains(&*sock.0.to_string_lossy()),
        "{err}"
    );
    assert!(
        !s.is_connected(),
        "a connection that missed a deadline is dropped"
    );
    // The next token gets its own answer on a new connection, not the late one.
    assert_eq!(s.score(&tok(1, "fast", None)).expect("scored"), 1.0);
    assert_eq!(s.score(&tok(2, "fast", None)).expect("scored"), 2.0);
}

#[test]
fn unix_start_hands_back_the_wait_instead_of_blocking() {
    let sock = SockPath::new("start");
    let (go, gate) = mpsc::channel::<()>();
    let gate = std::sync::Mutex::new(gate);
    serve(
        &sock.0,
        Arc::new(move |req, conn| {
            // Answers only when the test says so.
            let _ = gate.lock().map(|g| g.recv());
            let index = req["index"].as_u64().unwrap_or_default();
            reply(conn, &format!("{{\"score\":{index}}}\n"))
        }),
    );
    let mut s = unix(&sock.0, MAX_DEADLINE_US);
    s.begin_turn("t").expect("connects");
    let Scored::Wait(w) = s.start(&tok(7, "x", None)) else {
        panic!("no reply yet: the scorer must hand back the wait");
    };
    assert_eq!(w.interest, Interest::Readable);
    assert!(w.deadline > Instant::now());
    assert!(!s.is_connected(), "the waiter holds the connection");
    // Woken before the reply is there: the scorer waits again, on the same connection.
    let Scored::Wait(w) = s.resume(Woke::Ready(w.fd)) else {
        panic!("still no reply");
    };
    go.send(()).expect("server waits");
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&w.fd),
        events: w.interest.poll_mask(),
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&raw mut pfd, 1, 5_000) };
    assert_eq!(ready, 1, "the reply comes");
    match s.resume(Woke::Ready(w.fd)) {
        Scored::Done(Ok(score)) => assert_eq!(score, 7.0),
        other => panic!("got {other:?}"),
    }
    assert!(
        s.is_connected(),
        "the connection is back for the next token"
    );
    // A wait that timed out is the deadline error, and the connection is dropped.
    let Scored::Wait(w) = s.start(&tok(8, "y", None)) else {
        panic!("no reply yet");
    };
    match s.resume(Woke::TimedOut(w.fd)) {
        Scored::Done(Err(e @ ScorerError::Deadline { index: 8, .. })) => {
            assert_eq!(e.kind(), crate::detect::FailureKind::ScorerTimeout);
        }
        other => panic!("got {other:?}"),
    }
    assert!(!s.is_connected());
    // Resumed with nothing under way: fails closed, never panics.
    let (a, _b) = UnixStream::pair().expect("pair");
    assert!(matches!(
        s.resume(Woke::Ready(a.into())),
        Scored::Done(Err(ScorerError::NotWaiting))
    ));
    go.send(()).expect("server waits");
}

#[test]
fn unix_bad_replies() {
    let sock = SockPath::new("bad");
    // The token text is the raw reply; "CLOSE:" sends the rest, then closes.
    serve(
        &sock.0,
        Arc::new(|req, conn| {
            let text = req["text"].as_str().unwrap_or_default();
            match text.strip_prefix("CLOSE:") {
                Some(rest) => {
                    reply(conn, rest);
                    false
                }
                None => reply(conn, text),
            }
        }),
    );
    let mut s = unix(&sock.0, MAX_DEADLINE_US);
    s.begin_turn("t").expect("connects");
    let too_long = "a".repeat(MAX_REPLY_BYTES + 10);
    let cases: [(&str, &str); 14] = [
        ("this is not json\n", "malformed"),
        ("{\"score\":\"0.5\"}\n", "malformed"),
        ("{\"score\":0.5,\"extra\":1}\n", "malformed"),
        ("{}\n", "malformed"),
        ("{\"score\":null}\n", "malformed"),
        ("{\"score\":1e999}\n", "malformed"),
        ("\n", "malformed"),
        ("{\"score\":1}\n{\"score\":1}\n", "more than one line"),
        (&too_long, "no newline within 4096 bytes"),
        ("{\"score\": NaN}\n", "score NaN"),
        ("{\"score\":Infinity}\n", "score inf"),
        ("{ \"score\" : -Infinity }\n", "score -inf"),
        ("CLOSE:{\"score\":", "closed by the scorer"),
        ("CLOSE:", "closed by the scorer"),
    ];
    for (i, (raw, want)) in (0u64..).zip(cases) {
        let err = s.score(&tok(i, raw, None)).expect_err("bad reply");
        let msg = err.to_string();
        assert!(msg.contains(want), "{raw:?}: {msg}");
        assert!(msg.contains(&*sock.0.to_string_lossy()), "{msg}");
        assert!(!s.is_connected());
        // A good reply after a bad one: the scorer recovers on a new connection.
        assert_eq!(
            s.score(&tok(i, "{\"score\":0.5}\n", None)).expect("ok"),
            0.5
        );
    }
    let err = s.score(&tok(0, "CLOSE:", None)).expect_err("closed");
    assert!(matches!(err, ScorerError::Closed { index: 0, .. }), "{err}");
    let err = s
        .score(&tok(0, "{\"score\": NaN}\n", None))
        .expect_err("nan");
    assert!(matches!(err, ScorerError::NonFiniteScore { value, .. } if value.is_nan()));
    let err = s.score(&tok(0, "garbage\n", None)).expect_err("garbage");
    assert!(matches!(err, ScorerError::Malformed { .. }), "{err}");
}

#[test]
fn unix_server_closes_after_one_token() {
    let sock = SockPath::new("close");
    serve(
        &sock.0,
        Arc::new(|req, conn| req["index"] == json!(0) && reply(conn, "{\"score\":1}\n")),
    );
    let mut s = unix(&sock.0, MAX_DEADLINE_US);
    s.begin_turn("t").expect("connects");
    assert_eq!(s.score(&tok(0, "a", None)).expect("scored"), 1.0);
    let err = s.score(&tok(1, "b", None)).expect_err("closed");
    assert!(matches!(err, ScorerError::Closed { index: 1, .. }), "{err}");
}

#[test]
fn unix_connect_failures() {
    // No socket file at all.
    let missing = SockPath::new("missing");
    let mut s = unix(&missing.0, 2000);
    let err = s.begin_turn("t").expect_err("nothing there");
    assert!(
        matches!(&err, ScorerError::Connect { source, .. }
        if source.kind() == io::ErrorKind::NotFound),
        "{err}"
    );
    assert!(err.to_string().contains(&*missing.0.to_string_lossy()));
    assert!(!s.is_connected());

    // A socket file nobody listens on any more: connection refused.
    let stale = SockPath::new("stale");
    drop(UnixListener::bind(&stale.0).expect("bind"));
    let mut s = unix(&stale.0, 2000);
    let err = s.begin_turn("t").expect_err("refused");
    assert!(
        matches!(&err, ScorerError::Connect { source, .. }
        if source.kind() == io::ErrorKind::ConnectionRefused),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("cannot connect") && msg.contains(&*stale.0.to_string_lossy()));
    // score() without a connection tries to connect and says the same.
    let err = s.score(&tok(0, "a", None)).expect_err("refused");
    assert!(matches!(err, ScorerError::Connect { .. }), "{err}");
}

#[test]
fn errors_are_send_sync() {
    fn check<T: Send + Sync + 'static>() {}
    check::<ScorerError>();
    check::<ScorerConfigError>();
    fn scorer<T: Scorer>() {}
    scorer::<UnixScorer>();
    scorer::<ProbabilityScorer>();
}

proptest! {
    /// Nothing a scorer sends makes parsing panic; what parses is a finite score.
    #[test]
    fn prop_parse_reply_never_panics(line in proptest::collection::vec(any::<u8>(), 0..64)) {
        if let Ok(score) = parse_reply(&line) {
            prop_assert!(score.is_finite());
        }
    }

    /// Any finite score survives the wire format.
    #[test]
    fn prop_finite_scores_parse(x in proptest::num::f64::NORMAL | proptest::num::f64::ZERO
                                    | proptest::num::f64::SUBNORMAL) {
        let line = serde_json::to_vec(&json!({"score": x})).expect("serializes");
        let got = parse_reply(&line).map_err(|e| format!("{e:?}"));
        prop_assert_eq!(got, Ok(x));
    }
}

/// Per-token cost of a UnixScorer round trip against an immediate std server on this
/// machine, and of a per-turn connect:
/// `cargo test -p haltd --release --lib scorer::tests::bench -- --ignored --nocapture`.
#[test]
#[ignore = "measurement; run in release with --ignored --nocapture"]
fn bench_unix_round_trip() {
    let sock = SockPath::new("bench");
    // HALTD_SCORER_SOCKET: measure against that scorer (e.g. the Python one of the module
    // docs) instead of the in-process std server.
    let (path, tokens, turns) = match std::env::var_os("HALTD_SCORER_SOCKET") {
        Some(p) => (PathBuf::from(p), 20_000, 500),
        None => {
            serve(
                &sock.0,
                Arc::new(|_, conn| reply(conn, "{\"score\":0.9}\n")),
            );
            (sock.0.clone(), 200_000, 2_000)
        }
    };
    println!("scorer at {}", path.display());
    let mut s = unix(&path, MAX_DEADLINE_US);
    s.begin_turn("chatcmpl-bench-0000000000000000")
        .expect("connects");
    let text = " token";
    for i in 0..1_000 {
        s.score(&tok(i, text, Some(-0.25))).expect("scored");
    }
    let mut ns = Vec::with_capacity(tokens);
    for i in 0..tokens as u64 {
        let t = Instant::now();
        let score = s.score(&tok(i, text, Some(-0.25))).expect("scored");
        ns.push(t.elapsed().as_nanos());
        assert!((0.0..=1.0).contains(&score), "{score}");
    }
    report("round trip per token", &mut ns);

    let mut ns = Vec::with_capacity(turns);
    let mut first = Vec::with_capacity(turns);
    for i in 0..turns {
        let t = Instant::now();
        s.begin_turn(&format!("turn-{i}")).expect("connects");
        ns.push(t.elapsed().as_nanos());
        let t = Instant::now();
        s.score(&tok(0, text, Some(-0.25))).expect("scored");
        first.push(t.elapsed().as_nanos());
    }
    report("begin_turn (connect)", &mut ns);
    report("first token of a turn (server accepts)", &mut first);
}

fn report(what: &str, ns: &mut [u128]) {
    ns.sort_unstable();
    let q = |p: f64| {
        let i = ((ns.len() as f64 - 1.0) * p).round() as usize;
        ns[i] as f64 / 1000.0
    };
    let mean = ns.iter().sum::<u128>() as f64 / ns.len() as f64 / 1000.0;
    println!(
        "{what}: n={} mean={mean:.2}µs p50={:.2}µs p90={:.2}µs p99={:.2}µs p99.9={:.2}µs max={:.2}µs",
        ns.len(),
        q(0.5),
        q(0.9),
        q(0.99),
        q(0.999),
        q(1.0)
    );
}
