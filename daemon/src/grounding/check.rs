//! What the tool arm's evaluator can check in a span: an arithmetic expression, date
//! arithmetic or a weekday claim, or a unit conversion, each with the value the text states
//! for it when it states one ("17 × 23 = 400": the expression `17 * 23`, stated `400`).
//!
//! Finding a check only picks the tokens out and spells them the way fend reads them (`×` as
//! `*`, "divided by" as `/`, a date as `@2024-01-01`); fend parses and evaluates
//! ([`super::evaluator`]). A `-` counts as an operator only with spaces around it, so a
//! range ("pages 10-20") is not a subtraction.

use super::scan::{scan, Kind, Tok};

/// What kind of check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckKind {
    Arithmetic,
    Date,
    Unit,
}

/// The value the text gives for the checked expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stated {
    /// A number, with its unit if it has one (`8.05`, `km`).
    Number { value: String, unit: Option<String> },
    /// An ISO date.
    Date(String),
    /// A weekday name, lower case.
    Weekday(String),
}

/// One check the evaluator can run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub kind: CheckKind,
    /// The part of the text the check is about, as written.
    pub fragment: String,
    /// The expression, as fend reads it.
    pub expr: String,
    /// The unit to show the result in (`5 miles in km`: `km`).
    pub target: Option<String>,
    pub stated: Option<Stated>,
}

/// Units a conversion may name (as written; see [`fend_unit`]).
const UNITS: [&str; 60] = [
    "km",
    "kilometer",
    "kilometers",
    "kilometre",
    "kilometres",
    "m",
    "meter",
    "meters",
    "metre",
    "metres",
    "cm",
    "mm",
    "mi",
    "mile",
    "miles",
    "ft",
    "foot",
    "feet",
    "inch",
    "inches",
    "yd",
    "yard",
    "yards",
    "kg",
    "kilogram",
    "kilograms",
    "g",
    "gram",
    "grams",
    "lb",
    "lbs",
    "pound",
    "pounds",
    "oz",
    "ounce",
    "ounces",
    "l",
    "liter",
    "liters",
    "litre",
    "litres",
    "ml",
    "gallon",
    "gallons",
    "°c",
    "°f",
    "celsius",
    "fahrenheit",
    "kelvin",
    "mph",
    "kb",
    "mb",
    "gb",
    "tb",
    "kib",
    "mib",
    "gib",
    "acre",
    "acres",
    "hectares",
];

const WEEKDAYS: [&str; 7] = [
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
    "sunday",
];

/// Words that introduce the stated value ("is", "=", "equals").
const STATES: [&str; 7] = ["=", "is", "are", "equals", "was", "makes", "gives"];
/// Words that may stand between those and the value.
const HEDGES: [&str; 8] = [
    "about",
    "approximately",
    "roughly",
    "around",
    "exactly",
    "equal",
    "to",
    "≈",
];

/// The first check in `text`: a date check, then a conversion, then arithmetic.
pub fn find(text: &str) -> Option<Check> {
    let toks = scan(text);
    let toks: Vec<Tok<'_>> = toks.into_iter().filter(|t| t.text != ",").collect();
    (0..toks.len())
        .find_map(|i| date_at(text, &toks, i))
        .or_else(|| {
            (0..toks.len())
                .find_map(|i| unit_at(text, &toks, i).or_else(|| unit_question_at(text, &toks, i)))
        })
        .or_else(|| (0..toks.len()).find_map(|i| arithmetic_at(text, &toks, i)))
}

fn unit_name(t: Option<&Tok<'_>>) -> Option<String> {
    let t = t.filter(|t| t.kind == Kind::Word)?;
    let lower = t.text.to_lowercase();
    UNITS.contains(&lower.as_str()).then(|| fend_unit(t.text))
}

/// A unit as fend spells it.
fn fend_unit(written: &str) -> String {
    match written.to_lowercase().as_str() {
        "celsius" | "°c" => "°C".to_owned(),
        "fahrenheit" | "°f" => "°F".to_owned(),
        "kelvin" => "K".to_owned(),
        "lbs" => "lb".to_owned(),
        "kb" => "kB".to_owned(),
        "mb" => "MB".to_owned(),
        "gb" => "GB".to_owned(),
        "tb" => "TB".to_owned(),
        "kib" => "KiB".to_owned(),
        "mib" => "MiB".to_owned(),
        "gib" => "GiB".to_owned(),
        _ => written.to_owned(),
    }
}

