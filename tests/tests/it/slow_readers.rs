//! Honest clients that read slowly get the end of their stream: a client reading through a
//! 4 KiB receive buffer at 10 KiB/s (1 KiB every 100 ms), over plain HTTP and TLS, 20 streams
//! at once in each cell: a completed stream of 600 tokens (it overflows the socket buffers, so
//! haltd's turn ends long before the client has read it), a stream tripped at B = 5 and one at
//! B = 0, each tripped while haltd's send waits on the full socket. Each must end within
//! (bytes received) ÷ 10 KiB/s + 1 s of its request: all its tokens and `[DONE]`, or at most B
//! post-trip tokens, the halted terminal and `[DONE]`, or a reset within 1 s of the trip where
//! the ceiling leaves no room for the terminal (it never does here: none is accepted). Under
//! TLS the end must carry `close_notify`. The egress check drops none of haltd's own segments
//! (`haltd_kernel_segments_total{verdict="drop_ceiling"}` stays at the self-test's count).
//!
//! The table each run prints is the one in docs/bench.md ("Slow readers").

use std::{
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, ensure, Result};
use haltd_tests::{
    slow_reader::{slow_stream, End, Pace, SlowRead},
    spawn_in_netns,
    sse::{chat_body, fresh_key},
    trip_here, Haltd, NetPair, Transport,
};
use serde_json::json;

/// Streams per cell.
const STREAMS: usize = 20;
/// Tokens of a completed stream.
const COMPLETED_TOKENS: u32 = 600;
/// Tokens a tripped stream would have: far more than fit in the socket buffers, so it is
/// still running (its send waiting on the client) when it is tripped.
const TRIPPED_TOKENS: u32 = 5_000;
/// When a tripped stream is tripped, after its response head arrived.
const TRIP_AFTER: Duration = Duration::from_millis(400);
/// The slack the issue allows past the reading time.
const SLACK: Duration = Duration::from_secs(1);

/// What a cell's streams are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completed,
    Tripped,
}

/// One stream's result, judged.
#[derive(Debug)]
struct Judged {
    /// How it ended: "[DONE]", "terminal", "reset".
    how: &'static str,
    /// Its time to the end, over the time the pace allows (reading time + 1 s).
    over: Duration,
    end_at: Duration,
    allowed: Duration,
    problem: Option<String>,
}

/// A body for `kind`: a streaming chat request of the built-in source that runs to
/// `max_tokens` (`ignore_eos`).
fn body(kind: Kind) -> serde_json::Value {
    let n = match kind {
        Kind::Completed => COMPLETED_TOKENS,
        Kind::Tripped => TRIPPED_TOKENS,
    };
    let mut b = chat_body("Tell me about rivers, slowly", n, true);
    b["ignore_eos"] = json!(true);
    b
}

/// What is wrong with a completed stream's read, if anything.
fn completed_problem(r: &SlowRead, closed: bool) -> Option<String> {
    let o = &r.outcome;
    let whole = o.tokens == COMPLETED_TOKENS as usize
        && o.finish_reason.as_deref() == Some("length")
        && o.done_at.is_some()
        && o.error.is_none();
    (!whole || !closed).then(|| {
        format!(
            "completed stream {}: {} tokens of {COMPLETED_TOKENS}, finish {:?}, [DONE] {}, error {:?}, end {:?}",
            o.stream_id,
            o.tokens,
            o.finish_reason,
            o.done_at.is_some(),
            o.error,
            r.end
        )
    })
}

/// What is wrong with a tripped stream's read (at budget B), if anything.
fn tripped_problem(r: &SlowRead, budget: u64, closed: bool, trip_ok: bool) -> Option<String> {
    let o = &r.outcome;
    if !trip_ok {
        return Some(format!("stream {}: the trip was refused", o.stream_id));
    }
    if r.end == End::Reset {
        return Some(format!(
            "tripped stream {} was reset ({} tokens, {} bytes): the ceiling always leaves room for the terminal here",
            o.stream_id, o.tokens, r.wire_bytes
        ));
    }
    if let Err(e) = o.halted_cleanly("OPERATOR_TRIP") {
        return Some(format!(
            "tripped stream {} ({} tokens, end {:?}): {e:#}",
            o.stream_id, o.tokens, r.end
        ));
    }
    let post = o
        .error
        .as_ref()
        .and_then(|e| e["post_trip_tokens"].as_u64());
    let tau = o
        .error
        .as_ref()
        .and_then(|e| e["trip_token_index"].as_u64());
    let counted = tau.zip(post).is_some_and(|(t, p)| t + p == o.tokens as u64);
    (post.is_none_or(|p| p > budget) || !counted || !closed).then(|| {
        format!(
            "tripped stream {}: {} tokens, trip_token_index {tau:?}, post_trip_tokens {post:?} (B = {budget}), end {:?}",
            o.stream_id, o.tokens, r.end
        )
    })
}

