//! `haltctl`: the operator's CLI for a running haltd (trip a stream, list streams, end
//! degraded safe mode) and for its flight recorder (verify the hash chain, show and follow
//! the records). It prints tables and lines for people, and every command takes `--json` for
//! scripts; where it finds the daemon is `haltd::ctl::settings`.

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

use clap::{Parser, Subcommand};
use haltd::admin::client::AdminClient;
use haltd::ctl::{out, render, settings};
use hyper::Method;
use serde_json::Value;

mod ledger;
mod policy;

use ledger::{ledger, LedgerCommand};
use policy::{detector_call, profile_call, DetectorCommand, ProfileCommand};

#[derive(Parser)]
#[command(name = "haltctl", version = haltd::build_info::LONG_VERSION, about = "Operate a running haltd")]
struct Cli {
    /// haltd's config file: haltctl takes `admin`, `admin_token_file`, `state_dir` and `ledger`
    /// from it where no flag or variable gives them, so it talks to the daemon that file
    /// configures.
    #[arg(long, global = true, env = "HALTD_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// haltd's admin API (`haltd serve --admin`): `unix:PATH`, or `IP:PORT` with
    /// --admin-token-file [default: --config's `admin`, else unix:/run/haltd/admin.sock].
    #[arg(long, global = true, env = "HALTD_ADMIN")]
    admin: Option<String>,
    /// The bearer token of a TCP admin listener (the file haltd's --admin-token-file names)
    /// [default: --config's `admin_token_file`].
    #[arg(
        long,
        global = true,
        env = "HALTD_ADMIN_TOKEN_FILE",
        value_name = "FILE"
    )]
    admin_token_file: Option<PathBuf>,
    /// Print the answer as JSON (the admin API's answer as haltd sent it; JSON Lines for
    /// `ledger show` and `ledger tail`) instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

/// Where haltctl finds the daemon, resolved once (`haltd::ctl::settings`).
struct Ctx {
    json: bool,
    admin: String,
    admin_token_file: Option<PathBuf>,
    file: settings::FileSettings,
}

impl Ctx {
    fn new(cli: &Cli) -> Result<Self, String> {
        let file = match &cli.config {
            Some(path) => settings::FileSettings::read(path).map_err(|e| e.to_string())?,
            None => settings::FileSettings::default(),
        };
        Ok(Ctx {
            json: cli.json,
            admin: settings::pick(
                cli.admin.as_ref(),
                file.admin.as_ref(),
                settings::DEFAULT_ADMIN.to_owned(),
            ),
            admin_token_file: cli
                .admin_token_file
                .clone()
                .or_else(|| file.admin_token_file.clone()),
            file,
        })
    }

    /// `--state-dir` (or `HALTD_STATE_DIR`), else `--config`'s, else haltd's default.
    fn state_dir(&self, given: Option<&PathBuf>) -> PathBuf {
        settings::pick(
            given,
            self.file.state_dir.as_ref(),
            PathBuf::from(settings::DEFAULT_STATE_DIR),
        )
    }
}

