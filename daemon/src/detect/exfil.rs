//! Exfiltration detector (`EXFIL_ALERT`, issue 4 point 4): finds secrets and credentials in the
//! model's output text while it streams, token by token, and decides how much of that text may
//! be *released* (emitted to the client) so that no byte of a secret ever is.
//!
//! Pure and I/O-free: the data plane owns the frames and the trip; this module only answers, per
//! token, "release this many more bytes" or "breach".
//!
//! # Guarantee
//!
//! Let the turn's text be the concatenation of everything passed to [`ExfilScanner::push`].
//! A *match* is a byte range `[s, e)` of that text that one rule (see [`builtin_rule_names`] and
//! [`ExfilConfig::extra_patterns`]) matches, anchored at `s`; for the rules with a value check
//! (`keyword_entropy`, `bearer_token`, `openai_api_key`) the check must pass too.
//!
//! - **Nothing of a match is released before it is decided.** A byte `p` is released only when
//!   every candidate match that starts at or before `p` has been ruled out: no rule can match at
//!   any start `s <= p`, whatever text follows. So no byte of a complete match of any rule is
//!   ever released before that match is reported as [`ExfilStep::Breach`]. (In `hard` mode the
//!   caller releases nothing more from then on: the secret is never emitted, not even in part.)
//! - **The hold-back is bounded.** Every rule has a finite maximum match length, checked when
//!   the rules are built: a built-in rule by construction, a user pattern or it is refused with
//!   [`ExfilError::Pattern`]. A candidate match is dropped once it is longer than the longest
//!   possible match, so after every `push` that returns [`ExfilStep::Release`],
//!   `held_bytes() <= ExfilRules::max_match_len() <= max_holdback_bytes`. There is no cut-off
//!   at the bound that would either leak a long match or trip on long innocent text: the bound
//!   is a property of the rules, not a timeout.
//! - **Token boundaries do not matter.** The decision after each byte depends only on the text
//!   so far, never on how it was split into tokens: the same text gives the same breaches, and
//!   the same prefix the same release point, whatever the chunking (property-tested).
//! - **Looking ahead changes no decision.** [`ExfilScanner::look_ahead`] lets a caller that
//!   knows the next text (the built-in model's next token) release now the held bytes that
//!   the push of that text would release; it holds what could still be a match within that
//!   text or at the end of the text so far. Breaches and everything else are decided by
//!   `push` and `finish` as before (property-tested over every split of a secret between the
//!   current and the next token).
//!
//! # How
//!
//! All rules (built-in and user) are compiled once, in [`ExfilRules::new`], into **one dense
//! multi-pattern DFA** (`regex_automata::dfa::dense`, anchored starts, `MatchKind::All`).
//! The scanner runs that DFA *anchored at every byte position* of the text: each position `s`
//! that the DFA has not yet rejected is a live candidate start with its own DFA state. Per byte,
//! the scanner starts a candidate at that position (with the previous byte as look-behind, so
//! `\b` and `^` work across tokens) and advances every live candidate by one transition:
//!
//! - a dead state means no continuation can match from `s`: the candidate is dropped;
//! - a match state means a match `[s, e)` is complete (a DFA reports it one byte late, or at
//!   the end of the turn): for a plain rule that is a breach; for a rule with a value check the
//!   value is extracted (a capture regex, run only on these rare events) and checked;
//! - otherwise the candidate stays live.
//!
//! The release point is the start of the earliest live candidate (or the end of the text when
//! none is live), which is exactly the "earliest position some rule could still cover" of the
//! guarantee. Because a DFA state is *dead* exactly when no continuation of the text can lead to
//! a match, "could still match" is decided exactly, not by a heuristic window.
//!
//! Why this crate and engine: `regex-automata`'s DFAs expose the automaton one transition at a
//! time (`start_state` with an explicit look-behind byte, `next_state`, `next_eoi_state`,
//! `is_dead_state`), which is what lets a scan resume across token boundaries without rescanning
//! and lets each candidate start be judged "dead or still possible". The `regex` crate only
//! searches complete haystacks and cannot say whether a prefix could still become a match;
//! `aho-corasick` matches literals only (no classes or counted repetitions). A *dense* DFA rather
//! than the lazy `hybrid` one: a lazy DFA's state ids are invalidated whenever its cache is
//! cleared, and this scanner holds many states at once; a dense DFA is built once, immutable,
//! shared by every stream through an `Arc` without locking, and costs one table lookup per
//! transition. Its size is bounded when building (an error, not a slow stream, if a user
//! pattern is too large).
//!
//! # Cost
//!
//! Per byte: one start-state lookup plus one transition per live candidate (in prose, almost
//! always zero or one). No allocation per token: the buffer of held text and the candidate list
//! keep their capacity; allocations happen per turn ([`ExfilScanner::new`], or none with
//! [`ExfilScanner::reset`]) and on the rare events (a value check, a breach). The measured cost
//! and hold-back are printed by the `#[ignore]`d tests `holdback_distribution_on_corpus` and
//! `push_cost_per_token`.
//!
//! # What counts as a secret
//!
//! See [`builtin_rule_names`] for the list and the tests for examples. Decisions on look-alikes:
//! the prefix `AKIA` in prose, short hex ids, UUIDs, bare base64 of ordinary words and a PEM
//! *public* key are not secrets; a UUID or base64 given as the value of a key word
//! (`api_key = 123e4567-...`) is. The value check of `keyword_entropy`, `bearer_token` and
//! `openai_api_key` is: at least one ASCII letter, at least one digit or one of `!@#$%^&*+~`,
//! and Shannon entropy of at least [`ExfilConfig::entropy_min_bits_per_char`] bits per byte.
//! This passes random keys of every common alphabet and rejects identifiers, placeholders and
//! pure numbers (`YOUR_API_KEY_GOES_HERE`, `get_secret_from_vault()`, `12345678901234567890`),
//! at the price of missing an all-letter passphrase such as `correcthorsebatterystaple`.
//!
//! # Limitations
//!
//! - Encoded or transformed secrets (base64 of a key, a key split by spaces, spelled out, in
//!   another alphabet) are not recognised; neither are secrets without a recognisable shape or
//!   key word.
//! - A JWT is recognised from its header segment plus the start of its payload (`eyJ...` `.`
//!   `ey...`); the signature is not awaited, since a payload can be arbitrarily long and waiting
//!   for it would make the hold-back unbounded.
//! - A PEM block is recognised from its `-----BEGIN ... PRIVATE KEY-----` line followed by at
//!   least 32 base64 characters; the header line alone (as in prose about PEM files) is not.
//! - User patterns must have a bounded match length no greater than `max_holdback_bytes`
//!   (write `{1,64}`, not `+`). Because a breach fires on the shortest complete match, this is
//!   rarely a restriction: `secret-\w{1}` trips on exactly the texts that `secret-\w+` does.
//!   Unicode `\b` is not supported by DFAs; use `(?-u:\b)`. `$` is the end of the turn
//!   (`(?m)$` is a line end). Prefer ASCII classes (`[A-Za-z0-9_]`, `(?-u:\w)`): a Unicode
//!   class under a large count makes a large DFA (`\w{1,64}` alone is about 10 MB; the
//!   combined DFA is capped at 32 MB, beyond which the rules fail to build).
//! - The data plane releases whole tokens, so a token straddling the release point waits for
//!   the rest of it: the client-side hold-back can exceed `held_bytes()` by part of one token.
//!   Such a token waits one inter-token gap for the next one, unless a look-ahead at that next
//!   token rules the held text out (the built-in model: 0.4 % of its tokens still wait, 6.0 %
//!   without the look-ahead; `holdback_distribution_on_corpus`).
//!
//! # Files
//!
//! - `patterns`: the built-in rules, as regexes (what counts as a secret);
//! - `rules`: every rule compiled into the shared DFAs, and the judgement of a match;
//! - `scanner`: the per-turn scanner that runs them over the text and says what to release.

