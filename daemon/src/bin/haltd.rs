//! `haltd`: the daemon. `haltd serve --help` lists every flag.

use std::{fmt::Display, process::ExitCode};

use clap::{Parser, Subcommand};
use haltd::{
    config::{LogFormat, ServeArgs},
    logging::LogControl,
};

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
    /// Print a shell completion script (e.g. `haltd completions bash > /usr/share/bash-completion/completions/haltd`).
    Completions {
        #[arg(value_enum)]
        shell: haltd::cli_docs::Shell,
    },
    /// Write the man pages (one per command) into DIR (packaging runs it).
    #[command(hide = true)]
    Man { dir: std::path::PathBuf },
}

/// Says why haltd stops: `haltd: WHY` in text mode, an ERROR log object in JSON mode.
fn fatal(format: LogFormat, why: &dyn Display) {
    match format {
        LogFormat::Text => eprintln!("haltd: {why}"),
        LogFormat::Json => tracing::error!(error = %why, "haltd stops"),
    }
}

/// Validates the flags, or says what is wrong (exit 2).
fn validated(args: ServeArgs) -> Result<(haltd::config::Config, LogControl), ExitCode> {
    let format = args.log_format;
    let log = haltd::logging::init(format);
    let cfg = args.validate().map_err(|e| {
        fatal(format, &e);
        ExitCode::from(2)
    })?;
    if let Err(e) = log.apply_file_level(cfg.log_level.as_deref()) {
        fatal(format, &e);
        return Err(ExitCode::from(2));
    }
    Ok((cfg, log))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            haltd::cli_docs::write_completions(&mut cmd, shell, &mut std::io::stdout());
            ExitCode::SUCCESS
        }
        Command::Man { dir } => {
            let cmd = <Cli as clap::CommandFactory>::command();
            match haltd::cli_docs::write_man_pages(&cmd, &dir) {
                Ok(pages) => {
                    pages.iter().for_each(|p| println!("{}", p.display()));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("haltd: writing man pages into {}: {e}", dir.display());
                    ExitCode::from(1)
                }
            }
        }
        Command::Serve(args) => {
            let (cfg, log) = match validated(args) {
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
            match haltd::server::run(cfg, log) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    fatal(format, &e);
                    ExitCode::from(e.exit_code())
                }
            }
        }
        Command::CheckGate(args) => {
            let (cfg, _log) = match validated(args) {
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
