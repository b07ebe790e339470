//! The daemon's layers (docs/architecture.md "Layers"): every top-level module of
//! `daemon/src/` belongs to one, and a file may import only from its own layer or a lower one.
//! Within a layer imports go either way, as long as no cycle between files forms (checked on
//! the same graph, `lint/cycles.rs`). The binaries (`src/bin/`) are the layer above all.

use super::cycles::Graph;

/// A layer: its name and its top-level modules (a file `a.rs` or a folder `a/`), lowest first.
pub(crate) struct Layer {
    pub(crate) name: &'static str,
    pub(crate) modules: &'static [&'static str],
}

/// The layers, lowest first. A new top-level module must be added to one.
pub(crate) const LAYERS: &[Layer] = &[
    Layer {
        name: "foundation",
        modules: &[
            "codes",
            "clock",
            "pem",
            "build_info",
            "logging",
            "privs",
            "histogram",
            "reuseport",
        ],
    },
    Layer {
        name: "core",
        modules: &[
            "wire",
            "credential",
            "identity",
            "scope",
            "limits",
            "keys",
            "circuit",
            "upstream",
            "client_tls",
            "stream",
            "admission",
            "access_log",
            "monitor",
            "safety",
            "detect",
            "policy",
            "grounding",
            "source",
            "sampling",
            "modes",
            "ledger",
            "state",
            "labels",
            "crash",
            "pulse",
            "progress",
        ],
    },
    Layer {
        name: "shared state",
        modules: &["config", "gate", "metrics", "halt"],
    },
    Layer {
        name: "drivers and threads",
        modules: &[
            "dataplane",
            "watchdog",
            "admin",
            "upstream_watch",
            "escalation",
            "lifecycle",
            "server",
            "ctl",
            "calibrate",
            "fuzz",
            "cli_docs",
        ],
    },
];

/// The top-level module of a file under `src/` (`a/b.rs` and `a.rs` are `a`); `None` for the
/// crate root, which only declares the modules.
fn top_module(rel: &str) -> Option<&str> {
    let first = rel.split('/').next().unwrap_or(rel);
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib").then_some(name)
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.modules.contains(&module))
}

/// What breaks the layers in `graph`: a file whose module has no layer, an import from a
/// higher layer, and a layer's module that no file has (a stale entry).
pub(crate) fn violations(graph: &Graph) -> Vec<String> {
    let mut found = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (file, targets) in graph {
        let Some(module) = top_module(file) else {
            continue;
        };
        seen.insert(module.to_owned());
        let Some(from) = layer_of(module) else {
            found.push(format!(
                "{file}: the module `{module}` is in no layer (xtask/src/lint/layers.rs)"
            ));
            continue;
        };
        for target in targets {
            let Some(to) = top_module(target).and_then(layer_of) else {
                continue;
            };
            if to > from {
                found.push(format!(
                    "{file} ({}) imports {target} ({}), a higher layer",
                    LAYERS[from].name, LAYERS[to].name
                ));
            }
        }
    }
    for layer in LAYERS {
        for m in layer.modules {
            if !seen.contains(*m) {
                found.push(format!(
                    "the layer {} names `{m}`, which no file is",
                    layer.name
                ));
            }
        }
    }
    found
}

/// One line per layer, for the lint's output.
pub(crate) fn summary() -> Vec<String> {
    LAYERS
        .iter()
        .enumerate()
        .map(|(i, l)| format!("{} {}: {}", i + 1, l.name, l.modules.join(" ")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &str)]) -> Graph {
        let mut g = Graph::new();
        for (a, b) in edges {
            g.entry((*a).to_owned())
                .or_default()
                .insert((*b).to_owned());
            g.entry((*b).to_owned()).or_default();
        }
        g
    }

    fn stale_free(v: Vec<String>) -> Vec<String> {
        v.into_iter()
            .filter(|m| !m.contains("no file is"))
            .collect()
    }

    #[test]
    fn a_lower_layer_importing_a_higher_one_is_found() {
        let found = stale_free(violations(&graph(&[
            ("wire/http.rs", "halt.rs"),
            ("halt.rs", "wire/http.rs"),
            ("dataplane/conn.rs", "watchdog/waits.rs"),
        ])));
        assert_eq!(
            found,
            ["wire/http.rs (core) imports halt.rs (shared state), a higher layer"]
        );
    }

    #[test]
    fn a_module_without_a_layer_is_found_and_the_root_is_not() {
        let found = stale_free(violations(&graph(&[("lib.rs", "novel/x.rs")])));
        assert_eq!(
            found,
            ["novel/x.rs: the module `novel` is in no layer (xtask/src/lint/layers.rs)"]
        );
    }

    #[test]
    fn every_module_is_in_one_layer_only() {
        let mut all: Vec<&str> = LAYERS
            .iter()
            .flat_map(|l| l.modules.iter().copied())
            .collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n);
    }
}
