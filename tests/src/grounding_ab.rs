//! The grounding A/B harness (issue 16, point 5; spec 003's `SURPRISE_CANARY` against
//! `SURPRISE_INTERVENE`): the labelled prompt set (`tests/grounding/prompts.jsonl`) through
//! two haltd instances in front of one backend, one with the surprise detector in `observe`
//! mode (the canary: measured, never acted on) and one in `intervene` mode (pause, ground,
//! rewind, resume), item by item, the canary's turn first. Both run at the same time against
//! the same backend, so the hold-back window's added latency is a difference measured in one
//! run, not across runs.
//!
//! Backends ([`Backend`]): any OpenAI-compatible server (a URL, a model name and the
//! continuation shape haltd uses to resume it), llama.cpp's server started here
//! ([`llama`]), the **stand-in model** ([`standin`]): the scripted upstream, told per item
//! what to say, or **haltd's built-in source** (no upstream): its trigram model, started
//! with `--builtin-restate-prompt` so that each reply restates the question before its
//! babble, and resumed after a rewind by reading the round's evidence. Neither knows
//! anything; they prove the plumbing and the metrics, not the quality of grounding on real
//! replies (see `docs/grounding.md`, "The A/B harness").
//!
//! haltd runs on loopback without the kernel gate (`--no-kernel-gate`): the harness measures
//! what grounding does to replies, not halts, and needs no root or namespaces, so it can run
//! against a backend anywhere the host reaches. Every turn is recorded (`--turn-sample-rate
//! 1`) and the grounding receipts are read from each instance's ledger.
//!
//! The figures are computed by [`report`].

pub mod llama;
mod proc;
pub mod report;
pub mod standin;

use std::{
    fmt, fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use crate::{ledger::read_ledger, sse, EventKind};
pub use proc::{free_port, Proc};

/// How long one turn may take (a grounding round included).
const TURN_TIMEOUT: Duration = Duration::from_secs(60);

/// One labelled item of the prompt set (`tests/grounding/README.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub id: String,
    pub kind: String,
    pub prompt: String,
    /// A string a correct reply contains.
    pub answer: String,
    /// A wrong claim of the kind a high-surprise window holds.
    pub span: String,
}

/// The prompt set at `path`, one JSON object a line.
pub fn load_items(path: &Path) -> Result<Vec<Item>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let v: Value = serde_json::from_str(l)
                .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
            let field = |k: &str| -> Result<String> {
                v[k].as_str()
                    .map(str::to_owned)
                    .with_context(|| format!("{}:{}: no string {k:?}", path.display(), i + 1))
            };
            Ok(Item {
                id: field("id")?,
                kind: field("kind")?,
                prompt: field("prompt")?,
                answer: field("answer")?,
                span: field("span")?,
            })
        })
        .collect()
}

/// The prompt set and memory store shipped in the repository (`tests/grounding/`).
pub fn shipped_set() -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("grounding");
    (dir.join("prompts.jsonl"), dir.join("memory"))
}

/// How haltd resumes a rewound reply on this backend (`[grounding] continuation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continuation {
    Vllm,
    LlamaCpp,
    None,
}

impl Continuation {
    pub const fn as_str(self) -> &'static str {
        match self {
            Continuation::Vllm => "vllm",
            Continuation::LlamaCpp => "llama_cpp",
            Continuation::None => "none",
        }
    }
}

impl std::str::FromStr for Continuation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "vllm" => Ok(Continuation::Vllm),
            "llama_cpp" => Ok(Continuation::LlamaCpp),
            "none" => Ok(Continuation::None),
            _ => Err(format!("{s:?}: vllm, llama_cpp or none")),
        }
    }
}

impl fmt::Display for Continuation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the items are sent to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// The scripted upstream playing the stand-in model, resumed in this shape.
    StandIn(Continuation),
    /// An OpenAI-compatible server at `url` (`/v1/chat/completions` under it).
    Server {
        name: String,
        url: String,
        model: String,
        continuation: Continuation,
    },
    /// haltd's built-in source, restating the question (`--builtin-restate-prompt`), one
    /// token per [`Settings::pace_ms`]; it resumes itself (no continuation shape).
    Builtin,
}

impl Backend {
    pub fn name(&self) -> String {
        match self {
            Backend::StandIn(c) => format!("stand-in ({c})"),
            Backend::Server { name, .. } => name.clone(),
            Backend::Builtin => "built-in".to_owned(),
        }
    }