use serde::{Deserialize, Serialize};

mod patterns;
mod rules;
mod scanner;

pub use patterns::builtin_rule_names;
pub use rules::ExfilRules;
pub use scanner::ExfilScanner;

/// The `exfil` detector's configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExfilConfig {
    /// Extra rules: regexes (the `regex` crate's syntax) whose matches are secrets. Each must
    /// not match the empty string and must have a bounded match length of at most
    /// `max_holdback_bytes`. Named `custom[i]` in breaches (`i` = index in this list).
    pub extra_patterns: Vec<String>,
    /// The most text the scanner may hold back, in bytes (default 512). Building the rules
    /// fails if some rule's longest match is longer (the built-in rules need about 360).
    pub max_holdback_bytes: usize,
    /// Minimum Shannon entropy, in bits per byte, of a value for the value-checked rules
    /// (default 3.0: random base62/base64 keys of 20+ characters and random hex keys of 32+
    /// always exceed it; about 3% of random 20-character hex strings fall below).
    pub entropy_min_bits_per_char: f64,
    /// Minimum length of a value after a key word for `keyword_entropy` (default 20).
    pub entropy_min_len: usize,
    /// Built-in rules to turn off, by name ([`builtin_rule_names`]).
    pub disabled_rules: Vec<String>,
}

impl Default for ExfilConfig {
    fn default() -> Self {
        Self {
            extra_patterns: Vec::new(),
            max_holdback_bytes: 512,
            entropy_min_bits_per_char: 3.0,
            entropy_min_len: 20,
            disabled_rules: Vec::new(),
        }
    }
}

/// Why the rules could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ExfilError {
    /// A user pattern (`extra_patterns[index]`) is invalid or unusable.
    #[error("exfil.extra_patterns[{index}] ({pattern:?}): {reason}")]
    Pattern {
        index: usize,
        pattern: String,
        reason: String,
    },
    /// Any other configuration problem.
    #[error("exfil: {0}")]
    Config(String),
}

/// A detected secret. Carries no secret material: the rule, where the match is in the turn's
/// text, and a short fingerprint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExfilHit {
    /// The rule's name: a built-in name or `custom[i]`.
    pub rule: String,
    /// Byte offset of the match in the turn's text (everything pushed since the turn began).
    pub start: usize,
    /// Length of the match in bytes. For value-checked rules it includes the byte that ended
    /// the value, when there was one.
    pub len: usize,
    /// The first 4 bytes of the SHA-256 of the matched bytes, big-endian: lets records tell
    /// repeats of one secret apart from different ones without holding the secret.
    pub fingerprint: u32,
}

/// The text that follows what was pushed, as far as the caller knows it before pushing it
/// ([`ExfilScanner::look_ahead`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ahead<'a> {
    /// The next push brings exactly this text.
    Text(&'a str),
    /// Nothing more is pushed: the turn's text ends here.
    End,
}

/// What one [`ExfilScanner::push`] or [`ExfilScanner::finish`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExfilStep {
    /// This many more bytes, at the front of the not-yet-released text, are now safe to
    /// release (0 is common: everything new is held). The scanner counts them as released.
    Release(usize),
    /// A rule matched. Nothing was released by this call. In `hard` mode release nothing more
    /// (held text before `hit.start` may itself belong to an undecided candidate). In
    /// `observe` mode keep pushing: the match counts as decided and is released with what
    /// follows.
    Breach(ExfilHit),
}

#[cfg(test)]
mod tests;
