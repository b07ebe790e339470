//! `haltctl`: the operator's CLI for a running haltd (trip a stream, list streams, end
//! degraded safe mode) and for its flight recorder (verify the hash chain, show and follow
//! the records).

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use haltd::admin::client::AdminClient;
use haltd::ledger::show;
use hyper::Method;

#[derive(Parser)]
#[command(name = "haltctl", version = haltd::build_info::LONG_VERSION, about = "Operate a running haltd")]
struct Cli {
    /// haltd's admin API (`haltd serve --admin`): `unix:PATH`, or `IP:PORT` with --admin-token-file.
    #[arg(
        long,
        global = true,
        env = "HALTD_ADMIN",
        default_value = "unix:/run/haltd/admin.sock"
    )]
    admin: String,
    /// The bearer token of a TCP admin listener (the file haltd's --admin-token-file names).
    #[arg(
        long,
        global = true,
        env = "HALTD_ADMIN_TOKEN_FILE",
        value_name = "FILE"
    )]
    admin_token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
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
    },
    /// List open streams.
    Streams,
    /// Daemon status (gate, heartbeat, streams).
    Status,
    /// Show degraded safe mode, or end it: `haltctl mode full [--scope all|node|key:<fingerprint>]`.
    Mode {
        /// `full` ends degraded mode for the scope; without it, show the degraded scopes.
        #[arg(value_parser = ["full"])]
        set: Option<String>,
        /// Which degraded scope to end: every one (`all`), the node-wide one, or one API key by its fingerprint (as records and `haltctl mode` show it).
        #[arg(long, default_value = "all", requires = "set")]
        scope: String,
    },
    /// Committed per-conversation state (turns that ended cleanly).
    Conversations,
    /// TokenCircuit (docs/tokencircuit.md): the conversations' tool circuits.
    Circuit {
        #[command(subcommand)]
        command: CircuitCommand,
    },
    /// Flight-recorder tools.
    Ledger {
        #[command(subcommand)]
        command: LedgerCommand,
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
    /// Print the report as JSON (with the ROC curve) instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum LedgerCommand {
    /// Check the keyed hash chain of a ledger, one file or a series of segments (oldest first),
    /// and its end against the head; says where it breaks. Needs the ledger key
    /// (`<state-dir>/ledger.key`, root-only). Exit status: 0 intact, 1 broken, 2 cannot check.
    Verify {
        /// haltd's `--state-dir`: the key, and the head of the last segment (the same
        /// `HALTD_STATE_DIR` as haltd's).
        #[arg(long, env = "HALTD_STATE_DIR", default_value = "/var/lib/haltd")]
        state_dir: PathBuf,
        /// The segments, oldest first; the last is the current ledger file.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
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
struct LedgerView {
    /// The ledger file (haltd's `--ledger`).
    #[arg(env = "HALTD_LEDGER", default_value = "/var/lib/haltd/ledger.jsonl")]
    path: PathBuf,
    /// Only the records of this stream (the `x-haltd-stream-id` response header).
    #[arg(long, value_name = "ID")]
    stream: Option<String>,
    /// Only records of this kind.
    #[arg(long, value_enum)]
    kind: Option<KindArg>,
    /// Print each record as its JSON line, as written, instead of a table row.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum CircuitCommand {
    /// The open keys (class, budget left, receipts) and haltd's last interventions of a
    /// conversation (its `x-haltd-conversation-id`, or the digest this shows), or of every
    /// conversation haltd keeps, most recently used first.
    Show {
        /// The conversation; without it, every one kept.
        conversation: Option<String>,
        /// Print the admin API's JSON as it came.
        #[arg(long)]
        json: bool,
    },
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

impl LedgerView {
    fn selection(&self) -> show::Selection {
        show::Selection {
            stream: self.stream.clone(),
            kind: self.kind.map(Into::into),
        }
    }

    /// Whether `line` is printed: matching records, and every line that is not a record.
    fn keeps(&self, sel: &show::Selection, line: &show::Line) -> bool {
        match line {
            show::Line::Record(_, v, _) => sel.matches(v),
            show::Line::NotARecord(..) => true,
        }
    }

    fn print(&self, line: &show::Line) {
        match line {
            show::Line::Record(_, _, text) if self.json => println!("{text}"),
            show::Line::Record(_, v, _) => println!("{}", show::table_row(v)),
            show::Line::NotARecord(n, why) => {
                eprintln!("haltctl: {} line {n}: {why}; skipped", self.path.display());
            }
        }
    }

    fn print_header(&self) {
        if !self.json {
            println!("{}", show::table_header());
        }
    }
}

/// `haltctl ledger show`.
fn ledger_show(view: &LedgerView, last: Option<usize>) -> ExitCode {
    let sel = view.selection();
    view.print_header();
    let read = match last {
        Some(n) => show::last_lines(&view.path, n, |l| view.keeps(&sel, l))
            .map(|lines| lines.iter().for_each(|l| view.print(l))),
        None => show::read_lines(&view.path, |l| {
            if view.keeps(&sel, &l) {
                view.print(&l);
            }
        }),
    };
    match read {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("haltctl: {}: {e}", view.path.display());
            ExitCode::from(2)
        }
    }
}

/// `haltctl ledger tail`: runs until interrupted, or until the file cannot be read.
fn ledger_tail(view: &LedgerView, lines: usize, interval_ms: u64) -> ExitCode {
    let sel = view.selection();
    let fail = |e: std::io::Error| {
        eprintln!("haltctl: {}: {e}", view.path.display());
        ExitCode::from(2)
    };
    // Open the follower first: a record appended while the last ones print is not lost.
    let mut follower = match show::Follower::at_end(&view.path) {
        Ok(f) => f,
        Err(e) => return fail(e),
    };
    view.print_header();
    match show::last_lines(&view.path, lines, |l| view.keeps(&sel, l)) {
        Ok(last) => last.iter().for_each(|l| view.print(l)),
        Err(e) => return fail(e),
    }
    loop {
        std::thread::sleep(std::time::Duration::from_millis(interval_ms.max(10)));
        let polled = match follower.poll() {
            Ok(p) => p,
            Err(e) => return fail(e),
        };
        for l in polled.lines.iter().filter(|l| view.keeps(&sel, l)) {
            view.print(l);
        }
        if polled.rotated {
            eprintln!(
                "haltctl: {} was rotated; following the new file",
                view.path.display()
            );
        }
    }
}

/// `haltctl ledger verify`.
fn ledger_verify(state_dir: &std::path::Path, paths: &[PathBuf]) -> ExitCode {
    let key = match haltd::ledger::LedgerKey::read(state_dir) {
        Ok(k) => k,
        Err(e) => {
            eprintln!(
                "haltctl: the ledger key: {e} (run as the user haltd runs as, or pass --state-dir)"
            );
            return ExitCode::from(2);
        }
    };
    let last = &paths[paths.len() - 1];
    let head = match haltd::ledger::head::read_head(state_dir, last, &key) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("haltctl: the head of {}: {e}", last.display());
            return ExitCode::from(2);
        }
    };
    if head.is_none() {
        eprintln!(
            "haltctl: no head for {} in {}: records cut off its end would go unnoticed",
            last.display(),
            state_dir.display()
        );
    }
    match haltd::ledger::verify_series(paths, &key, head.as_ref()) {
        Ok(report) => {
            println!("{report}");
            if report.is_intact() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("haltctl: {e}");
            ExitCode::from(2)
        }
    }
}