    /// How haltd resumes the backend; `None` for the built-in source (it resumes itself).
    pub fn continuation(&self) -> Option<Continuation> {
        match self {
            Backend::StandIn(c) => Some(*c),
            Backend::Server { continuation, .. } => Some(*continuation),
            Backend::Builtin => None,
        }
    }
}

/// The surprise detector and grounding settings both instances share (the intervene one
/// adds the hold-back and the grounder).
#[derive(Debug, Clone)]
pub struct Settings {
    pub haltd_bin: PathBuf,
    /// The scripted upstream (for [`Backend::StandIn`]).
    pub upstream_bin: PathBuf,
    pub memory_dir: PathBuf,
    pub threshold_bits: f64,
    pub window: usize,
    pub min_tokens: usize,
    pub hold_back: usize,
    pub max_rounds: usize,
    pub max_tokens: u32,
    /// The stand-in's delay before each token, ms; the built-in source's token interval.
    pub pace_ms: u64,
    /// The stand-in's reply length: its claim, then filler words.
    pub reply_tokens: usize,
}

/// What the client saw of one turn, and its grounding receipt.
#[derive(Debug, Clone)]
pub struct Turn {
    pub text: String,
    /// Each token event's arrival, µs after the request was sent.
    pub token_us: Vec<f64>,
    /// A halt or an upstream error, as the stream's `error` event said it.
    pub error: Option<String>,
    /// The turn record's `grounding` (null in observe mode).
    pub receipt: Value,
}

/// One item through both modes.
#[derive(Debug, Clone)]
pub struct Pair {
    pub item: Item,
    /// What the stand-in was told to play (`None` for a real backend).
    pub play: Option<standin::Play>,
    pub canary: Turn,
    pub intervene: Turn,
}

/// `[detectors.surprise]` and `[grounding]` for one mode.
fn config(s: &Settings, intervene: bool, continuation: Option<Continuation>) -> String {
    let mode = if intervene { "intervene" } else { "observe" };
    let mut c = format!(
        "[detectors.surprise]\nmode = \"{mode}\"\nwindow = {}\nmin_tokens = {}\n\
         threshold_bits = {:?}\n",
        s.window, s.min_tokens, s.threshold_bits
    );
    if intervene {
        let resume = continuation.map_or(String::new(), |c| format!("continuation = \"{c}\"\n"));
        c.push_str(&format!(
            "hold_back = {}\n\n[grounding]\nmax_rounds = {}\n{resume}\n\
             [grounding.memory]\ndir = {:?}\n",
            s.hold_back,
            s.max_rounds,
            s.memory_dir.display().to_string()
        ));
    }
    c
}

/// A haltd on loopback in front of `upstream` (`None`: the built-in source), and its
/// ledger.
#[derive(Debug)]
struct Instance {
    proc: Proc,
    url: String,
    ledger: PathBuf,
}

fn start_haltd(
    s: &Settings,
    dir: &Path,
    name: &str,
    upstream: Option<&str>,
    cfg: &str,
) -> Result<Instance> {
    let path = dir.join(format!("{name}.toml"));
    fs::write(&path, cfg)?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let ledger = dir.join(format!("{name}.ledger.jsonl"));
    let mut cmd = std::process::Command::new(&s.haltd_bin);
    cmd.arg("serve")
        .args(["--listen", &listen, "--no-kernel-gate"])
        .arg("--admin")
        .arg(format!(
            "unix:{}",
            dir.join(format!("{name}.admin.sock")).display()
        ))
        .args(["--metrics", &format!("127.0.0.1:{}", free_port()?)])
        .arg("--ledger")
        .arg(&ledger)
        .arg("--state-dir")
        .arg(dir.join(format!("{name}.state")))
        .arg("--ledger-no-fsync")
        .args(crate::TEST_SAMPLING)
        .arg("--config")
        .arg(&path);
    match upstream {
        Some(up) => cmd.args(["--source", "openai", "--upstream", up]),
        None => cmd.arg("--builtin-restate-prompt").args([
            "--builtin-token-interval-us",
            &(s.pace_ms * 1000).to_string(),
        ]),
    };
    let proc = Proc::spawn(cmd, dir, name, |out| {
        out.lines().any(|l| l.starts_with("haltd ready"))
    })?;
    Ok(Instance {
        proc,
        url: format!("http://{listen}/v1/chat/completions"),
        ledger,
    })
}

