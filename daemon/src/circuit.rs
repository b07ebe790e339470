//! TokenCircuit (spec 002): the failure state machine for agents' tool-call loops.
//!
//! haltd sees both halves of every tool round trip: the model's tool calls stream out
//! through it, and their results come back in the next request as `role: "tool"` messages.
//! This module is the pure part: it judges a tool call from the conversation's own history,
//! so it needs no store for what a transcript shows.
//!
//! * [`key`]: the [`EquivalenceKey`], the raw fields a failure is grouped by.
//! * [`class`]: the six [`FailureClass`]es with their next allowed action, default budget
//!   and verifier (the spec's table).
//! * [`canonical`]: canonical JSON arguments, so a reordered or re-spaced retry is the same
//!   call.
//! * [`evidence`] reads what a tool result carries (HTTP status, error codes and exception
//!   names, `Retry-After`, timeouts, empty results); [`classify`] turns that evidence into a
//!   class, with the tool's [`registry`] profile (side effects, verifier).
//! * [`policy`]: the budgets and backoff in force (configurable, the spec's values by
//!   default).
//! * [`artifact`]: the [`DiagnosticArtifact`] attached to every intervention, and the
//!   [`CircuitError`] carrying it.
//! * [`machine`]: the per-target state machine ([`Circuit`]); [`transcript`] rebuilds it
//!   from a request's messages.
//! * [`store`]: what the transcript cannot carry (the backoff clock, the intervention
//!   artifacts), per conversation, bounded, in memory; [`show`] prints its admin view.
//! * [`memory`]: the failed calls the store remembers, so that a trimmed or flattened
//!   transcript does not restore a budget.
//! * [`dispatched`]: the tool calls failed turns delivered, held until an operator
//!   reconciles them; a retry of one is refused meanwhile.
//!
//! The store and the dispatched calls are kept in the state store (`crate::state`), so a
//! restart or a crash forgets neither.

pub mod artifact;
pub mod canonical;
pub mod class;
pub mod classify;
pub mod config;
pub mod conversation;
pub mod dispatched;
pub mod evidence;
pub mod key;
pub mod machine;
pub mod memory;
pub mod metrics;
pub mod policy;
pub mod registry;
pub mod show;
pub mod store;
pub mod transcript;

pub use artifact::{CircuitError, DiagnosticArtifact};
pub use class::{FailureClass, NextAction, VerifierRequirement};
pub use key::EquivalenceKey;
pub use machine::{Circuit, ToolCall, Verdict};
pub use policy::{Backoff, Budgets, CircuitPolicy};
pub use registry::{Effect, ToolProfile, ToolRegistry};

#[cfg(test)]
mod tests;
