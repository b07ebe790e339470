//! The built-in source: a word-level trigram language model trained from an embedded corpus.
//!
//! haltd's detectors act on per-token probabilities (the surprise detector, logprob
//! pass-through), so the demo and test source has to produce real ones, not canned numbers.
//! This model is trained once, at first use, from `corpus.txt` (original prose shipped in the
//! binary), and then samples text token by token:
//!
//! - **Tokens** are words with their leading space (`" river"`) and punctuation marks as
//!   tokens of their own (`","`, `"."`), like a BPE stream; the text is the tokens joined.
//!   Each corpus paragraph is one training sequence and ends with an end-of-text event, so the
//!   model can stop by itself, usually after a sentence end ([`FinishReason::Stop`]).
//!   Every token is far shorter than the frame cap
//!   ([`crate::wire::MAX_TOKEN_TEXT_BYTES`]), so each goes out whole in one frame.
//! - **Distribution.** For the context `(u, v)` of the last two tokens the candidates are the
//!   tokens seen after `v`. Each gets `λ·c(u,v,w)/c(u,v) + (1-λ)·c(v,w)/c(v)`, with the
//!   Witten–Bell-style weight `λ = c(u,v) / (c(u,v) + T(u,v)/2)` (`T` = distinct followers of
//!   `(u,v)`, `λ = 0` for an unseen pair). That is a proper distribution over the candidates,
//!   and the token is sampled from exactly it: the reported `logprob` is `ln p` of the sampled
//!   token, and the top alternatives are the most likely candidates under the same `p`.
//!   The end-of-text event is part of that distribution but is not a token, so it never
//!   appears among the alternatives (their probabilities therefore sum to at most 1).
//! - **Determinism.** The sampler is a self-contained splitmix64 seeded from the request's seed
//!   (a fixed default when absent) mixed with an FNV-1a hash of the prompt, so the same
//!   `(prompt, seed)` always yields the same tokens on every build, independent of the `rand`
//!   crate's version, and different prompts give different text.
//! - **Hot path.** [`BuiltinStream::next_token`] does not allocate: tokens are `&'static str`
//!   into the trained vocabulary, candidate lists are precomputed CSR slices, and the
//!   alternatives are a fixed-capacity array.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::LazyLock;

/// The model name reported in responses (`"model": "builtin"`).
pub const MODEL_NAME: &str = "builtin";

/// The most alternatives [`TopLogprobs`] can hold (the OpenAI API's `top_logprobs` maximum).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Seed used when a request gives none: the model stays deterministic per prompt.
const DEFAULT_SEED: u64 = 0x6861_6c74_645f_6275; // "haltd_bu"

/// Weight of the distinct-follower count in the trigram/bigram interpolation weight.
const WITTEN_BELL_FACTOR: f64 = 0.2;

const CORPUS: &str = include_str!("corpus.txt");

/// Token id of the end-of-text event (never emitted as text).
const EOS: u32 = 0;
/// Token id of the start-of-text context (never sampled).
const BOS: u32 = 1;
/// Punctuation marks that are tokens of their own.
const PUNCTUATION: &[char] = &[',', '.', ';', ':', '!', '?'];

static MODEL: LazyLock<BuiltinModel> = LazyLock::new(|| BuiltinModel::train(CORPUS));

