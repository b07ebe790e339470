//! `haltctl`: the operator's CLI for a running haltd (trip a stream, list streams, end
//! degraded safe mode) and for
//! its flight recorder (verify the hash chain).

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "haltctl", version, about = "Operate a running haltd")]
struct Cli {
    /// haltd's admin address (`haltd serve --admin`).
    #[arg(
        long,
        global = true,
        env = "HALTD_ADMIN",
        default_value = "127.0.0.1:8081"
    )]
    admin: String,
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
    /// Flight-recorder tools.
    Ledger {
        #[command(subcommand)]
        command: LedgerCommand,
    },
}

#[derive(Subcommand)]
enum LedgerCommand {
    /// Check the hash chain of a ledger file; says where it breaks.
    Verify { path: PathBuf },
}

fn base(admin: &str) -> String {
    if admin.starts_with("http://") || admin.starts_with("https://") {
        admin.trim_end_matches('/').to_owned()
    } else {
        format!("http://{admin}")
    }
}

fn print_response(resp: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> ExitCode {
    match resp {
        Ok(mut r) => {
            let status = r.status();
            let body = r.body_mut().read_to_string().unwrap_or_default();
            println!("{}", body.trim_end());
            if status.is_success() {
                ExitCode::SUCCESS
            } else {
                eprintln!("haltctl: haltd answered {status}");
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("haltctl: request to haltd failed: {e}");
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let base = base(&cli.admin);
    match cli.command {
        Command::Trip { stream_id, cause } => {
            let body = serde_json::json!({ "cause": cause });
            print_response(
                agent
                    .post(&format!("{base}/admin/streams/{stream_id}/trip"))
                    .send_json(&body),
            )
        }
        Command::Streams => print_response(agent.get(&format!("{base}/admin/streams")).call()),
        Command::Status => print_response(agent.get(&format!("{base}/admin/status")).call()),
        Command::Mode { set: None, .. } => {
            print_response(agent.get(&format!("{base}/admin/mode")).call())
        }
        Command::Mode {
            set: Some(mode),
            scope,
        } => print_response(
            agent
                .post(&format!("{base}/admin/mode"))
                .send_json(serde_json::json!({ "mode": mode, "scope": scope })),
        ),
        Command::Conversations => {
            print_response(agent.get(&format!("{base}/admin/conversations")).call())
        }
        Command::Ledger {
            command: LedgerCommand::Verify { path },
        } => match haltd::ledger::verify(&path) {
            Ok(report) => {
                println!("{report}");
                if report.broken.is_none() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                }
            }
            Err(e) => {
                eprintln!("haltctl: {e}");
                ExitCode::from(2)
            }
        },
    }
}
