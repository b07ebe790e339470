//! Every test that `docs/ad09-compliance.md` cites exists.
//!
//! What counts as a citation, in the forms the document's preamble sets out:
//! - in the cells of its tables' `tests` and `status` columns, every code span that names a
//!   test or a module:
//!   - `topic::module::name`: a module path in the `it` binary (`tests/tests/it/main.rs`), the
//!     last segment a `#[test]` function of that module's file, or the path a module itself;
//!   - `path.rs::name`: a `#[test]` function of that file's module, its inline `mod tests`, or
//!     its test files beside it (`path/tests.rs`, `path/tests/...`); `path` is relative to
//!     `daemon/src/` or, for other crates, to the repository root (`model/tests/bounds.rs`,
//!     `ebpf/haltd-common/src/decide.rs`), and must be exactly one of the two;
//!   - `dir/::name`: a `#[test]` function of a file under that directory;
//!   - `::name`: a test of the module or file cited last in the same cell; a file cited on its
//!     own (`upstream/tls.rs` tests (`::name`, ...)) sets that module too;
//!   - `prefix_…` in place of a name: the one test whose name starts with `prefix_`;
//! - in the preamble, the same spans, and in each topic's list (`` `topic` ([link]): `a`,
//!   `b::c` ``) every span, as a module or a test under that topic.
//!
//! A span with `::` there that none of these forms resolves fails the check; so does a file
//! that does not exist. Spans without `::` that are not `.rs` paths (failure codes, fields,
//! flags) are prose. Paths of code, not of tests, start with a crate name (`haltd_common::...`)
//! and are left to the path check.

use std::collections::BTreeSet;

use crate::{
    markdown::{code_spans, link_targets, prose_lines, tables},
    rust_tests::{it_module, module_files, tests_in},
    Repo,
};

/// The document this check reads.
const DOC: &str = "docs/ad09-compliance.md";

/// The columns whose cells cite tests.
const COLUMNS: [&str; 2] = ["tests", "status"];

/// Crate names: a span starting with one of these and `::` is a path of code, not a test.
const CRATES: [&str; 4] = ["haltd", "haltd_common", "haltd_model", "std"];

/// A module or file a test is looked for in: what it is called, and its files.
#[derive(Debug, Clone)]
struct Scope {
    name: String,
    files: Vec<String>,
}

/// Resolves citations against one repository, counting what it resolved.
#[derive(Debug)]
pub(crate) struct Checker<'r> {
    repo: &'r Repo,
    scope: Option<Scope>,
    pub(crate) tests: BTreeSet<String>,
    pub(crate) modules: usize,
}

impl<'r> Checker<'r> {
    pub(crate) fn new(repo: &'r Repo) -> Self {
        Checker {
            repo,
            scope: None,
            tests: BTreeSet::new(),
            modules: 0,
        }
    }

    /// Checks one span: `Ok(())` when it is no citation or resolves, else why not.
    fn span(&mut self, span: &str) -> Result<(), String> {
        let Some((head, rest)) = span.split_once("::") else {
            if is_path(span) {
                let scope = self.path_scope(span)?;
                self.scope = Some(scope);
            }
            return Ok(());
        };
        if CRATES.contains(&head) {
            return Ok(());
        }
        let names: Vec<&str> = rest.split("::").collect();
        if let Some(bad) = names.iter().find(|n| !is_name(n)) {
            return Err(format!("`{bad}` is not a test or module name"));
        }
        if head.is_empty() {
            let [name] = names[..] else {
                return Err("`::` takes one test name".to_owned());
            };
            let scope = self
                .scope
                .clone()
                .ok_or("`::name` with no test or file before it in the cell")?;
            return self.test_in(&scope, name);
        }
        if is_path(head) {
            let scope = self.path_scope(head)?;
            self.scope = Some(scope.clone());
            let [name] = names[..] else {
                return Err(format!("one test name after `{head}`"));
            };
            return self.test_in(&scope, name);
        }
        let mut segs = vec![head];
        segs.extend(names);
        self.integration(&segs)
    }

    /// A module path of the `it` binary, ending in a module or in one of its tests.
    fn integration(&mut self, segs: &[&str]) -> Result<(), String> {
        let whole = segs.join("::");
        if let Some(file) = it_module(self.repo, segs) {
            self.modules += 1;
            self.scope = Some(Scope {
                name: whole,
                files: module_files(self.repo, &file),
            });
            return Ok(());
        }
        let (name, module) = segs.split_last().ok_or("empty citation")?;
        let file = it_module(self.repo, module).ok_or_else(|| {
            format!(
                "`{}` is no module of the `it` binary ({})",
                module.join("::"),
                crate::rust_tests::IT_ROOT
            )
        })?;
        let scope = Scope {
            name: module.join("::"),
            files: module_files(self.repo, &file),
        };
        self.scope = Some(scope.clone());
        self.test_in(&scope, name)
    }

