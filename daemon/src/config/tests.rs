use clap::Parser;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn parse(args: &[&str]) -> Result<Config, ConfigError> {
    let cli =
        Cli::try_parse_from(std::iter::once("haltd").chain(args.iter().copied())).expect("parses");
    cli.serve.validate()
}

#[test]
fn defaults_are_valid() {
    let c = parse(&[]).expect("valid");
    assert_eq!(c.args.budget, 5);
    assert_eq!(c.degraded_for, Some(std::time::Duration::from_secs(3600)));
    assert!(c.escalation.is_none());
    let c = parse(&[
        "--escalation-url",
        "https://hooks.example:8443/haltd/incidents",
    ])
    .expect("valid");
    let e = c.escalation.expect("escalation");
    assert_eq!(
        (e.url.host.as_str(), e.url.port, e.path.as_str()),
        ("hooks.example", 8443, "/haltd/incidents")
    );
    assert_eq!((e.attempts, e.deadline.as_millis()), (5, 60_000));
    assert!(!c.args.no_kernel_gate);
    assert_eq!(c.faults, Faults::default());
}

#[test]
fn the_upstream_watch_settings_are_checked_and_an_unresolvable_name_is_no_error() {
    let c = parse(&[
        "--source",
        "openai",
        "--upstream",
        "http://no-such-host.invalid:8000",
    ])
    .expect("a name that does not resolve yet is retried, not refused");
    let probe = c.upstream_watch.probe.expect("probing by default");
    assert_eq!(probe.path, "/v1/models");
    assert_eq!((probe.failures, probe.successes), (2, 1));
    assert_eq!(probe.interval, Duration::from_secs(1));
    assert_eq!(c.upstream_watch.resolve_interval, Duration::from_secs(30));
    let off = parse(&["--no-upstream-probe"]).expect("valid");
    assert!(off.upstream_watch.probe.is_none());
    for (args, flag) in [
        (
            &["--upstream-probe-failures", "0"][..],
            "upstream-probe-failures",
        ),
        (
            &["--upstream-probe-interval-ms", "0"][..],
            "upstream-probe-interval-ms",
        ),
        (
            &["--upstream-probe-path", "v1/models"][..],
            "upstream-probe-path",
        ),
        (
            &["--upstream-probe-path", "/a b"][..],
            "upstream-probe-path",
        ),
        (
            &["--upstream-resolve-interval-ms", "0"][..],
            "upstream-resolve-interval-ms",
        ),
    ] {
        let e = parse(args).expect_err("refused");
        assert_eq!(e.flag, flag, "{args:?}: {e}");
    }
}

#[test]
fn bad_values_name_their_flag() {
    for (args, flag) in [
        (&["--budget", "5000"][..], "budget"),
        (&["--hard-limit", "1.5"][..], "hard-limit"),
        (&["--hard-limit", "NaN"][..], "hard-limit"),
        (
            &["--heartbeat-deadline-ms", "3"][..],
            "heartbeat-deadline-ms",
        ),
        (&["--max-streams", "0"][..], "max-streams"),
        (&["--fault", "sneeze"][..], "fault"),
        (&["--workers", "0"][..], "workers"),
        (&["--worker-stall-ms", "49"][..], "worker-stall-ms"),
        (&["--source", "openai"][..], "upstream"),
        (
            &[
                "--source",
                "openai",
                "--upstream",
                "https://127.0.0.1:1",
                "--upstream-ca-file",
                "/nonexistent/ca.pem",
            ][..],
            "upstream-ca-file",
        ),
        (
            &[
                "--source",
                "openai",
                "--upstream",
                "http://127.0.0.1:1",
                "--upstream-ca-file",
                "/etc/hostname",
            ][..],
            "upstream-ca-file",
        ),
        (&["--upstream", "http://127.0.0.1:1"][..], "upstream"),
        (
            &["--upstream-stall-timeout-ms", "0"][..],
            "upstream-stall-timeout-ms",
        ),
        (&["--turn-sample-rate", "0"][..], "turn-sample-rate"),
        (&["--turn-sample-rate", "-0.05"][..], "turn-sample-rate"),
        (&["--turn-sample-rate", "NaN"][..], "turn-sample-rate"),
        (&["--turn-sample-rate", "1.5"][..], "turn-sample-rate"),
        (&["--turn-sample-rate", "0.005"][..], "turn-sample-rate"),
        (&["--group", "root"][..], "group"),
    ] {
        assert_eq!(parse(args).expect_err("invalid").flag, flag, "{args:?}");
    }
}

