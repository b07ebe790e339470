//! A smoke run of `bench-token-instructions` (issue 30, point 5; issue 34, point 7): haltd
//! under callgrind, a few tokens on two streams, one round, on chat and on Messages. The
//! bench's figures must add up: every token it asked for arrived on each surface, and the
//! data-plane thread's loop was found and counted (a callgrind toggle that matched nothing
//! would count 0).

use anyhow::{ensure, Context, Result};
use haltd_tests::{haltd_bin, temp_dir};

#[test]
fn the_instruction_bench_counts_the_data_plane_per_token() -> Result<()> {
    let out = temp_dir("token-instructions")?.join("report.json");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_bench-token-instructions"))
        .env("HALTD_BIN", haltd_bin()?)
        .args(["--tokens", "20", "--streams", "2", "--rounds", "1"])
        .args(["--surfaces", "chat,messages", "--out"])
        .arg(&out)
        .status()
        .context("running bench-token-instructions")?;
    ensure!(
        status.success(),
        "bench-token-instructions failed: {status}"
    );
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
    let result = &report["results"][0];
    for (i, surface) in ["chat", "messages"].into_iter().enumerate() {
        let s = &result["surfaces"][i];
        ensure!(s["surface"] == surface, "{report}");
        let count = &s["per_binary"][0]["counts"][0];
        let tokens = count["tokens"].as_u64().context("tokens")?;
        let instructions = count["instructions"].as_u64().context("instructions")?;
        ensure!(tokens == 40, "{surface}: {report}");
        // A proxied token costs thousands of instructions (about 21,000 in a release build);
        // a debug build more. Zero would mean the loop was never counted.
        ensure!(
            instructions / tokens > 1_000 && instructions / tokens < 10_000_000,
            "{surface}: {report}"
        );
    }
    ensure!(
        result["ratios"][0]["messages_over_chat"].is_f64(),
        "{report}"
    );
    Ok(())
}
