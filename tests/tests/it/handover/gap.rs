//! What must not happen around a process change: a successor that fails its start takes the
//! old haltd down with it, or a client reaches a haltd whose gate is not attached (start,
//! restart, `kill -9`, with a client hammering the port).

use std::{
    sync::{
        atomic::{AtomicBool, Ordering::SeqCst},
        Arc,
    },
    thread,
    time::Duration,
};

use anyhow::{anyhow, ensure, Result};
use haltd_tests::{require_root, spawn_in_netns, sse, wait_for, Haltd, NetPair};

/// One short streaming turn; `Ok` only for a clean `[DONE]`.
fn turn(url: &str) -> Result<()> {
    let out = sse::stream(
        url,
        &sse::chat_body("gap", 3, true),
        Duration::from_secs(20),
        |_, _| {},
    )?;
    ensure!(
        out.status == 200 && out.done_at.is_some(),
        "status {}, body {:?}, read error {:?}",
        out.status,
        out.body,
        out.read_error
    );
    Ok(())
}

#[test]
fn a_successor_that_fails_its_start_leaves_the_old_one_serving() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let mut old = Haltd::start(&pair, &[])?;
    let url = format!("{}/v1/chat/completions", old.api_url());
    let stop = Arc::new(AtomicBool::new(false));
    let (u, s) = (url.clone(), Arc::clone(&stop));
    // A client throughout: every turn must end normally.
    let client = spawn_in_netns(&pair.cli, move || -> Result<usize> {
        let mut n = 0;
        while !s.load(SeqCst) {
            turn(&u)?;
            n += 1;
            thread::sleep(Duration::from_millis(20));
        }
        Ok(n)
    });
    // It fails after it asked the old haltd to hand over: its access log cannot be opened.
    let mut broken = Haltd::spawn_successor(
        &pair,
        &old,
        &["--access-log", "/nonexistent/haltd/access.log"],
    )?;
    let pid = broken.pid().ok_or_else(|| anyhow!("no pid"))?;
    let status = broken.wait_exit(Duration::from_secs(20))?;
    ensure!(!status.success(), "the broken successor exited {status}");
    let reason = broken.log_file("stderr.log")?;
    ensure!(
        reason.contains("access log"),
        "its stderr does not say why: {reason}"
    );
    let called_off = format!("hand-over to pid {pid} called off");
    wait_for(
        Duration::from_secs(10),
        "the old haltd's record of the called-off hand-over",
        || {
            Ok(old
                .ledger_records()?
                .iter()
                .any(|r| {
                    r["message"]
                        .as_str()
                        .is_some_and(|m| m.starts_with(&called_off))
                })
                .then_some(()))
        },
    )?;
    ensure!(
        old.log_file("stderr.log")?.contains(&called_off),
        "the old haltd's log does not say it"
    );
    thread::sleep(Duration::from_millis(500));
    stop.store(true, SeqCst);
    let served = client
        .join()
        .map_err(|_| anyhow!("the client panicked"))??;
    ensure!(served > 0, "the client was served nothing");
    // Called off, the old haltd can still hand over to a successor that starts.
    let new = Haltd::start_successor(&pair, &old, &[])?;
    super::exits_cleanly(&mut old, Duration::from_secs(20))?;
    super::verify_pair(&old, &new)?;
    Ok(())
}

/// Reads, for the haltd about to stop, its accepted connections, those its gate adopted at
/// establishment, and those it could not govern; checks every accepted one was governed.
fn all_governed(haltd: &Haltd) -> Result<(f64, f64)> {
    let m = haltd.metrics()?;
    let accepted = m.value("haltd_connections_accepted_total", &[])?;
    let adopted = m.value_or_zero("haltd_kernel_adoptions_total", &[("verdict", "adopted")])?;
    let ungovernable = m.value_or_zero("haltd_ungovernable_connections_total", &[])?;
    ensure!(accepted > 0.0, "no connection accepted");
    ensure!(
        adopted >= accepted,
        "{accepted} connections accepted but only {adopted} adopted by the gate"
    );
    ensure!(
        ungovernable == 0.0,
        "{ungovernable} connections could not be governed"
    );
    Ok((accepted, adopted))
}