#[derive(Subcommand)]
enum Command {
    /// Trip a stream now: at most B more tokens reach its client, then the terminal event.
    Trip {
        /// The stream id (the `x-haltd-stream-id` response header).
        stream_id: String,
        /// Failure code recorded as the trip cause.
        #[arg(long, default_value = "OPERATOR_TRIP")]
        cause: String,
        /// Do not put the stream's scope into degraded mode (recorded with the trip). A scope
        /// that is degraded already stays so.
        #[arg(long)]
        no_degrade: bool,
    },
    /// Incidents (halts) as the ledger records them: label one.
    Incident {
        #[command(subcommand)]
        command: IncidentCommand,
    },
    /// List open streams.
    Streams,
    /// Daemon status: which daemon answered (pid, listen and admin addresses, version,
    /// commit, ledger), then its gate, heartbeat and streams.
    Status,
    /// Show degraded safe mode, or end it: `haltctl mode full [--scope all|node|SCOPE]`.
    Mode {
        /// `full` ends degraded mode for the scope; without it, show the degraded scopes.
        #[arg(value_parser = ["full"])]
        set: Option<String>,
        /// Which degraded scope to end: every one (`all`), the node-wide one, or one scope as records and `haltctl mode` name it (`addr:<fp>`, `header:<fp>`, or `key:<fp>` kept from before 0.36).
        #[arg(long, default_value = "all", requires = "set")]
        scope: String,
    },
    /// The detectors per route: their mode and what they did in it (`list`), or switch one
    /// between observe and hard for turns that start from now (`mode`).
    Detector {
        #[command(subcommand)]
        command: DetectorCommand,
    },
    /// The architecture profile: `haltctl profile set full|mkp` switches it for turns that
    /// start from now (`mkp` refuses a B above 5 or no kernel gate).
    Profile {
        #[command(subcommand)]
        command: ProfileCommand,
    },
    /// Committed per-conversation state (turns that ended cleanly).
    Conversations,
    /// This node's per-scope limits (--limit-*) and what each scope used in its current
    /// minute: turns in flight, requests and tokens.
    Limits,
    /// The state that survives a restart (the state store in --state-dir): show it, or end
    /// one entry.
    State {
        #[command(subcommand)]
        command: StateCommand,
    },
    /// TokenCircuit (docs/tokencircuit.md): the conversations' tool circuits.
    Circuit {
        #[command(subcommand)]
        command: CircuitCommand,
    },
    /// The tool calls failed turns delivered, which wait for an operator's outcome: list
    /// them, or record one (`haltctl reconcile REF --outcome done|not_done|compensated`), in
    /// the ledger with your identity. A retry of an unreconciled call is refused; `not_done`
    /// allows it once.
    Reconcile {
        /// The call's reference (as the list shows it); without it, list.
        reference: Option<String>,
        /// What the call did: `done` (took effect), `not_done` (did not: one retry is
        /// allowed) or `compensated` (took effect and was undone).
        #[arg(long, requires = "reference", value_parser = ["done", "not_done", "compensated"])]
        outcome: Option<String>,
        /// List the reconciled calls too.
        #[arg(long, conflicts_with = "reference")]
        all: bool,
    },
    /// Flight-recorder tools.
    Ledger {
        #[command(subcommand)]
        command: LedgerCommand,
    },
    /// API keys as haltd sees them.
    Key {
        #[command(subcommand)]
        command: KeyCommand,
    },
    /// Calibrate the surprise detector on labelled token streams (offline: no haltd needed).
    ///
    /// Prints the AUROC with a bootstrap confidence interval and the operating point (highest
    /// precision at recall ≥ 0.5); with --config, writes its threshold into that config file.
    /// Labels file: JSON Lines, one stream a line:
    /// {"id": "...", "label": 0|1, "logprobs": [natural-log probabilities], "tokens": [...]}
    /// (label 1 = the detector should trip; "tokens" optional). Exit status: 0 done, 1 no
    /// operating point (nothing written), 2 error.
    Calibrate(CalibrateArgs),
    /// Print a shell completion script (e.g. `haltctl completions bash > /usr/share/bash-completion/completions/haltctl`).
    Completions {
        #[arg(value_enum)]
        shell: haltd::cli_docs::Shell,
    },
    /// Write the man pages (one per command) into DIR (packaging runs it).
    #[command(hide = true)]
    Man { dir: PathBuf },
}

