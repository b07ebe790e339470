//! "Governed or refused" (issue 35, point 5), by translation: every cell of surface (chat,
//! Messages, Responses) × {stream, batch} × {text, tool call, reasoning} × {normal, tripped},
//! each a turn of the surface's official SDK through the scripted upstream, with the kernel
//! gate on, is either governed (its turn record is written and agrees with what the client
//! got: all of its tokens, or, tripped, τ plus at most B post-trip tokens; a tripped batch
//! turn none) or refused (an HTTP error, no token). No cell is forwarded unpoliced. Messages
//! and Responses cells come twice: translated to chat, and passed through to the scripted
//! upstream's own surface (`--upstream-surfaces`, a haltd of its own); chat has nothing to
//! pass through.

use std::fmt::Write as _;

use anyhow::{bail, ensure, Context, Result};
use haltd_tests::{openai_sdk, rig::Rig};
use serde_json::Value;

use super::{trips::long_args, turn};
use crate::{
    messages::{self, tripping_on, Trips, WEATHER_TOOL},
    UPSTREAM_BIN,
};

/// The surfaces, each translated (`false`) and, where a backend can serve it, passed through.
const GROUPS: [(Surface, bool); 5] = [
    (Surface::Chat, false),
    (Surface::Messages, false),
    (Surface::Responses, false),
    (Surface::Messages, true),
    (Surface::Responses, true),
];

/// The budget of the tripped cells.
const B: u64 = 5;
/// Token frames a tripped turn has when it is tripped.
const AT: u64 = 4;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Surface {
    Chat,
    Messages,
    Responses,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Content {
    Text,
    Tool,
    Reasoning,
}

/// One cell of the table.
#[derive(Clone, Copy, Debug)]
struct Cell {
    surface: Surface,
    /// Passed through to the backend's own surface, not translated.
    passed: bool,
    stream: bool,
    content: Content,
    tripped: bool,
}

impl Cell {
    fn all() -> Vec<Cell> {
        let mut out = Vec::new();
        for (surface, passed) in GROUPS {
            for stream in [true, false] {
                for content in [Content::Text, Content::Tool, Content::Reasoning] {
                    for tripped in [false, true] {
                        out.push(Cell {
                            surface,
                            passed,
                            stream,
                            content,
                            tripped,
                        });
                    }
                }
            }
        }
        out
    }

    /// The cell's API key: a trip degrades its key, so every cell has its own.
    fn key(self) -> String {
        format!("sk-cell-{self:?}")
            .replace([' ', '{', '}', ',', ':'], "")
            .to_lowercase()
    }

    /// The scripted model's answer: a short one, or a long slow one to trip.
    fn prompt(self) -> String {
        match (self.content, self.tripped) {
            (Content::Text, false) => "[[script:normal tokens=5]]".to_owned(),
            (Content::Text, true) => "[[script:normal tokens=300 pace_ms=20]]".to_owned(),
            (Content::Tool, false) => "[[script:tool_call tokens=2]]".to_owned(),
            (Content::Tool, true) => format!(
                "[[script:tool_call tokens=1 args_chunks=300 pace_ms=20 args=\"{}\"]]",
                long_args()
            ),
            (Content::Reasoning, false) => "[[script:normal tokens=6 reasoning=3]]".to_owned(),
            (Content::Reasoning, true) => {
                "[[script:normal tokens=300 reasoning=300 pace_ms=20]]".to_owned()
            }
        }
    }

    /// The SDK driver's own arguments for the cell (Messages and Responses: one turn of a
    /// `--turns` run).
    fn args(self) -> Vec<String> {
        let prompt = self.prompt();
        let key = self.key();
        let mut a = turn(&["--api-key", &key, "--prompt", &prompt]);
        let tool = self.content == Content::Tool;
        match self.surface {
            Surface::Chat => {
                a.push(
                    if self.stream {
                        "--stream"
                    } else {
                        "--no-stream"
                    }
                    .to_owned(),
                );
                a.extend(turn(&["--max-tokens", "1000"]));
                if tool {
                    a.push("--tools".to_owned());
                }
            }
            Surface::Messages => {
                let mode = if self.stream { "stream" } else { "create" };
                a.extend(turn(&["--mode", mode, "--max-tokens", "2000"]));
                if tool {
                    a.extend(turn(&["--tools", WEATHER_TOOL]));
                }
                if self.content == Content::Reasoning {
                    a.extend(turn(&["--thinking-budget", "1024"]));
                }
            }
            Surface::Responses => {
                let mode = if self.stream { "stream" } else { "create" };
                a.extend(turn(&["--mode", mode, "--max-output-tokens", "1000"]));
                if tool {
                    a.extend(turn(&["--tools", "weather"]));
                }
            }
        }
        a
    }
}

/// What a cell's client saw: the stream id, the HTTP status, the token frames (streams) or
/// output tokens (batch), and whether a halt reached it.
#[derive(Debug)]
struct Seen {
    stream_id: Option<String>,
    status: Option<u64>,
    tokens: u64,
    halted: bool,
}

fn seen(cell: Cell, r: &Value) -> Seen {
    let u = |v: &Value| v.as_u64().unwrap_or(0);
    match cell.surface {
        Surface::Chat => Seen {
            stream_id: r["stream_id"].as_str().map(str::to_owned),
            status: r["error"]["status_code"].as_u64().or(Some(200)),
            tokens: if cell.stream {
                u(&r["chunks"])
            } else {
                u(&r["usage"]["completion_tokens"])
            },
            halted: r["finish_reason"] == "content_filter"
                || r["error"]["body"]["type"] == "halted",
        },
        Surface::Messages => Seen {
            stream_id: r["headers"]["x-haltd-stream-id"]
                .as_str()
                .map(str::to_owned),
            status: r["status"].as_u64(),
            tokens: if cell.stream {
                messages::frames_seen(r) as u64
            } else {
                u(&r["usage"]["output_tokens"])
            },
            halted: r["stop_reason"] == "refusal" && r["halt"]["type"] == "halted",
        },
        Surface::Responses => Seen {
            stream_id: r["headers"]["x-haltd-stream-id"]
                .as_str()
                .map(str::to_owned),
            status: r["status"].as_u64(),
            tokens: if cell.stream {
                u(&r["frames"])
            } else {
                u(&r["usage"]["output_tokens"])
            },
            halted: r["incomplete_details"]["reason"] == "content_filter"
                && r["halt"]["type"] == "halted",
        },
    }
}

/// Runs the cells of one surface (chat: one process a cell; the others: one process).
fn run(rig: &Rig, surface: Surface, cells: &[Cell]) -> Result<Vec<Value>> {
    let haltd = &rig.haltd;
    let turns: Vec<Vec<String>> = cells.iter().map(|c| c.args()).collect();
    match surface {
        Surface::Chat => {
            let base = format!("{}/v1", haltd.api_url());
            turns
                .iter()
                .map(|t| {
                    let mut args = vec!["--base-url", base.as_str()];
                    args.extend(t.iter().map(String::as_str));
                    openai_sdk(&haltd.client_ns, &args)
                })
                .collect()
        }
        Surface::Messages => messages::sdk(haltd, &[], &turns),
        Surface::Responses => super::sdk(haltd, &[], &turns),
    }
}

/// The verdict on one cell: "governed" or "refused", or why neither.
fn judge(rig: &Rig, cell: Cell, r: &Value, trips: &Trips) -> Result<&'static str> {
    let s = seen(cell, r);
    if s.status.is_some_and(|st| st >= 400) {
        ensure!(s.tokens == 0, "refused, with tokens: {r}");
        return Ok("refused");
    }
    let id = s
        .stream_id
        .clone()
        .with_context(|| format!("no stream id: {r}"))?;
    let rec = rig.turn_record(&id)?;
    if !cell.tripped {
        ensure!(!s.halted, "halted untripped: {r}");
        // A batch body is not a token frame: its record's tokens_emitted is 0
        // (docs/fhr-schema.md).
        let emitted = if cell.stream { s.tokens } else { 0 };
        ensure!(
            rec["turn_status"] == "committed"
                && rec["outcome"] == "completed"
                && rec["tokens_emitted"] == emitted
                && s.tokens > 0,
            "the record {rec} for {s:?}: {r}"
        );
        return Ok("governed");
    }
    let (code, trip) = trips
        .get(&id)
        .with_context(|| format!("not tripped: {r}"))?;
    ensure!(*code == 200 && trip["kernel_enforced"] == true, "{trip}");
    let tau = trip["trip_token_index"].as_u64().context("τ")?;
    let post = rec["halt_tokens_post_trip"].as_u64().context("post")?;
    ensure!(
        s.halted && rec["trip_cause"] == "OPERATOR_TRIP" && rec["trip_token_index"] == tau,
        "the record {rec} for {s:?}: {r}"
    );
    if cell.stream {
        ensure!(
            post <= B && s.tokens == tau + post,
            "{} frames, τ {tau}, post-trip {post}, B {B}: {r}",
            s.tokens
        );
    } else {
        ensure!(
            post == 0,
            "a halted batch turn with post-trip tokens: {rec}"
        );
    }
    Ok("governed")
}

