//! The evidence a snippet carries: one line, at most [`MAX_EVIDENCE_CHARS`] characters, what
//! every arm and the evaluator cut their findings to.

/// The longest evidence a snippet carries, in characters: grounding enters the context as
/// short evidence, never as a document.
pub const MAX_EVIDENCE_CHARS: usize = 400;

/// `text` on one line, without control characters, at most [`MAX_EVIDENCE_CHARS`]
/// characters (cut ones end in `…`).
pub fn cap_evidence(text: &str) -> String {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let flat: String = flat.chars().filter(|c| !c.is_control()).collect();
    if flat.chars().count() <= MAX_EVIDENCE_CHARS {
        return flat;
    }
    let mut cut: String = flat.chars().take(MAX_EVIDENCE_CHARS - 1).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evidence_is_one_capped_line() {
        assert_eq!(cap_evidence(" a\n\tb\u{7}c  "), "a bc");
        let long = "é".repeat(MAX_EVIDENCE_CHARS + 10);
        let capped = cap_evidence(&long);
        assert_eq!(capped.chars().count(), MAX_EVIDENCE_CHARS);
        assert!(capped.ends_with('…'));
        assert_eq!(
            cap_evidence(&"x".repeat(MAX_EVIDENCE_CHARS))
                .chars()
                .count(),
            MAX_EVIDENCE_CHARS
        );
    }
}