#[test]
fn bad_degraded_mode_and_escalation_values_name_their_flag() {
    let long = "x".repeat(4097);
    for (args, flag) in [
        (&["--degraded-ask-first", &long][..], "degraded-ask-first"),
        (
            &["--degraded-instruction", &long][..],
            "degraded-instruction",
        ),
        (
            &["--escalation-url", "http://127.0.0.1:9/hooks"][..],
            "escalation-url",
        ),
        (
            &["--escalation-url", "ftp://127.0.0.1/x"][..],
            "escalation-url",
        ),
        (
            &["--escalation-token-file", "/etc/hostname"][..],
            "escalation-token-file",
        ),
        (
            &["--escalation-ca-file", "/etc/hostname"][..],
            "escalation-ca-file",
        ),
        (
            &[
                "--escalation-url",
                "https://127.0.0.1:9/h",
                "--escalation-attempts",
                "0",
            ][..],
            "escalation-attempts",
        ),
        (
            &[
                "--escalation-url",
                "https://127.0.0.1:9/h",
                "--escalation-deadline-ms",
                "50",
            ][..],
            "escalation-deadline-ms",
        ),
        (
            &[
                "--escalation-url",
                "https://127.0.0.1:9/h",
                "--escalation-token-file",
                "/nonexistent",
            ][..],
            "escalation-token-file",
        ),
    ] {
        assert_eq!(parse(args).expect_err("invalid").flag, flag, "{args:?}");
    }
}

/// A config file in a fresh temporary directory, removed on drop.
struct TempConfig(std::path::PathBuf);

