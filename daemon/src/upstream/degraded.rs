//! What a degraded turn's upstream request becomes (spec 000 §4.2 step 4): the shape that
//! [`super::request::prepare_turn`] gives a translated request and [`super::native`] a
//! passed-through one.

/// What a degraded turn's upstream request becomes (spec 000 §4.2 step 4, fact-only literal
/// content): no tool fields, `temperature` 0, and `instruction` (`--degraded-instruction`;
/// none when empty) for the model to read first: a system message put first in a chat
/// request's messages, appended to a passed-through request's own instructions (Responses
/// `instructions`, Messages `system`). A completions request has no place for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DegradedShape<'a> {
    pub instruction: &'a str,
}

impl DegradedShape<'static> {
    /// The default shape (`--degraded-instruction`'s default).
    pub const DEFAULT: DegradedShape<'static> = DegradedShape {
        instruction: "Answer only with facts stated literally in this conversation. Do not guess, speculate or infer; if the conversation does not state the answer, say so.",
    };
}
