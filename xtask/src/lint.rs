//! `cargo xtask lint`: rustfmt and clippy, with warnings denied, over both builds the project
//! ships: the node build (default features) and the test and bench build (`--all-features`:
//! haltd's `fault-injection`; haltd-common's `user` is on in both through the daemon).
//!
//! Clippy's lints are the workspace's (`[workspace.lints]` in the root `Cargo.toml`), among them
//! `clippy::too_many_lines` with the threshold in `clippy.toml`: both passes enforce them.
//!
//! Checks of its own read the daemon's sources:
//! - no trip's result is thrown away with `let _ =` (a trip that did not happen must be
//!   handled, `dataplane/turn/own_trip.rs`);
//! - the data plane's slab of connections belongs to its ring driver: `impl Worker` and every
//!   use of `self.conns` lie in `dataplane/driver/`, and a connection is looked up by key only
//!   in `driver/step.rs` (`Worker::step_of`, `Worker::conn_of`); connection, turn and upstream
//!   code runs on a `Step`, which holds one connection and no slab;
//! - tests where the convention puts them: no inline test module over 200 lines, no `#[path]`
//!   module;
//! - one convention for module files, in every crate of the workspace: a module with children
//!   is `foo.rs` beside `foo/`, never `foo/mod.rs`;
//! - the layers (`lint/layers.rs`): no file imports from a higher layer, and every top-level
//!   module is in one;
//! - no import cycle between the daemon's files (`lint/cycles.rs`).

mod cycles;
mod layers;

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
    let slab = slab_uses(&ctx.root.join("daemon/src/dataplane"))?;
    println!(
        "[lint] the connection slab: {} uses, all in dataplane/driver/; {} lookups by key, in driver/step.rs",
        slab.uses, slab.lookups
    );
    for v in &slab.violations {
        println!("[lint] {v}");
    }
    outcomes.push(("the slab is the driver's", slab.violations.is_empty()));
    let graph = cycles::graph(&ctx.root.join("daemon/src"))?;
    let cycles = cycles::cycles(&graph);
    println!(
        "[lint] import cycles between the daemon's files: {}",
        cycles.len()
    );
    for c in &cycles {
        println!("[lint]   {}", c.join(" "));
    }
    outcomes.push(("no import cycle", cycles.is_empty()));
    println!("[lint] the daemon's layers, lowest first (lint/layers.rs):");
    for l in layers::summary() {
        println!("[lint]   {l}");
    }
    let upward = layers::violations(&graph);
    for v in &upward {
        println!("[lint] {v}");
    }
    println!(
        "[lint] imports from a higher layer: {} in {} files",
        upward.len(),
        graph.len()
    );
    outcomes.push(("every import goes down the layers", upward.is_empty()));
    let mod_files = mod_rs_files(&ctx.root)?;
    for m in &mod_files {
        println!("[lint] {m}: a module file named mod.rs; make it the folder's name + .rs");
    }
    outcomes.push(("module files are foo.rs beside foo/", mod_files.is_empty()));
    let misplaced = misplaced_tests(&ctx.root.join("daemon/src"))?;
    for m in &misplaced {
        println!("[lint] {m}");
    }
    outcomes.push(("tests where the convention puts them", misplaced.is_empty()));
    println!(
        "[lint] impl Worker: {} methods (at most {WORKER_METHODS_MAX})",
        slab.worker_methods
    );
    outcomes.push(("a thin driver", slab.worker_methods <= WORKER_METHODS_MAX));
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

/// What the slab check found: uses of the slab, lookups by key, and the places that break the
/// rule (`FILE:LINE: why`).
struct SlabUses {
    worker_methods: usize,
    uses: usize,
    lookups: usize,
    violations: Vec<String>,
}

