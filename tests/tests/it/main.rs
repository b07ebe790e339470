//! The root-only integration tests of haltd, as one test binary with a module per topic (the
//! layout of aya's integration tests). What two or more topics share lives in the
//! `haltd_tests` library (`tests/src`); what one topic needs stays in its module.
//!
//! Every test needs root: the tests create network namespaces, run haltd with its kernel gate
//! and load the gate themselves. They share kernel state (BPF programs and maps, namespaces,
//! cgroups) and one process, so they run serially: `cargo xtask test` runs
//! `cargo test -p haltd-tests --features haltd/fault-injection -- --test-threads=1 --nocapture`
//! with `HALTD_BIN`, `HALTD_PRODUCTION_BIN`, `HALTCTL_BIN`, `HALTD_BPF_OBJECT`, `HALTD_PYTHON`,
//! `HALTD_OPENAI_CLIENT` and `HALTD_LLAMA_MODEL` (the real backend's model) set. A test's name is `topic::name`; one topic runs with e.g.
//! `cargo xtask test --no-unit -- kernel_gate::`.

/// The scripted OpenAI-compatible upstream, this crate's `scripted-upstream` binary.
const UPSTREAM_BIN: &str = env!("CARGO_BIN_EXE_scripted-upstream");

mod acceptance;
mod access_log;
mod admin;
mod adversarial;
mod api_surface;
mod build_info;
mod client_tls;
mod config;
mod crash;
mod degraded_policy;
mod detectors;
mod drain;
mod fail_closed;
mod guarantee;
mod haltctl_cli;
mod handover;
mod hostile;
mod incident_labels;
mod intervene;
mod intervene_ab;
mod keepalive;
mod kernel_gate;
mod ledger_cli;
mod leftovers;
mod logs;
mod messages;
mod namespaces;
mod ops_pack;
mod passthrough;
mod policy;
mod privileges;
mod proxy;
mod readiness;
mod real_backend;
mod reload;
mod responses;
mod restart_circuit;
mod restart_state;
mod safety_check;
mod scopes;
mod slow_readers;
mod token_instructions;
mod tool_circuit;
mod tool_circuit_loops;
mod upstream_pool;
mod upstream_tls;