#[test]
fn every_cell_of_every_surface_is_governed_or_refused() -> Result<()> {
    let budget = B.to_string();
    let translating = Rig::start(UPSTREAM_BIN, &["--budget", &budget])?;
    let mut args = vec!["--budget", budget.as_str()];
    args.extend_from_slice(&crate::passthrough::PASS_THROUGH);
    let passing = Rig::start(UPSTREAM_BIN, &args)?;
    let cells = Cell::all();
    let mut table = String::new();
    let mut failures = Vec::new();
    for (surface, passed) in GROUPS {
        let rig = if passed { &passing } else { &translating };
        let of = |tripped: bool| -> Vec<Cell> {
            cells
                .iter()
                .copied()
                .filter(|c| c.surface == surface && c.passed == passed && c.tripped == tripped)
                .collect()
        };
        let normal = of(false);
        let r = run(rig, surface, &normal)?;
        let tripped = of(true);
        let endpoint = match surface {
            Surface::Chat => "chat",
            Surface::Messages => "messages",
            Surface::Responses => "responses",
        };
        let (rt, trips) = tripping_on(&rig.haltd, &[endpoint], AT, || run(rig, surface, &tripped))?;
        for (cell, r) in normal.iter().zip(&r).chain(tripped.iter().zip(&rt)) {
            let verdict = judge(rig, *cell, r, &trips);
            let _ = writeln!(
                table,
                "{:?} {} {} {:?} {}: {}",
                cell.surface,
                if cell.passed {
                    "pass-through"
                } else {
                    "translated"
                },
                if cell.stream { "stream" } else { "batch" },
                cell.content,
                if cell.tripped { "tripped" } else { "normal" },
                match &verdict {
                    Ok(v) => (*v).to_owned(),
                    Err(e) => format!("NEITHER: {e:#}"),
                }
            );
            if verdict.is_err() {
                failures.push(*cell);
            }
        }
    }
    println!("governed or refused, B = {B}:\n{table}");
    if !failures.is_empty() {
        bail!(
            "{} cells neither governed nor refused:\n{table}",
            failures.len()
        );
    }
    Ok(())
}
