//! A labelled set from the built-in model, for calibrating without a real model's data.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::LabelledStream;
use crate::source::builtin::BuiltinModel;

/// Prompts for [`builtin_labelled_set`] (the built-in model only uses them to seed).
const BUILTIN_PROMPTS: &[&str] = &[
    "Tell me about the river.",
    "Describe the node.",
    "What happened at the station?",
    "Write a short paragraph.",
    "Explain how the valley was mapped.",
    "Summarise the report.",
];

/// Tokens per generated stream: uniform in this range (the same for both labels, so length
/// does not give the label away).
pub(super) const BUILTIN_LEN: std::ops::RangeInclusive<u32> = 48..=160;
/// Length of the garbled span in a positive stream.
const BUILTIN_SPAN: std::ops::RangeInclusive<u32> = 16..=48;
/// Sampling temperature inside the garbled span.
const BUILTIN_TEMPERATURE: std::ops::RangeInclusive<f64> = 1.5..=3.0;

/// A labelled set from the built-in model: `n` streams, `n / 2` of them positive.
///
/// **What it measures.** Negatives (label 0) are the model's ordinary generations. Positives
/// (label 1) are generations where one contiguous span of 16–48 tokens, at a random place, is
/// sampled at a raised temperature (1.5–3.0, [`BuiltinStream::set_temperature`]): the text
/// there is garbled, while the reported logprobs stay the model's own untempered ones, as a
/// backend reports them. Both run with `ignore_eos` to a length drawn from the same 48–160
/// range. A calibration on this set therefore measures how well the detector tells garbled
/// spans from this model's normal output; it says nothing about hallucination in a real
/// model, for which a labelled set from that model is needed.
///
/// Deterministic in `(n, seed)`.
///
/// [`BuiltinStream::set_temperature`]: crate::source::builtin::BuiltinStream::set_temperature
pub fn builtin_labelled_set(n: usize, seed: u64) -> Vec<LabelledStream> {
    let model = BuiltinModel::get();
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let positive = i % 2 == 1;
            let prompt = BUILTIN_PROMPTS[rng.random_range(0..BUILTIN_PROMPTS.len())];
            let len = rng.random_range(BUILTIN_LEN);
            let stream_seed: u64 = rng.random();
            let (span_start, span_end, temperature) = if positive {
                let span = rng.random_range(BUILTIN_SPAN).min(len);
                let start = rng.random_range(0..=len - span);
                (start, start + span, rng.random_range(BUILTIN_TEMPERATURE))
            } else {
                (0, 0, 1.0)
            };
            let mut stream = model
                .stream(prompt, Some(stream_seed), len)
                .with_ignore_eos(true);
            let mut logprobs = Vec::with_capacity(len as usize);
            let mut tokens = Vec::with_capacity(len as usize);
            for k in 0..len {
                stream.set_temperature(if (span_start..span_end).contains(&k) {
                    temperature
                } else {
                    1.0
                });
                let Some(tok) = stream.next_token(0) else {
                    break;
                };
                logprobs.push(Some(tok.logprob));
                tokens.push(tok.text.to_owned());
            }
            LabelledStream {
                id: if positive {
                    format!("builtin-{seed}-{i}-garbled-{span_start}..{span_end}-t{temperature:.2}")
                } else {
                    format!("builtin-{seed}-{i}-normal")
                },
                positive,
                logprobs,
                tokens: Some(tokens),
            }
        })
        .collect()
}
