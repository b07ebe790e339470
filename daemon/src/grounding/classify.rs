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
//! "= 400" in the window make one computable claim.

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

/// The text a span is classified (and checked) by: the sentence of the prefix it continues
/// (at most [`FOCUS_PREFIX_BYTES`]), then the span.
pub fn focus(query: &SpanQuery) -> String {
    let ctx = query.context.as_str();
    let mut from = [". ", "! ", "? ", "\n"]
        .iter()
        .filter_map(|end| ctx.rfind(end).map(|i| i + end.len()))
        .max()
        .unwrap_or(0);
    from = from.max(ctx.len().saturating_sub(FOCUS_PREFIX_BYTES));
    while !ctx.is_char_boundary(from) {
        from += 1;
    }
    let sentence = ctx[from..].trim_start();
    let joined = sentence.is_empty()
        || sentence.ends_with(char::is_whitespace)
        || query.span.starts_with(char::is_whitespace);
    let joint = if joined { "" } else { " " };
    format!("{sentence}{joint}{}", query.span)
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
