use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf};

use clap::{Command, FromArgMatches};

use super::*;
use crate::config::ServeArgs;

/// haltd's command as the daemon builds it, with `serve` only.
fn haltd() -> Command {
    Command::new("haltd").subcommand(ServeArgs::command())
}

/// A config file in a fresh temporary directory, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str, text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("haltd-layers-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("haltd.toml");
        std::fs::write(&path, text).expect("write");
        TempFile(path)
    }
    fn path(&self) -> &str {
        self.0.to_str().expect("utf-8")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `haltd serve ARGS` with the variables `env` (and no other) and `--config FILE` when a file
/// is given.
fn layered(
    args: &[&str],
    env: &[(&str, &str)],
    file: Option<&TempFile>,
) -> Result<Layered, LayerError> {
    let env: BTreeMap<String, OsString> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
        .collect();
    let mut argv: Vec<OsString> = ["haltd", "serve"].map(OsString::from).to_vec();
    if let Some(f) = file {
        argv.extend(["--config", f.path()].map(OsString::from));
    }
    argv.extend(args.iter().map(OsString::from));
    parse(haltd(), &argv, &|var| env.get(var).cloned())
}

fn serve(args: &[&str], env: &[(&str, &str)], file: Option<&TempFile>) -> ServeArgs {
    let l = layered(args, env, file).unwrap_or_else(|e| panic!("{args:?} {env:?}: {e}"));
    let (_, sub) = l.matches.subcommand().expect("serve");
    ServeArgs::from_arg_matches(sub).expect("serve args")
}

fn problems(args: &[&str], env: &[(&str, &str)], file: Option<&TempFile>) -> Vec<Problem> {
    match layered(args, env, file) {
        Err(LayerError::Invalid(p)) => p,
        other => panic!("expected problems, got {other:?}"),
    }
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("addr")
}

#[test]
fn flag_beats_env_beats_file_beats_default() {
    let f = TempFile::new(
        "precedence",
        "listen = \"127.0.0.1:1001\"\nledger = \"/tmp/file.jsonl\"\nbudget = 11\n\
         ledger_no_fsync = true\nfault = [\"file-a\", \"file-b\"]\n\n[log]\nlevel = \"info\"\n",
    );
    // The default.
    let s = serve(&[], &[], None);
    assert_eq!(s.listen, addr("127.0.0.1:8080"));
    assert_eq!(s.ledger, PathBuf::from("haltd-ledger.jsonl"));
    assert_eq!(s.budget, 5);
    assert!(!s.ledger_no_fsync);
    assert!(s.faults.is_empty());
    // The file over the default.
    let s = serve(&[], &[], Some(&f));
    assert_eq!(s.listen, addr("127.0.0.1:1001"));
    assert_eq!(s.ledger, PathBuf::from("/tmp/file.jsonl"));
    assert_eq!(s.budget, 11);
    assert!(s.ledger_no_fsync);
    assert_eq!(s.faults, ["file-a", "file-b"]);
    // The environment over the file.
    let env = [
        ("HALTD_LISTEN", "127.0.0.1:1002"),
        ("HALTD_LEDGER", "/tmp/env.jsonl"),
        ("HALTD_BUDGET", "12"),
        ("HALTD_LEDGER_NO_FSYNC", "no"),
        ("HALTD_FAULT", "env-a"),
    ];
    let s = serve(&[], &env, Some(&f));
    assert_eq!(s.listen, addr("127.0.0.1:1002"));
    assert_eq!(s.ledger, PathBuf::from("/tmp/env.jsonl"));
    assert_eq!(s.budget, 12);
    assert!(!s.ledger_no_fsync);
    assert_eq!(s.faults, ["env-a"]);
    // The flag over the environment.
    let flags = [
        "--listen",
        "127.0.0.1:1003",
        "--ledger",
        "/tmp/flag.jsonl",
        "--budget",
        "13",
        "--ledger-no-fsync",
        "--fault",
        "flag-a",
    ];
    let s = serve(&flags, &env, Some(&f));
    assert_eq!(s.listen, addr("127.0.0.1:1003"));
    assert_eq!(s.ledger, PathBuf::from("/tmp/flag.jsonl"));
    assert_eq!(s.budget, 13);
    assert!(s.ledger_no_fsync);
    assert_eq!(s.faults, ["flag-a"]);
    // The environment over the default, without a file; HALTD_CONFIG names the file.
    let s = serve(&[], &[("HALTD_BUDGET", "14")], None);
    assert_eq!(s.budget, 14);
    let s = serve(&[], &[("HALTD_CONFIG", f.path())], None);
    assert_eq!(s.budget, 11);
    assert_eq!(s.config.as_deref(), Some(f.0.as_path()));
    // An empty variable is unset.
    let s = serve(&[], &[("HALTD_BUDGET", "")], Some(&f));
    assert_eq!(s.budget, 11);
}

#[test]
fn sources_say_where_each_value_came_from() {
    let f = TempFile::new("sources", "\n\nbudget = 11\nlisten = \"localhost:1001\"\n");
    let l = layered(
        &["--ledger", "x"],
        &[("HALTD_LISTEN", "127.0.0.1:2")],
        Some(&f),
    )
    .expect("parses");
    let source = |name: &str| {
        l.sources
            .iter()
            .find(|(s, _)| s.name == name)
            .map(|(_, src)| src.clone())
            .expect(name)
    };
    assert_eq!(source("budget"), Source::File { line: Some(3) });
    assert_eq!(source("listen"), Source::Env("HALTD_LISTEN".into()));
    assert_eq!(source("ledger"), Source::Flag);
    assert_eq!(source("config"), Source::Flag);
    assert_eq!(source("workers"), Source::Default);
    // A host name in the file, resolved at start.
    let s = serve(&[], &[], Some(&f));
    assert_eq!(s.listen, addr("127.0.0.1:1001"));
}

#[test]
fn bad_values_are_reported_where_they_are() {
    let f = TempFile::new(
        "bad",
        "# comment\nlisten = 8080\nbudget = \"many\"\nsource = \"cloud\"\nfault = 3\n\
         metrics = \"nowhere.invalid:1\"\nworkers = [1, 2]\nwindow = 3\n\
         turn_sample_rate = 0.5\nconfig = \"/etc/other.toml\"\n\n[detector]\nmode = \"hard\"\n",
    );
    let p = problems(
        &[],
        &[
            ("HALTD_MAX_STREAMS", "lots"),
            ("HALTD_NO_KERNEL_GATE", "maybe"),
        ],
        Some(&f),
    );
    let shown: Vec<String> = p.iter().map(ToString::to_string).collect();
    let path = f.path();
    for want in [
        "HALTD_MAX_STREAMS (environment): invalid value \"lots\": invalid digit".to_owned(),
        "HALTD_NO_KERNEL_GATE (environment): \"maybe\" is not true or false".to_owned(),
        format!("{path}:2: listen: must be a string (in quotes), not the integer 8080"),
        format!("{path}:3: budget: must be a whole number, not the string \"many\""),
        format!("{path}:4: source: \"cloud\" is not one of: builtin, openai"),
        format!("{path}:5: fault: must be a string (in quotes), not the integer 3"),
        format!("{path}:6: metrics: invalid value \"nowhere.invalid:1\": host \"nowhere.invalid\" does not resolve"),
        format!("{path}:7: workers: takes one value, not a list"),
        format!("{path}:8: window: unknown setting"),
        format!("{path}:9: turn_sample_rate: set it as `turn_sample_rate` in [flight_recorder]"),
        format!("{path}:10: config: is not read from the file"),
        format!("{path}:12: detector: unknown section [detector] (known: [detectors.*], [safety], [flight_recorder], [tool_circuit], [grounding], [log], [[routes]])"),
    ] {
        assert!(
            shown.iter().any(|s| s.starts_with(&want)),
            "no problem starts with {want:?} in:\n{}",
            shown.join("\n")
        );
    }
    assert_eq!(shown.len(), 12, "{}", shown.join("\n"));
    // A file value is checked even when the flag overrides it.
    let f = TempFile::new("overridden", "budget = \"x\"\n");
    assert_eq!(problems(&["--budget", "3"], &[], Some(&f)).len(), 1);
    // A file that does not parse, or is not there.
    let f = TempFile::new("syntax", "listen = \"127.0.0.1:1\"\nbudget = \n");
    match layered(&[], &[], Some(&f)) {
        Err(LayerError::File(e)) => assert_eq!(e.line, Some(2), "{e}"),
        other => panic!("{other:?}"),
    }
    match layered(&["--config", "/nonexistent/haltd.toml"], &[], None) {
        Err(LayerError::File(e)) => assert!(e.to_string().contains("/nonexistent"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn variable_names_are_unique_and_free() {
    let settings = settings(&ServeArgs::command());
    let mut seen = std::collections::BTreeSet::new();
    for s in &settings {
        assert!(seen.insert(s.env.clone()), "two settings use {}", s.env);
        assert!(
            !OTHER_ENV.contains(&s.env.as_str()),
            "--{} would take {}, which means something else (OTHER_ENV); name its variable in ENV_NAMES",
            s.name,
            s.env
        );
        assert!(s.env.starts_with(ENV_PREFIX), "{}", s.env);
    }
    assert_eq!(
        settings
            .iter()
            .find(|s| s.id == "bpf_object")
            .map(|s| s.env.as_str()),
        Some("HALTD_BPF_OBJECT_FILE")
    );
    let unknown = unknown_env(
        &ServeArgs::command(),
        ["HALTD_LISTN", "HALTD_LISTEN", "HALTD_LOG", "PATH"]
            .into_iter()
            .map(OsString::from),
    );
    assert_eq!(unknown, ["HALTD_LISTN"]);
}

/// A value of `s`'s type the flag's parser takes and that is not its default.
fn sample(s: &Setting) -> Option<(toml::Value, String)> {
    let cmd = ServeArgs::command();
    let arg = arg_of(&cmd, &s.id).clone();
    let default: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    let candidates: Vec<(toml::Value, String)> = match s.kind {
        Kind::Bool => vec![(toml::Value::Boolean(true), "true".into())],
        Kind::Integer => vec![(toml::Value::Integer(7), "7".into())],
        Kind::Float => vec![(toml::Value::Float(0.5), "0.5".into())],
        Kind::Text => arg
            .get_possible_values()
            .iter()
            .map(|p| p.get_name().to_owned())
            .chain(
                [
                    "127.0.0.1:1",
                    "unix:/tmp/haltd-walk.sock",
                    "/tmp/haltd-walk",
                    "walk",
                    "7",
                    "1s",
                    "http://127.0.0.1:1",
                ]
                .map(str::to_owned),
            )
            .map(|v| (toml::Value::String(v.clone()), v))
            .collect(),
    };
    candidates.into_iter().find(|(_, text)| {
        !default.contains(text) && check(&cmd, s, vec![OsString::from(text)]).is_ok()
    })
}

/// Every flag of `serve`, walked from clap: it can be set from the file and from its
/// variable (its value reaches the parsed settings), alone on the command line (no
/// `requires` or `conflicts_with` between flags: clap does not see the file's and the
/// environment's values as given), and the reference names it with its variable and key.
#[test]
fn every_flag_is_settable_everywhere_and_documented() {
    let cmd = ServeArgs::command();
    let reference = crate::config::reference::render(&cmd);
    let defaults = format!("{:?}", serve(&[], &[], None));
    let mut built = cmd.clone();
    built.build();
    for s in settings(&cmd) {
        assert!(
            built
                .get_arg_conflicts_with(arg_of(&built, &s.id))
                .is_empty(),
            "--{} conflicts_with another flag: that rule belongs in ServeArgs::validate",
            s.name
        );
        let (value, text) = sample(&s).unwrap_or_else(|| {
            panic!(
                "--{}: no sample value for this flag's type; add one to `sample`",
                s.name
            )
        });
        // The reference.
        assert!(
            reference.contains(&format!("| [`--{}`](#{})", s.name, s.name))
                && reference.contains(&format!("`{}`", s.env))
                && reference.contains(&format!("\n### {}\n", s.name)),
            "--{} is not in the reference",
            s.name
        );
        let changed = |args: ServeArgs| format!("{args:?}") != defaults;
        if s.id == "config" {
            // Names the file: `flag_beats_env_beats_file_beats_default` sets it both ways.
            assert_eq!(s.file, FileKey::None, "a file does not name another");
            continue;
        }
        // The environment.
        let s_env = serve(&[], &[(s.env.as_str(), text.as_str())], None);
        assert!(
            changed(s_env),
            "--{}: {}={text} did not set it",
            s.name,
            s.env
        );
        // The file.
        assert_file_sets(&s, &value, &defaults);
        // Alone on the command line.
        let flag = format!("--{}", s.name);
        let alone: Vec<&str> = if s.kind == Kind::Bool {
            vec![&flag]
        } else {
            vec![&flag, &text]
        };
        let mut argv: Vec<OsString> = ["haltd", "serve"].map(OsString::from).to_vec();
        argv.extend(alone.iter().map(OsString::from));
        if let Err(e) = haltd().try_get_matches_from(&argv) {
            panic!(
                "{flag} alone does not parse ({e}): a rule between flags (requires, conflicts_with) belongs in ServeArgs::validate, since values from the file and the environment reach clap as defaults, which its rules ignore"
            );
        }
    }
}

/// `s` set in the file to `value` reaches the settings (`defaults`: the defaults' Debug).
fn assert_file_sets(s: &Setting, value: &toml::Value, defaults: &str) {
    let changed = |args: ServeArgs| format!("{args:?}") != defaults;
    match &s.file {
        FileKey::Top(key) => {
            let mut t = toml::Table::new();
            t.insert(key.clone(), value.clone());
            let f = TempFile::new(&format!("walk-{key}"), &t.to_string());
            let from_file = serve(&[], &[], Some(&f));
            assert!(
                changed(from_file),
                "--{}: `{key} = {value}` in the file did not set it",
                s.name
            );
        }
        FileKey::Section(path) => {
            let (section, key) = path.rsplit_once('.').expect("section.key");
            let text = format!("[{section}]\n{key} = {value}\n");
            let f = TempFile::new(&format!("walk-{key}"), &text);
            let base = serve(&[], &[], None).validate().expect("defaults");
            let with = serve(&[], &[], Some(&f))
                .validate()
                .expect("the sample validates");
            assert_ne!(
                format!("{:?}{:?}", with.detectors, with.sampling),
                format!("{:?}{:?}", base.detectors, base.sampling),
                "--{}: `{key} = {value}` in [{section}] did not set it",
                s.name
            );
        }
        FileKey::None => panic!("--{}: only --config has no file key", s.name),
    }
}