/// Why a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// The model ended the text by itself.
    Stop,
    /// `max_tokens` was reached.
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub const fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The most likely alternatives at one position, most likely first (ties: vocabulary order).
///
/// Fixed capacity ([`MAX_TOP_LOGPROBS`]) so that producing it never allocates.
#[derive(Clone, Copy)]
pub struct TopLogprobs {
    items: [(&'static str, f32); MAX_TOP_LOGPROBS],
    len: u8,
}

impl TopLogprobs {
    /// No alternatives.
    pub const fn new() -> Self {
        Self {
            items: [("", 0.0); MAX_TOP_LOGPROBS],
            len: 0,
        }
    }

    /// `(token, logprob)` pairs, sorted by descending logprob.
    pub fn as_slice(&self) -> &[(&'static str, f32)] {
        &self.items[..usize::from(self.len)]
    }

    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Inserts keeping the list sorted and at most `cap` long. Equal logprobs keep insertion
    /// order, which is vocabulary order, so the list is deterministic.
    fn offer(&mut self, cap: usize, text: &'static str, logprob: f32) {
        let len = usize::from(self.len);
        if cap == 0 || (len == cap && logprob <= self.items[len - 1].1) {
            return;
        }
        let pos = self.items[..len].partition_point(|&(_, lp)| lp >= logprob);
        let new_len = if len < cap { len + 1 } else { cap };
        // Shift the tail right by one (dropping the last entry when full).
        let mut i = new_len - 1;
        while i > pos {
            self.items[i] = self.items[i - 1];
            i -= 1;
        }
        self.items[pos] = (text, logprob);
        // new_len <= MAX_TOP_LOGPROBS = 20, so it fits in a u8.
        self.len = new_len as u8;
    }
}

impl Default for TopLogprobs {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for TopLogprobs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// One sampled token.
#[derive(Debug, Clone, Copy)]
pub struct TokenSample {
    /// The token's text (never empty).
    pub text: &'static str,
    /// Natural log of the probability the model gave this token when sampling it.
    pub logprob: f32,
    /// The `top_n` most likely alternatives under the same distribution (may include `text`).
    pub top: TopLogprobs,
}

/// One candidate continuation: the next token and how often it followed the context.
#[derive(Debug, Clone, Copy)]
struct Edge {
    next: u32,
    count: u32,
}

/// A trigram context's followers: `tri_next[start..start + len]`, `total` occurrences.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: u32,
    len: u32,
    total: u32,
}

/// The trained model. Obtain it with [`BuiltinModel::get`].
pub struct BuiltinModel {
    /// Token text by id; ids [`EOS`] and [`BOS`] are empty.
    vocab: Vec<Box<str>>,
    /// Bigram followers of token `v`: `bi_next[bi_start[v]..bi_start[v + 1]]`, sorted by id.
    bi_start: Vec<u32>,
    bi_next: Vec<Edge>,
    /// How often token `v` occurred as a context.
    bi_total: Vec<u32>,
    /// Trigram followers of `(u, v)`, sorted by id, in `tri_next`.
    tri: HashMap<(u32, u32), Span>,
    tri_next: Vec<Edge>,
}

impl fmt::Debug for BuiltinModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The tables are large and meaningless in a log line; the sizes identify the model.
        f.debug_struct("BuiltinModel")
            .field("vocab_size", &self.vocab_size())
            .field("bigrams", &self.bi_next.len())
            .field("trigrams", &self.tri_next.len())
            .finish()
    }
}

/// A piece of text as the tokenizer sees it.
enum Piece<'a> {
    Word(&'a str),
    Punct(&'a str),
}

/// Splits text into words (letters, digits, inner `'` and `-`) and punctuation marks; other
/// characters only separate.
fn for_each_piece<'a>(text: &'a str, mut f: impl FnMut(Piece<'a>)) {
    let is_word = |c: char| c.is_alphanumeric() || c == '\'' || c == '-';
    let mut word_start: Option<usize> = None;
    for (i, c) in text.char_indices() {
        if is_word(c) {
            word_start.get_or_insert(i);
            continue;
        }
        if let Some(s) = word_start.take() {
            f(Piece::Word(&text[s..i]));
        }
        if PUNCTUATION.contains(&c) {
            f(Piece::Punct(&text[i..i + c.len_utf8()]));
        }
    }
    if let Some(s) = word_start {
        f(Piece::Word(&text[s..]));
    }
}

impl BuiltinModel {
    /// The model, trained on first use.
    pub fn get() -> &'static BuiltinModel {
        &MODEL
    }

    /// Number of distinct text tokens the model can emit.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len() - 2
    }

    /// How many tokens the model's tokenizer splits `text` into (for `usage.prompt_tokens`).
    pub fn count_tokens(&self, text: &str) -> usize {
        let mut n = 0;
        for_each_piece(text, |_| n += 1);
        n
    }

