//! Token sources: where the tokens that haltd governs come from (DESIGN §2).
//!
//! - [`builtin`]: a small deterministic language model compiled into the binary, with real
//!   per-token probabilities; used by the demo, the tests and the benchmarks, so that none of
//!   them needs a GPU, a network or model weights.
//!
//! The OpenAI-compatible upstream source lives with the control plane's HTTP client.

pub mod builtin;
