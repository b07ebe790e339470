//! The memory arm (spec 003's Remember): the operator's local document store, a directory
//! of `.txt` and `.md` files, indexed at start with tantivy (BM25) in RAM.
//!
//! Each file is cut into passages (paragraphs, split again past [`PASSAGE_CHARS`]) and each
//! passage is one indexed document, so a hit's evidence is the passage that scored, not the
//! whole file. A passage is evidence only when the BM25 score of the span's words reaches the
//! operator's floor (`[grounding.memory] floor`); the span's numbers add to the score that
//! ranks the passages, never to the one the floor is held against ([`is_number`]). Its
//! snippet's source is the file's path and the passage's first line (`notes/rivers.md:12`),
//! and its confidence is `score / (score + floor)`: 0.5 at the floor, towards 1 above it (a
//! ranking, not a probability).
//!
//! The span is searched as plain terms (its words through the index's own analyzer, one
//! term query each, any may match), never through a query parser: text from the model cannot
//! use query syntax.

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use tantivy::{
    collector::TopDocs,
    doc,
    query::{BooleanQuery, EnableScoring, Occur, Query, TermQuery},
    schema::{Field, IndexRecordOption, Schema, TextFieldIndexing, TextOptions, Value, STORED},
    tokenizer::{LowerCaser, RemoveLongFilter, SimpleTokenizer, StopWordFilter, TextAnalyzer},
    DocSet, Index, IndexReader, TantivyDocument, Term,
};

use super::arm::{cap_evidence, Arm, ArmError};
use super::classify::focus;
use super::{ArmKind, Snippet, SpanClass, SpanQuery};

/// A passage longer than this (characters) is split.
pub const PASSAGE_CHARS: usize = 1000;
/// Files larger than this (bytes) are skipped: the store holds notes, not dumps.
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// Most files indexed.
pub const MAX_FILES: usize = 20_000;
/// The body's tokenizer: words, lower case, without English stop words, so that "the" and
/// "has" do not lift an unrelated passage over the floor.
const TOKENIZER: &str = "haltd_en";
/// Lucene's English stop words (the list tantivy ships).
const STOP_WORDS: [&str; 33] = [
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it",
    "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these",
    "they", "this", "to", "was", "will", "with",
];
/// Function words Lucene's list leaves out: auxiliaries, pronouns, question words,
/// quantifiers, prepositions, and what the analyzer leaves of clitics ("Kestrel's", "don't").
/// A model's span is prose, full of them; a passage that shares "has" and "every" with it
/// says nothing about it. ("may" stays out of the list, being also a month, and "m", a unit.)
const FUNCTION_WORDS: &str =
    "am were been being have has had having do does did doing can could would should shall \
     might must i me my mine myself we our ours ourselves you your yours yourself yourselves he \
     him his himself she her hers herself its itself them theirs themselves those what which \
     who whom whose when where why how all any both each every few more most other some own \
     same nor only so than too very about above after again against before below between down \
     during from further off once out over through under until up upon while here because just \
     also s t";

/// The index writer's memory budget (tantivy's minimum is 15 MB per thread).
const WRITER_BYTES: usize = 32 << 20;

/// Why the store could not be indexed.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{dir}: more than {MAX_FILES} files")]
    TooMany { dir: PathBuf },
    #[error("indexing {dir}: {source}")]
    Index {
        dir: PathBuf,
        #[source]
        source: tantivy::TantivyError,
    },
}

/// The memory arm: an index of the store, searched per round.
pub struct MemoryArm {
    index: Index,
    reader: IndexReader,
    path: Field,
    body: Field,
    floor: f32,
    max_results: usize,
    passages: usize,
}

impl std::fmt::Debug for MemoryArm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryArm")
            .field("passages", &self.passages)
            .field("floor", &self.floor)
            .finish_non_exhaustive()
    }
}

/// The `.txt` and `.md` files under `dir`, sorted (a stable index order).
fn documents(dir: &Path) -> Result<Vec<PathBuf>, MemoryError> {
    let read = |p: &Path| {
        std::fs::read_dir(p).map_err(|source| MemoryError::Read {
            path: p.to_owned(),
            source,
        })
    };
    let (mut files, mut todo) = (Vec::new(), vec![dir.to_owned()]);
    while let Some(d) = todo.pop() {
        for entry in read(&d)? {
            let entry = entry.map_err(|source| MemoryError::Read {
                path: d.clone(),
                source,
            })?;
            let path = entry.path();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let ext = path.extension().and_then(|e| e.to_str());
            if kind.is_dir() {
                todo.push(path);
            } else if kind.is_file() && matches!(ext, Some("txt" | "md")) {
                if entry.metadata().is_ok_and(|m| m.len() <= MAX_FILE_BYTES) {
                    files.push(path);
                }
                if files.len() > MAX_FILES {
                    return Err(MemoryError::TooMany {
                        dir: dir.to_owned(),
                    });
                }
            }
        }
    }
    files.sort();
    Ok(files)
}