/// Judges one slow read against the three acceptable ends.
fn judge(r: &SlowRead, kind: Kind, budget: u64, tls: bool, trip_ok: bool) -> Judged {
    let pace = Pace::PHONE;
    let allowed = r.reading_time(&pace) + SLACK;
    // Under TLS the end must carry close_notify.
    let closed = match r.end {
        End::Closed => true,
        End::ClosedWithoutNotify => !tls,
        _ => false,
    };
    let (how, mut problem) = match kind {
        Kind::Completed => ("[DONE]", completed_problem(r, closed)),
        Kind::Tripped if r.end == End::Reset => {
            ("reset", tripped_problem(r, budget, closed, trip_ok))
        }
        Kind::Tripped => ("terminal", tripped_problem(r, budget, closed, trip_ok)),
    };
    if r.end_at > allowed && problem.is_none() {
        problem = Some(format!(
            "stream {} ended after {:.2} s, allowed {:.2} s ({} bytes at {:.0} B/s + 1 s)",
            r.outcome.stream_id,
            r.end_at.as_secs_f64(),
            allowed.as_secs_f64(),
            r.wire_bytes,
            pace.rate()
        ));
    }
    Judged {
        how,
        over: r.end_at.saturating_sub(allowed),
        end_at: r.end_at,
        allowed,
        problem,
    }
}

/// Runs `n` slow streams of each of `kinds` at once against `haltd`; the tripped ones are
/// tripped [`TRIP_AFTER`] after their head came. Returns each read with its kind and whether
/// its trip was accepted.
fn run_cell(haltd: &Haltd, kinds: &[Kind], n: usize) -> Result<Vec<(Kind, SlowRead, bool)>> {
    let tls = match haltd.client() {
        haltd_tests::ApiClient::Tls { cfg, .. } => Some(cfg),
        haltd_tests::ApiClient::Plain { .. } => None,
    };
    let api = haltd.api;
    let admin = haltd.admin_url();
    let ns = haltd.client_ns.clone();
    let mut readers = Vec::new();
    for &kind in kinds {
        for _ in 0..n {
            let (tx, rx) = mpsc::channel::<Result<u16>>();
            let tls = tls.clone();
            let (admin, ns2) = (admin.clone(), ns.clone());
            let h = spawn_in_netns(&ns, move || -> Result<SlowRead> {
                let on_head = |id: &str| {
                    if kind != Kind::Tripped {
                        return;
                    }
                    let url = format!("{admin}/admin/streams/{id}/trip");
                    let tx = tx.clone();
                    spawn_in_netns(&ns2, move || {
                        thread::sleep(TRIP_AFTER);
                        let _ = tx.send(trip_here(&url, None).map(|(status, _)| status));
                    });
                };
                slow_stream(
                    api,
                    tls.as_ref(),
                    &body(kind),
                    &fresh_key(),
                    Pace::PHONE,
                    on_head,
                )
            });
            readers.push((kind, h, rx));
        }
    }
    let mut out = Vec::new();
    for (kind, h, rx) in readers {
        let read = h.join().map_err(|_| anyhow!("a slow reader panicked"))??;
        let trip_ok = match kind {
            Kind::Completed => true,
            Kind::Tripped => {
                rx.recv_timeout(Duration::from_secs(5))
                    .ok()
                    .and_then(Result::ok)
                    == Some(200)
            }
        };
        out.push((kind, read, trip_ok));
    }
    Ok(out)
}