/// Reads the data plane under `dir` (each file up to its `#[cfg(test)]`; sibling test files
/// are skipped): `impl Worker` and `self.conns` only under `driver/`, lookups by key
/// (`self.conns[`, `self.conns.get`) only in `driver/step.rs`.
fn slab_uses(dir: &Path) -> Result<SlabUses> {
    let mut found = SlabUses {
        worker_methods: 0,
        uses: 0,
        lookups: 0,
        violations: Vec::new(),
    };
    for path in rust_files(dir)? {
        let rel = path
            .strip_prefix(dir)
            .unwrap_or(&path)
            .to_string_lossy()
            .into_owned();
        if rel.ends_with("_tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        found.worker_methods += worker_methods_in(text);
        for (line, what) in slab_uses_in(text) {
            let in_driver = rel.starts_with("driver/");
            let why = match what {
                SlabUse::ImplWorker if !in_driver => Some("`impl Worker` outside driver/"),
                SlabUse::Use | SlabUse::Lookup if !in_driver => {
                    Some("the slab used outside driver/: take a `Step`")
                }
                SlabUse::Lookup if rel != "driver/step.rs" => {
                    Some("a lookup by key outside driver/step.rs: use `step_of` or `conn_of`")
                }
                _ => None,
            };
            match what {
                SlabUse::Use => found.uses += 1,
                SlabUse::Lookup => {
                    found.uses += 1;
                    found.lookups += 1;
                }
                SlabUse::ImplWorker => {}
            }
            if let Some(why) = why {
                found
                    .violations
                    .push(format!("{}:{line}: {why}", path.display()));
            }
        }
    }
    Ok(found)
}

/// The most methods `impl Worker` may have (issue 30: a thin io_uring driver).
const WORKER_METHODS_MAX: usize = 30;

/// The methods of the `impl Worker` blocks in `text` (rustfmt's layout: the block's items at
/// four spaces, its end a `}` at the start of a line).
fn worker_methods_in(text: &str) -> usize {
    let mut n = 0;
    for (at, _) in text.match_indices("\nimpl Worker {\n") {
        let block = &text[at + 1..];
        let end = block.find("\n}").unwrap_or(block.len());
        n += block[..end]
            .lines()
            .filter(|l| {
                let l = l.strip_prefix("    ").unwrap_or_default();
                let l = l.strip_prefix("pub(in crate::dataplane) ").unwrap_or(l);
                l.starts_with("fn ")
            })
            .count();
    }
    n
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlabUse {
    ImplWorker,
    /// `self.conns` walked, inserted into, removed from.
    Use,
    /// `self.conns[` or `self.conns.get`: a connection looked up by key.
    Lookup,
}

/// The 1-based lines of `text` with `impl Worker` or `self.conns` (the field access may be
/// split over lines: `self\n    .conns`), and what each is.
fn slab_uses_in(text: &str) -> Vec<(usize, SlabUse)> {
    let mut found = Vec::new();
    for (at, _) in text.match_indices("impl Worker ") {
        found.push((text[..at].matches('\n').count() + 1, SlabUse::ImplWorker));
    }
    for (at, _) in text.match_indices("self") {
        let rest = text[at + 4..].trim_start();
        let Some(after) = rest.strip_prefix(".conns") else {
            continue;
        };
        if after.starts_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let after = after.trim_start();
        let what = if after.starts_with('[') || after.starts_with(".get") {
            SlabUse::Lookup
        } else {
            SlabUse::Use
        };
        found.push((text[..at].matches('\n').count() + 1, what));
    }
    found.sort_unstable_by_key(|&(line, _)| line);
    found
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

/// The crates whose sources the module-file convention covers.
const CRATE_SOURCES: &[&str] = &[
    "daemon/src",
    "tests/src",
    "tests/tests",
    "xtask/src",
    "ebpf/haltd-common/src",
    "ebpf/haltd-ebpf/src",
    "ebpf/haltd-ebpf-build/src",
    "model/src",
    "model/tests",
    "model/examples",
    "fuzz/fuzz_targets",
];

/// Every `mod.rs` in the workspace's crates.
fn mod_rs_files(root: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for dir in CRATE_SOURCES {
        let dir = root.join(dir);
        if !dir.exists() {
            continue;
        }
        for path in rust_files(&dir)? {
            if path.file_name().is_some_and(|n| n == "mod.rs") {
                found.push(
                    path.strip_prefix(root)
                        .unwrap_or(&path)
                        .display()
                        .to_string(),
                );
            }
        }
    }
    Ok(found)
}

/// The longest test module that may stay inline in a production file.
const INLINE_TESTS_MAX: usize = 200;

/// Where the daemon's tests break the convention (docs/architecture.md "Modules"): a module's
/// tests live in its own folder (`foo.rs` puts them in `foo/tests.rs`),
/// or inline when they are at most [`INLINE_TESTS_MAX`] lines; no `#[path]`.
fn misplaced_tests(dir: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for path in rust_files(dir)? {
        let text = std::fs::read_to_string(&path)?;
        for (line, why) in misplaced_in(&text) {
            found.push(format!("{}:{line}: {why}", path.display()));
        }
    }
    Ok(found)
}

/// The 1-based lines of `text` that break the test convention, and why.
fn misplaced_in(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if l.trim_start().starts_with("#[path") {
            found.push((i + 1, "a module file named by #[path]".to_owned()));
        }
        let opens = l.trim_end() == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|n| n.starts_with("mod ") && n.ends_with(" {"));
        if !opens {
            continue;
        }
        let len = lines[i + 2..]
            .iter()
            .position(|l| *l == "}")
            .map_or(lines.len() - i, |end| end + 3);
        if len > INLINE_TESTS_MAX {
            let why = format!(
                "an inline test module of {len} lines (at most {INLINE_TESTS_MAX}): \
                 move it to the module's tests.rs"
            );
            found.push((i + 1, why));
        }
    }
    found
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
    use super::{discarded_in, misplaced_in, slab_uses_in, worker_methods_in, SlabUse};

    #[test]
    fn long_inline_tests_and_path_modules_are_found() {
        let long = format!(
            "fn a() {{}}\n#[cfg(test)]\nmod tests {{\n{}}}\n",
            "    x;\n".repeat(199)
        );
        let short = "#[cfg(test)]\nmod tests {\n    x;\n}\n#[cfg(test)]\nmod tests;\n";
        let path = "#[cfg(test)]\n#[path = \"a_tests.rs\"]\nmod tests;\n";
        assert_eq!(
            misplaced_in(&long).iter().map(|f| f.0).collect::<Vec<_>>(),
            [2]
        );
        assert!(misplaced_in(short).is_empty());
        assert_eq!(
            misplaced_in(path).iter().map(|f| f.0).collect::<Vec<_>>(),
            [2]
        );
    }

    #[test]
    fn the_methods_of_impl_worker_are_counted_and_nothing_else() {
        let text = "//! doc\nimpl Worker {\n    fn a(&self) {\n        fn inner() {}\n    }\n\n    \
                    pub(in crate::dataplane) fn b(&self) {}\n}\n\nimpl Io {\n    fn c(&self) {}\n}\n";
        assert_eq!(worker_methods_in(text), 2);
    }

    #[test]
    fn slab_uses_and_lookups_are_told_apart_across_lines() {
        let text =
            "impl Worker {\n    fn a(&mut self) {\n        let c = &self.conns[k];\n        \
                    self\n            .conns\n            .get_mut(k);\n        \
                    for c in &self.conns {}\n        self.conns_seen += 1;\n    }\n}\n";
        assert_eq!(
            slab_uses_in(text),
            [
                (1, SlabUse::ImplWorker),
                (3, SlabUse::Lookup),
                (4, SlabUse::Lookup),
                (7, SlabUse::Use),
            ]
        );
    }

    #[test]
    fn a_discarded_trip_is_found_and_a_handled_one_is_not() {
        let text = "fn a() {\n    let _ = shared.trip_by(\n        id,\n    );\n    \
                    let _ = slot.state.compare_exchange(1, 2);\n    \
                    let _ = shared.trip(id, c);\n    trip_own(&shared, id, c, by);\n}\n";
        assert_eq!(discarded_in(text), [2, 6]);
    }
}