    /// A new generation for `prompt`. The same `(prompt, seed)` always yields the same stream.
    pub fn stream(
        &'static self,
        prompt: &str,
        seed: Option<u64>,
        max_tokens: u32,
    ) -> BuiltinStream {
        let mut rng =
            SplitMix64(seed.unwrap_or(DEFAULT_SEED) ^ fnv1a(prompt.as_bytes()).rotate_left(29));
        // One draw to spread the mixed seed before the first sample.
        rng.0 = rng.next_u64();
        BuiltinStream {
            model: self,
            rng,
            ctx: (BOS, BOS),
            generated: 0,
            max_tokens,
            finish: None,
            ignore_eos: false,
            temperature: 1.0,
        }
    }

    fn train(corpus: &str) -> BuiltinModel {
        let mut vocab: Vec<Box<str>> = vec!["".into(), "".into()];
        let mut ids: HashMap<String, u32> = HashMap::new();
        let mut bigrams: BTreeMap<(u32, u32), u32> = BTreeMap::new();
        let mut trigrams: BTreeMap<(u32, u32, u32), u32> = BTreeMap::new();

        for paragraph in corpus.split("\n\n") {
            let mut seq = vec![BOS, BOS];
            for_each_piece(paragraph, |piece| {
                let text = match piece {
                    Piece::Word(w) => format!(" {w}"),
                    Piece::Punct(p) => p.to_owned(),
                };
                let next_id = u32::try_from(vocab.len()).unwrap_or(u32::MAX);
                let id = *ids.entry(text).or_insert_with_key(|t| {
                    vocab.push(t.as_str().into());
                    next_id
                });
                seq.push(id);
            });
            if seq.len() == 2 {
                continue; // blank paragraph
            }
            seq.push(EOS);
            for w in seq.windows(3) {
                *bigrams.entry((w[1], w[2])).or_default() += 1;
                *trigrams.entry((w[0], w[1], w[2])).or_default() += 1;
            }
        }

        let n = vocab.len();
        let mut bi_start = vec![0u32; n + 1];
        let mut bi_total = vec![0u32; n];
        let mut bi_next = Vec::with_capacity(bigrams.len());
        // BTreeMap order is (v, w) ascending: followers come grouped by v, sorted by w.
        for (&(v, w), &count) in &bigrams {
            bi_start[v as usize + 1] += 1;
            bi_total[v as usize] += count;
            bi_next.push(Edge { next: w, count });
        }
        for i in 0..n {
            bi_start[i + 1] += bi_start[i];
        }

        let mut tri: HashMap<(u32, u32), Span> = HashMap::new();
        let mut tri_next = Vec::with_capacity(trigrams.len());
        for (&(u, v, w), &count) in &trigrams {
            let start = tri_next.len() as u32;
            let span = tri.entry((u, v)).or_insert(Span {
                start,
                len: 0,
                total: 0,
            });
            span.len += 1;
            span.total += count;
            tri_next.push(Edge { next: w, count });
        }

        BuiltinModel {
            vocab,
            bi_start,
            bi_next,
            bi_total,
            tri,
            tri_next,
        }
    }

    fn followers(&self, v: u32) -> (&[Edge], u32) {
        let v = v as usize;
        match (self.bi_start.get(v), self.bi_start.get(v + 1)) {
            (Some(&s), Some(&e)) => (&self.bi_next[s as usize..e as usize], self.bi_total[v]),
            _ => (&[], 0),
        }
    }

    fn trigram_followers(&self, u: u32, v: u32) -> (&[Edge], u32) {
        match self.tri.get(&(u, v)) {
            Some(s) => (
                &self.tri_next[s.start as usize..(s.start + s.len) as usize],
                s.total,
            ),
            None => (&[], 0),
        }
    }
}

/// The next-token distribution for one context: walks the candidates with their probability.
///
/// Both follower lists are sorted by token id and every trigram follower is also a bigram
/// follower, so one merge walk gives each candidate its interpolated probability.
struct Distribution<'m> {
    bi: &'m [Edge],
    bi_total: f64,
    tri: &'m [Edge],
    tri_total: f64,
    lambda: f64,
}

