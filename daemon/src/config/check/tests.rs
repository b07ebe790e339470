use std::{collections::BTreeMap, ffi::OsString, path::PathBuf};

use clap::{Command, FromArgMatches};

use super::*;
use crate::config::layers::{parse, LayerError};

/// `haltd check-config FILE ARGS` with the variables `env`: the report.
fn check_file(text: &str, args: &[&str], env: &[(&str, &str)]) -> (String, Report) {
    // Numbered, not named by the text's length: tests run in parallel in one process.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("haltd-check-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("haltd.toml");
    std::fs::write(&path, text).expect("write");
    let report = check_path(&path, args, env);
    let _ = std::fs::remove_dir_all(&dir);
    (path.display().to_string(), report)
}

fn check_path(path: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Report {
    let env: BTreeMap<String, OsString> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
        .collect();
    let cmd = Command::new("haltd").subcommand(ServeArgs::command());
    let mut argv: Vec<OsString> = ["haltd", "serve", "--config"].map(OsString::from).to_vec();
    argv.push(path.into());
    argv.extend(args.iter().map(OsString::from));
    let layered = match parse(cmd, &argv, &|v| env.get(v).cloned()) {
        Ok(l) => l,
        Err(LayerError::Invalid(p)) => {
            return Report {
                errors: p.iter().map(ToString::to_string).collect(),
                ..Report::default()
            }
        }
        Err(e) => panic!("{e}"),
    };
    let (_, sub) = layered.matches.subcommand().expect("serve");
    let args = ServeArgs::from_arg_matches(sub).expect("args");
    check(args, &layered, env.keys().map(OsString::from))
}

#[test]
fn the_shipped_example_is_valid() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/haltd.toml");
    let r = check_path(&path, &[], &[]);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(
        r.settings
            .iter()
            .any(|s| s.starts_with("listen = 127.0.0.1:8080  (")),
        "{:?}",
        r.settings
    );
}

#[test]
fn errors_name_their_line_variable_or_flag() {
    let text = "listen = \"127.0.0.1:8080\"\nbudget = 5000\n\n[detectors.surprise]\nmode = \"observe\"\nwindow = 0\n";
    let (path, r) = check_file(text, &[], &[]);
    assert_eq!(
        r.errors,
        [format!(
            "{path}:2: budget: 5000 exceeds the maximum of 1000"
        )]
    );
    let (path, r) = check_file(text, &["--budget", "5"], &[]);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert!(
        r.errors[0].starts_with(&format!("{path}:6: detectors.surprise.window = 0: ")),
        "{:?}",
        r.errors
    );
    let (_, r) = check_file("", &[], &[("HALTD_BUDGET", "5000"), ("HALTD_LISTN", "x")]);
    assert_eq!(
        r.errors,
        ["HALTD_BUDGET (environment): 5000 exceeds the maximum of 1000"]
    );
    assert!(
        r.warnings
            .iter()
            .any(|w| w.starts_with("HALTD_LISTN (environment): no such setting")),
        "{:?}",
        r.warnings
    );
    let (_, r) = check_file("", &["--budget", "5000"], &[]);
    assert_eq!(r.errors, ["--budget: 5000 exceeds the maximum of 1000"]);
    let (path, r) = check_file("listen = \"localhost:99999\"\n", &[], &[]);
    assert!(
        r.errors[0].starts_with(&format!(
            "{path}:1: listen: invalid value \"localhost:99999\""
        )),
        "{:?}",
        r.errors
    );
    let (path, r) = check_file("[log]\nlevel = \"loud[\"\n", &[], &[]);
    assert!(
        r.errors[0].starts_with(&format!("{path}:2: log.level: ")),
        "{:?}",
        r.errors
    );
    let (path, r) = check_file("\n[flight_recorder]\nturn_sample_rate = 2.0\n", &[], &[]);
    assert!(
        r.errors[0].starts_with(&format!("{path}:3: flight_recorder.turn_sample_rate: ")),
        "{:?}",
        r.errors
    );
    let (_, r) = check_file("bpf_object = \"/nonexistent/gate.o\"\n", &[], &[]);
    assert!(
        r.errors
            .iter()
            .any(|e| e.contains(":1: bpf_object: /nonexistent/gate.o: No such file")),
        "{:?}",
        r.errors
    );
    let (_, r) = check_file("user = \"haltd-no-such-user\"\n", &[], &[]);
    assert!(r.errors[0].contains(":1: user: "), "{:?}", r.errors);
}