#[derive(clap::Args, Clone)]
struct CalibrateArgs {
    /// Labels file (JSON Lines; see above).
    #[arg(
        long,
        required_unless_present = "builtin_set",
        conflicts_with = "builtin_set"
    )]
    labels: Option<PathBuf>,
    /// Instead of a labels file, generate N labelled streams from the built-in model: normal
    /// generations against ones with a garbled (temperature-raised) span. This measures
    /// garbled-versus-normal on that model, not hallucination.
    #[arg(long, value_name = "N")]
    builtin_set: Option<usize>,
    /// With --builtin-set: also write the generated set to FILE as a labels file.
    #[arg(long, value_name = "FILE", requires = "builtin_set")]
    write_labels: Option<PathBuf>,
    /// haltd's TOML config file: set [detectors.surprise] threshold_bits, window, statistic
    /// and min_tokens (created if missing; other content and comments kept).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Rolling window W in tokens (1..=256).
    #[arg(long, default_value_t = haltd::detect::surprise::DEFAULT_WINDOW)]
    window: usize,
    /// Statistic of the window the threshold applies to.
    #[arg(long, default_value = "mean", value_parser = ["mean", "p90"])]
    statistic: String,
    /// Surprises the window must hold before it can trip [default: W/2].
    #[arg(long)]
    min_tokens: Option<usize>,
    /// Bootstrap resamples for the AUROC interval (0: none).
    #[arg(long, default_value_t = haltd::calibrate::DEFAULT_BOOTSTRAP)]
    bootstrap: usize,
    /// RNG seed (bootstrap, and --builtin-set generation).
    #[arg(long, default_value_t = haltd::calibrate::DEFAULT_SEED)]
    seed: u64,
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Print the fingerprint haltd gives the key on standard input (one line: the API key, or
    /// `Bearer KEY`; with --header, an --identity-header value): the conversation records'
    /// `conversation`, `haltctl conversations` and a `key:<fingerprint>` scope kept from before
    /// 0.36 name it by. Needs the node secret (`<state-dir>/node.key`).
    /// Exit status: 0 printed, 2 cannot (no secret, not a key haltd accepts).
    Fingerprint {
        /// The line is the value of haltd's --identity-header, not an API key.
        #[arg(long)]
        header: bool,
        /// haltd's `--state-dir` [default: --config's `state_dir`, else /var/lib/haltd].
        #[arg(long, env = "HALTD_STATE_DIR")]
        state_dir: Option<PathBuf>,
    },
    /// Issue a key of the key store (--client-keys store): prints its secret once. Recorded
    /// in the ledger with your identity. Limits not given are the node's --limit-*.
    Add {
        /// What the key is for (shown in `key list`, the access log and records).
        name: String,
        /// Most turns the key may have open at once on this node.
        #[arg(long)]
        concurrency: Option<u32>,
        /// Most turns the key may start per minute on this node.
        #[arg(long)]
        rpm: Option<u32>,
        /// Most prompt and output tokens the key may use per minute on this node.
        #[arg(long)]
        tpm: Option<u64>,
    },
    /// Revoke a key: its next request gets 401, and its open turns are halted. Recorded.
    Revoke {
        /// The key's id (16 hex digits, as `key list` shows it).
        id: String,
    },
    /// Give a key a new secret (printed once); the old one keeps working for --overlap-s.
    /// Recorded.
    Rotate {
        /// The key's id.
        id: String,
        /// How long the old secret keeps working, in seconds (0: it stops at once).
        #[arg(long, default_value_t = 86_400)]
        overlap_s: u64,
    },
    /// Every key: id, name, state (active, rotating, revoked), and its use of the current
    /// minute against its limits. Never a secret.
    List,
}

#[derive(Subcommand)]
enum IncidentCommand {
    /// Label a stream's incident a true (`tp`) or a false (`fp`) positive, recorded in the
    /// ledger with your identity and counted in `haltd_incident_labels{detector, route,
    /// label}`. The incident is the stream's last `incident` record in the current ledger
    /// segment; labelling it again replaces the label (the counts move). Exit status: 0
    /// labelled, 1 haltd refused (404: no incident of that stream), 2 no answer.
    Label {
        /// The stream id (`x-haltd-stream-id`, the incident record's `stream_id`).
        stream_id: String,
        /// `tp`: the halt was right; `fp`: it stopped a stream that was fine.
        #[arg(value_enum)]
        label: haltd::labels::Label,
        /// Why, for whoever reads the record (at most 1024 bytes).
        #[arg(long, value_name = "TEXT")]
        note: Option<String>,
    },
}

#[derive(Subcommand)]
enum StateCommand {
    /// What the store holds: the degraded scopes with their expiry, and the ledger record it
    /// reflects.
    Show,
    /// Ends one held entry: a degraded scope (`node`, or a scope as `haltctl mode` names it),
    /// recorded in the ledger with the operator's identity (as `haltctl mode full --scope S`).
    Reset {
        #[arg(long)]
        scope: String,
    },
}

