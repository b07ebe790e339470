//! The `content` of a chat message that a translated surface writes (Messages, Responses):
//! a string where the message is text only, so that backends and chat templates that take
//! only strings serve it; an array of parts where it has an image.
//!
//! A leaf of the wire layer, shared by the translations so that they never import each other.

use serde_json::{json, Value};

/// A text or image part of a message's content, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Text(String),
    /// The chat `image_url` object (`url`, and `detail` when the surface gives one).
    Image(Value),
}

/// The chat `content` of `parts`: the texts concatenated, or an array of parts when there is
/// an image.
pub fn content(parts: Vec<Part>) -> Value {
    if !parts.iter().any(|p| matches!(p, Part::Image(_))) {
        let text: String = parts
            .into_iter()
            .filter_map(|p| match p {
                Part::Text(t) => Some(t),
                Part::Image(_) => None,
            })
            .collect();
        return Value::String(text);
    }
    let parts = parts.into_iter().map(|p| match p {
        Part::Text(t) => json!({"type": "text", "text": t}),
        Part::Image(image) => json!({"type": "image_url", "image_url": image}),
    });
    Value::Array(parts.collect())
}
