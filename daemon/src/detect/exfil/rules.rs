//! Every rule, built-in and user, compiled once into shared DFAs ([`ExfilRules`]), and the
//! judgement of a complete match: a secret or not (the value check).

use std::fmt;

use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::nfa::thompson::{self, WhichCaptures};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::util::syntax;
use regex_automata::{meta, Anchored, Input, MatchKind};
use sha2::{Digest, Sha256};

use super::patterns::{builtin_rules, STARTS_AFTER_NON_LETTER, VALUE_MAX};
use super::{ExfilConfig, ExfilError, ExfilHit};

/// Size limits for the compiled DFA (all rules together, and each user pattern alone).
const DFA_SIZE_LIMIT: usize = 32 << 20;
const DETERMINIZE_SIZE_LIMIT: usize = 64 << 20;

/// How a rule's match is judged.
enum Check {
    /// Any match is a secret.
    Plain,
    /// The match's value (capture group `value` or `value_max`) must pass [`value_is_secret`].
    /// The regex is the rule's pattern followed by `$`, run anchored on the matched bytes.
    Value(Box<meta::Regex>),
}

struct Rule {
    name: String,
    check: Check,
}

/// The compiled, shareable rule set. Build once per configuration, share through an `Arc`
/// with every stream's [`ExfilScanner`].
pub struct ExfilRules {
    /// Every rule: candidates that start at the beginning of the turn or after a byte that is
    /// not an ASCII letter.
    any: RuleDfa,
    /// The rules that may also start right after an ASCII letter (all but
    /// [`STARTS_AFTER_NON_LETTER`]); `None` when there are none.
    after_letter: Option<RuleDfa>,
    rules: Vec<Rule>,
    max_match_len: usize,
    max_holdback_bytes: usize,
    entropy_min_bits: f64,
}

/// One compiled DFA over some of the rules.
pub(super) struct RuleDfa {
    pub(super) dfa: dense::DFA<Vec<u32>>,
    /// Anchored start state for each look-behind: index = previous byte, 256 = none.
    starts: Box<[StateID]>,
    /// The index in [`ExfilRules::rules`] of each of the DFA's pattern ids.
    rule_of: Vec<usize>,
}

impl RuleDfa {
    fn build(patterns: &[&str], rule_of: Vec<usize>) -> Result<Self, ExfilError> {
        let dfa = dfa_builder()
            .build_many(patterns)
            .map_err(|e| ExfilError::Config(format!("compiling the rules: {e}")))?;
        let mut starts = Vec::with_capacity(257);
        for lb in (0..=255u8).map(Some).chain([None]) {
            let cfg = start::Config::new().anchored(Anchored::Yes).look_behind(lb);
            let id = dfa
                .start_state(&cfg)
                .map_err(|e| ExfilError::Config(format!("start state: {e}")))?;
            starts.push(id);
        }
        Ok(Self {
            dfa,
            starts: starts.into_boxed_slice(),
            rule_of,
        })
    }

    #[inline]
    pub(super) fn start_for(&self, prev: Option<u8>) -> StateID {
        self.starts[prev.map_or(256, usize::from)]
    }
}

impl fmt::Debug for ExfilRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExfilRules")
            .field("rules", &self.rule_names().collect::<Vec<_>>())
            .field("max_match_len", &self.max_match_len)
            .field("max_holdback_bytes", &self.max_holdback_bytes)
            .field("dfa_bytes", &self.dfa_memory_usage())
            .finish()
    }
}

fn dfa_builder() -> dense::Builder {
    let mut b = dense::Builder::new();
    b.configure(
        dense::DFA::config()
            .match_kind(MatchKind::All)
            .start_kind(StartKind::Anchored)
            .accelerate(false)
            .dfa_size_limit(Some(DFA_SIZE_LIMIT))
            .determinize_size_limit(Some(DETERMINIZE_SIZE_LIMIT)),
    )
    .syntax(syntax::Config::new())
    .thompson(thompson::Config::new().which_captures(WhichCaptures::None));
    b
}

/// Bounds of a pattern's match length in bytes, or why it has none.
fn match_len_bounds(pattern: &str) -> Result<(usize, usize), String> {
    let hir = syntax::parse(pattern).map_err(|e| e.to_string())?;
    let props = hir.properties();
    let min = props
        .minimum_len()
        .ok_or_else(|| "can never match".to_owned())?;
    if min == 0 {
        return Err("can match the empty string".to_owned());
    }
    let max = props.maximum_len().ok_or_else(|| {
        "has no upper bound on its match length (use a bounded repetition such as {1,64} \
         instead of + or *)"
            .to_owned()
    })?;
    Ok((min, max))
}