#[derive(Subcommand)]
enum CircuitCommand {
    /// The open keys (class, budget left, receipts) and haltd's last interventions of a
    /// conversation (its `x-haltd-conversation-id`, or the digest this shows), or of every
    /// conversation haltd keeps, most recently used first.
    Show {
        /// The conversation; without it, every one kept.
        conversation: Option<String>,
    },
}

/// `haltctl key fingerprint`.
fn key_fingerprint(ctx: &Ctx, state_dir: &Path, header: bool) -> ExitCode {
    use haltd::ctl::fingerprint::{fingerprint, Input};
    let mut line = String::new();
    if let Err(e) = std::io::stdin().read_line(&mut line) {
        eprintln!("haltctl: reading standard input: {e}");
        return ExitCode::from(2);
    }
    let input = if header { Input::Header } else { Input::Bearer };
    match fingerprint(state_dir, input, &line) {
        Ok(fp) if ctx.json => {
            out::line(&serde_json::json!({"fingerprint": fp}).to_string());
            ExitCode::SUCCESS
        }
        Ok(fp) => {
            out::line(&fp);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("haltctl key fingerprint: {e}");
            ExitCode::from(2)
        }
    }
}

/// Sends one admin request; prints the answer as `render` makes it (as it came with --json).
/// Exit status: 0 success, 1 haltd refused, 2 no answer.
fn admin_call(
    ctx: &Ctx,
    (method, path): (Method, &str),
    body: Option<Value>,
    render: fn(&Value) -> String,
) -> ExitCode {
    let client = match AdminClient::new(&ctx.admin, ctx.admin_token_file.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("haltctl: --admin {}: {e}", ctx.admin);
            return ExitCode::from(2);
        }
    };
    match client.request(method, path, body.as_ref()) {
        Ok((status, body)) if status.is_success() => {
            match serde_json::from_str::<Value>(&body) {
                Ok(v) if !ctx.json => out::write(&render(&v)),
                _ => out::line(body.trim_end()),
            }
            ExitCode::SUCCESS
        }
        Ok((status, body)) => {
            if ctx.json {
                out::line(body.trim_end());
            }
            eprintln!("haltctl: haltd answered {status}: {}", body.trim_end());
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("haltctl: {e}");
            ExitCode::from(2)
        }
    }
}

/// `haltctl circuit show` and `haltctl reconcile`: one admin request (`haltd::ctl::circuit`).
fn circuit_call(
    ctx: &Ctx,
    request: Result<haltd::ctl::circuit::AdminRequest, &str>,
    render: fn(&Value) -> String,
) -> ExitCode {
    match request {
        Ok((method, path, body)) => admin_call(ctx, (method, &path), body, render),
        Err(e) => {
            eprintln!("haltctl: {e}");
            ExitCode::from(2)
        }
    }
}

/// `haltctl key add|revoke|rotate|list`.
fn key_call(ctx: &Ctx, command: &KeyCommand) -> ExitCode {
    use haltd::ctl::keys;
    let (request, render): (Result<_, String>, fn(&Value) -> String) = match command {
        KeyCommand::Add {
            name,
            concurrency,
            rpm,
            tpm,
        } => (
            Ok(keys::add(name, *concurrency, *rpm, *tpm)),
            keys::render_secret,
        ),
        KeyCommand::Revoke { id } => (keys::revoke(id), keys::render_revoked),
        KeyCommand::Rotate { id, overlap_s } => {
            (keys::rotate(id, Some(*overlap_s)), keys::render_secret)
        }
        KeyCommand::List => (
            Ok((Method::GET, "/admin/keys".to_owned(), None)),
            keys::render_list,
        ),
        KeyCommand::Fingerprint { header, state_dir } => {
            return key_fingerprint(ctx, &ctx.state_dir(state_dir.as_ref()), *header);
        }
    };
    match request {
        Ok((method, path, body)) => admin_call(ctx, (method, &path), body, render),
        Err(e) => {
            eprintln!("haltctl: {e}");
            ExitCode::from(2)
        }
    }
}

