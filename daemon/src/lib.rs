//! haltd: a token-stream governor for LLM inference nodes.
//!
//! (Architecture overview: see `docs/architecture.md`; filled in as the modules land.)

pub mod codes;
pub mod monitor;
pub mod source;
pub mod ledger;