impl ExfilRules {
    /// Compiles the built-in rules (less `disabled_rules`) and the user patterns. A bad user
    /// pattern gives [`ExfilError::Pattern`] naming it and saying why.
    pub fn new(cfg: &ExfilConfig) -> Result<Self, ExfilError> {
        check_config(cfg)?;
        let mut set = RuleSet::default();
        set.add_builtins(cfg)?;
        set.add_user_patterns(cfg)?;
        let RuleSet {
            patterns,
            rules,
            max_match_len,
        } = set;
        let bound = cfg.max_holdback_bytes;
        let bits = cfg.entropy_min_bits_per_char;
        if patterns.is_empty() {
            return Err(ExfilError::Config(
                "no rules left (every built-in disabled and no extra_patterns)".to_owned(),
            ));
        }
        let all: Vec<&str> = patterns.iter().map(String::as_str).collect();
        let any = RuleDfa::build(&all, (0..rules.len()).collect())?;
        let (glued, glued_rules): (Vec<&str>, Vec<usize>) = rules
            .iter()
            .zip(&patterns)
            .enumerate()
            .filter(|(_, (r, _))| !STARTS_AFTER_NON_LETTER.contains(&r.name.as_str()))
            .map(|(i, (_, p))| (p.as_str(), i))
            .unzip();
        let after_letter = if glued.is_empty() {
            None
        } else {
            Some(RuleDfa::build(&glued, glued_rules)?)
        };
        Ok(Self {
            any,
            after_letter,
            rules,
            max_match_len,
            max_holdback_bytes: bound,
            entropy_min_bits: bits,
        })
    }

    /// Names of the active rules, built-in then `custom[i]`.
    pub fn rule_names(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().map(|r| r.name.as_str())
    }

    /// The longest match any active rule can have, in bytes: the actual bound on
    /// [`ExfilScanner::held_bytes`] (at most `max_holdback_bytes`).
    pub fn max_match_len(&self) -> usize {
        self.max_match_len
    }

    /// The configured bound.
    pub fn max_holdback_bytes(&self) -> usize {
        self.max_holdback_bytes
    }

    /// Memory used by the compiled DFAs, in bytes.
    pub fn dfa_memory_usage(&self) -> usize {
        self.any.dfa.memory_usage()
            + self
                .after_letter
                .as_ref()
                .map_or(0, |d| d.dfa.memory_usage())
    }

    /// The DFA a candidate starting after `prev` runs in: a rule of
    /// [`STARTS_AFTER_NON_LETTER`] cannot start right after an ASCII letter.
    #[inline]
    pub(super) fn dfa_after(&self, prev: Option<u8>) -> Option<&RuleDfa> {
        if prev.is_some_and(|b| b.is_ascii_alphabetic()) {
            self.after_letter.as_ref()
        } else {
            Some(&self.any)
        }
    }

    #[inline]
    pub(super) fn dfa(&self, after_letter: bool) -> &RuleDfa {
        match (after_letter, &self.after_letter) {
            (true, Some(d)) => d,
            _ => &self.any,
        }
    }

    /// Judges the match(es) that `state` (a match state) reports for `[start, end)`, the text
    /// being `hay` (which begins at absolute offset `base`). The first rule whose match is a
    /// secret wins.
    pub(super) fn decide(
        &self,
        dfa: &RuleDfa,
        hay: &[u8],
        base: usize,
        start: usize,
        end: usize,
        state: StateID,
    ) -> Option<ExfilHit> {
        let (s, e) = (start - base, end - base);
        for k in 0..dfa.dfa.match_len(state) {
            let rule = &self.rules[dfa.rule_of[dfa.dfa.match_pattern(state, k).as_usize()]];
            let secret = match &rule.check {
                Check::Plain => true,
                Check::Value(re) => self.value_check(re, &hay[..e], s),
            };
            if secret {
                let digest = Sha256::digest(&hay[s..e]);
                return Some(ExfilHit {
                    rule: rule.name.clone(),
                    start,
                    len: end - start,
                    fingerprint: u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]),
                });
            }
        }
        None
    }

    /// Extracts the value of a value-checked rule's match `hay[s..]` and checks it. A match the
    /// capture regex does not reproduce (it should always) counts as a secret: fail closed.
    fn value_check(&self, re: &meta::Regex, hay: &[u8], s: usize) -> bool {
        let mut caps = re.create_captures();
        re.search_captures(
            &Input::new(hay).range(s..).anchored(Anchored::Yes),
            &mut caps,
        );
        let Some(span) = caps
            .get_group_by_name("value")
            .or_else(|| caps.get_group_by_name("value_max"))
        else {
            return true;
        };
        value_is_secret(&hay[span.range()], self.entropy_min_bits)
    }
}