/// Skips a stating word and hedges from `i`; the index after them, if a stating word or
/// hedge was there.
fn skip_stating(toks: &[Tok<'_>], mut i: usize) -> Option<usize> {
    let from = i;
    while toks
        .get(i)
        .is_some_and(|t| STATES.iter().chain(&HEDGES).any(|w| t.is(w)) || t.is("a"))
    {
        i += 1;
    }
    (i > from).then_some(i)
}

/// A stated number (with a unit) at `i`.
fn stated_number(toks: &[Tok<'_>], i: usize) -> Option<(Stated, usize)> {
    let t = toks.get(i).filter(|t| t.kind == Kind::Num)?;
    let unit = unit_name(toks.get(i + 1));
    let end = if unit.is_some() { i + 2 } else { i + 1 };
    let value = t.text.replace(',', "");
    Some((Stated::Number { value, unit }, end))
}

fn fragment(text: &str, toks: &[Tok<'_>], from: usize, to: usize) -> String {
    text[toks[from].start..toks[to - 1].end].to_owned()
}

/// `5 miles is 8 km`, `5 miles in km`, `100 °F to °C`.
fn unit_at(text: &str, toks: &[Tok<'_>], i: usize) -> Option<Check> {
    let n = toks.get(i).filter(|t| t.kind == Kind::Num)?;
    let unit = unit_name(toks.get(i + 1))?;
    let expr = format!("{} {unit}", n.text.replace(',', ""));
    if toks.get(i + 2).is_some_and(|t| t.is("in") || t.is("to")) {
        let target = unit_name(toks.get(i + 3))?;
        return Some(Check {
            kind: CheckKind::Unit,
            fragment: fragment(text, toks, i, i + 4),
            expr,
            target: Some(target),
            stated: None,
        });
    }
    let after = skip_stating(toks, i + 2)?;
    let (stated, end) = stated_number(toks, after)?;
    let Stated::Number {
        unit: Some(target), ..
    } = &stated
    else {
        return None;
    };
    Some(Check {
        kind: CheckKind::Unit,
        fragment: fragment(text, toks, i, end),
        expr,
        target: Some(target.clone()),
        stated: Some(stated),
    })
}

/// The question form of a conversion: `how many km is 26.2 miles`, `how many feet are in
/// 3 miles` (a reply that restates the question asks for the conversion it answers).
fn unit_question_at(text: &str, toks: &[Tok<'_>], i: usize) -> Option<Check> {
    let asks = toks.get(i..i + 2)?;
    if !(asks[0].is("how") && (asks[1].is("many") || asks[1].is("much"))) {
        return None;
    }
    let target = unit_name(toks.get(i + 2))?;
    let mut at = i + 3;
    while toks
        .get(at)
        .is_some_and(|t| t.is("is") || t.is("are") || t.is("in") || t.is("there"))
    {
        at += 1;
    }
    let n = toks.get(at).filter(|t| t.kind == Kind::Num)?;
    let unit = unit_name(toks.get(at + 1))?;
    Some(Check {
        kind: CheckKind::Unit,
        fragment: fragment(text, toks, i, at + 2),
        expr: format!("{} {unit}", n.text.replace(',', "")),
        target: Some(target),
        stated: None,
    })
}

/// The most days a date check moves (fend steps one day at a time).
pub const MAX_DAYS: u64 = 100_000;

/// `N days|weeks` at `i`: the number of days.
fn days_at(toks: &[Tok<'_>], i: usize) -> Option<u64> {
    let n: u64 = toks
        .get(i)
        .filter(|t| t.kind == Kind::Num)?
        .text
        .parse()
        .ok()?;
    let unit = toks.get(i + 1)?;
    let days = if unit.is("day") || unit.is("days") {
        n
    } else if unit.is("week") || unit.is("weeks") {
        n.checked_mul(7)?
    } else {
        return None;
    };
    (days <= MAX_DAYS).then_some(days)
}

/// `D + N days [is X]`, `N days after D [is X]`, `D was a Monday`.
fn date_at(text: &str, toks: &[Tok<'_>], i: usize) -> Option<Check> {
    let (from, expr, mut end) = if toks.get(i)?.kind == Kind::Date {
        let d = toks[i].text;
        let op = toks.get(i + 1);
        let sign = if op.is_some_and(|t| t.is("+") || t.is("plus")) {
            Some('+')
        } else if op.is_some_and(|t| t.is("-") || t.is("minus")) {
            Some('-')
        } else {
            None
        };
        match sign.zip(days_at(toks, i + 2)) {
            Some((sign, days)) => (i, format!("@{d} {sign} {days} days"), i + 4),
            None => (i, format!("@{d}"), i + 1),
        }
    } else {
        let days = days_at(toks, i)?;
        let dir = toks.get(i + 2)?;
        let sign = if dir.is("after") || dir.is("from") || dir.is("later") {
            '+'
        } else if dir.is("before") {
            '-'
        } else {
            return None;
        };
        let d = toks.get(i + 3).filter(|t| t.kind == Kind::Date)?.text;
        (i, format!("@{d} {sign} {days} days"), i + 4)
    };
    let moved = expr.contains("days");
    let stated = skip_stating(toks, end)
        .or_else(|| {
            toks.get(end)
                .filter(|t| t.is("falls") || t.is("fell"))
                .map(|_| end + 1)
        })
        .and_then(|at| {
            let mut at = at;
            while toks.get(at).is_some_and(|t| t.is("on") || t.is("a")) {
                at += 1;
            }
            let t = toks.get(at)?;
            let lower = t.text.to_lowercase();
            if t.kind == Kind::Date {
                Some((Stated::Date(t.text.to_owned()), at + 1))
            } else if WEEKDAYS.contains(&lower.as_str()) {
                Some((Stated::Weekday(lower), at + 1))
            } else {
                None
            }
        });
    if let Some((_, e)) = &stated {
        end = *e;
    } else if !moved {
        // A bare date states nothing a tool could check.
        return None;
    }
    Some(Check {
        kind: CheckKind::Date,
        fragment: fragment(text, toks, from, end),
        expr,
        target: None,
        stated: stated.map(|(s, _)| s),
    })
}

/// An operator at `i` as fend spells it, and how many tokens it took.
fn operator(toks: &[Tok<'_>], i: usize) -> Option<(&'static str, usize)> {
    let t = toks.get(i)?;
    let next_spaced = toks.get(i + 1).is_none_or(|n| n.spaced_before);
    let op = match t.text.to_lowercase().as_str() {
        "+" | "plus" => "+",
        "-" | "−" if t.spaced_before && next_spaced => "-",
        "minus" => "-",
        "*" | "×" | "x" | "times" => "*",
        "/" | "÷" | "over" => "/",
        "^" => "^",
        "multiplied" | "divided" if toks.get(i + 1).is_some_and(|n| n.is("by")) => {
            return Some((if t.is("multiplied") { "*" } else { "/" }, 2));
        }
        "%" if toks.get(i + 1).is_some_and(|n| n.is("of")) => return Some(("/ 100 *", 2)),
        "percent" if toks.get(i + 1).is_some_and(|n| n.is("of")) => {
            return Some(("/ 100 *", 2));
        }
        "to" if toks
            .get(i + 1..i + 4)
            .is_some_and(|w| w[0].is("the") && w[1].is("power") && w[2].is("of")) =>
        {
            return Some(("^", 4));
        }
        _ => return None,
    };
    Some((op, 1))
}

/// `17 × 23 [= 400]`, `(12 + 30) / 6`, `2^10 is 1024`.
fn arithmetic_at(text: &str, toks: &[Tok<'_>], i: usize) -> Option<Check> {
    let first = toks.get(i)?;
    if !(first.kind == Kind::Num || first.is("(")) {
        return None;
    }
    if i > 0 && (toks[i - 1].kind == Kind::Num || toks[i - 1].is("(")) {
        return None;
    }
    let (mut j, mut expr, mut nums, mut ops, mut depth) = (i, String::new(), 0, 0, 0i32);
    while let Some(t) = toks.get(j) {
        if t.kind == Kind::Num {
            expr.push_str(&t.text.replace(',', ""));
            nums += 1;
            j += 1;
        } else if t.is("(") {
            expr.push('(');
            depth += 1;
            j += 1;
        } else if t.is(")") && depth > 0 {
            expr.push(')');
            depth -= 1;
            j += 1;
        } else if let Some((op, took)) = operator(toks, j).filter(|_| nums > 0) {
            expr.push_str(&format!(" {op} "));
            ops += 1;
            j += took;
        } else if t.is("squared") || t.is("cubed") {
            expr.push_str(if t.is("squared") { "^2" } else { "^3" });
            ops += 1;
            j += 1;
        } else {
            break;
        }
    }
    // Trailing operators or open parentheses are not part of the expression.
    let expr = expr
        .trim_end_matches([' ', '+', '-', '*', '/', '^'])
        .to_owned();
    if nums < 1
        || ops < 1
        || depth != 0
        || !expr.ends_with(|c: char| c.is_ascii_digit() || c == ')')
    {
        return None;
    }
    if nums < 2 && !expr.contains('^') {
        return None;
    }
    let stated = skip_stating(toks, j).and_then(|at| stated_number(toks, at));
    let end = stated.as_ref().map_or(j, |(_, e)| *e);
    Some(Check {
        kind: CheckKind::Arithmetic,
        fragment: fragment(text, toks, i, end).trim_end().to_owned(),
        expr,
        target: None,
        stated: stated.map(|(s, _)| s),
    })
}

#[cfg(test)]
mod tests;