/// `haltctl reconcile [REF --outcome O] [--all]`.
fn reconcile(ctx: &Ctx, reference: Option<&str>, outcome: Option<&str>, all: bool) -> ExitCode {
    let render = if reference.is_some() {
        haltd::circuit::show::render_reconciled
    } else {
        haltd::circuit::show::render_calls
    };
    let request = haltd::ctl::circuit::reconcile(reference, outcome, all);
    circuit_call(ctx, request, render)
}

/// `haltctl calibrate`: offline, it never talks to haltd.
fn calibrate(args: CalibrateArgs, json: bool) -> ExitCode {
    use haltd::calibrate as cal;

    let fail = |msg: String| {
        eprintln!("haltctl calibrate: {msg}");
        ExitCode::from(2)
    };
    let statistic = match args.statistic.parse() {
        Ok(s) => s,
        Err(e) => return fail(format!("{e}")),
    };
    let (streams, skipped) = match load_streams(&args) {
        Ok(x) => x,
        Err(e) => return fail(e),
    };
    if let Some(out) = &args.write_labels {
        let written = std::fs::File::create(out)
            .and_then(|f| cal::write_labels(std::io::BufWriter::new(f), &streams));
        if let Err(e) = written {
            return fail(format!("writing {}: {e}", out.display()));
        }
        eprintln!(
            "haltctl calibrate: wrote {} labelled streams to {}",
            streams.len(),
            out.display()
        );
    }
    let opts = cal::CalibrateOptions {
        window: args.window,
        statistic,
        min_tokens: args.min_tokens,
        bootstrap: args.bootstrap,
        seed: args.seed,
        ..cal::CalibrateOptions::default()
    };
    let mut report = match cal::calibrate(&streams, &opts) {
        Ok(r) => r,
        Err(e) => {
            for s in &skipped {
                eprintln!(
                    "haltctl calibrate: line {}: id {:?}: {}",
                    s.line.unwrap_or(0),
                    s.id,
                    s.reason
                );
            }
            return fail(e.to_string());
        }
    };
    report.add_skipped(skipped);
    match finish_calibration(&args, &report, json) {
        Ok(code) => code,
        Err(e) => fail(e),
    }
}

/// The labelled streams `haltctl calibrate` was given: a labels file or the built-in set.
fn load_streams(
    args: &CalibrateArgs,
) -> Result<
    (
        Vec<haltd::calibrate::LabelledStream>,
        Vec<haltd::calibrate::Skipped>,
    ),
    String,
> {
    match (&args.labels, args.builtin_set) {
        (Some(path), _) => {
            let file = std::fs::File::open(path)
                .map_err(|e| format!("opening {}: {e}", path.display()))?;
            haltd::calibrate::read_labels(std::io::BufReader::new(file))
                .map_err(|e| format!("{}: {e}", path.display()))
        }
        (None, Some(n)) => Ok((
            haltd::calibrate::builtin_labelled_set(n, args.seed),
            Vec::new(),
        )),
        (None, None) => Err("give --labels FILE or --builtin-set N".to_owned()),
    }
}

