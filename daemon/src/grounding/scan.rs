//! The span as tokens: numbers, words, ISO dates, paths, code and single symbols, each with
//! its byte range. The classifier ([`super::classify`]) and the tool arm's check finder
//! ([`super::check`]) read the same tokens, so a span is classified computable exactly when
//! something in it has the shape a check needs.
//!
//! This is not an expression parser: it only cuts text into pieces. Evaluation is fend's
//! ([`super::evaluator`]).

/// What a token is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Digits, with `.` or `,` between digits (`1,024`, `3.5`).
    Num,
    /// Letters (and `°`, `_`, `'`, inner `-`).
    Word,
    /// `YYYY-MM-DD`.
    Date,
    /// Something with a `/` inside, or a file name with a known extension.
    Path,
    /// Text between backticks.
    Code,
    /// One other character (`+`, `=`, `(`, `×`...).
    Sym,
}

/// One token of the span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tok<'a> {
    pub kind: Kind,
    pub text: &'a str,
    /// Byte range in the scanned text.
    pub start: usize,
    pub end: usize,
    /// Whitespace (or the text's start) right before it.
    pub spaced_before: bool,
}

impl Tok<'_> {
    /// A word or symbol equal to `s` (ASCII case-insensitive).
    pub fn is(&self, s: &str) -> bool {
        matches!(self.kind, Kind::Word | Kind::Sym) && self.text.eq_ignore_ascii_case(s)
    }
}

/// File extensions that make a word a path (`main.rs`, `haltd.toml`).
const EXTENSIONS: [&str; 16] = [
    "rs", "py", "toml", "json", "yaml", "yml", "md", "txt", "c", "h", "go", "js", "ts", "sh",
    "cfg", "conf",
];

/// Cuts `text` into tokens.
pub fn scan(text: &str) -> Vec<Tok<'_>> {
    let bytes = text.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    let mut spaced = true;
    while i < text.len() {
        let c = char_at(text, i);
        if c.is_whitespace() {
            i += c.len_utf8();
            spaced = true;
            continue;
        }
        let (kind, end) = if c == '`' {
            let close = text[i + 1..]
                .find('`')
                .map_or(text.len(), |j| i + 1 + j + 1);
            (Kind::Code, close)
        } else if c.is_ascii_digit() {
            number(text, i)
        } else if c.is_alphabetic() || c == '°' || c == '_' {
            word(text, i)
        } else if (c == '/' || (c == '.' && bytes.get(i + 1) == Some(&b'/')))
            && text[i + 1..]
                .chars()
                .next()
                .is_some_and(|n| n.is_alphanumeric() || n == '/')
        {
            let end = i + text[i..]
                .find(char::is_whitespace)
                .unwrap_or(text.len() - i);
            (Kind::Path, trim_punct(text, i, end))
        } else {
            (Kind::Sym, i + c.len_utf8())
        };
        toks.push(Tok {
            kind,
            text: &text[i..end],
            start: i,
            end,
            spaced_before: spaced,
        });
        spaced = false;
        i = end;
    }
    toks
}

fn char_at(text: &str, i: usize) -> char {
    text[i..].chars().next().unwrap_or(' ')
}

/// A number, or an ISO date starting at `i`.
fn number(text: &str, i: usize) -> (Kind, usize) {
    let b = text.as_bytes();
    let digit = |k: usize| b.get(k).is_some_and(u8::is_ascii_digit);
    if (i..i + 4).all(digit)
        && b.get(i + 4) == Some(&b'-')
        && digit(i + 5)
        && digit(i + 6)
        && b.get(i + 7) == Some(&b'-')
        && digit(i + 8)
        && digit(i + 9)
        && !digit(i + 10)
    {
        return (Kind::Date, i + 10);
    }
    let mut end = i;
    while end < b.len() {
        if digit(end) || (matches!(b[end], b'.' | b',') && digit(end + 1) && end > i) {
            end += 1;
        } else {
            break;
        }
    }
    (Kind::Num, end)
}

/// A word, or a path-like word (`src/main.rs`, `haltd.toml`).
fn word(text: &str, i: usize) -> (Kind, usize) {
    let mut end = i;
    for (j, c) in text[i..].char_indices() {
        let inner = matches!(c, '-' | '.' | '/' | '\'') && j > 0;
        if c.is_alphanumeric() || c == '°' || c == '_' || inner {
            end = i + j + c.len_utf8();
        } else {
            break;
        }
    }
    let end = trim_punct(text, i, end);
    let w = &text[i..end];
    let has_ext = w
        .rsplit_once('.')
        .is_some_and(|(stem, ext)| !stem.is_empty() && EXTENSIONS.contains(&ext));
    if w.contains('/') || has_ext {
        (Kind::Path, end)
    } else if let Some(dot) = w.find('.') {
        // "end.Next" is two words and a full stop, not one word.
        (Kind::Word, i + dot)
    } else {
        (Kind::Word, end)
    }
}

/// `end` without trailing `.`, `,`, `-`, `'`, `/`, `:`, `;`.
fn trim_punct(text: &str, start: usize, mut end: usize) -> usize {
    while end > start && text[..end].ends_with(['.', ',', '-', '\'', '/', ':', ';', ')']) {
        end -= 1;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(text: &str) -> Vec<(Kind, &str)> {
        scan(text).into_iter().map(|t| (t.kind, t.text)).collect()
    }

    #[test]
    fn cuts_numbers_dates_words_and_paths() {
        assert_eq!(
            kinds("17 × 23 = 391."),
            [
                (Kind::Num, "17"),
                (Kind::Sym, "×"),
                (Kind::Num, "23"),
                (Kind::Sym, "="),
                (Kind::Num, "391"),
                (Kind::Sym, "."),
            ]
        );
        assert_eq!(
            kinds("On 2024-02-28, 1,024.5 km"),
            [
                (Kind::Word, "On"),
                (Kind::Date, "2024-02-28"),
                (Kind::Sym, ","),
                (Kind::Num, "1,024.5"),
                (Kind::Word, "km"),
            ]
        );
        assert_eq!(
            kinds("see /etc/hosts. and src/main.rs or `f(x)` 5°C"),
            [
                (Kind::Word, "see"),
                (Kind::Path, "/etc/hosts"),
                (Kind::Sym, "."),
                (Kind::Word, "and"),
                (Kind::Path, "src/main.rs"),
                (Kind::Word, "or"),
                (Kind::Code, "`f(x)`"),
                (Kind::Num, "5"),
                (Kind::Word, "°C"),
            ]
        );
    }

    #[test]
    fn records_spacing_and_sentence_ends() {
        let t = scan("10-20 and 3 - 1. Next");
        assert!(!t[1].spaced_before, "the dash in 10-20 touches its numbers");
        assert!(t[5].spaced_before && t[5].is("-"));
        assert_eq!(t.last().map(|t| t.text), Some("Next"));
    }
}
