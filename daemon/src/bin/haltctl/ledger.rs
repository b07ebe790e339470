//! `haltctl ledger`: the flight-recorder tools (verify, re-anchor, show, tail), offline: none
//! of them talks to haltd.

use std::{path::PathBuf, process::ExitCode};

use clap::Subcommand;
use haltd::ctl::{
    out,
    reader::{ledger_show, ledger_tail, Reader},
    settings,
};
use haltd::ledger::show;

use super::Ctx;

#[derive(Subcommand)]
pub(crate) enum LedgerCommand {
    /// Check the keyed hash chain of a ledger, one file or a series of segments (oldest first),
    /// the key it was written under, and its end against the head; says where it breaks.
    /// Needs the ledger key (`<state-dir>/ledger.key`, root-only). Exit status: 0 intact,
    /// 1 broken chain, 2 cannot check (I/O, no key), 3 key mismatch (the wrong --state-dir),
    /// 4 end not checkable (no head: give --head FILE, or --no-end-check).
    Verify {
        /// haltd's `--state-dir`: the key, and the head of the last segment [default:
        /// --config's `state_dir`, else /var/lib/haltd].
        #[arg(long, env = "HALTD_STATE_DIR")]
        state_dir: Option<PathBuf>,
        /// Check the end against this head file (`ledger-<id>.head` from haltd's state
        /// directory, kept under its name), e.g. for a copy of a ledger.
        #[arg(long, value_name = "FILE", conflicts_with = "no_end_check")]
        head: Option<PathBuf>,
        /// Accept that the end cannot be checked (exit 0 instead of 4 without a head).
        #[arg(long)]
        no_end_check: bool,
        /// The segments, oldest first; the last is the current ledger file.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Take a ledger whose head is missing as it stands, on your word. haltd refuses to start
    /// on such a ledger (exit 3): records cut off its end could not be ruled out. This writes an
    /// `admin` record (`ledger_reanchor`) naming you and where the chain stood, then a new
    /// head. Stop haltd first. Needs the ledger key (`<state-dir>/ledger.key`, root-only).
    /// Exit status: 0 re-anchored, 1 refused (a head is there, no record, a broken chain),
    /// 2 cannot (no key, haltd holds the ledger, I/O).
    Reanchor {
        /// Your name, recorded with this command's uid, gid and pid.
        #[arg(long, value_name = "NAME")]
        operator: String,
        /// haltd's `--state-dir`: the key, and where the new head goes [default: --config's
        /// `state_dir`, else /var/lib/haltd].
        #[arg(long, env = "HALTD_STATE_DIR")]
        state_dir: Option<PathBuf>,
        /// The ledger file (haltd's `--ledger`) [default: --config's `ledger`, else
        /// /var/lib/haltd/ledger.jsonl].
        #[arg(env = "HALTD_LEDGER")]
        path: Option<PathBuf>,
    },
    /// Print a ledger's records as a table (or as JSON Lines), oldest first. Reads only: it
    /// does not check the chain (`verify` does). Lines that are not records (a torn last line,
    /// damage) are reported on stderr by number. Exit status: 0 printed, 2 cannot read.
    Show {
        #[command(flatten)]
        view: LedgerView,
        /// Only the last N matching records.
        #[arg(long, value_name = "N")]
        last: Option<usize>,
    },
    /// Print the last records, then follow the file as haltd appends to it (until
    /// interrupted), across rotations: when the path names a new file, or the file got
    /// shorter, it reads the new one from its start.
    Tail {
        #[command(flatten)]
        view: LedgerView,
        /// How many records to print before following.
        #[arg(short = 'n', long, default_value_t = 10)]
        lines: usize,
        /// How often to look for new records, in milliseconds.
        #[arg(long, default_value_t = 250, value_name = "MS")]
        interval_ms: u64,
    },
}

/// What `ledger show` and `ledger tail` read and print.
#[derive(clap::Args)]
pub(crate) struct LedgerView {
    /// The ledger file (haltd's `--ledger`) [default: --config's `ledger`, else
    /// /var/lib/haltd/ledger.jsonl].
    #[arg(env = "HALTD_LEDGER")]
    path: Option<PathBuf>,
    /// Only the records of this stream (the `x-haltd-stream-id` response header).
    #[arg(long, value_name = "ID")]
    stream: Option<String>,
    /// Only records of this kind.
    #[arg(long, value_enum)]
    kind: Option<KindArg>,
}

/// `--kind`: the record kinds of docs/fhr-schema.md §1.
#[derive(Clone, Copy, clap::ValueEnum)]
enum KindArg {
    Turn,
    Incident,
    Lifecycle,
    Crash,
    Admin,
    /// TokenCircuit's interventions (`tool_circuit`).
    #[value(name = "tool_circuit")]
    ToolCircuit,
}

impl From<KindArg> for haltd::ledger::RecordKind {
    fn from(k: KindArg) -> Self {
        use haltd::ledger::RecordKind as K;
        match k {
            KindArg::Turn => K::Turn,
            KindArg::Incident => K::Incident,
            KindArg::Lifecycle => K::Lifecycle,
            KindArg::Crash => K::Crash,
            KindArg::Admin => K::Admin,
            KindArg::ToolCircuit => K::ToolCircuit,
        }
    }
}

/// The reader of `ledger show` and `ledger tail`.
fn reader(view: &LedgerView, ctx: &Ctx) -> Reader {
    Reader {
        path: settings::pick(
            view.path.as_ref(),
            ctx.file.ledger.as_ref(),
            PathBuf::from(settings::DEFAULT_LEDGER),
        ),
        sel: show::Selection {
            stream: view.stream.clone(),
            kind: view.kind.map(Into::into),
        },
        json: ctx.json,
    }
}

/// `haltctl ledger verify`: one line (or a JSON object), and the exit code of its verdict.
fn ledger_verify(ctx: &Ctx, req: &haltd::ctl::verify::VerifyRequest<'_>) -> ExitCode {
    let outcome = haltd::ctl::verify::run(req);
    if ctx.json {
        out::line(&serde_json::to_string(&outcome).unwrap_or_default());
    } else if outcome.exit_code == 0 || outcome.exit_code == 1 {
        out::line(&outcome.message);
    } else {
        eprintln!("haltctl: {}", outcome.message);
    }
    ExitCode::from(outcome.exit_code)
}

/// `haltctl ledger reanchor`: one line (or a JSON object), and its exit code.
fn ledger_reanchor(ctx: &Ctx, req: &haltd::ctl::reanchor::ReanchorRequest<'_>) -> ExitCode {
    let outcome = haltd::ctl::reanchor::run(req);
    if ctx.json {
        out::line(&serde_json::to_string(&outcome).unwrap_or_default());
    } else if outcome.reanchored {
        out::line(&outcome.message);
    } else {
        eprintln!("haltctl ledger reanchor: {}", outcome.message);
    }
    ExitCode::from(outcome.exit_code)
}

pub(crate) fn ledger(ctx: &Ctx, command: &LedgerCommand) -> ExitCode {
    match command {
        LedgerCommand::Verify {
            state_dir,
            head,
            no_end_check,
            paths,
        } => {
            let state_dir = ctx.state_dir(state_dir.as_ref());
            let req = haltd::ctl::verify::VerifyRequest {
                state_dir: &state_dir,
                paths,
                head: head.as_deref(),
                no_end_check: *no_end_check,
            };
            ledger_verify(ctx, &req)
        }
        LedgerCommand::Reanchor {
            operator,
            state_dir,
            path,
        } => {
            let state_dir = ctx.state_dir(state_dir.as_ref());
            let ledger = settings::pick(
                path.as_ref(),
                ctx.file.ledger.as_ref(),
                PathBuf::from(settings::DEFAULT_LEDGER),
            );
            ledger_reanchor(
                ctx,
                &haltd::ctl::reanchor::ReanchorRequest {
                    state_dir: &state_dir,
                    ledger: &ledger,
                    operator,
                },
            )
        }
        LedgerCommand::Show { view, last } => ledger_show(&reader(view, ctx), *last),
        LedgerCommand::Tail {
            view,
            lines,
            interval_ms,
        } => ledger_tail(&reader(view, ctx), *lines, *interval_ms),
    }
}
