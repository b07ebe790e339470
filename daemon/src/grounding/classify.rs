//! The span classifier (spec 003, "Arbitration"): deterministic, from the text alone.
//!
//! A span is [`SpanClass::Computable`] when a tool could check it: an arithmetic expression,
//! date arithmetic or a weekday claim, a unit conversion (each one a [`Check`] the
//! evaluator can run), code or a file path, or a claim about live status ("currently",
//! "is down", "latest version"). Otherwise it is [`SpanClass::EntityShaped`] when it holds a
//! number, a date, a month, or a name (a capitalised word that does not open a sentence, an
//! acronym), and [`SpanClass::Other`] when it holds none of these.
//!
//! The span is the high-surprise window, which may start mid-sentence; the classifier reads
//! it together with the sentence it continues ([`focus`]), so "17 × 23" in the prefix and
//! "= 400" in the window make one computable claim; when that sentence names nothing
//! ([`SpanClass::Other`]), with the one before it too.

use super::check::{self, Check};
use super::scan::{scan, Kind, Tok};
use super::{SpanClass, SpanQuery};

/// The most bytes of the prefix's current sentence read with the span.
pub const FOCUS_PREFIX_BYTES: usize = 200;

/// Phrases that make a claim about live state, which only a live tool can check.
const LIVE_PHRASES: [&str; 14] = [
    "currently",
    "right now",
    "at the moment",
    "as of today",
    "as of now",
    "is down",
    "is up and running",
    "is offline",
    "is online",
    "latest version",
    "latest release",
    "current version",
    "current price",
    "uptime",
];

const MONTHS: [&str; 12] = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
];

/// The text a span is classified (and checked, and searched) by: the sentence of the prefix
/// it continues (at most [`FOCUS_PREFIX_BYTES`]), then the span. When that text holds nothing
/// the classifier can name ([`SpanClass::Other`]: the model ended the claim's sentence and
/// wandered on before the window), the sentence before it is read too, one sentence and at
/// most [`FOCUS_PREFIX_BYTES`] more, if it makes the text classifiable: the uncertain words
/// are about the claim just made ("What is 1806 divided by 43. The leaves" + "open slowly").
pub fn focus(query: &SpanQuery) -> String {
    let ctx = query.context.as_str();
    let (from, after_an_end) = sentence_start(ctx, ctx.len());
    let text = joined(&ctx[from..], &query.span);
    if !after_an_end || classify(&text) != SpanClass::Other {
        return text;
    }
    let (earlier, _) = sentence_start(ctx, ctx[..from].trim_end().len());
    let wider = joined(&ctx[earlier..], &query.span);
    if classify(&wider) == SpanClass::Other {
        text
    } else {
        wider
    }
}

/// Where the sentence of `ctx` that `ctx[..end]` ends in starts: after the last sentence end
/// before `end`, at most [`FOCUS_PREFIX_BYTES`] back; and whether a sentence end is there
/// (rather than the reply's start or the bound).
fn sentence_start(ctx: &str, end: usize) -> (usize, bool) {
    let head = &ctx[..end];
    let after_end = [". ", "! ", "? ", "\n"]
        .iter()
        .filter_map(|e| head.rfind(e).map(|i| i + e.len()))
        .max()
        .unwrap_or(0);
    let mut from = after_end.max(end.saturating_sub(FOCUS_PREFIX_BYTES));
    while !ctx.is_char_boundary(from) {
        from += 1;
    }
    (from, after_end > 0 && from == after_end)
}

/// `sentence` (its leading space dropped), then `span`, one space between them when neither
/// has one.
fn joined(sentence: &str, span: &str) -> String {
    let sentence = sentence.trim_start();
    let joint = sentence.is_empty()
        || sentence.ends_with(char::is_whitespace)
        || span.starts_with(char::is_whitespace);
    format!("{sentence}{}{span}", if joint { "" } else { " " })
}

/// The span's class, from its [`focus`] text.
pub fn classify(text: &str) -> SpanClass {
    let toks = scan(text);
    if check::find(text).is_some() || is_code_or_live(text, &toks) {
        SpanClass::Computable
    } else if is_entity_shaped(&toks) {
        SpanClass::EntityShaped
    } else {
        SpanClass::Other
    }
}

/// The check a computable span carries, if it is one the evaluator can run.
pub fn check_of(text: &str) -> Option<Check> {
    check::find(text)
}

fn is_code_or_live(text: &str, toks: &[Tok<'_>]) -> bool {
    if toks
        .iter()
        .any(|t| matches!(t.kind, Kind::Code | Kind::Path))
    {
        return true;
    }
    let lower = text.to_lowercase();
    LIVE_PHRASES.iter().any(|p| contains_words(&lower, p))
}

/// `phrase` in `text` on word boundaries.
fn contains_words(text: &str, phrase: &str) -> bool {
    text.match_indices(phrase).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + phrase.len()..].chars().next();
        !before.is_some_and(char::is_alphanumeric) && !after.is_some_and(char::is_alphanumeric)
    })
}

