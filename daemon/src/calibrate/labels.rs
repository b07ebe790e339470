//! The labels file (format in the [module docs](super)): one labelled token stream per line.

use std::collections::HashMap;
use std::io::{self, BufRead, Write};

use serde::{Deserialize, Serialize};

/// One labelled token stream: a line of the labels file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LabelledStream {
    pub id: String,
    /// `true` (`"label": 1`): the detector should trip on this stream.
    #[serde(rename = "label", with = "label_01")]
    pub positive: bool,
    /// Natural-log probability per token; `None` for a token that came without one.
    pub logprobs: Vec<Option<f32>>,
    /// The tokens' text, when known (same length as `logprobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<String>>,
}

/// `label` is written and read as the number 0 or 1.
mod label_01 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(positive: &bool, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(u8::from(*positive))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        match u8::deserialize(d)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(serde::de::Error::custom(format!(
                "label {v}: must be 0 or 1"
            ))),
        }
    }
}

/// A stream left out of the calibration, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Skipped {
    /// 1-based line of the labels file, when it came from one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    pub id: String,
    #[serde(rename = "label", with = "label_01")]
    pub positive: bool,
    pub reason: String,
}

/// A labels file that cannot be read; each names its line.
#[derive(Debug, thiserror::Error)]
pub enum LabelsError {
    #[error("labels line {line}: read failed: {source}")]
    Io {
        line: usize,
        #[source]
        source: io::Error,
    },
    #[error("labels line {line}: {source}")]
    Json {
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("labels line {line}: {tokens} tokens but {logprobs} logprobs")]
    LengthMismatch {
        line: usize,
        tokens: usize,
        logprobs: usize,
    },
    #[error("labels line {line}: id {id:?} is already used on line {first}")]
    DuplicateId {
        line: usize,
        id: String,
        first: usize,
    },
}

/// One line as written (`logprobs` may be absent or `null`).
#[derive(Deserialize)]
struct LineRepr {
    id: String,
    #[serde(with = "label_01")]
    label: bool,
    #[serde(default)]
    logprobs: Option<Vec<Option<f32>>>,
    #[serde(default)]
    tokens: Option<Vec<String>>,
}

/// Reads a labels file (format in the [module docs](self)). Lines without logprobs come back
/// as [`Skipped`]; malformed lines are errors naming the line.
pub fn read_labels(
    reader: impl BufRead,
) -> Result<(Vec<LabelledStream>, Vec<Skipped>), LabelsError> {
    let mut streams = Vec::new();
    let mut skipped = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, text) in reader.lines().enumerate() {
        let line = i + 1;
        let text = text.map_err(|source| LabelsError::Io { line, source })?;
        if text.trim().is_empty() {
            continue;
        }
        let repr: LineRepr =
            serde_json::from_str(&text).map_err(|source| LabelsError::Json { line, source })?;
        if let Some(&first) = seen.get(&repr.id) {
            return Err(LabelsError::DuplicateId {
                line,
                id: repr.id,
                first,
            });
        }
        seen.insert(repr.id.clone(), line);
        let logprobs = repr.logprobs.unwrap_or_default();
        if let Some(tokens) = &repr.tokens {
            if tokens.len() != logprobs.len() && !logprobs.is_empty() {
                return Err(LabelsError::LengthMismatch {
                    line,
                    tokens: tokens.len(),
                    logprobs: logprobs.len(),
                });
            }
        }
        if logprobs.is_empty() {
            skipped.push(Skipped {
                line: Some(line),
                id: repr.id,
                positive: repr.label,
                reason: "the stream has no logprobs".to_owned(),
            });
            continue;
        }
        streams.push(LabelledStream {
            id: repr.id,
            positive: repr.label,
            logprobs,
            tokens: repr.tokens,
        });
    }
    Ok((streams, skipped))
}

/// Writes streams as a labels file (one JSON object per line).
pub fn write_labels(mut w: impl Write, streams: &[LabelledStream]) -> io::Result<()> {
    for s in streams {
        serde_json::to_writer(&mut w, s)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}
