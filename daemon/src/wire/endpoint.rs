//! Which OpenAI endpoint a request came in on, and so which shapes its answer takes.

use serde::Serialize;

/// Which OpenAI endpoint a stream answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Endpoint {
    #[default]
    Chat = 0,
    Completion = 1,
}
