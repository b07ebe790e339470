//! Import cycles between the daemon's production files: every `use` tree and every `crate::`,
//! `super::` and `self::` path of a file (its tests left out: `tests.rs`, `*_tests.rs`,
//! `tests/` folders and what follows `#[cfg(test)]`) is resolved to the file of the longest
//! module prefix it names, and the strongly connected components of that graph with more than
//! one file are the cycles.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use anyhow::Result;

/// A group of files that import each other, by their paths under the source folder.
pub(crate) type Cycle = Vec<String>;

/// Who imports whom: each production file under `src` (a crate's `src/`) with the files its
/// paths name, by their paths under `src`.
pub(crate) type Graph = BTreeMap<String, BTreeSet<String>>;

/// The cycles of `graph` (from [`graph`]).
pub(crate) fn cycles(graph: &Graph) -> Vec<Cycle> {
    strongly_connected(graph)
        .into_iter()
        .filter(|c| c.len() > 1)
        .collect()
}

/// The import graph of the production files under `src` (a crate's `src/`).
pub(crate) fn graph(src: &Path) -> Result<Graph> {
    let mut files = BTreeMap::new();
    for path in super::rust_files(src)? {
        let rel = path
            .strip_prefix(src)
            .unwrap_or(&path)
            .to_string_lossy()
            .replace('\\', "/");
        if rel.starts_with("bin/") || rel == "main.rs" {
            continue;
        }
        files.insert(module_of(&rel), (rel, std::fs::read_to_string(&path)?));
    }
    let mut graph = Graph::new();
    for (module, (rel, text)) in &files {
        if is_test_file(rel) {
            continue;
        }
        let targets = graph.entry(rel.clone()).or_default();
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for path in paths_in(code) {
            let Some(absolute) = absolute(module, &path) else {
                continue;
            };
            let target = (0..=absolute.len())
                .rev()
                .find_map(|n| files.get(&absolute[..n]).map(|(r, _)| r));
            if let Some(t) = target.filter(|t| *t != rel && !is_test_file(t)) {
                targets.insert(t.clone());
            }
        }
    }
    Ok(graph)
}

fn is_test_file(rel: &str) -> bool {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    name == "tests.rs" || name.ends_with("_tests.rs") || rel.contains("tests/")
}

/// The module path of a file: `a/b.rs` and `a/b/mod.rs` are `[a, b]`, `lib.rs` is `[]`.
fn module_of(rel: &str) -> Vec<String> {
    let stem = rel.strip_suffix(".rs").unwrap_or(rel);
    let stem = stem.strip_suffix("/mod").unwrap_or(stem);
    if stem == "lib" {
        return Vec::new();
    }
    stem.split('/').map(str::to_owned).collect()
}