/// Sends one admin request and prints the answer. Exit status: 0 success, 1 haltd refused,
/// 2 no answer.
fn admin_call(cli: &Cli, method: Method, path: &str, body: Option<serde_json::Value>) -> ExitCode {
    let client = match AdminClient::new(&cli.admin, cli.admin_token_file.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("haltctl: --admin {}: {e}", cli.admin);
            return ExitCode::from(2);
        }
    };
    match client.request(method, path, body.as_ref()) {
        Ok((status, body)) => {
            println!("{}", body.trim_end());
            if status.is_success() {
                ExitCode::SUCCESS
            } else {
                eprintln!("haltctl: haltd answered {status}");
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("haltctl: {e}");
            ExitCode::from(2)
        }
    }
}

/// `haltctl circuit show`: `GET /admin/circuit[/{id}]`, as text or as the JSON.
fn circuit_show(cli: &Cli, conversation: Option<&str>, json: bool) -> ExitCode {
    let path = match conversation {
        // A header value is any visible ASCII: every byte but [A-Za-z0-9-_.~] is escaped.
        Some(id) => format!(
            "/admin/circuit/{}",
            id.bytes()
                .map(|b| match b {
                    b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                        char::from(b).to_string()
                    }
                    _ => format!("%{b:02X}"),
                })
                .collect::<String>()
        ),
        None => "/admin/circuit".to_owned(),
    };
    if json {
        return admin_call(cli, Method::GET, &path, None);
    }
    let client = match AdminClient::new(&cli.admin, cli.admin_token_file.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("haltctl: --admin {}: {e}", cli.admin);
            return ExitCode::from(2);
        }
    };
    match client.request(Method::GET, &path, None) {
        Ok((status, body)) if status.is_success() => {
            let view: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            print!("{}", haltd::circuit::show::render(&view));
            ExitCode::SUCCESS
        }
        Ok((status, body)) => {
            eprintln!("haltctl: haltd answered {status}: {}", body.trim_end());
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("haltctl: {e}");
            ExitCode::from(2)
        }
    }
}

