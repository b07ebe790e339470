//! The built-in source behind `POST /v1/responses` (`--source builtin`, the default): the
//! SDK's `responses.create`, streamed and not, and its `responses.stream` helper.

use anyhow::{ensure, Result};
use haltd_tests::{Haltd, NetPair};
use serde_json::json;

use super::{answered, sdk, stream_id, turn};

#[test]
fn builtin_source_answers_create_stream_and_the_helper_in_responses_order() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "1000"])?;
    let r = sdk(
        &haltd,
        &["--model", "builtin", "--max-output-tokens", "400"],
        &[
            turn(&["--mode", "create"]),
            turn(&["--mode", "stream"]),
            turn(&["--mode", "helper"]),
            turn(&["--mode", "create", "--max-output-tokens", "5"]),
            turn(&["--mode", "stream", "--max-output-tokens", "5"]),
        ],
    )?;
    // The whole answer ends at the model's end of turn; the same prompt, the same text.
    for t in &r[..3] {
        answered(t, "completed")?;
        ensure!(
            t["model"] == "builtin" && t["output_types"] == json!(["message"]),
            "{t}"
        );
        ensure!(
            t["text"] == r[0]["text"] && t["usage"] == r[0]["usage"],
            "the same prompt, another answer: {t} / {}",
            r[0]
        );
    }
    ensure!(r[0]["usage"]["input_tokens"].as_u64() > Some(0), "{}", r[0]);
    let text = r[0]["text"].as_str().unwrap_or_default();
    ensure!(text.split_whitespace().count() >= 5, "{text:?}");
    // Five tokens asked: incomplete for max_output_tokens, five of them, five deltas.
    for t in &r[3..] {
        answered(t, "incomplete")?;
        ensure!(t["usage"]["output_tokens"] == 5, "{t}");
        ensure!(text.starts_with(t["text"].as_str().unwrap_or("?")), "{t}");
    }
    ensure!(r[4]["frames"] == 5, "{}", r[4]);
    let rec = haltd.wait_record("the stream's turn record", |rec| {
        rec["kind"] == "turn" && stream_id(&r[1]).is_ok_and(|id| rec["stream_id"] == id.as_str())
    })?;
    ensure!(
        rec["turn_status"] == "committed"
            && rec["tokens_emitted"] == r[1]["usage"]["output_tokens"],
        "{rec}"
    );
    Ok(())
}
