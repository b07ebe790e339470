//! `cargo xtask lint`: rustfmt and clippy, with warnings denied, over both builds the project
//! ships: the node build (default features) and the test and bench build (`--all-features`:
//! haltd's `fault-injection`; haltd-common's `user` is on in both through the daemon).
//!
//! `clippy::too_many_lines` (threshold in `clippy.toml`) is not enforced yet: functions are
//! still being shrunk. `--too-many-lines` reports and counts them without failing; once
//! `[workspace.lints.clippy]` enables the lint, the default-features pass enforces it.

use std::{
    collections::HashSet,
    fs,
    io::{BufReader, IsTerminal},
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, Context, Result};
use cargo_metadata::Message;
use clap::Args;

use crate::{
    build,
    ctx::Ctx,
    util::{run, secs, show},
};

#[derive(Debug, Args)]
pub(crate) struct Options {
    /// Also report functions longer than clippy.toml's `too-many-lines-threshold`
    /// (`clippy::too_many_lines` as a forced warning): listed and counted, not failed.
    #[arg(long)]
    too_many_lines: bool,
}

/// One check: a name for the summary and the cargo arguments.
struct Check {
    name: &'static str,
    args: Vec<String>,
    /// Report `clippy::too_many_lines` (JSON messages, counted).
    long_fns: bool,
}

/// `cargo xtask lint` on its own: builds the gate first, so the daemon's build script embeds
/// that object as in every other task (and does not build it).
pub(crate) fn lint_task(ctx: &Ctx, opts: &Options) -> Result<()> {
    let object = build::build_ebpf(ctx)?;
    lint(ctx, &object, opts.too_many_lines)
}

/// Runs every check, even after one failed; fails with the list of failed checks.
pub(crate) fn lint(ctx: &Ctx, object: &Path, too_many_lines: bool) -> Result<()> {
    let t = Instant::now();
    let mut outcomes = Vec::new();
    let mut long_fns = None;
    for check in checks(ctx, too_many_lines) {
        println!("[lint] cargo {}", check.args.join(" "));
        let mut c = ctx.cargo_with_gate(object);
        c.args(&check.args);
        let result = if check.long_fns {
            run_counting_long_fns(&mut c).map(|n| long_fns = Some(n))
        } else {
            run(&mut c)
        };
        outcomes.push((check.name, result.is_ok()));
    }
    if let Some(n) = long_fns {
        println!(
            "[lint] clippy::too_many_lines: {n} functions longer than {} lines (reported, not enforced: the workspace lints do not enable it yet)",
            threshold(ctx)
        );
    }
    summarize(&outcomes, t)
}

fn checks(ctx: &Ctx, too_many_lines: bool) -> Vec<Check> {
    let bpf_manifest = ctx.gate.dir().join("Cargo.toml");
    let fmt = |extra: &[&str]| {
        let mut args = vec!["fmt".to_owned()];
        args.extend(extra.iter().map(|&a| a.to_owned()));
        args
    };
    vec![
        Check {
            name: "fmt",
            args: fmt(&["--all", "--check"]),
            long_fns: false,
        },
        // The BPF crate is its own workspace, which `--all` does not reach.
        Check {
            name: "fmt (BPF crate)",
            args: fmt(&[
                "--check",
                "--manifest-path",
                &bpf_manifest.to_string_lossy(),
            ]),
            long_fns: false,
        },
        Check {
            name: "clippy --all-features",
            args: clippy(&["--all-features"], too_many_lines),
            long_fns: too_many_lines,
        },
        Check {
            name: "clippy (default features)",
            args: clippy(&[], false),
            long_fns: false,
        },
    ]
}

/// `clippy --workspace --all-targets FEATURES -- -D warnings`; with `long_fns`, JSON messages
/// and `clippy::too_many_lines` forced to warn (`--force-warn` is not raised by `-D warnings`).
fn clippy(features: &[&str], long_fns: bool) -> Vec<String> {
    let mut args = vec!["clippy", "--workspace", "--all-targets"];
    args.extend(features);
    if long_fns {
        args.push(if std::io::stderr().is_terminal() {
            "--message-format=json-diagnostic-rendered-ansi"
        } else {
            "--message-format=json"
        });
    }
    args.extend(["--", "-D", "warnings"]);
    if long_fns {
        args.extend(["--force-warn", "clippy::too_many_lines"]);
    }
    args.into_iter().map(str::to_owned).collect()
}

/// Runs a clippy command with JSON messages; prints every diagnostic as cargo would and
/// returns how many long functions it reported.
fn run_counting_long_fns(c: &mut Command) -> Result<usize> {
    let shown = show(c);
    let mut child = c
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting `{shown}`"))?;
    let stdout = child.stdout.take().context("clippy's stdout")?;
    let long_fns = print_messages(BufReader::new(stdout));
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(long_fns)
}

/// Prints each distinct diagnostic (`--all-targets` repeats a library's for its test target);
/// returns the number of `clippy::too_many_lines` ones.
fn print_messages(stdout: impl std::io::BufRead) -> usize {
    let mut seen = HashSet::new();
    let mut long_fns = 0;
    for message in Message::parse_stream(stdout).map_while(Result::ok) {
        match message {
            Message::CompilerMessage(m) => {
                let Some(rendered) = m.message.rendered else {
                    continue;
                };
                if !seen.insert(rendered.clone()) {
                    continue;
                }
                if m.message
                    .code
                    .is_some_and(|c| c.code == "clippy::too_many_lines")
                {
                    long_fns += 1;
                }
                eprint!("{rendered}");
            }
            Message::TextLine(line) => println!("{line}"),
            _ => {}
        }
    }
    long_fns
}

/// `too-many-lines-threshold` from the root `clippy.toml`, for the report line.
fn threshold(ctx: &Ctx) -> String {
    fs::read_to_string(ctx.root.join("clippy.toml"))
        .ok()
        .and_then(|toml| {
            toml.lines().find_map(|l| {
                let (key, value) = l.split_once('=')?;
                (key.trim() == "too-many-lines-threshold").then(|| value.trim().to_owned())
            })
        })
        .unwrap_or_else(|| "100 (clippy's default)".to_owned())
}

fn summarize(outcomes: &[(&str, bool)], t: Instant) -> Result<()> {
    let parts: Vec<String> = outcomes
        .iter()
        .map(|(name, ok)| format!("{name} {}", if *ok { "ok" } else { "FAILED" }))
        .collect();
    let failed: Vec<&str> = outcomes
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| *name)
        .collect();
    println!(
        "lint: {} — {}; {}",
        if failed.is_empty() { "ok" } else { "FAILED" },
        parts.join(", "),
        secs(t.elapsed())
    );
    if !failed.is_empty() {
        bail!(
            "lint failed: {} (see above; `cargo fmt --all` and `cargo fmt --manifest-path \
             ebpf/haltd-ebpf/Cargo.toml` fix formatting)",
            failed.join(", ")
        );
    }
    Ok(())
}