fn is_entity_shaped(toks: &[Tok<'_>]) -> bool {
    toks.iter().enumerate().any(|(i, t)| match t.kind {
        Kind::Num | Kind::Date => true,
        Kind::Word => {
            let lower = t.text.to_lowercase();
            let opens_sentence = i == 0
                || toks[i - 1].kind == Kind::Sym && matches!(toks[i - 1].text, "." | "!" | "?");
            let capital = t.text.chars().next().is_some_and(char::is_uppercase);
            let acronym = t.text.chars().filter(|c| c.is_alphabetic()).count() >= 2
                && t.text
                    .chars()
                    .all(|c| !c.is_alphabetic() || c.is_uppercase());
            MONTHS.contains(&lower.as_str()) && lower != "may"
                || acronym
                || (capital && !opens_sentence && t.text != "I")
        }
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn computable_spans() {
        for text in [
            "so 17 × 23 = 400 in total",
            "(12 + 30) / 6",
            "two to the 10: 2^10 is 1024",
            "2024-01-01 plus 30 days is 2024-01-31",
            "45 days after 2024-03-01",
            "2024-01-01 was a Tuesday",
            "5 miles is about 8 km",
            "100 °F in °C",
            "the config lives in /etc/haltd/haltd.toml",
            "calling `parse()` returns None",
            "the service is currently unavailable",
            "the latest version is 2.3",
        ] {
            assert_eq!(classify(text), SpanClass::Computable, "{text}");
        }
    }

    #[test]
    fn entity_shaped_spans() {
        for text in [
            "was born in 1879 in Ulm",
            "the capital is Canberra",
            "signed on 1990-05-01",
            "founded by NASA engineers",
            "it opened in March that year",
            "pages 10-20 cover it",
        ] {
            assert_eq!(classify(text), SpanClass::EntityShaped, "{text}");
        }
    }

    #[test]
    fn other_spans() {
        for text in [
            "the answer depends on what you value most",
            "They may prefer a quieter approach.",
            "",
        ] {
            assert_eq!(classify(text), SpanClass::Other, "{text}");
        }
    }

    #[test]
    fn the_span_is_read_with_the_sentence_it_continues() {
        let q = SpanQuery {
            span: "= 400, as".into(),
            context: "Hello there. We multiplied: 17 × 23".into(),
            prompt: String::new(),
        };
        assert_eq!(focus(&q), "We multiplied: 17 × 23 = 400, as");
        assert_eq!(classify(&focus(&q)), SpanClass::Computable);
        assert_eq!(classify(&q.span), SpanClass::EntityShaped);
    }

    fn q(context: &str, span: &str) -> SpanQuery {
        SpanQuery {
            span: span.into(),
            context: context.into(),
            prompt: String::new(),
        }
    }

    #[test]
    fn a_sentence_of_nothing_is_read_with_the_one_before() {
        // The division is one sentence back: read, checked.
        let f = focus(&q(
            "Sure. What is 1806 divided by 43 Night falls over the valley. The leaves open",
            " slowly, and that is fine.",
        ));
        assert_eq!(
            f,
            "What is 1806 divided by 43 Night falls over the valley. The leaves open slowly, \
             and that is fine."
        );
        assert_eq!(classify(&f), SpanClass::Computable);
        assert_eq!(check_of(&f).map(|c| c.expr), Some("1806 / 43".to_owned()));
        // A sentence that names something is read alone.
        let f = focus(&q("17 × 23 = 400. Then Oslo", " was rainy"));
        assert_eq!(f, "Then Oslo was rainy");
        // One sentence back at most, and only when it names something.
        for context in [
            "17 × 23 = 400. It rained. The leaves",
            "It rained. The leaves",
            "The leaves",
        ] {
            let f = focus(&q(context, " open slowly"));
            assert_eq!(f, "The leaves open slowly", "{context}");
            assert_eq!(classify(&f), SpanClass::Other);
        }
        // A sentence cut at the byte bound has no sentence before it to read.
        let long = format!("17 × 23 = 400. {}", "and so on ".repeat(30));
        let f = focus(&q(&long, "on"));
        assert!(!f.contains("17"), "{f}");
    }

    #[test]
    fn the_prefix_read_is_bounded() {
        let q = SpanQuery {
            span: "tail".into(),
            context: "é".repeat(300),
            prompt: String::new(),
        };
        let f = focus(&q);
        assert!(
            f.len() <= FOCUS_PREFIX_BYTES + 1 + "tail".len(),
            "{}",
            f.len()
        );
        assert!(f.ends_with(" tail"));
    }
}
