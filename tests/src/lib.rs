//! Shared harness for the root-only integration tests (network namespaces, haltd processes, clients).
