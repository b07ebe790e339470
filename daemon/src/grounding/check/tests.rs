use super::*;

fn num(value: &str, unit: Option<&str>) -> Option<Stated> {
    Some(Stated::Number {
        value: value.into(),
        unit: unit.map(Into::into),
    })
}

#[test]
fn arithmetic_with_and_without_a_stated_value() {
    let c = find("so 17 × 23 = 400 in total").expect("a check");
    assert_eq!(c.kind, CheckKind::Arithmetic);
    assert_eq!(c.expr, "17 * 23");
    assert_eq!(c.fragment, "17 × 23 = 400");
    assert_eq!(c.stated, num("400", None));

    let c = find("(12 + 30) divided by 6 is about 7").expect("a check");
    assert_eq!(c.expr, "(12 + 30) / 6");
    assert_eq!(c.stated, num("7", None));

    let c = find("we had 1,000 plus 24").expect("a check");
    assert_eq!(c.expr, "1000 + 24");
    assert_eq!(c.stated, None);

    assert_eq!(
        find("12 squared is 144").map(|c| c.expr),
        Some("12^2".into())
    );
    assert_eq!(
        find("15% of 80 is 12").map(|c| c.expr),
        Some("15 / 100 * 80".into())
    );
    let c = find("What is 2 to the power of 20").expect("a check");
    assert_eq!(
        (c.expr.as_str(), c.fragment.as_str()),
        ("2 ^ 20", "2 to the power of 20")
    );
    // Not the phrase: "to the" alone is no operator.
    assert_eq!(find("from 2 to the 20 floors"), None);
}

#[test]
fn not_arithmetic() {
    for text in [
        "pages 10-20",
        "in 1999 and 2004",
        "version 2.3 is out",
        "12 (twelve)",
    ] {
        assert_eq!(find(text), None, "{text}");
    }
}

#[test]
fn conversions() {
    let c = find("5 miles is about 8.05 km").expect("a check");
    assert_eq!(c.kind, CheckKind::Unit);
    assert_eq!(c.expr, "5 miles");
    assert_eq!(c.target.as_deref(), Some("km"));
    assert_eq!(c.stated, num("8.05", Some("km")));
    assert_eq!(c.fragment, "5 miles is about 8.05 km");

    // The question form: the conversion it asks for, nothing stated.
    for (text, expr, target) in [
        (
            "How many kilometres is 26.2 miles?",
            "26.2 miles",
            "kilometres",
        ),
        ("how many feet are there in 3 miles", "3 miles", "feet"),
        ("How much kg is 10 lb", "10 lb", "kg"),
    ] {
        let c = find(text).expect("a check");
        assert_eq!(c.kind, CheckKind::Unit, "{text}");
        assert_eq!((c.expr.as_str(), c.target.as_deref()), (expr, Some(target)));
        assert_eq!(c.stated, None, "{text}");
    }
    assert_eq!(find("how many km is it to Oslo"), None);

    let c = find("100 fahrenheit in celsius").expect("a check");
    assert_eq!(
        (c.expr.as_str(), c.target.as_deref()),
        ("100 °F", Some("°C"))
    );
    assert_eq!(c.stated, None);
}

#[test]
fn dates() {
    let c = find("2024-01-01 plus 30 days is 2024-01-31").expect("a check");
    assert_eq!(c.kind, CheckKind::Date);
    assert_eq!(c.expr, "@2024-01-01 + 30 days");
    assert_eq!(c.stated, Some(Stated::Date("2024-01-31".into())));

    let c = find("2 weeks before 2024-03-01 falls on a Friday").expect("a check");
    assert_eq!(c.expr, "@2024-03-01 - 14 days");
    assert_eq!(c.stated, Some(Stated::Weekday("friday".into())));

    let c = find("2024-01-01 was a Tuesday").expect("a check");
    assert_eq!(c.expr, "@2024-01-01");
    assert_eq!(c.fragment, "2024-01-01 was a Tuesday");

    assert_eq!(find("signed on 1990-05-01 in Paris"), None);
    assert_eq!(find("200000 days after 2024-01-01"), None, "over MAX_DAYS");
}
