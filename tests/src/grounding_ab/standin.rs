//! The stand-in model: the scripted upstream, told by a directive in each request what to
//! say. It is not a model and knows nothing; the harness decides per item what it plays, so
//! that every path of the A/B comparison is taken with a known ground truth:
//!
//! - [`Play::Wrong`]: it says the item's wrong claim (`span`), its last token unlikely
//!   (logprob ln 0.001, about 10 bits): a model that is unsure where it is wrong;
//! - [`Play::Right`]: it says `The answer is ANSWER`, every token likely: a model that knows;
//! - [`Play::RightSurprised`]: the same right reply with its last token unlikely: a model
//!   unsure where it is right, so the detector breaches on a correct reply (a false
//!   positive for the intervention's precision).
//!
//! Asked to continue a rewound reply (haltd's resume, in vLLM's or llama.cpp's shape), the
//! scripted upstream says the words of the evidence in the request's `[grounding]` segment
//! (`scripted-upstream`, "Continuations"): it answers from the evidence, as a model would
//! that reads it. Items take the plays in turn (item `i` plays `i mod 3`).
//!
//! What this proves: haltd's side — the breach, the held span, the round over the real arms
//! and the shipped memory store, the rewind, the continuation request and the splice, the
//! receipts — and the harness's metrics, against a ground truth known in advance. What it
//! does not: whether grounding helps a real model (that needs a real backend; see
//! [`super::llama`] and `--backend`).

use std::{path::Path, process::Command};

use anyhow::{Context, Result};

use super::{Item, Proc, Settings};

/// Tokens a continuation says (the evidence's words, cycled).
const RESUME_TOKENS: usize = 48;

/// What pads a reply after its claim to [`Settings::reply_tokens`] (cycled): a reply longer
/// than the hold-back window, so the window's added latency reaches its steady state.
const FILLER: &[&str] = &[
    " and", " that", " is", " how", " it", " was", " written", " down", " at", " the", " time", ".",
];

/// What the stand-in says for an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Play {
    Wrong,
    Right,
    RightSurprised,
}

impl Play {
    /// Item `i`'s play.
    pub fn of(i: usize) -> Self {
        match i % 3 {
            0 => Play::Wrong,
            1 => Play::Right,
            _ => Play::RightSurprised,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Play::Wrong => "wrong",
            Play::Right => "right",
            Play::RightSurprised => "right_surprised",
        }
    }
}

/// The reply's words, each with a leading space (a directive's `words` are split at commas
/// and quoted with `"`, so those are left out of a word).
fn words(text: &str) -> Vec<String> {
    text.split_whitespace()
        .map(|w| format!(" {}", w.replace([',', '"'], "")))
        .filter(|w| w.len() > 1)
        .collect()
}

/// The user message for `item` played as `play`: the question and the directive.
pub fn prompt(item: &Item, play: Play, s: &Settings) -> String {
    let mut reply = match play {
        Play::Wrong => words(&item.span),
        Play::Right | Play::RightSurprised => words(&format!("The answer is {}", item.answer)),
    };
    let low = match play {
        Play::Right => String::new(),
        Play::Wrong | Play::RightSurprised => format!(" low_at={}", reply.len() - 1),
    };
    let pad = s.reply_tokens.saturating_sub(reply.len());
    reply.extend(FILLER.iter().cycle().take(pad).map(|w| (*w).to_owned()));
    format!(
        "{}\n[[script:normal tokens={} pace_ms={} resume={RESUME_TOKENS}{low} words=\"{}\"]]",
        item.prompt,
        reply.len(),
        s.pace_ms,
        reply.join(",")
    )
}

/// The scripted upstream on a free loopback port.
#[derive(Debug)]
pub struct Upstream {
    pub proc: Proc,
    /// `http://ADDR:PORT`, haltd's `--upstream`.
    pub url: String,
}

/// Starts `bin` (the scripted upstream) with its files in `dir`.
pub fn start(bin: &Path, dir: &Path) -> Result<Upstream> {
    let mut cmd = Command::new(bin);
    cmd.args(["--listen", "127.0.0.1:0"]);
    let proc = Proc::spawn(cmd, dir, "upstream", |out| out.contains("listening on "))?;
    let out = std::fs::read_to_string(&proc.stdout)?;
    let addr = out
        .lines()
        .find_map(|l| l.strip_prefix("listening on "))
        .context("no address printed")?
        .trim()
        .to_owned();
    Ok(Upstream {
        proc,
        url: format!("http://{addr}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item() -> Item {
        Item {
            id: "x".into(),
            kind: "arithmetic".into(),
            prompt: "What is 17 times 23?".into(),
            answer: "391".into(),
            span: "17 × 23 = 401".into(),
        }
    }

    fn settings() -> Settings {
        Settings {
            haltd_bin: "haltd".into(),
            upstream_bin: "up".into(),
            memory_dir: "m".into(),
            threshold_bits: 2.0,
            window: 4,
            min_tokens: 2,
            hold_back: 16,
            max_rounds: 2,
            max_tokens: 64,
            pace_ms: 3,
            reply_tokens: 0,
        }
    }

    #[test]
    fn each_play_says_its_reply_with_its_unlikely_token() {
        let s = settings();
        let p = prompt(&item(), Play::Wrong, &s);
        assert!(p.starts_with("What is 17 times 23?\n[[script:normal tokens=5 pace_ms=3 "));
        assert!(
            p.ends_with("low_at=4 words=\" 17, ×, 23, =, 401\"]]"),
            "{p}"
        );
        let p = prompt(&item(), Play::Right, &s);
        assert!(!p.contains("low_at"), "{p}");
        assert!(p.contains("tokens=4 ") && p.contains("words=\" The, answer, is, 391\""));
        let p = prompt(&item(), Play::RightSurprised, &s);
        assert!(p.contains("low_at=3 "), "{p}");
        let padded = Settings {
            reply_tokens: 7,
            ..settings()
        };
        let p = prompt(&item(), Play::Wrong, &padded);
        assert!(p.contains("tokens=7 ") && p.contains("low_at=4 "), "{p}");
        assert!(
            p.ends_with("words=\" 17, ×, 23, =, 401, and, that\"]]"),
            "{p}"
        );
        assert_eq!(
            (0..4).map(Play::of).collect::<Vec<_>>(),
            [Play::Wrong, Play::Right, Play::RightSurprised, Play::Wrong]
        );
    }

    #[test]
    fn directive_quoting_is_kept_out_of_words() {
        assert_eq!(words("a, \"b\" c"), [" a", " b", " c"]);
    }
}