/// A Markdown heading on the path to a passage: its level (the number of `#`), its title,
/// its line, and whether a passage has been labelled with it yet.
struct Heading {
    level: usize,
    title: String,
    line: u64,
    used: bool,
}

/// The label of the passages under `stack`: its titles, outermost first (`Title / Part`).
fn label(stack: &[Heading]) -> String {
    let titles: Vec<&str> = stack.iter().map(|h| h.title.as_str()).collect();
    titles.join(" / ")
}

/// Closes the sections of `stack` at `level` or deeper; a heading with nothing under it
/// becomes a passage of its own (labelled with its path, which then counts as used).
fn close(stack: &mut Vec<Heading>, level: usize, out: &mut Vec<(u64, String)>) {
    while let Some(top) = stack.last() {
        if top.level < level {
            break;
        }
        if !top.used {
            out.push((top.line, label(stack)));
            stack.iter_mut().for_each(|h| h.used = true);
        }
        stack.pop();
    }
}

/// A file's passages: (first line, 1-based; text). A paragraph of Markdown headings alone
/// (`# Title`) is not a passage: it opens a section, and every passage in the section is
/// labelled with the headings on its path (`Title / Part: paragraph`), until a heading of
/// the same or a higher level closes it. A heading states nothing; as a short passage full
/// of the document's names it would outrank the paragraph that holds the fact, and a
/// paragraph without its heading loses its subject ("The observatory's founding director
/// was ..." under `# Orrin Valley Observatory`). The first passage under a heading opens at
/// the heading's line; a heading with nothing under it is a passage of its own.
fn passages(text: &str) -> Vec<(u64, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut first = 1u64;
    let mut stack: Vec<Heading> = Vec::new();
    for (n, line) in (1u64..).zip(text.lines()) {
        let line = line.trim();
        if current.is_empty() && line.starts_with('#') {
            let level = line.chars().take_while(|&c| c == '#').count();
            close(&mut stack, level, &mut out);
            let title = line.trim_start_matches('#').trim().to_owned();
            stack.push(Heading {
                level,
                title,
                line: n,
                used: false,
            });
            continue;
        }
        if !line.is_empty() {
            if current.is_empty() {
                first = stack.iter().find(|h| !h.used).map_or(n, |h| h.line);
                if !stack.is_empty() {
                    current.push_str(&label(&stack));
                    current.push_str(": ");
                }
                stack.iter_mut().for_each(|h| h.used = true);
            } else {
                current.push(' ');
            }
            current.push_str(line);
        }
        if (line.is_empty() || current.chars().count() >= PASSAGE_CHARS) && !current.is_empty() {
            out.push((first, std::mem::take(&mut current)));
        }
    }
    if !current.is_empty() {
        out.push((first, current));
    }
    // Headings with nothing under them at the end: the file's last words, kept.
    close(&mut stack, 0, &mut out);
    out
}

impl MemoryArm {
    /// Indexes the store under `dir` (in RAM).
    pub fn open(dir: &Path, floor: f32, max_results: usize) -> Result<Self, MemoryError> {
        let index_err = |source| MemoryError::Index {
            dir: dir.to_owned(),
            source,
        };
        let mut schema = Schema::builder();
        let path = schema.add_text_field("path", STORED);
        let indexing = TextFieldIndexing::default()
            .set_tokenizer(TOKENIZER)
            .set_index_option(IndexRecordOption::WithFreqsAndPositions);
        let body_options = TextOptions::default()
            .set_indexing_options(indexing)
            .set_stored();
        let body = schema.add_text_field("body", body_options);
        let index = Index::create_in_ram(schema.build());
        index.tokenizers().register(
            TOKENIZER,
            TextAnalyzer::builder(SimpleTokenizer::default())
                .filter(RemoveLongFilter::limit(40))
                .filter(LowerCaser)
                .filter(StopWordFilter::remove(
                    STOP_WORDS
                        .iter()
                        .copied()
                        .chain(FUNCTION_WORDS.split_whitespace())
                        .map(str::to_owned),
                ))
                .build(),
        );
        let mut writer = index
            .writer_with_num_threads::<TantivyDocument>(1, WRITER_BYTES)
            .map_err(index_err)?;
        let mut count = 0;
        for file in documents(dir)? {
            // A file that is not UTF-8 is not a note: skipped.
            let Ok(text) = std::fs::read_to_string(&file) else {
                continue;
            };
            let shown = file
                .strip_prefix(dir)
                .unwrap_or(&file)
                .display()
                .to_string();
            for (line, passage) in passages(&text) {
                writer
                    .add_document(doc!(path => format!("{shown}:{line}"), body => passage))
                    .map_err(index_err)?;
                count += 1;
            }
        }
        writer.commit().map_err(index_err)?;
        let reader = index.reader().map_err(index_err)?;
        Ok(MemoryArm {
            index,
            reader,
            path,
            body,
            floor,
            max_results,
            passages: count,
        })
    }

