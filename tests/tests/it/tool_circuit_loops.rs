//! Root-only smoke test of `bench-tool-circuit`: two of spec 002's loops
//! (`haltd_tests::circuit_loops`), each run by the official `openai` SDK's agent straight
//! against the scripted upstream and through haltd with `[tool_circuit]`.
//!
//! Covered: the permission/auth loop with paraphrased queries costs fewer model calls and
//! fewer generated tokens through haltd, and its tool runs once; the side-effect loop (a
//! write that timed out after it happened) duplicates the write without haltd and never
//! with it. The second also checks end to end that a call delivered to the agent counts as
//! dispatched (had haltd taken it for undelivered, the timeout would be `transient` and the
//! duplicate would go out).

use anyhow::{ensure, Context, Result};
use haltd_tests::{circuit_loops, rig::Rig, temp_dir};

use crate::UPSTREAM_BIN;

#[test]
fn the_permission_and_side_effect_loops_cost_less_through_haltd() -> Result<()> {
    let rig = Rig::with_config(UPSTREAM_BIN, circuit_loops::CONFIG, &[])?;
    let dir = temp_dir("circuit-loops")?;
    let cases = circuit_loops::cases();
    let case = |name| cases.iter().find(|c| c.name == name).context(name);

    let permission = case("permission")?;
    let without = circuit_loops::run(&rig, permission, None, &dir)?;
    let with = circuit_loops::run(&rig, permission, Some("smoke-permission"), &dir)?;
    let summary = circuit_loops::summary(permission, &without, &with);
    ensure!(
        without.tool_executions >= 4 && without.ended == "answered in text",
        "{summary}"
    );
    ensure!(
        with.model_calls < without.model_calls
            && with.completion_tokens < without.completion_tokens,
        "{summary}"
    );
    ensure!(with.tool_executions == 1, "{summary}");
    ensure!(
        with.ended.contains("without the model") && with.ended.contains("permission/auth"),
        "{summary}"
    );

    let write = case("side_effect")?;
    let without = circuit_loops::run(&rig, write, None, &dir)?;
    let with = circuit_loops::run(&rig, write, Some("smoke-side-effect"), &dir)?;
    let summary = circuit_loops::summary(write, &without, &with);
    ensure!(without.duplicate_effects == 1, "{summary}");
    ensure!(
        with.duplicate_effects == 0 && with.tool_executions == 1,
        "{summary}"
    );
    ensure!(
        with.ended.contains("halted in the stream") && with.ended.contains("ambiguous_effect"),
        "{summary}"
    );
    Ok(())
}

/// Issue 29 point 6: agents that trim their history (the first user message and the newest
/// exchange; after a refusal only the first message) or flatten older tool messages into text
/// carry on after haltd's refusals. The conversation's failed calls are remembered, so neither
/// restores a budget: the permission loop's tool runs once (budget 0), the validation loop's
/// twice (one repair), as with the full history.
#[test]
fn trimmed_or_flattened_histories_do_not_restore_a_budget() -> Result<()> {
    let rig = Rig::with_config(UPSTREAM_BIN, circuit_loops::CONFIG, &[])?;
    let dir = temp_dir("circuit-memory")?;
    let cases = circuit_loops::cases();
    let case = |name| cases.iter().find(|c| c.name == name).context(name);
    for history in ["trim", "flatten"] {
        for (name, runs) in [("permission", 1), ("validation", 2)] {
            let conversation = format!("memory-{history}-{name}");
            let arm = circuit_loops::run_with_history(
                &rig,
                case(name)?,
                Some(&conversation),
                history,
                &dir,
            )?;
            ensure!(
                arm.tool_executions == runs,
                "{history} {name}: the tool ran {} times, not {runs}: {arm:?}",
                arm.tool_executions
            );
        }
    }
    Ok(())
}
