//! Just enough Markdown for the checks: prose lines (fenced code blocks left out), code spans,
//! inline link targets and pipe tables.

/// A code span: the text between its backticks, and where it starts in its line (in bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) at: usize,
    pub(crate) text: String,
}

/// The lines outside fenced code blocks (```` ``` ```` or `~~~`), numbered from 1.
pub(crate) fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| t.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(f), Some(m)) if f == m => fence = None,
            (None, None) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// The code spans of one line: a run of n backticks up to the next run of exactly n.
pub(crate) fn code_spans(line: &str) -> Vec<Span> {
    let b = line.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'`' {
            i += 1;
            continue;
        }
        let n = b[i..].iter().take_while(|&&c| c == b'`').count();
        let start = i + n;
        let mut j = start;
        let mut end = None;
        while j < b.len() {
            if b[j] == b'`' {
                let m = b[j..].iter().take_while(|&&c| c == b'`').count();
                if m == n {
                    end = Some(j);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match end {
            Some(e) => {
                let text = line[start..e].trim().to_owned();
                out.push(Span { at: i, text });
                i = e + n;
            }
            // An unmatched run is literal text.
            None => i = start,
        }
    }
    out
}

/// The line with every code span blanked out (same length), for searching prose only.
pub(crate) fn without_code(line: &str) -> String {
    let mut out: Vec<u8> = line.as_bytes().to_vec();
    for s in code_spans(line) {
        let n = line[s.at..].bytes().take_while(|&c| c == b'`').count();
        let end = line[s.at + n..]
            .find(&"`".repeat(n))
            .map_or(line.len(), |e| s.at + n + e + n);
        for c in &mut out[s.at..end] {
            *c = b' ';
        }
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

/// The targets of the inline links `[text](target)` of one line (code spans are not links).
pub(crate) fn link_targets(line: &str) -> Vec<String> {
    let prose = without_code(line);
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(end) = after.find(')') else { break };
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.to_owned());
        rest = &after[end..];
    }
    out
}

/// The cells of a table row, split at the `|`s outside code spans.
pub(crate) fn cells(line: &str) -> Vec<String> {
    let prose = without_code(line);
    let mut cuts: Vec<usize> = prose
        .match_indices('|')
        .map(|(i, _)| i)
        .filter(|&i| i == 0 || !prose[..i].ends_with('\\'))
        .collect();
    let t = line.trim_end();
    if !t.ends_with('|') {
        cuts.push(line.len());
    }
    let mut out = Vec::new();
    let mut from = if line.trim_start().starts_with('|') {
        cuts.first().map_or(0, |&c| c + 1)
    } else {
        0
    };
    for &c in cuts
        .iter()
        .skip(usize::from(line.trim_start().starts_with('|')))
    {
        out.push(line[from..c].trim().to_owned());
        from = c + 1;
    }
    out
}

/// A pipe table: its header cells and its rows (line number, cells).
#[derive(Debug)]
pub(crate) struct Table {
    pub(crate) header: Vec<String>,
    pub(crate) rows: Vec<(usize, Vec<String>)>,
}

/// The pipe tables of a document: a header row, a `|---|` row, then rows up to a line that is
/// not one.
pub(crate) fn tables(text: &str) -> Vec<Table> {
    let lines = prose_lines(text);
    let mut out = Vec::new();
    let mut i = 0;
    while i + 1 < lines.len() {
        let (_, head) = lines[i];
        let (_, rule) = lines[i + 1];
        let is_rule = rule.trim().starts_with('|')
            && rule.chars().all(|c| matches!(c, '|' | '-' | ':' | ' '));
        if !(head.trim().starts_with('|') && is_rule) {
            i += 1;
            continue;
        }
        let mut table = Table {
            header: cells(head).iter().map(|c| c.to_lowercase()).collect(),
            rows: Vec::new(),
        };
        i += 2;
        while i < lines.len() && lines[i].1.trim().starts_with('|') {
            table.rows.push((lines[i].0, cells(lines[i].1)));
            i += 1;
        }
        out.push(table);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_links_and_cells() {
        let line = "| a `x|y` | [t `c`](../p.rs#h) and ``d`e`` |";
        let spans: Vec<String> = code_spans(line).into_iter().map(|s| s.text).collect();
        assert_eq!(spans, ["x|y", "c", "d`e"]);
        assert_eq!(link_targets(line), ["../p.rs#h"]);
        assert_eq!(cells(line), ["a `x|y`", "[t `c`](../p.rs#h) and ``d`e``"]);
    }

    #[test]
    fn fenced_blocks_are_not_prose_and_tables_are_found() {
        let text = "```\n| a | b |\n|---|---|\n```\n| h | tests |\n|---|---|\n| 1 | `t` |\nend\n";
        let t = tables(text);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].header, ["h", "tests"]);
        assert_eq!(t[0].rows, [(7, vec!["1".to_owned(), "`t`".to_owned()])]);
    }
}
