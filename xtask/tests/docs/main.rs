//! Docs kept true by tests: the claims the documentation makes about the repository itself are
//! checked against the repository, so a renamed test or a moved file fails CI instead of
//! leaving the docs wrong.
//!
//! - [`cited_tests`]: every test that `docs/ad09-compliance.md` cites exists, as a `#[test]`
//!   function in the file or module the citation names.
//! - [`cited_paths`]: every file `docs/`, `README.md` and `deploy/README.md` cite is in the
//!   repository.
//!
//! They read the sources and `git ls-files`, need no root and no build of haltd, and run in the
//! unit stage of `cargo xtask test` (`cargo test --workspace --exclude haltd-tests`).

mod cited_paths;
mod cited_tests;
mod markdown;
mod rust_tests;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    process::Command,
};

/// The repository: its root and the files git tracks there.
#[derive(Debug)]
pub(crate) struct Repo {
    pub(crate) root: PathBuf,
    /// The files git tracks, and untracked ones it does not ignore (so a file cited before its
    /// `git add` passes here and fails in CI, on the clone), relative to the root.
    pub(crate) files: BTreeSet<String>,
    /// For the checks' own tests: file contents that stand in for the disk.
    texts: BTreeMap<String, String>,
}

impl Repo {
    /// The repository this test was built from (the parent of `xtask/`). Panics when git
    /// cannot list it: a check that cannot see the repository must not pass.
    pub(crate) fn here() -> Self {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask lies in the workspace root")
            .to_path_buf();
        let out = Command::new("git")
            .arg("-C")
            .arg(&root)
            .args([
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ])
            .output()
            .expect("git ls-files: run git in the repository root");
        assert!(
            out.status.success(),
            "git ls-files in {} failed: {}",
            root.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let files = String::from_utf8(out.stdout)
            .expect("tracked paths are UTF-8")
            .split('\0')
            .filter(|p| !p.is_empty())
            .filter(|p| root.join(p).is_file())
            .map(str::to_owned)
            .collect();
        Repo {
            root,
            files,
            texts: BTreeMap::new(),
        }
    }

    /// A repository for the checks' own tests: these files and their contents, nothing on disk.
    pub(crate) fn of(files: &[(&str, &str)]) -> Self {
        Repo {
            root: PathBuf::from("/nonexistent"),
            files: files.iter().map(|&(f, _)| f.to_owned()).collect(),
            texts: files
                .iter()
                .map(|&(f, t)| (f.to_owned(), t.to_owned()))
                .collect(),
        }
    }

    /// The text of a tracked file. Panics when it cannot be read: the check must not pass then.
    pub(crate) fn read(&self, path: &str) -> String {
        if let Some(t) = self.texts.get(path) {
            return t.clone();
        }
        std::fs::read_to_string(self.root.join(path))
            .unwrap_or_else(|e| panic!("read {}: {e}", self.root.join(path).display()))
    }

    pub(crate) fn is_file(&self, path: &str) -> bool {
        self.files.contains(path)
    }

    /// Whether `path` (no trailing `/`) is a directory holding a tracked file.
    pub(crate) fn is_dir(&self, path: &str) -> bool {
        let prefix = format!("{}/", path.trim_end_matches('/'));
        self.files
            .range(prefix.clone()..)
            .next()
            .is_some_and(|f| f.starts_with(&prefix))
    }

    /// The tracked files under directory `dir`, at any depth.
    pub(crate) fn files_under<'a>(&'a self, dir: &str) -> impl Iterator<Item = &'a String> {
        let prefix = format!("{}/", dir.trim_end_matches('/'));
        self.files
            .range(prefix.clone()..)
            .take_while(move |f| f.starts_with(&prefix))
    }
}