impl TempConfig {
    /// Each file gets its own directory, numbered: tests run in parallel in one
    /// process, and two of them once shared a tag, so one removed the other's file.
    fn new(tag: &str, text: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "haltd-config-test-{}-{n}-{tag}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("haltd.toml");
        std::fs::write(&path, text).expect("write config");
        TempConfig(path)
    }
    fn arg(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[test]
fn sampling_defaults_to_five_percent_without_text() {
    let c = parse(&[]).expect("valid");
    assert_eq!(c.sampling, crate::sampling::SamplingPolicy::default());
    assert_eq!(c.sampling.turn_sample_rate, 0.05);
    assert!(!c.sampling.record_token_text);
    let c = parse(&["--turn-sample-rate", "1", "--record-token-text"]).expect("valid");
    assert_eq!(c.sampling.turn_sample_rate, 1.0);
    assert!(c.sampling.record_token_text && c.sampling.above_spec());
    let c = parse(&["--turn-sample-rate=0.01", "--record-token-text=false"]).expect("valid");
    assert_eq!(c.sampling.turn_sample_rate, 0.01);
    assert!(!c.sampling.record_token_text);
    let e = parse(&["--turn-sample-rate", "0"]).expect_err("zero");
    assert!(
        e.to_string()
            .starts_with("invalid --turn-sample-rate: 0 is not a fraction in [0.01, 1]"),
        "{e}"
    );
}

#[test]
fn sampling_from_the_file_and_the_flags_over_it() {
    let f = TempConfig::new(
        "sampling",
        "[flight_recorder]\nturn_sample_rate = 0.02\nrecord_token_text = true\n\n\
         [detectors.surprise]\nmode = \"observe\"\n",
    );
    let c = parse(&["--config", f.arg()]).expect("valid");
    assert_eq!(c.sampling.turn_sample_rate, 0.02);
    assert!(c.sampling.record_token_text);
    let c = parse(&[
        "--config",
        f.arg(),
        "--turn-sample-rate",
        "1",
        "--record-token-text=false",
    ])
    .expect("valid");
    assert_eq!(c.sampling.turn_sample_rate, 1.0);
    assert!(!c.sampling.record_token_text);
    for (tag, text, want) in [
        (
            "zero",
            "[flight_recorder]\nturn_sample_rate = 0.0\n",
            "flight_recorder.turn_sample_rate",
        ),
        (
            "unknown",
            "[flight_recorder]\nsample_rate = 0.05\n",
            "unknown field `sample_rate`",
        ),
        (
            "type",
            "[flight_recorder]\nrecord_token_text = \"yes\"\n",
            "flight_recorder",
        ),
        ("scalar", "flight_recorder = 1\n", "must be a table"),
    ] {
        let f = TempConfig::new(tag, text);
        let e = parse(&["--config", f.arg()]).expect_err(tag);
        assert_eq!(e.flag, "config", "{tag}: {e}");
        assert!(e.reason.contains(want), "{tag}: {e}");
    }
    // The flag wins, but a file value haltd would refuse is refused all the same.
    let f = TempConfig::new("override", "[flight_recorder]\nturn_sample_rate = 0.0\n");
    let e = parse(&["--config", f.arg(), "--turn-sample-rate", "0.05"]).expect_err("bad file");
    assert_eq!(e.flag, "config", "{e}");
}

/// The settings at the top of the file are the flags' ([`layers`]); the sections' loaders,
/// at start and on SIGHUP, leave them alone, and name every section when one is unknown.
#[test]
fn sections_beside_settings() {
    let f = TempConfig::new(
        "top",
        "listen = \"127.0.0.1:1\"\nbudget = 7\n\n[log]\nlevel = \"debug\"\n\n\
         [detectors.surprise]\nmode = \"off\"\n",
    );
    let c = parse(&["--config", f.arg()]).expect("valid");
    assert_eq!(c.log_level.as_deref(), Some("debug"));
    let r = c.args.reloadable().expect("reloads");
    assert_eq!(
        r.detectors.surprise.policy.mode,
        crate::detect::DetectorMode::Off
    );
    let f = TempConfig::new("unknown", "budget = 7\n[nope]\nx = 1\n");
    let e = parse(&["--config", f.arg()]).expect_err("unknown section");
    assert_eq!(e.key.as_deref(), Some("nope"), "{e}");
    assert!(
        e.reason.contains(
            "[detectors.*], [safety], [flight_recorder], [tool_circuit], [grounding], [log]"
        ),
        "{e}"
    );
}

#[cfg(feature = "fault-injection")]
#[test]
fn faults_parse() {
    let c = parse(&[
        "--fault",
        "emitter-ignores-halt",
        "--fault",
        "watchdog-stall-after-ms=250",
        "--fault",
        "panic-after-tokens=12,thread=watchdog",
    ])
    .expect("valid");
    assert!(c.faults.emitter_ignores_halt);
    assert_eq!(
        c.faults.watchdog_stall_after,
        Some(Duration::from_millis(250))
    );
    assert_eq!(
        c.faults.panic,
        Some(crate::crash::PanicFault {
            after_tokens: 12,
            thread: crate::crash::PanicThread::Watchdog
        })
    );
    let e = parse(&["--fault", "panic-after-tokens=0"]).expect_err("N = 0");
    assert_eq!(e.flag, "fault", "{e}");
    let c = parse(&[
        "--fault",
        "detector-hang=surprise",
        "--fault",
        "ledger-write-fails-after=3",
    ])
    .expect("valid");
    assert_eq!(
        c.faults.detector_hang,
        Some(crate::detect::DetectorId::Surprise)
    );
    assert_eq!(c.faults.ledger_write_fails_after, Some(3));
    let c = parse(&["--fault", "silent-rewrite=42>43"]).expect("valid");
    assert_eq!(c.faults.silent_rewrite, Some(("42", "43")));
    for bad in [
        "detector-hang=nope",
        "ledger-write-fails-after=0",
        "silent-rewrite=42",
        "silent-rewrite=>43",
    ] {
        let e = parse(&["--fault", bad]).expect_err(bad);
        assert_eq!(e.flag, "fault", "{e}");
    }
}

#[test]
fn upstream_surfaces_name_what_the_backend_serves_itself() {
    let up = ["--source", "openai", "--upstream", "http://127.0.0.1:8000"];
    let none = parse(&up).expect("valid");
    assert!(none.upstream_surfaces.is_empty(), "translated by default");
    let both =
        parse(&[&up[..], &["--upstream-surfaces", "responses,messages"]].concat()).expect("valid");
    assert_eq!(
        both.upstream_surfaces
            .passes(crate::wire::Endpoint::Messages),
        Some(crate::upstream::UpstreamSurface::Messages)
    );
    assert!(both
        .upstream_surfaces
        .passes(crate::wire::Endpoint::Responses)
        .is_some());
    let e = parse(&["--upstream-surfaces", "messages"]).expect_err("builtin");
    assert_eq!(e.flag, "upstream-surfaces", "{e}");
    let cli = Cli::try_parse_from(["haltd", "--upstream-surfaces", "chat"]);
    assert!(cli.is_err(), "chat is no surface to pass through");
}