impl<'m> Distribution<'m> {
    fn new(model: &'m BuiltinModel, (u, v): (u32, u32)) -> Self {
        let (bi, bi_total) = model.followers(v);
        let (tri, tri_total) = model.trigram_followers(u, v);
        let lambda = if tri_total == 0 {
            0.0
        } else {
            let c = f64::from(tri_total);
            c / (c + WITTEN_BELL_FACTOR * tri.len() as f64)
        };
        Self {
            bi,
            bi_total: f64::from(bi_total),
            tri,
            tri_total: f64::from(tri_total),
            lambda,
        }
    }

    /// Calls `f(token, p)` for every candidate, in token-id order.
    #[inline]
    fn for_each(&self, mut f: impl FnMut(u32, f64)) {
        let mut j = 0;
        for e in self.bi {
            let mut p = (1.0 - self.lambda) * f64::from(e.count) / self.bi_total;
            if let Some(t) = self.tri.get(j) {
                if t.next == e.next {
                    p += self.lambda * f64::from(t.count) / self.tri_total;
                    j += 1;
                }
            }
            f(e.next, p);
        }
    }
}

/// One generation in progress. Produced by [`BuiltinModel::stream`].
#[derive(Debug, Clone)]
pub struct BuiltinStream {
    model: &'static BuiltinModel,
    rng: SplitMix64,
    ctx: (u32, u32),
    generated: u32,
    max_tokens: u32,
    finish: Option<FinishReason>,
    /// vLLM's `ignore_eos`: the end-of-text event is taken out of the distribution (which is
    /// renormalised, so logprobs stay those of the distribution actually sampled).
    ignore_eos: bool,
    /// Sampling temperature ([`set_temperature`](Self::set_temperature)); 1.0 = the model's own
    /// distribution.
    temperature: f64,
}

impl BuiltinStream {
    /// Never stop by itself: generate until `max_tokens` (vLLM's `ignore_eos`).
    pub fn with_ignore_eos(mut self, ignore_eos: bool) -> Self {
        self.ignore_eos = ignore_eos;
        self
    }

    /// Samples from now on at `temperature` (builder form of
    /// [`set_temperature`](Self::set_temperature)).
    pub fn with_temperature(mut self, temperature: f64) -> Self {
        self.set_temperature(temperature);
        self
    }

    /// Samples the following tokens from the model's distribution raised to the power
    /// `1/temperature` (renormalised): above 1.0 less likely tokens are drawn more often, which
    /// garbles the text. **The reported `logprob` and alternatives stay the model's own,
    /// untempered ones** (like vLLM's default raw logprobs), so a raised temperature shows up as
    /// higher surprise. Used to build labelled sets for `haltctl calibrate --builtin-set`;
    /// the data plane never calls it. A temperature that is not finite and positive is ignored
    /// (the previous one stays); 1.0, the default, samples exactly as a stream that never set
    /// it.
    pub fn set_temperature(&mut self, temperature: f64) {
        if temperature.is_finite() && temperature > 0.0 {
            self.temperature = temperature;
        }
    }