/// The request for `item`: the stand-in's carries its directive.
fn body(backend: &Backend, s: &Settings, item: &Item, play: Option<standin::Play>) -> Value {
    let (model, content) = match backend {
        Backend::StandIn(_) => (
            "stand-in".to_owned(),
            play.map_or_else(|| item.prompt.clone(), |p| standin::prompt(item, p, s)),
        ),
        Backend::Server { model, .. } => (model.clone(), item.prompt.clone()),
        Backend::Builtin => ("builtin".to_owned(), item.prompt.clone()),
    };
    // Greedy, seeded: both modes get the same reply from a deterministic backend, so a
    // changed reply is the intervention's doing.
    json!({"model": model, "stream": true, "max_tokens": s.max_tokens, "temperature": 0,
        "seed": 7, "messages": [{"role": "user", "content": content}]})
}

/// One streamed turn through `inst`.
fn turn(inst: &Instance, body: &Value) -> Result<(String, Turn)> {
    let t0 = Instant::now();
    let o = sse::stream(&inst.url, body, TURN_TIMEOUT, |_, _| {})?;
    ensure!(
        o.status == 200,
        "{}: HTTP {} {:?}",
        inst.url,
        o.status,
        o.body
    );
    let token_us = o
        .events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Token(_)))
        .map(|e| e.at.duration_since(t0).as_secs_f64() * 1e6)
        .collect();
    let error = o.error.as_ref().map(|e| {
        e["code"]
            .as_str()
            .map_or_else(|| e.to_string(), str::to_owned)
    });
    let t = Turn {
        text: o.text.clone(),
        token_us,
        error,
        receipt: Value::Null,
    };
    Ok((o.stream_id, t))
}

/// The `grounding` of each turn record in `ledger`, by stream id, into `turns`.
fn attach_receipts(ledger: &Path, turns: &mut [(String, &mut Turn)]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let records = read_ledger(ledger)?;
        let mut missing = 0;
        for (id, t) in turns.iter_mut() {
            match records
                .iter()
                .find(|r| r["kind"] == "turn" && r["stream_id"] == id.as_str())
            {
                Some(r) => t.receipt = r["grounding"].clone(),
                None => missing += 1,
            }
        }
        if missing == 0 {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{missing} turn records missing from {}",
            ledger.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `items` through an observe and an intervene haltd in front of `upstream` (the URL
/// the backend answers on; `None`: the built-in source), canary first for each item. `dir`
/// holds the instances' files.
pub fn run_pairs(
    backend: &Backend,
    upstream: Option<&str>,
    s: &Settings,
    items: &[Item],
    dir: &Path,
) -> Result<Vec<Pair>> {
    let cont = backend.continuation();
    let mut canary = start_haltd(s, dir, "canary", upstream, &config(s, false, cont))?;
    let mut inter = start_haltd(s, dir, "intervene", upstream, &config(s, true, cont))?;
    let mut pairs = Vec::new();
    let mut ids = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let play = matches!(backend, Backend::StandIn(_)).then(|| standin::Play::of(i));
        let b = body(backend, s, item, play);
        let (cid, c) = turn(&canary, &b)?;
        let (iid, t) = turn(&inter, &b)?;
        ids.push((cid, iid));
        pairs.push(Pair {
            item: item.clone(),
            play,
            canary: c,
            intervene: t,
        });
    }
    eprintln!("  {}: {} items", backend.name(), items.len());
    let (mut cs, mut is): (Vec<_>, Vec<_>) = pairs
        .iter_mut()
        .zip(&ids)
        .map(|(p, (c, i))| ((c.clone(), &mut p.canary), (i.clone(), &mut p.intervene)))
        .unzip();
    attach_receipts(&canary.ledger, &mut cs)?;
    attach_receipts(&inter.ledger, &mut is)?;
    canary.proc.check_alive()?;
    inter.proc.check_alive()?;
    Ok(pairs)
}

/// Runs `items` against `backend`: the stand-in's scripted upstream is started here (and
/// stopped after); a server is used where it is; the built-in source is haltd's own.
pub fn run_backend(
    backend: &Backend,
    s: &Settings,
    items: &[Item],
    dir: &Path,
) -> Result<Vec<Pair>> {
    match backend {
        Backend::StandIn(_) => {
            let mut up = standin::start(&s.upstream_bin, dir)?;
            let pairs = run_pairs(backend, Some(&up.url), s, items, dir)?;
            up.proc.check_alive()?;
            Ok(pairs)
        }
        Backend::Server { url, .. } => run_pairs(backend, Some(url), s, items, dir),
        Backend::Builtin => run_pairs(backend, None, s, items, dir),
    }
}
