//! `haltd check-config FILE [FLAGS]`: the whole configuration checked as `haltd serve
//! --config FILE [FLAGS]` would take it in the same environment (the file's settings and
//! sections, the `HALTD_*` variables, the flags), like `nginx -t`: nothing is bound, loaded or
//! started and no privilege is needed. Each error names where the bad value is (the file's
//! line and key, the variable or the flag). The systemd unit runs it as `ExecStartPre`.

use std::{ffi::OsString, path::Path};

use super::{
    file::ConfigFile,
    layers::{self, Layered, Setting, Source},
    ConfigError, ServeArgs,
};

/// What `check-config` found.
#[derive(Debug, Default)]
pub struct Report {
    /// What would stop `haltd serve`, each with where it is.
    pub errors: Vec<String>,
    /// What is doubtful but would not stop it here.
    pub warnings: Vec<String>,
    /// The settings not at their default, with where each came from.
    pub settings: Vec<String>,
}

/// Checks `args` (parsed from `layered`) as `serve` would, and what `serve` reads at start
/// beyond them; `vars` are the names of the environment's variables.
pub fn check(args: ServeArgs, layered: &Layered, vars: impl Iterator<Item = OsString>) -> Report {
    let mut report = Report::default();
    if args.config.is_none() {
        report
            .errors
            .push("no file to check: give FILE (or set HALTD_CONFIG)".to_owned());
        return report;
    }
    for var in layers::unknown_env(&ServeArgs::command(), vars) {
        report
            .warnings
            .push(format!("{var} (environment): no such setting (ignored)"));
    }
    if let Some(level) = std::env::var_os(crate::logging::LEVEL_ENV) {
        if let Err(e) = crate::logging::check_level(&level.to_string_lossy()) {
            report
                .errors
                .push(format!("{} (environment): {e}", crate::logging::LEVEL_ENV));
        }
    }
    report.warnings.extend(paths(&args));
    if let Some(obj) = &args.bpf_object {
        if let Err(e) = std::fs::File::open(obj) {
            let at = describe_flag("bpf-object", layered);
            report.errors.push(format!("{at}: {}: {e}", obj.display()));
        }
    }
    if let Err(e) = args.validate() {
        report.errors.push(describe(&e, layered));
    }
    report.settings = settings(layered);
    report
}

/// The directories `serve` writes to: missing ones are reported, not refused (they are made
/// by systemd's `StateDirectory=` on the node, and check-config also runs elsewhere).
fn paths(args: &ServeArgs) -> Vec<String> {
    let ledger_dir = args
        .ledger
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for (what, dir) in [
        ("ledger", ledger_dir),
        ("state-dir", args.state_dir.as_path()),
    ] {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => out.push(format!("--{what}: {} is not a directory", dir.display())),
            Err(e) => out.push(format!(
                "--{what}: directory {}: {e} (haltd needs it to start)",
                dir.display()
            )),
        }
    }
    out
}

/// `e` with where its value came from: the file's line and key, the variable, or the flag.
pub fn describe(e: &ConfigError, layered: &Layered) -> String {
    if let (Some(key), Some(file)) = (&e.key, &layered.file) {
        // A section's error says `config KEY: why`: keep the why.
        let reason = e
            .reason
            .strip_prefix(&format!("config {key}: "))
            .unwrap_or(&e.reason);
        // The why may start with a deeper key (`detectors.surprise.window = 0: ...`): point
        // at its line, and say it once.
        let deeper = reason
            .strip_prefix(&format!("{key}."))
            .map(|rest| {
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len());
                format!("{key}.{}", &rest[..end])
            })
            .filter(|k| !k.ends_with('.') && file.line_of(k) > file.line_of(key));
        return match deeper {
            Some(k) => match file.line_of(&k) {
                Some(line) => format!("{}:{line}: {reason}", file.path.display()),
                None => format!("{}: {reason}", file.path.display()),
            },
            None => format!("{}: {reason}", at_key(file, key)),
        };
    }
    format!("{}: {}", describe_flag(e.flag, layered), e.reason)
}

/// Where the bad value of `e` was set when not on the command line (`FILE:LINE, key`, or
/// `VAR in the environment`): what a refused start adds to its message.
pub fn origin(e: &ConfigError, layered: &Layered) -> Option<String> {
    let in_file = |file: &ConfigFile, key: &str| match file.line_of(key) {
        Some(line) => format!("{}:{line}, {key}", file.path.display()),
        None => format!("{}, {key}", file.path.display()),
    };
    if let (Some(key), Some(file)) = (&e.key, &layered.file) {
        return Some(in_file(file, key));
    }
    let (setting, source) = layered.sources.iter().find(|(s, _)| s.name == e.flag)?;
    match (source, &layered.file, &setting.file) {
        (Source::Env(var), _, _) => Some(format!("{var} in the environment")),
        (Source::File { .. }, Some(file), layers::FileKey::Top(key)) => Some(in_file(file, key)),
        _ => None,
    }
}

fn at_key(file: &ConfigFile, key: &str) -> String {
    match file.line_of(key) {
        Some(line) => format!("{}:{line}: {key}", file.path.display()),
        None => format!("{}: {key}", file.path.display()),
    }
}

/// Where the value of the setting `name` (a flag's name) came from.
fn describe_flag(name: &str, layered: &Layered) -> String {
    let found = layered.sources.iter().find(|(s, _)| s.name == name);
    match found.map(|(s, src)| (s, src)) {
        Some((_, Source::Env(var))) => format!("{var} (environment)"),
        Some((s, Source::File { .. })) => match (&layered.file, &s.file) {
            (Some(f), layers::FileKey::Top(key)) => at_key(f, key),
            _ => format!("--{name}"),
        },
        Some((_, Source::Default)) => format!("--{name} (default)"),
        _ => format!("--{name}"),
    }
}

/// `name = value (where)` for each setting not at its default.
fn settings(layered: &Layered) -> Vec<String> {
    let Some((_, sub)) = layered.matches.subcommand() else {
        return Vec::new();
    };
    layered
        .sources
        .iter()
        .filter(|(s, src)| *src != Source::Default && s.id != "config")
        .map(|(s, src)| {
            let value = raw(sub, s);
            let from = match src {
                Source::Flag => format!("--{}", s.name),
                Source::Env(var) => var.clone(),
                Source::File { line } => match (&layered.file, line) {
                    (Some(f), Some(l)) => format!("{}:{l}", f.path.display()),
                    _ => "file".to_owned(),
                },
                Source::Default => "default".to_owned(),
            };
            format!("{} = {value}  ({from})", s.name)
        })
        .collect()
}

fn raw(m: &clap::ArgMatches, s: &Setting) -> String {
    m.get_raw(&s.id)
        .map(|v| {
            v.map(|x| x.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