/// `haltctl calibrate`: offline, it never talks to haltd.
fn calibrate(args: CalibrateArgs) -> ExitCode {
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
    match finish_calibration(&args, &report) {
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
) -> Result<ExitCode, String> {
    if args.json {
        let j = serde_json::to_string_pretty(report)
            .map_err(|e| format!("encoding the report: {e}"))?;
        println!("{j}");
    } else {
        print!("{report}");
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match &cli.command {
        Command::Trip { stream_id, cause } => admin_call(
            &cli,
            Method::POST,
            &format!("/admin/streams/{stream_id}/trip"),
            Some(serde_json::json!({ "cause": cause })),
        ),
        Command::Streams => admin_call(&cli, Method::GET, "/admin/streams", None),
        Command::Status => admin_call(&cli, Method::GET, "/admin/status", None),
        Command::Mode { set: None, .. } => admin_call(&cli, Method::GET, "/admin/mode", None),
        Command::Mode {
            set: Some(mode),
            scope,
        } => admin_call(
            &cli,
            Method::POST,
            "/admin/mode",
            Some(serde_json::json!({ "mode": mode, "scope": scope })),
        ),
        Command::Conversations => admin_call(&cli, Method::GET, "/admin/conversations", None),
        Command::Circuit {
            command: CircuitCommand::Show { conversation, json },
        } => circuit_show(&cli, conversation.as_deref(), *json),
        Command::Calibrate(args) => calibrate(args.clone()),
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            haltd::cli_docs::write_completions(&mut cmd, *shell, &mut std::io::stdout());
            ExitCode::SUCCESS
        }
        Command::Man { dir } => {
            let cmd = <Cli as clap::CommandFactory>::command();
            match haltd::cli_docs::write_man_pages(&cmd, dir) {
                Ok(pages) => {
                    pages.iter().for_each(|p| println!("{}", p.display()));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("haltctl: writing man pages into {}: {e}", dir.display());
                    ExitCode::from(1)
                }
            }
        }
        Command::Ledger { command } => match command {
            LedgerCommand::Verify { state_dir, paths } => ledger_verify(state_dir, paths),
            LedgerCommand::Show { view, last } => ledger_show(view, *last),
            LedgerCommand::Tail {
                view,
                lines,
                interval_ms,
            } => ledger_tail(view, *lines, *interval_ms),
        },
    }
}