/// The numeric settings of an [`ExfilConfig`], checked before any rule is compiled.
fn check_config(cfg: &ExfilConfig) -> Result<(), ExfilError> {
    let bits = cfg.entropy_min_bits_per_char;
    if !(0.0..=8.0).contains(&bits) {
        return Err(ExfilError::Config(format!(
            "entropy_min_bits_per_char must be in 0..=8, got {bits}"
        )));
    }
    if !(1..=VALUE_MAX).contains(&cfg.entropy_min_len) {
        return Err(ExfilError::Config(format!(
            "entropy_min_len must be in 1..={VALUE_MAX}, got {}",
            cfg.entropy_min_len
        )));
    }
    Ok(())
}

/// The rules being gathered by [`ExfilRules::new`]: patterns and rules in pattern order, and
/// the longest match of any.
#[derive(Default)]
struct RuleSet {
    patterns: Vec<String>,
    rules: Vec<Rule>,
    max_match_len: usize,
}

impl RuleSet {
    /// The built-in rules, less `disabled_rules` (each of which must name one).
    fn add_builtins(&mut self, cfg: &ExfilConfig) -> Result<(), ExfilError> {
        let builtins = builtin_rules(cfg);
        for name in &cfg.disabled_rules {
            if !builtins.iter().any(|(n, _, _)| n == name) {
                return Err(ExfilError::Config(format!(
                    "disabled_rules: unknown rule {name:?}"
                )));
            }
        }
        let bound = cfg.max_holdback_bytes;
        for (name, pattern, checked) in builtins {
            if cfg.disabled_rules.iter().any(|d| d == name) {
                continue;
            }
            let (_, max) = match_len_bounds(&pattern)
                .map_err(|e| ExfilError::Config(format!("built-in rule {name}: {e}")))?;
            if max > bound {
                return Err(ExfilError::Config(format!(
                    "max_holdback_bytes {bound} is below the longest match of built-in rule \
                     {name} ({max} bytes); raise it or disable the rule"
                )));
            }
            self.max_match_len = self.max_match_len.max(max);
            let check = if checked {
                let re = meta::Regex::new(&format!("(?:{pattern})$"))
                    .map_err(|e| ExfilError::Config(format!("built-in rule {name}: {e}")))?;
                Check::Value(Box::new(re))
            } else {
                Check::Plain
            };
            self.rules.push(Rule {
                name: name.to_owned(),
                check,
            });
            self.patterns.push(pattern);
        }
        Ok(())
    }

    /// `extra_patterns`, each named `custom[i]`; a bad one is [`ExfilError::Pattern`].
    fn add_user_patterns(&mut self, cfg: &ExfilConfig) -> Result<(), ExfilError> {
        let bound = cfg.max_holdback_bytes;
        for (index, pattern) in cfg.extra_patterns.iter().enumerate() {
            let bad = |reason: String| ExfilError::Pattern {
                index,
                pattern: pattern.clone(),
                reason,
            };
            let (_, max) = match_len_bounds(pattern).map_err(bad)?;
            if max > bound {
                return Err(bad(format!(
                    "can match up to {max} bytes, more than max_holdback_bytes ({bound})"
                )));
            }
            // Alone first, so that a DFA-specific problem (Unicode \b, size) names the pattern.
            dfa_builder().build(pattern).map_err(|e| {
                let mut reason = e.to_string();
                if reason.contains("Unicode word boundar") {
                    reason.push_str(" (write (?-u:\\b) for an ASCII word boundary)");
                }
                bad(reason)
            })?;
            self.max_match_len = self.max_match_len.max(max);
            self.rules.push(Rule {
                name: format!("custom[{index}]"),
                check: Check::Plain,
            });
            self.patterns.push(pattern.clone());
        }
        Ok(())
    }
}

/// The value check: a letter, a digit or symbol, and enough Shannon entropy.
fn value_is_secret(v: &[u8], min_bits: f64) -> bool {
    let letter = v.iter().any(u8::is_ascii_alphabetic);
    let digit_or_symbol = v
        .iter()
        .any(|b| b.is_ascii_digit() || b"!@#$%^&*+~".contains(b));
    letter && digit_or_symbol && shannon_bits_per_byte(v) >= min_bits
}

/// Shannon entropy of the byte distribution of `v`, in bits per byte.
fn shannon_bits_per_byte(v: &[u8]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut counts = [0u32; 256];
    for &b in v {
        counts[usize::from(b)] += 1;
    }
    let n = v.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = f64::from(c) / n;
            -p * p.log2()
        })
        .sum()
}
