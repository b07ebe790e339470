//! Where a test lives: the `#[test]` functions of a Rust file, the files of a module and its
//! test modules, and the modules of the root-only integration binary.

use std::collections::BTreeSet;

use crate::Repo;

/// The root of the `it` test binary (`cargo test -p haltd-tests --test it`).
pub(crate) const IT_ROOT: &str = "tests/tests/it/main.rs";

/// The names of the functions marked `#[test]` (also `#[tokio::test]`, and inside
/// `proptest!`), with other attributes and comments between the mark and the `fn`.
pub(crate) fn test_fns(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut marked = false;
    for line in text.lines() {
        let mut t = line.trim();
        if let Some(rest) = t
            .strip_prefix("#[test]")
            .or_else(|| t.strip_prefix("#[tokio::test]"))
        {
            marked = true;
            t = rest.trim();
        } else if t.starts_with("#[tokio::test(") {
            marked = true;
            continue;
        }
        if !marked || t.is_empty() || t.starts_with("//") || t.starts_with("#[") {
            continue;
        }
        if let Some(name) = fn_name(t) {
            out.insert(name);
        }
        marked = false;
    }
    out
}

/// The name in `[pub ][async ]fn NAME(`, if the line declares a function.
fn fn_name(line: &str) -> Option<String> {
    let at = line.find("fn ")?;
    let before = &line[..at];
    if !before
        .split_whitespace()
        .all(|w| w == "async" || w.starts_with("pub"))
    {
        return None;
    }
    let name: String = line[at + 3..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// The files that make up the module whose file is `file` as far as its tests go: the file
/// itself (inline `mod tests`) and its test modules beside it (`X/tests.rs`, `X/tests/...`).
pub(crate) fn module_files(repo: &Repo, file: &str) -> Vec<String> {
    let stem = file.strip_suffix(".rs").unwrap_or(file);
    let dir = stem.strip_suffix("/tests").unwrap_or(stem);
    let mut out = vec![file.to_owned()];
    let sibling = format!("{dir}/tests.rs");
    if repo.is_file(&sibling) && sibling != file {
        out.push(sibling);
    }
    out.extend(
        repo.files_under(&format!("{dir}/tests"))
            .filter(|f| f.ends_with(".rs"))
            .cloned(),
    );
    out
}

/// The `#[test]` functions of these files.
pub(crate) fn tests_in(repo: &Repo, files: &[String]) -> BTreeSet<String> {
    files.iter().flat_map(|f| test_fns(&repo.read(f))).collect()
}

/// The file of module `path` of the `it` binary (`kernel_gate::send_check` is
/// `tests/tests/it/kernel_gate/send_check.rs`), if every module on the way is declared.
pub(crate) fn it_module(repo: &Repo, path: &[&str]) -> Option<String> {
    let mut parent = IT_ROOT.to_owned();
    let mut dir = "tests/tests/it".to_owned();
    for seg in path {
        let declared = repo.read(&parent).lines().any(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l == format!("mod {seg};")
        });
        let file = format!("{dir}/{seg}.rs");
        if !declared || !repo.is_file(&file) {
            return None;
        }
        dir = format!("{dir}/{seg}");
        parent = file;
    }
    Some(parent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marked_functions_are_found_and_helpers_are_not() {
        let text = "fn helper() {}\n#[test]\n/// doc\n#[ignore = \"x\"]\nfn a() {}\n\
                    #[tokio::test(flavor = \"current_thread\")]\nasync fn b() {}\n\
                    proptest! {\n    #[test]\n    fn prop_c(x in 0..1u8) {}\n}\n#[test] fn d() {}\n";
        let names: Vec<String> = test_fns(text).into_iter().collect();
        assert_eq!(names, ["a", "b", "d", "prop_c"]);
    }

    #[test]
    fn modules_and_their_test_files_resolve() {
        let repo = Repo::of(&[
            (IT_ROOT, "mod kernel_gate;\n"),
            ("tests/tests/it/kernel_gate.rs", "mod send_check;\n"),
            ("tests/tests/it/kernel_gate/send_check.rs", ""),
            ("tests/tests/it/orphan.rs", ""),
            ("daemon/src/a.rs", ""),
            ("daemon/src/a/tests.rs", ""),
            ("daemon/src/a/tests/b.rs", ""),
            ("daemon/src/a/c.rs", ""),
        ]);
        assert_eq!(
            it_module(&repo, &["kernel_gate", "send_check"]).as_deref(),
            Some("tests/tests/it/kernel_gate/send_check.rs")
        );
        assert_eq!(it_module(&repo, &["orphan"]), None, "not declared");
        assert_eq!(
            module_files(&repo, "daemon/src/a.rs"),
            [
                "daemon/src/a.rs",
                "daemon/src/a/tests.rs",
                "daemon/src/a/tests/b.rs"
            ]
        );
    }
}