    /// Samples the next token, with the `top_n` (at most [`MAX_TOP_LOGPROBS`]) most likely
    /// alternatives. `None` when the stream has finished; see [`finish_reason`](Self::finish_reason).
    pub fn next_token(&mut self, top_n: usize) -> Option<TokenSample> {
        if self.finish.is_some() {
            return None;
        }
        if self.generated >= self.max_tokens {
            self.finish = Some(FinishReason::Length);
            return None;
        }
        let model = self.model;
        let dist = Distribution::new(model, self.ctx);

        let ignore_eos = self.ignore_eos;
        let mut total = 0.0;
        dist.for_each(|id, p| {
            if !(ignore_eos && id == EOS) {
                total += p;
            }
        });
        if total <= 0.0 {
            // A context with no followers cannot happen with the embedded corpus (every token
            // but the end has a successor); end cleanly rather than loop.
            self.finish = Some(FinishReason::Stop);
            return None;
        }

        // Inverse-CDF sampling over the same probabilities the caller is told about (at
        // temperature 1; otherwise over p^(1/T), while the caller is still told p).
        let inv_t = 1.0 / self.temperature;
        let tempered = self.temperature != 1.0;
        let weight = |p: f64| if tempered { p.powf(inv_t) } else { p };
        let mut sample_total = total;
        if tempered {
            sample_total = 0.0;
            dist.for_each(|id, p| {
                if !(ignore_eos && id == EOS) {
                    sample_total += weight(p);
                }
            });
        }
        let threshold = self.rng.next_f64() * sample_total;
        let top_n = top_n.min(MAX_TOP_LOGPROBS);
        let mut top = TopLogprobs::new();
        let mut acc = 0.0;
        let mut chosen: Option<(u32, f32)> = None;
        let mut last: Option<(u32, f32)> = None;
        dist.for_each(|id, p| {
            if ignore_eos && id == EOS {
                return;
            }
            let logprob = (p / total).ln() as f32;
            if id != EOS {
                if let Some(text) = model.vocab.get(id as usize) {
                    top.offer(top_n, text, logprob);
                }
            }
            if p > 0.0 {
                last = Some((id, logprob));
            }
            acc += weight(p);
            if chosen.is_none() && acc > threshold {
                chosen = Some((id, logprob));
            }
        });
        // Rounding can leave the threshold just above the final sum: take the last candidate.
        let (id, logprob) = chosen.or(last)?;

        if id == EOS {
            self.finish = Some(FinishReason::Stop);
            return None;
        }
        self.ctx = (self.ctx.1, id);
        self.generated += 1;
        let text: &'static str = model.vocab.get(id as usize)?;
        Some(TokenSample { text, logprob, top })
    }

    /// The text of the token [`next_token`](Self::next_token) will return, `None` when it will
    /// end the stream, without taking it: the same sampling on a copy of the stream's state
    /// (`top_n` does not change what is sampled). So the next `next_token` returns exactly
    /// this unless the stream is changed in between ([`set_temperature`](Self::set_temperature)).
    /// Costs one more sampling of the distribution; no allocation.
    pub fn peek_text(&self) -> Option<&'static str> {
        self.clone().next_token(0).map(|t| t.text)
    }

    /// Why the stream ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Tokens returned so far.
    pub fn tokens_generated(&self) -> u32 {
        self.generated
    }

    /// The model's context (its last two tokens): where the next token is sampled from.
    pub fn context(&self) -> (u32, u32) {
        self.ctx
    }

    /// Continues as if the stream had returned only `generated` tokens, the last two of
    /// which make `ctx` ([`context`](Self::context) taken then), with its random draws from
    /// now on mixed with `salt` (a grounding round's evidence, `source/resume.rs`): the same
    /// prefix and salt always continue alike, a different salt differently.
    pub fn resume_at(&mut self, ctx: (u32, u32), generated: u32, salt: u64) {
        self.ctx = ctx;
        self.generated = generated;
        self.finish = None;
        self.rng.0 ^= salt.rotate_left(17);
        self.rng.0 = self.rng.next_u64();
    }

    /// Counts a token the source said without sampling it (a word it reads,
    /// `source/resume.rs`): `false`, and nothing counted, once the stream has ended or
    /// reached `max_tokens` (its next [`next_token`](Self::next_token) then ends it).
    pub fn count_read(&mut self) -> bool {
        if self.finish.is_some() || self.generated >= self.max_tokens {
            return false;
        }
        self.generated += 1;
        true
    }
}

/// The FNV-1a hash (for the resume salt of a grounding round, `source/resume.rs`).
pub(crate) fn hash(bytes: &[u8]) -> u64 {
    fnv1a(bytes)
}

/// splitmix64: small, fast, and fixed forever, so seeded output never changes with a crate
/// upgrade.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// FNV-1a, 64 bit: a stable hash of the prompt for seeding.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests;