    /// The module a path names: relative to `daemon/src/` or to the root, exactly one.
    fn path_scope(&self, path: &str) -> Result<Scope, String> {
        let found: Vec<String> = [format!("daemon/src/{path}"), path.to_owned()]
            .into_iter()
            .filter(|p| {
                if p.ends_with('/') {
                    self.repo.is_dir(p)
                } else {
                    self.repo.is_file(p)
                }
            })
            .collect();
        let file = match &found[..] {
            [one] => one.clone(),
            [] => return Err(format!("no file `{path}` under daemon/src/ or the root")),
            _ => return Err(format!("`{path}` is ambiguous: {}", found.join(", "))),
        };
        let files = if file.ends_with('/') {
            self.repo
                .files_under(&file)
                .filter(|f| f.ends_with(".rs"))
                .cloned()
                .collect()
        } else {
            module_files(self.repo, &file)
        };
        Ok(Scope { name: file, files })
    }

    /// `name` (or the one test starting with `prefix` for `prefix…`) is a test of `scope`.
    fn test_in(&mut self, scope: &Scope, name: &str) -> Result<(), String> {
        let tests = tests_in(self.repo, &scope.files);
        let found: Vec<&String> = match name.strip_suffix('…') {
            Some(prefix) => tests.iter().filter(|t| t.starts_with(prefix)).collect(),
            None => tests.iter().filter(|t| *t == name).collect(),
        };
        match found[..] {
            [t] => {
                self.tests.insert(format!("{}::{t}", scope.name));
                Ok(())
            }
            [] => Err(format!(
                "no #[test] fn `{name}` in {}",
                scope.files.join(", ")
            )),
            _ => Err(format!("`{name}` matches several tests of {}", scope.name)),
        }
    }

    /// Checks a table cell; the scope of `::name` does not reach past it.
    pub(crate) fn cell(&mut self, cell: &str) -> Vec<String> {
        self.scope = None;
        let mut errors = Vec::new();
        for s in code_spans(cell) {
            if let Err(e) = self.span(&s.text) {
                errors.push(format!("`{}`: {e}", s.text));
            }
        }
        errors
    }

    /// Checks a preamble bullet: its spans, and under its topic its topic's list.
    pub(crate) fn bullet(&mut self, text: &str) -> Vec<String> {
        self.scope = None;
        let mut errors = Vec::new();
        let list = topic_list(self.repo, text);
        for s in code_spans(text) {
            let r = match &list {
                Some((topic, from, to)) if s.at > *from && s.at < *to => {
                    let mut segs = vec![topic.as_str()];
                    segs.extend(s.text.split("::"));
                    self.integration(&segs)
                }
                _ => self.span(&s.text),
            };
            if let Err(e) = r {
                errors.push(format!("`{}`: {e}", s.text));
            }
        }
        errors
    }
}

/// In a bullet `... \`topic\` ([link](...): \`a\`, \`b\`)`: the topic and the byte range of its
/// list (after the link, inside the parentheses).
fn topic_list(repo: &Repo, text: &str) -> Option<(String, usize, usize)> {
    let spans = code_spans(text);
    let topic = spans.iter().find(|s| {
        is_name(&s.text) && it_module(repo, &[s.text.as_str()]).is_some() && {
            let after = &text[s.at + s.text.len() + 2..];
            after.trim_start().starts_with('(')
        }
    })?;
    let open = s_after(text, topic.at + topic.text.len() + 2, '(')?;
    let mut depth = 0usize;
    let mut close = None;
    for (i, c) in text[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    close = Some(open + i);
                    break;
                }
            }
            _ => {}
        }
    }
    let close = close?;
    // The list starts after the link's target, if the group opens with a link.
    let group = &text[open..close];
    let from = match link_targets(group).first() {
        Some(t) => open + group.find(&format!("]({t})"))? + t.len() + 3,
        None => open,
    };
    Some((topic.text.clone(), from, close))
}

/// The position of the first `c` at or after `from`.
fn s_after(text: &str, from: usize, c: char) -> Option<usize> {
    text[from..].find(c).map(|i| from + i)
}

/// A Rust name, or a name prefix ending in `…`.
fn is_name(s: &str) -> bool {
    let s = s.strip_suffix('…').unwrap_or(s);
    let mut cs = s.chars();
    cs.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && cs.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A span that is a path of Rust sources: `x/y.rs` or a directory `x/y/`.
fn is_path(s: &str) -> bool {
    (s.ends_with(".rs") || (s.ends_with('/') && s.len() > 1))
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '/' | '.'))
}

