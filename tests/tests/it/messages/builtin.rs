//! The built-in source behind `POST /v1/messages` (`--source builtin`, the default): the SDK's
//! `messages.create`, `messages.stream` and raw `create(stream=True)`.

use anyhow::{ensure, Result};
use haltd_tests::{Haltd, NetPair};

use super::{answered, deltas, sdk, stream_id, turn};

#[test]
fn builtin_source_answers_create_and_stream_in_messages_order() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "1000"])?;
    let r = sdk(
        &haltd,
        &["--model", "builtin", "--max-tokens", "400"],
        &[
            turn(&["--mode", "create"]),
            turn(&["--mode", "stream"]),
            turn(&["--mode", "create-stream-raw"]),
            turn(&["--mode", "create", "--max-tokens", "5"]),
            turn(&["--mode", "stream", "--max-tokens", "5"]),
        ],
    )?;
    // The whole answer ends at the model's end of turn; the same prompt, the same text.
    for t in &r[..3] {
        answered(t, "end_turn")?;
        ensure!(
            t["model"] == "builtin" && t["content_types"] == serde_json::json!(["text"]),
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
    // Five tokens asked: max_tokens, five of them, five deltas.
    for t in &r[3..] {
        answered(t, "max_tokens")?;
        ensure!(t["usage"]["output_tokens"] == 5, "{t}");
        ensure!(text.starts_with(t["text"].as_str().unwrap_or("?")), "{t}");
    }
    ensure!(deltas(&r[4]) == 5, "{}", r[4]);
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
