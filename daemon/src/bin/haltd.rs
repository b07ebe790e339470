//! `haltd`: the daemon. `haltd serve --help` lists every flag.

use std::{fmt::Display, io::IsTerminal, process::ExitCode};

use clap::{Parser, Subcommand};
use haltd::config::{LogFormat, ServeArgs};

#[derive(Parser)]
#[command(
    name = "haltd",
    version = haltd::build_info::LONG_VERSION,
    about = "Token-stream governor with a kernel-enforced halt budget"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API with every stream under the halt budget.
    Serve(ServeArgs),
    /// Load and attach the kernel halt gate once, then exit: checks the verifier accepts it here.
    CheckGate(ServeArgs),
}

/// Logs to stderr: text (colour only on a terminal) or JSON, one flat object per line
/// (`timestamp`, `level`, `target`, `message`, then the event's own fields; no span data).
fn init_logging(format: LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("HALTD_LOG").unwrap_or_else(|_| "info".into());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}

/// Says why haltd stops: `haltd: WHY` in text mode, an ERROR log object in JSON mode.
fn fatal(format: LogFormat, why: &dyn Display) {
    match format {
        LogFormat::Text => eprintln!("haltd: {why}"),
        LogFormat::Json => tracing::error!(error = %why, "haltd stops"),
    }
}

/// Validates the flags, or says what is wrong (exit 2).
fn validated(args: ServeArgs) -> Result<haltd::config::Config, ExitCode> {
    let format = args.log_format;
    init_logging(format);
    args.validate().map_err(|e| {
        fatal(format, &e);
        ExitCode::from(2)
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            let cfg = match validated(args) {
                Ok(c) => c,
                Err(code) => return code,
            };
            // Before any thread starts: from here an uncontained panic anywhere ends the
            // process at once and leaves a crash file for the next start (fail closed).
            let format = cfg.args.log_format;
            if let Err(e) = haltd::crash::install(&haltd::crash::file_for(&cfg.args.ledger)) {
                fatal(format, &format_args!("installing the panic hook: {e}"));
                return ExitCode::from(1);
            }
            match haltd::server::run(cfg) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    fatal(format, &e);
                    ExitCode::from(1)
                }
            }
        }
        Command::CheckGate(args) => {
            let cfg = match validated(args) {
                Ok(c) => c,
                Err(code) => return code,
            };
            match haltd::server::load_gate(&cfg) {
                Ok(gate) => {
                    println!(
                        "kernel halt gate: loaded, verified, attached to cgroup {} and self-tested (governed sockets at most {})",
                        gate.cgroup().display(),
                        gate.max_sockets()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("haltd: kernel halt gate failed to load: {e}");
                    let mut src = std::error::Error::source(&e);
                    while let Some(s) = src {
                        eprintln!("  caused by: {s}");
                        src = s.source();
                    }
                    ExitCode::from(1)
                }
            }
        }
    }
}