/// Every citation of `text` (the compliance map) that does not resolve, as `line: why`.
pub(crate) fn check<'r>(repo: &'r Repo, text: &str) -> (Vec<String>, Checker<'r>) {
    let mut checker = Checker::new(repo);
    let mut errors = Vec::new();
    for table in tables(text) {
        let cols: Vec<usize> = (0..table.header.len())
            .filter(|&i| COLUMNS.contains(&table.header[i].as_str()))
            .collect();
        for (line, cells) in &table.rows {
            for &c in &cols {
                let cell = cells.get(c).map_or("", String::as_str);
                errors.extend(
                    checker
                        .cell(cell)
                        .into_iter()
                        .map(|e| format!("{line}: {e}")),
                );
            }
        }
    }
    for (line, bullet) in preamble_bullets(text) {
        errors.extend(
            checker
                .bullet(&bullet)
                .into_iter()
                .map(|e| format!("{line}: {e}")),
        );
    }
    (errors, checker)
}

/// The preamble's bullets (before the first `## `), each joined onto one line, with the
/// number of its first line.
fn preamble_bullets(text: &str) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    for (n, line) in prose_lines(text) {
        if line.starts_with("## ") {
            break;
        }
        if let Some(b) = line.strip_prefix("- ") {
            out.push((n, b.to_owned()));
        } else if line.starts_with("  ") {
            if let Some((_, b)) = out.last_mut() {
                b.push(' ');
                b.push_str(line.trim());
            }
        }
    }
    out
}

#[test]
fn every_test_the_compliance_map_cites_exists() {
    let repo = Repo::here();
    let text = repo.read(DOC);
    let (errors, checker) = check(&repo, &text);
    assert!(
        errors.is_empty(),
        "{DOC} cites tests that do not exist:\n{}",
        errors
            .iter()
            .map(|e| format!("  {DOC}:{e}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    println!(
        "{DOC}: {} distinct tests and {} module citations resolved",
        checker.tests.len(),
        checker.modules
    );
    // A parser that finds nothing passes nothing: the map cites well over a hundred tests.
    assert!(
        checker.tests.len() >= 100,
        "only {} tests found",
        checker.tests.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rust_tests::IT_ROOT;

    fn repo() -> Repo {
        Repo::of(&[
            (IT_ROOT, "mod proxy;\nmod kernel_gate;\n"),
            (
                "tests/tests/it/proxy.rs",
                "#[test]\nfn a() {}\n#[test]\nfn b() {}\n",
            ),
            ("tests/tests/it/kernel_gate.rs", "mod send_check;\n"),
            (
                "tests/tests/it/kernel_gate/send_check.rs",
                "#[test]\nfn exact() {}\n",
            ),
            ("daemon/src/ledger.rs", "#[cfg(test)]\nmod tests;\n"),
            (
                "daemon/src/ledger/tests.rs",
                "#[test]\nfn truncation() {}\n",
            ),
            ("daemon/src/wire/request.rs", "#[test]\nfn parse() {}\n"),
            ("daemon/src/upstream/request.rs", "#[test]\nfn parse() {}\n"),
            (
                "daemon/src/detect/timing/tests/cusum.rs",
                "#[test]\nfn detects() {}\n",
            ),
            (
                "model/tests/mutations.rs",
                "#[test]\nfn m2_terminal() {}\nfn m2_x() {}\n",
            ),
        ])
    }

    fn doc(preamble_list: &str, cell: &str) -> String {
        format!(
            "Intro.\n\n- proxy tests: `proxy` ([`tests/tests/it/proxy.rs`](../p.rs): {preamble_list});\n\n\
             ## T\n\n| # | how | tests | status |\n|---|---|---|---|\n| 1 | `x::y` | {cell} | **met** |\n"
        )
    }

    #[test]
    fn every_form_resolves() {
        let cell = "`proxy::a`, `::b`; `kernel_gate::send_check::exact`, `kernel_gate::send_check`; \
                    `ledger.rs::truncation`; `wire/request.rs::parse`; `detect/timing/tests/::detects`; \
                    `model/tests/mutations.rs::m2_…`; `haltd_common::decide`; `HEARTBEAT_LOST`";
        let text = doc("`a`,\n  `b`", cell);
        let repo = repo();
        let (errors, c) = check(&repo, &text);
        assert!(errors.is_empty(), "{errors:#?}");
        assert_eq!(c.tests.len(), 7, "{:?}", c.tests);
        assert_eq!(c.modules, 1);
    }

    #[test]
    fn each_unresolvable_citation_fails_naming_its_line() {
        let repo = repo();
        for (list, cell) in [
            (
                "`a`",
                "`ledger.rs::truncated_last_line_is_reported_and_refused`",
            ),
            ("`a`", "`proxy::c`"),
            ("`a`", "`::b`"),
            ("`a`", "`decide::tests::a`"),
            ("`a`", "`request.rs::parse`"),
            ("`a`", "`model/tests/mutations.rs::m3_…`"),
            ("`a`", "`proxy::a b`"),
            ("`a`", "`stream.rs`"),
            ("`c`", "`proxy::a`"),
        ] {
            let (errors, _) = check(&repo, &doc(list, cell));
            assert_eq!(errors.len(), 1, "{list} / {cell}: {errors:?}");
            let line = if list == "`c`" { "3:" } else { "9:" };
            assert!(errors[0].starts_with(line), "{errors:?}");
        }
    }
}