#[test]
fn no_gate_gap_on_start_restart_or_kill() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let stop = Arc::new(AtomicBool::new(false));
    let url = format!(
        "http://{}/v1/chat/completions",
        pair.srv_addr(haltd_tests::daemon::PORT_API)
    );
    let s = Arc::clone(&stop);
    // Hammers from before the first start to after the last: a refused connection is no
    // byte served, and every answer must be a clean turn from a governed socket.
    let client = spawn_in_netns(&pair.cli, move || {
        let (mut ok, mut failed) = (0_u64, 0_u64);
        while !s.load(SeqCst) {
            if turn(&url).is_ok() {
                ok += 1
            } else {
                failed += 1
            }
            thread::sleep(Duration::from_millis(5));
        }
        (ok, failed)
    });
    let mut first = Haltd::start(&pair, &[])?;
    thread::sleep(Duration::from_millis(500));
    let lives = vec![all_governed(&first)?];
    first.stop()?;
    let ledger = first.ledger.clone();
    let mut second = Haltd::start_with_ledger(&pair, Some(&ledger), &[])?;
    thread::sleep(Duration::from_millis(500));
    let lives = [lives, vec![all_governed(&second)?]].concat();
    second.crash()?;
    let mut third = Haltd::start_with_ledger(&pair, Some(&ledger), &[])?;
    thread::sleep(Duration::from_millis(500));
    let lives = [lives, vec![all_governed(&third)?]].concat();
    stop.store(true, SeqCst);
    let (ok, failed) = client.join().map_err(|_| anyhow!("the client panicked"))?;
    third.stop()?;
    for r in haltd_tests::read_ledger(&ledger)? {
        ensure!(
            r["kernel_gate"] == "enforcing",
            "a record of a haltd without its gate: {r}"
        );
    }
    eprintln!("no gate gap: {ok} turns served, {failed} refused or cut by a stop or kill -9; (accepted, adopted) per life: {lives:?}");
    ensure!(ok > 0, "nothing was served");
    Ok(())
}

/// The pid of the haltd that answers `haltctl status` on the admin socket `sock`.
fn answering_pid(sock: &std::path::Path) -> Result<u64> {
    let out = std::process::Command::new(haltd_tests::daemon::haltctl_bin()?)
        .arg("--admin")
        .arg(format!("unix:{}", sock.display()))
        .args(["--json", "status"])
        .output()?;
    ensure!(
        out.status.success(),
        "haltctl status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v["pid"].as_u64().ok_or_else(|| anyhow!("no pid in {v}"))
}

/// As the template unit runs it: both processes name the same admin socket. A successor binds
/// its own beside it and takes the name once it serves; one that fails first leaves the
/// running haltd's socket in place.
#[test]
fn the_admin_socket_passes_to_the_successor_once_it_serves() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let dir = haltd_tests::temp_dir("handover-admin")?;
    let sock = dir.join("admin.sock");
    let admin = format!("unix:{}", sock.display());
    let mut old = Haltd::start(&pair, &["--admin", &admin])?;
    let old_pid = u64::from(old.pid().ok_or_else(|| anyhow!("no pid"))?);
    ensure!(
        answering_pid(&sock)? == old_pid,
        "the old haltd does not answer on its socket"
    );
    let mut broken = Haltd::spawn_successor(
        &pair,
        &old,
        &[
            "--admin",
            &admin,
            "--take-over-from",
            &admin,
            "--access-log",
            "/nonexistent/haltd/access.log",
        ],
    )?;
    ensure!(
        !broken.wait_exit(Duration::from_secs(20))?.success(),
        "the broken successor started"
    );
    ensure!(
        answering_pid(&sock)? == old_pid,
        "a failed successor took the admin socket away"
    );
    let new = Haltd::start_successor(
        &pair,
        &old,
        &["--admin", &admin, "--take-over-from", &admin],
    )?;
    let new_pid = u64::from(new.pid().ok_or_else(|| anyhow!("no pid"))?);
    ensure!(
        answering_pid(&sock)? == new_pid,
        "the successor does not answer on the socket once ready"
    );
    super::exits_cleanly(&mut old, Duration::from_secs(20))?;
    ensure!(
        answering_pid(&sock)? == new_pid,
        "the socket went with the old haltd"
    );
    Ok(())
}