/// One haltd at budget `budget` serving `kinds` of slow streams, 20 each: the table rows and
/// the problems, appended.
fn run_budget(
    transport: Transport,
    budget: u64,
    kinds: &[Kind],
    rows: &mut Vec<String>,
    problems: &mut Vec<String>,
) -> Result<()> {
    let pair = NetPair::new()?;
    let b = budget.to_string();
    let haltd = Haltd::start_over(
        &pair,
        transport,
        &["--budget", &b, "--builtin-token-interval-us", "1000"],
    )?;
    let drops = |h: &Haltd| {
        h.metrics().and_then(|m| {
            m.value_or_zero(
                "haltd_kernel_segments_total",
                &[("verdict", "drop_ceiling")],
            )
        })
    };
    let self_test = drops(&haltd)?;
    let t = Instant::now();
    let reads = run_cell(&haltd, kinds, STREAMS)?;
    let took = t.elapsed();
    let after = drops(&haltd)?;
    let before = problems.len();
    if after != self_test {
        problems.push(format!(
            "{} B = {budget}: drop_ceiling went from {self_test} (self-test) to {after}",
            transport.name()
        ));
    }
    for &kind in kinds {
        let judged: Vec<Judged> = reads
            .iter()
            .filter(|(k, ..)| *k == kind)
            .map(|(k, r, ok)| judge(r, *k, budget, transport == Transport::Tls, *ok))
            .collect();
        let worst = judged
            .iter()
            .max_by_key(|j| j.end_at.as_millis() as i128 - j.allowed.as_millis() as i128)
            .ok_or_else(|| anyhow!("no streams"))?;
        let mut hows: Vec<&str> = judged.iter().map(|j| j.how).collect();
        hows.sort_unstable();
        hows.dedup();
        let cell = match kind {
            Kind::Completed => format!("completed, {COMPLETED_TOKENS} tokens"),
            Kind::Tripped => format!("tripped, B = {budget}"),
        };
        let row = format!(
            "| {} | {cell} | {} | {} | {:.2} s of {:.2} s allowed | {} | {} |",
            transport.name(),
            judged.len(),
            judged.iter().filter(|j| j.problem.is_none()).count(),
            worst.end_at.as_secs_f64(),
            worst.allowed.as_secs_f64(),
            hows.join(", "),
            after - self_test,
        );
        println!("{row}");
        rows.push(row);
        problems.extend(judged.into_iter().filter_map(|j| {
            j.problem
                .map(|p| format!("{} {cell}: {p} (over by {:?})", transport.name(), j.over))
        }));
    }
    println!("  cell took {:.1} s", took.as_secs_f64());
    if problems.len() > before {
        print_diagnostics(&haltd)?;
    }
    ensure!(
        haltd.list_streams()?["streams"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "streams still open after every client ended"
    );
    Ok(())
}

/// What haltd said about streams that ended otherwise: stalls, watchdog halts, resets.
fn print_diagnostics(haltd: &Haltd) -> Result<()> {
    let m = haltd.metrics()?;
    for (name, labels) in [
        ("haltd_client_stalls_total", &[("phase", "stream")][..]),
        ("haltd_client_stalls_total", &[("phase", "drain")][..]),
        ("haltd_halts_total", &[("halted_by", "watchdog")][..]),
    ] {
        println!("  {name}{labels:?} = {}", m.value_or_zero(name, labels)?);
    }
    for line in haltd.log_tail(400).lines().filter(|l| {
        l.contains("reset")
            || l.contains("ERROR")
            || l.contains("not delivered")
            || l.contains("halted_by=\"watchdog\"")
    }) {
        println!("  haltd: {line}");
    }
    Ok(())
}

/// One transport: haltd at B = 5 (completed and tripped streams at once), then at B = 0
/// (tripped streams). Prints the table rows; fails on any stream that ended otherwise.
fn slow_readers(transport: Transport) -> Result<()> {
    let mut problems = Vec::new();
    let mut rows = Vec::new();
    run_budget(
        transport,
        5,
        &[Kind::Completed, Kind::Tripped],
        &mut rows,
        &mut problems,
    )?;
    run_budget(transport, 0, &[Kind::Tripped], &mut rows, &mut problems)?;
    println!("| transport | streams | n | ended as asked | worst time to end | how | drop_ceiling beyond the self-test |");
    for r in &rows {
        println!("{r}");
    }
    if !problems.is_empty() {
        for p in &problems {
            println!("  {p}");
        }
        return Err(anyhow!(
            "{} slow streams did not end as asked",
            problems.len()
        ));
    }
    Ok(())
}

#[test]
fn slow_readers_get_their_whole_stream() -> Result<()> {
    slow_readers(Transport::Plain)
}

#[test]
fn slow_readers_get_their_whole_stream_over_tls() -> Result<()> {
    slow_readers(Transport::Tls)
}