/// Prints the report and writes the threshold into `--config`: exit status 0, or 1 when there
/// is no operating point (nothing written).
fn finish_calibration(
    args: &CalibrateArgs,
    report: &haltd::calibrate::CalibrationReport,
    json: bool,
) -> Result<ExitCode, String> {
    if json {
        let j = serde_json::to_string_pretty(report)
            .map_err(|e| format!("encoding the report: {e}"))?;
        out::line(&j);
    } else {
        out::write(&report.to_string());
    }
    if report.operating_point.is_none() {
        if args.config.is_some() {
            eprintln!("haltctl calibrate: no operating point: the config file was not changed");
        }
        return Ok(ExitCode::from(1));
    }
    if let Some(path) = &args.config {
        haltd::calibrate::write_threshold(path, report).map_err(|e| e.to_string())?;
        eprintln!(
            "haltctl calibrate: wrote [detectors.surprise] threshold_bits, window, statistic, \
             min_tokens to {}",
            path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `haltctl incident label STREAM_ID tp|fp [--note TEXT]`.
fn incident(ctx: &Ctx, command: &IncidentCommand) -> ExitCode {
    let IncidentCommand::Label {
        stream_id,
        label,
        note,
    } = command;
    admin_call(
        ctx,
        (Method::POST, &format!("/admin/incidents/{stream_id}/label")),
        Some(serde_json::json!({ "label": label.as_str(), "note": note })),
        render::labelled,
    )
}

/// The body of `haltctl trip`: its cause, and `"degrade": false` for `--no-degrade`.
fn trip_body(cause: &str, no_degrade: bool) -> serde_json::Value {
    let mut body = serde_json::json!({ "cause": cause });
    if no_degrade {
        body["degrade"] = false.into();
    }
    body
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let ctx = match Ctx::new(&cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("haltctl: {e}");
            return ExitCode::from(2);
        }
    };
    match &cli.command {
        Command::Trip {
            stream_id,
            cause,
            no_degrade,
        } => admin_call(
            &ctx,
            (Method::POST, &format!("/admin/streams/{stream_id}/trip")),
            Some(trip_body(cause, *no_degrade)),
            render::trip,
        ),
        Command::Incident { command } => incident(&ctx, command),
        Command::Streams => {
            admin_call(&ctx, (Method::GET, "/admin/streams"), None, render::streams)
        }
        Command::Status => admin_call(&ctx, (Method::GET, "/admin/status"), None, render::status),
        Command::Mode { set: None, .. } => {
            admin_call(&ctx, (Method::GET, "/admin/mode"), None, render::mode)
        }
        Command::Mode {
            set: Some(mode),
            scope,
        } => admin_call(
            &ctx,
            (Method::POST, "/admin/mode"),
            Some(serde_json::json!({ "mode": mode, "scope": scope })),
            render::mode_changed,
        ),
        Command::State {
            command: StateCommand::Show,
        } => admin_call(&ctx, (Method::GET, "/admin/state"), None, render::state),
        Command::State {
            command: StateCommand::Reset { scope },
        } => admin_call(
            &ctx,
            (Method::POST, "/admin/mode"),
            Some(serde_json::json!({ "mode": "full", "scope": scope })),
            render::mode_changed,
        ),
        Command::Limits => admin_call(&ctx, (Method::GET, "/admin/limits"), None, render::limits),
        Command::Conversations => admin_call(
            &ctx,
            (Method::GET, "/admin/conversations"),
            None,
            render::conversations,
        ),
        Command::Circuit {
            command: CircuitCommand::Show { conversation },
        } => circuit_call(
            &ctx,
            Ok(haltd::ctl::circuit::show(conversation.as_deref())),
            haltd::circuit::show::render,
        ),
        Command::Reconcile {
            reference,
            outcome,
            all,
        } => reconcile(&ctx, reference.as_deref(), outcome.as_deref(), *all),
        Command::Calibrate(args) => calibrate(args.clone(), ctx.json),
        Command::Key { command } => key_call(&ctx, command),
        Command::Detector { command } => detector_call(&ctx, command),
        Command::Profile { command } => profile_call(&ctx, command),
        Command::Completions { shell } => completions(*shell),
        Command::Man { dir } => man(dir),
        Command::Ledger { command } => ledger(&ctx, command),
    }
}

fn completions(shell: haltd::cli_docs::Shell) -> ExitCode {
    let mut cmd = <Cli as clap::CommandFactory>::command();
    let mut text = Vec::new();
    haltd::cli_docs::write_completions(&mut cmd, shell, &mut text);
    out::write(&String::from_utf8_lossy(&text));
    ExitCode::SUCCESS
}

fn man(dir: &Path) -> ExitCode {
    let cmd = <Cli as clap::CommandFactory>::command();
    match haltd::cli_docs::write_man_pages(&cmd, dir) {
        Ok(pages) => {
            pages
                .iter()
                .for_each(|p| out::line(&p.display().to_string()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("haltctl: writing man pages into {}: {e}", dir.display());
            ExitCode::from(1)
        }
    }
}