/// A successor that would write the old haltd's own ledger file is refused by it, with the
/// reason, and the old haltd serves on.
#[test]
fn a_successor_on_the_old_ledger_file_is_refused() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let old = Haltd::start(&pair, &[])?;
    let mut same = Haltd::spawn_successor_on(&pair, &old, Some(&old.ledger), &[])?;
    ensure!(
        !same.wait_exit(Duration::from_secs(20))?.success(),
        "a successor on the old ledger file started"
    );
    let said = same.log_file("stderr.log")?;
    ensure!(
        said.contains("refused the hand-over") && said.contains("--ledger of its own"),
        "its stderr: {said}"
    );
    let url = format!("{}/v1/chat/completions", old.api_url());
    spawn_in_netns(&pair.cli, move || turn(&url))
        .join()
        .map_err(|_| anyhow!("the client panicked"))??;
    ensure!(
        !old.ledger_records()?
            .iter()
            .any(|r| r.get("handover").is_some()),
        "the old haltd wrote a hand-over record for a refused successor"
    );
    Ok(())
}

/// A successor whose gate does not load stops before it asks anything: the running haltd
/// records no hand-over, and serves on.
#[test]
fn a_successor_whose_gate_fails_never_asks() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let old = Haltd::start(&pair, &[])?;
    let mut broken =
        Haltd::spawn_successor(&pair, &old, &["--bpf-object", "/nonexistent/haltd-gate.o"])?;
    ensure!(
        !broken.wait_exit(Duration::from_secs(20))?.success(),
        "a successor without its gate started"
    );
    let said = broken.log_file("stderr.log")?;
    ensure!(
        said.contains("cannot load the kernel halt gate"),
        "its stderr: {said}"
    );
    thread::sleep(Duration::from_millis(300));
    ensure!(
        !old.ledger_records()?
            .iter()
            .any(|r| r.get("handover").is_some()
                || r["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("hand-over"))),
        "the old haltd heard from a successor whose gate failed"
    );
    let url = format!("{}/v1/chat/completions", old.api_url());
    spawn_in_netns(&pair.cli, move || turn(&url))
        .join()
        .map_err(|_| anyhow!("the client panicked"))??;
    Ok(())
}

/// One hand-over at a time: while a successor serves beside the old haltd (the overlap), a
/// second one is refused by the old haltd, with the reason, and the first goes on.
#[test]
fn a_second_successor_is_refused_while_a_hand_over_is_under_way() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let old = Haltd::start(&pair, &[])?;
    let first = Haltd::start_successor(&pair, &old, &["--take-over-overlap-ms", "60000"])?;
    let mut second = Haltd::spawn_successor(&pair, &old, &[])?;
    ensure!(
        !second.wait_exit(Duration::from_secs(20))?.success(),
        "a second successor started during a hand-over"
    );
    let said = second.log_file("stderr.log")?;
    ensure!(said.contains("is under way"), "its stderr: {said}");
    let first_pid = first.pid().ok_or_else(|| anyhow!("no pid"))?;
    let handovers: Vec<_> = old
        .ledger_records()?
        .into_iter()
        .filter_map(|r| {
            r.pointer("/handover/to_pid")
                .and_then(serde_json::Value::as_u64)
        })
        .collect();
    ensure!(
        handovers == [u64::from(first_pid)],
        "hand-over records: {handovers:?}"
    );
    Ok(())
}
