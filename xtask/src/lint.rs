//! `cargo xtask lint`: rustfmt and clippy, with warnings denied, over both builds the project
//! ships: the node build (default features) and the test and bench build (`--all-features`:
//! haltd's `fault-injection`; haltd-common's `user` is on in both through the daemon).
//!
//! Clippy's lints are the workspace's (`[workspace.lints]` in the root `Cargo.toml`), among them
//! `clippy::too_many_lines` with the threshold in `clippy.toml`: both passes enforce them.
//!
//! Two checks of its own read the daemon's sources: no trip's result is thrown away with
//! `let _ =` (a trip that did not happen must be handled, `dataplane/turn/own_trip.rs`), and the
//! data plane's `self.conns[` lookups by connection key do not grow past
//! [`CONNS_LOOKUP_CEILING`]: issue 30 moves them into the ring driver's completion dispatch,
//! and lowers the ceiling as it goes.

use std::{path::Path, time::Instant};

use anyhow::{bail, Result};

use crate::{
    build,
    ctx::Ctx,
    util::{run, secs},
};

/// One check: a name for the summary and the cargo arguments.
struct Check {
    name: &'static str,
    args: Vec<String>,
}

/// `cargo xtask lint` on its own: builds the gate first, so the daemon's build script embeds
/// that object as in every other task (and does not build it).
pub(crate) fn lint_task(ctx: &Ctx) -> Result<()> {
    let object = build::build_ebpf(ctx)?;
    lint(ctx, &object)
}

/// Runs every check, even after one failed; fails with the list of failed checks.
pub(crate) fn lint(ctx: &Ctx, object: &Path) -> Result<()> {
    let t = Instant::now();
    let mut outcomes = Vec::new();
    for check in checks(ctx) {
        println!("[lint] cargo {}", check.args.join(" "));
        let mut c = ctx.cargo_with_gate(object);
        c.args(&check.args);
        outcomes.push((check.name, run(&mut c).is_ok()));
    }
    let discarded = discarded_trips(&ctx.root.join("daemon/src"))?;
    for d in &discarded {
        println!("[lint] {d}: a trip's result is thrown away with `let _ =`; handle it");
    }
    outcomes.push(("no discarded trip results", discarded.is_empty()));
    let lookups = count_in(&ctx.root.join("daemon/src/dataplane"), "self.conns[")?;
    println!(
        "[lint] self.conns[ lookups in daemon/src/dataplane: {lookups} (ceiling {CONNS_LOOKUP_CEILING})"
    );
    outcomes.push((
        "connection lookups within their ceiling",
        lookups <= CONNS_LOOKUP_CEILING,
    ));
    summarize(&outcomes, t)
}

fn checks(ctx: &Ctx) -> Vec<Check> {
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
        },
        // The BPF crate is its own workspace, which `--all` does not reach.
        Check {
            name: "fmt (BPF crate)",
            args: fmt(&[
                "--check",
                "--manifest-path",
                &bpf_manifest.to_string_lossy(),
            ]),
        },
        Check {
            name: "clippy --all-features",
            args: clippy(&["--all-features"]),
        },
        Check {
            name: "clippy (default features)",
            args: clippy(&[]),
        },
    ]
}

/// The most `self.conns[` lookups the data plane may hold: the count when the check came in
/// (issue 30). A change that adds one fails; one that removes some lowers this with it.
const CONNS_LOOKUP_CEILING: usize = 132;

/// Occurrences of `needle` in the `.rs` files under `dir`.
fn count_in(dir: &Path, needle: &str) -> Result<usize> {
    let mut n = 0;
    for path in rust_files(dir)? {
        n += std::fs::read_to_string(&path)?.matches(needle).count();
    }
    Ok(n)
}

/// The `.rs` files under `dir`.
fn rust_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// The places under `dir` (`FILE:LINE`) where a `let _ =` statement throws away the result of
/// a trip (`trip(`, `trip_by(`, `trip_own(`).
fn discarded_trips(dir: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for path in rust_files(dir)? {
        let text = std::fs::read_to_string(&path)?;
        found.extend(
            discarded_in(&text)
                .into_iter()
                .map(|line| format!("{}:{line}", path.display())),
        );
    }
    Ok(found)
}

/// The 1-based lines of `text` where a `let _ =` statement (up to its `;`) calls a trip.
fn discarded_in(text: &str) -> Vec<usize> {
    let mut lines = Vec::new();
    for (at, _) in text.match_indices("let _ =") {
        let statement = text[at..].split(';').next().unwrap_or_default();
        if ["trip(", "trip_by(", "trip_own("]
            .iter()
            .any(|call| statement.contains(call))
        {
            lines.push(text[..at].matches('\n').count() + 1);
        }
    }
    lines
}

/// `clippy --workspace --all-targets FEATURES -- -D warnings`.
fn clippy(features: &[&str]) -> Vec<String> {
    let mut args = vec!["clippy", "--workspace", "--all-targets"];
    args.extend(features);
    args.extend(["--", "-D", "warnings"]);
    args.into_iter().map(str::to_owned).collect()
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

#[cfg(test)]
mod tests {
    use super::discarded_in;

    #[test]
    fn a_discarded_trip_is_found_and_a_handled_one_is_not() {
        let text = "fn a() {\n    let _ = shared.trip_by(\n        id,\n    );\n    \
                    let _ = slot.state.compare_exchange(1, 2);\n    \
                    let _ = shared.trip(id, c);\n    trip_own(&shared, id, c, by);\n}\n";
        assert_eq!(discarded_in(text), [2, 6]);
    }
}