/// The crate-absolute module path a `path` written in the file of `module` names, or `None`
/// for a path outside the crate (`std::`, another crate's).
fn absolute(module: &[String], path: &[String]) -> Option<Vec<String>> {
    let (first, rest) = path.split_first()?;
    let mut base = match first.as_str() {
        "crate" => Vec::new(),
        "self" | "super" => module.to_vec(),
        _ => return None,
    };
    // In `a/b.rs`, as in `a/b/mod.rs`, `self` is `a::b` and `super` is `a`.
    let mut rest = if first == "super" {
        base.pop();
        rest
    } else {
        rest
    };
    while let Some((seg, tail)) = rest.split_first() {
        match seg.as_str() {
            "super" => {
                base.pop();
            }
            "self" => {}
            _ => break,
        }
        rest = tail;
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// Every path of `code`: the leaves of each `use` tree, and each `crate::`, `super::` or
/// `self::` path written inline. Comments are dropped first.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let code: String = code
        .lines()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = code[at..].find("use ") {
        let start = at + i;
        at = start + 4;
        let word_start =
            start == 0 || !code[..start].ends_with(|c: char| c.is_alphanumeric() || c == '_');
        if !word_start {
            continue;
        }
        let Some(end) = code[at..].find(';') else {
            break;
        };
        let tree: String = without_renames(&code[at..at + end])
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        expand(&[], &tree, &mut out);
    }
    for root in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(root) {
            let start = from + i;
            from = start + root.len();
            if code[..start].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let tail: String = code[start..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            out.push(
                tail.split("::")
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect(),
            );
        }
    }
    out
}

/// `tree` without its renames (`X as Y` becomes `X`).
fn without_renames(tree: &str) -> String {
    let words: Vec<&str> = tree.split_whitespace().collect();
    let mut out = String::new();
    let mut skip = 0;
    for (i, w) in words.iter().enumerate() {
        if skip > 0 {
            skip -= 1;
            continue;
        }
        if *w == "as" {
            // `as Y,` or `as Y}` keeps the punctuation after the new name.
            let next = words.get(i + 1).copied().unwrap_or_default();
            out.push_str(next.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_'));
            skip = 1;
            continue;
        }
        out.push(' ');
        out.push_str(w);
    }
    out
}

/// The leaves of the `use` tree `tree` (whitespace and renames removed) under `prefix`.
fn expand(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
    let Some(open) = tree.find('{') else {
        let mut path = prefix.to_vec();
        path.extend(
            tree.split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
        );
        out.push(path);
        return;
    };
    let mut head = prefix.to_vec();
    head.extend(
        tree[..open]
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
    );
    // A brace that does not close (text that only looked like a `use`) ends at the end.
    let close = tree.rfind('}').filter(|&c| c > open).unwrap_or(tree.len());
    let inner = &tree[open + 1..close];
    let (mut depth, mut part) = (0, String::new());
    for c in inner.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand(&head, &std::mem::take(&mut part), out);
                continue;
            }
            _ => {}
        }
        part.push(c);
    }
    if !part.is_empty() {
        expand(&head, &part, out);
    }
}

/// Tarjan's strongly connected components of `graph`, each sorted.
fn strongly_connected(graph: &Graph) -> Vec<Cycle> {
    struct Walk<'g> {
        graph: &'g BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'g str, (usize, usize)>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        next: usize,
        found: Vec<Cycle>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, v: &'g str) {
            self.index.insert(v, (self.next, self.next));
            self.next += 1;
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.index[w].1.min(self.index[v].1);
                    self.index.get_mut(v).expect("visited").1 = low;
                } else if self.on_stack.contains(w) {
                    let low = self.index[w].0.min(self.index[v].1);
                    self.index.get_mut(v).expect("visited").1 = low;
                }
            }
            if self.index[v].0 == self.index[v].1 {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                component.sort();
                self.found.push(component);
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_trees_expand_to_their_leaves() {
        let mut out = Vec::new();
        let tree: String = without_renames("crate::{a::{b, c::D as E}, e as F}")
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        expand(&[], &tree, &mut out);
        let joined: Vec<String> = out.iter().map(|p| p.join("::")).collect();
        assert_eq!(joined, ["crate::a::b", "crate::a::c::D", "crate::e"]);
    }

    #[test]
    fn super_and_self_resolve_from_the_file_module() {
        let m = module_of("x/y.rs");
        let p = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(absolute(&m, &p("super::z::T")), Some(p("x::z::T")));
        assert_eq!(absolute(&m, &p("self::w")), Some(p("x::y::w")));
        assert_eq!(absolute(&m, &p("std::io")), None);
        assert_eq!(module_of("x/mod.rs"), p("x"));
    }

    #[test]
    fn a_cycle_is_one_component_and_a_chain_none() {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let edge = |g: &mut BTreeMap<String, BTreeSet<String>>, a: &str, b: &str| {
            g.entry(a.to_owned()).or_default().insert(b.to_owned());
            g.entry(b.to_owned()).or_default();
        };
        edge(&mut g, "a", "b");
        edge(&mut g, "b", "c");
        edge(&mut g, "c", "a");
        edge(&mut g, "c", "d");
        let cycles: Vec<Cycle> = strongly_connected(&g)
            .into_iter()
            .filter(|c| c.len() > 1)
            .collect();
        assert_eq!(
            cycles,
            [vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]]
        );
    }
}