    /// How many passages are indexed.
    pub fn passages(&self) -> usize {
        self.passages
    }

    /// Scored passages for `text`, best first, with the floor applied to the score of the
    /// text's words alone ([`is_number`]: numbers rank hits but never make one).
    fn hits(&self, text: &str) -> Result<Vec<(f32, String, String)>, tantivy::TantivyError> {
        // The span's words through the body's own analyzer, as plain terms: no query
        // syntax, and nothing to search when only stop words are left.
        let mut analyzer = self.index.tokenizer_for_field(self.body)?;
        let mut stream = analyzer.token_stream(text);
        let mut terms: Vec<String> = Vec::new();
        while let Some(token) = stream.next() {
            if !terms.contains(&token.text) {
                terms.push(token.text.clone());
            }
        }
        let (numbers, words): (Vec<&String>, Vec<&String>) =
            terms.iter().partition(|t| is_number(t));
        if words.is_empty() {
            return Ok(Vec::new());
        }
        let any_of = |terms: &[&String]| -> Box<dyn Query> {
            Box::new(BooleanQuery::new(
                terms
                    .iter()
                    .map(|t| {
                        let term = Term::from_field_text(self.body, t);
                        let q: Box<dyn Query> =
                            Box::new(TermQuery::new(term, IndexRecordOption::WithFreqs));
                        (Occur::Should, q)
                    })
                    .collect(),
            ))
        };
        // A hit matches at least one word; its numbers add to its rank.
        let on_words = any_of(&words);
        let query: Box<dyn Query> = if numbers.is_empty() {
            on_words.box_clone()
        } else {
            Box::new(BooleanQuery::new(vec![
                (Occur::Must, on_words.box_clone()),
                (Occur::Should, any_of(&numbers)),
            ]))
        };
        let searcher = self.reader.searcher();
        let top = searcher.search(
            &query,
            &TopDocs::with_limit(self.max_results).order_by_score(),
        )?;
        let words_weight = on_words.weight(EnableScoring::enabled_from_searcher(&searcher))?;
        let mut out = Vec::new();
        for (score, address) in top {
            let mut scorer =
                words_weight.scorer(searcher.segment_reader(address.segment_ord), 1.0)?;
            let words_score = if scorer.seek(address.doc_id) == address.doc_id {
                scorer.score()
            } else {
                0.0
            };
            if words_score < self.floor {
                continue;
            }
            let doc: TantivyDocument = searcher.doc(address)?;
            let field = |f| {
                doc.get_first(f)
                    .and_then(|v| v.as_str())
                    .unwrap_or_default()
                    .to_owned()
            };
            out.push((score, field(self.path), field(self.body)));
        }
        Ok(out)
    }
}

/// A term of digits alone (`45`; the analyzer cuts `07:45` and `2024-01-20` at their
/// punctuation). A number names no topic: `45` in a question about 45 days matches the `45`
/// of a timetable's 07:45, so a passage that shares only numbers with the span, or whose words
/// alone score under the floor, is not evidence for it. Numbers still rank the passages that
/// are (the right figure lifts its passage).
fn is_number(term: &str) -> bool {
    !term.is_empty() && term.bytes().all(|b| b.is_ascii_digit())
}

impl Arm for MemoryArm {
    fn kind(&self) -> ArmKind {
        ArmKind::Memory
    }

    /// In-memory search: it does no I/O and finishes in milliseconds, so it ignores the
    /// deadline (the router's wait still bounds it).
    fn search(
        &self,
        query: &SpanQuery,
        _class: SpanClass,
        _deadline: Instant,
    ) -> Result<Vec<Snippet>, ArmError> {
        let hits = self.hits(&focus(query))?;
        Ok(hits
            .into_iter()
            .map(|(score, source, passage)| Snippet {
                claim: cap_evidence(&query.span),
                evidence: cap_evidence(&passage),
                confidence: score / (score + self.floor.max(f32::EPSILON)),
                source,
            })
            .collect())
    }
}

#[cfg(test)]
pub(crate) mod tests;
