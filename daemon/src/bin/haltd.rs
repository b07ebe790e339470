//! `haltd`: the daemon. `haltd serve --help` lists every flag; each can also be set from a
//! `HALTD_*` variable or the config file (docs/configuration.md).

use std::{ffi::OsString, fmt::Display, process::ExitCode};

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use haltd::{
    config::{
        check,
        layers::{self, LayerError, Layered},
        LogFormat, ServeArgs,
    },
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

/// Said under every subcommand's flags.
const LAYERS_HELP: &str = "Every flag can also be set as a HALTD_* environment variable (--budget: HALTD_BUDGET) or in the --config file (budget = 8, before its first [section]); a flag wins over the variable, the variable over the file. Reference: docs/configuration.md.";

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API with every stream under the halt budget.
    #[command(after_help = LAYERS_HELP)]
    Serve(ServeArgs),
    /// Load and attach the kernel halt gate once, then exit: checks the verifier accepts it here.
    #[command(after_help = LAYERS_HELP)]
    CheckGate(ServeArgs),
    /// Check a configuration without starting anything, like `nginx -t`: the file, the HALTD_* variables and the flags, as `haltd serve --config FILE` would take them. Binds and loads nothing, needs no privilege. Exit 0: valid; 2: not, each error with its line or variable.
    #[command(after_help = LAYERS_HELP)]
    CheckConfig(ServeArgs),
    /// Print a shell completion script (e.g. `haltd completions bash > /usr/share/bash-completion/completions/haltd`).
    Completions {
        #[arg(value_enum)]
        shell: haltd::cli_docs::Shell,
    },
    /// Write the man pages (one per command) into DIR (packaging runs it).
    #[command(hide = true)]
    Man { dir: std::path::PathBuf },
}

/// haltd's command: `check-config` takes its file as `FILE`, not `--config FILE`.
fn command() -> clap::Command {
    Cli::command().mut_subcommand("check-config", |c| {
        c.mut_arg("config", |a| {
            a.long(None)
                .index(1)
                .value_name("FILE")
                .help("The config file to check (default: HALTD_CONFIG)")
        })
    })
}

/// Says why haltd stops: `haltd: WHY` in text mode, an ERROR log object in JSON mode.
fn fatal(format: LogFormat, why: &dyn Display) {
    match format {
        LogFormat::Text => eprintln!("haltd: {why}"),
        LogFormat::Json => tracing::error!(error = %why, "haltd stops"),
    }
}

/// Validates the flags, or says what is wrong (exit 2), and where a bad value was set when
/// not on the command line.
fn validated(
    args: ServeArgs,
    layered: &Layered,
) -> Result<(haltd::config::Config, LogControl), ExitCode> {
    let format = args.log_format;
    let log = haltd::logging::init(format);
    let cfg = args.validate().map_err(|e| {
        match check::origin(&e, layered) {
            Some(at) => fatal(format, &format_args!("{e} (from {at})")),
            None => fatal(format, &e),
        }
        ExitCode::from(2)
    })?;
    if let Err(e) = log.apply_file_level(cfg.log_level.as_deref()) {
        fatal(format, &e);
        return Err(ExitCode::from(2));
    }
    Ok((cfg, log))
}

/// The command line over the environment over the config file, or exit: 2 with every bad
/// value and where it is.
fn parse() -> Result<(Cli, Layered), ExitCode> {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let layered = match layers::parse(command(), &argv, &|var| std::env::var_os(var)) {
        Ok(l) => l,
        Err(LayerError::Clap(e)) => e.exit(),
        Err(e) => {
            let text = e.to_string();
            for line in text.lines() {
                eprintln!("haltd: {line}");
            }
            let n = text.lines().count();
            eprintln!(
                "haltd: configuration invalid ({n} error{})",
                if n == 1 { "" } else { "s" }
            );
            return Err(ExitCode::from(2));
        }
    };
    match Cli::from_arg_matches(&layered.matches) {
        Ok(cli) => Ok((cli, layered)),
        Err(e) => e.exit(),
    }
}

/// `haltd check-config`: the report, exit 0 when valid, 2 when not.
fn check_config(args: ServeArgs, layered: &Layered) -> ExitCode {
    let shown = args
        .config
        .as_ref()
        .map_or_else(String::new, |p| p.display().to_string());
    let report = check::check(args, layered, std::env::vars_os().map(|(k, _)| k));
    for w in &report.warnings {
        eprintln!("haltd: warning: {w}");
    }
    for e in &report.errors {
        eprintln!("haltd: {e}");
    }
    if !report.errors.is_empty() {
        let n = report.errors.len();
        eprintln!(
            "haltd: {shown}: configuration invalid ({n} error{})",
            if n == 1 { "" } else { "s" }
        );
        return ExitCode::from(2);
    }
    println!("haltd: {shown}: configuration ok");
    for s in &report.settings {
        println!("  {s}");
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let (cli, layered) = match parse() {
        Ok(p) => p,
        Err(code) => return code,
    };
    match cli.command {
        Command::CheckConfig(args) => check_config(args, &layered),
        Command::Completions { shell } => {
            let mut cmd = command();
            haltd::cli_docs::write_completions(&mut cmd, shell, &mut std::io::stdout());
            ExitCode::SUCCESS
        }
        Command::Man { dir } => {
            let cmd = command();
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
            let (cfg, log) = match validated(args, &layered) {
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
            let (cfg, _log) = match validated(args, &layered) {
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
                    // Nothing left behind: the leaf goes with the check (the self-test's
                    // sockets are closed).
                    if let Err(e) = gate.leave_cgroup() {
                        eprintln!("haltd: warning: {e}; the next start removes the leaf");
                    }
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
