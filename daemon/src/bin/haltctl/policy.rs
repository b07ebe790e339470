//! `haltctl detector list|mode` and `haltctl profile set`: the policy at runtime (issue 37),
//! one admin request each (`admin/policy.rs` serves them).

use std::process::ExitCode;

use clap::Subcommand;
use hyper::Method;

use super::{admin_call, Ctx};

#[derive(Subcommand)]
pub(crate) enum DetectorCommand {
    /// Each route's detectors: mode, turns judged, findings and trips in that mode.
    List,
    /// Switch a detector for new turns (open streams keep their mode); recorded in the
    /// ledger with your identity and kept across a restart.
    Mode {
        /// The detector (halt_monitor, surprise, compute_budget, latency_anomaly, exfil).
        name: String,
        #[arg(value_parser = ["observe", "hard"])]
        mode: String,
        /// Only this route (`[[routes]]`'s name, or `default`); without it, every route.
        #[arg(long)]
        route: Option<String>,
    },
}

#[derive(Subcommand)]
pub(crate) enum ProfileCommand {
    /// Switch the profile for new turns; recorded in the ledger with your identity and kept
    /// across a restart.
    Set {
        #[arg(value_parser = ["full", "mkp"])]
        profile: String,
    },
}

/// `haltctl detector list|mode`.
pub(crate) fn detector_call(ctx: &Ctx, command: &DetectorCommand) -> ExitCode {
    match command {
        DetectorCommand::List => admin_call(
            ctx,
            (Method::GET, "/admin/policy"),
            None,
            haltd::ctl::policy::render_list,
        ),
        DetectorCommand::Mode { name, mode, route } => admin_call(
            ctx,
            (Method::POST, &format!("/admin/detectors/{name}/mode")),
            Some(serde_json::json!({ "mode": mode, "route": route })),
            haltd::ctl::policy::render_mode,
        ),
    }
}

/// `haltctl profile set P`.
pub(crate) fn profile_call(ctx: &Ctx, command: &ProfileCommand) -> ExitCode {
    let ProfileCommand::Set { profile } = command;
    admin_call(
        ctx,
        (Method::POST, "/admin/profile"),
        Some(serde_json::json!({ "profile": profile })),
        haltd::ctl::policy::render_profile,
    )
}
