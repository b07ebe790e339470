//! systemd's view of a hand-over (`Type=notify`, each instance its own unit): the successor
//! says `READY=1` once it serves, and only then does the old haltd say `STOPPING=1`, drain and
//! exit 0. On `NOTIFY_SOCKET`s the test owns (systemd is not PID 1 on the test machines).

use std::{
    os::unix::net::UnixDatagram,
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, ensure, Result};
use haltd_tests::{require_root, temp_dir, Haltd, NetPair};

/// Reads every datagram that arrives on `sock`, with when it came, until a datagram containing
/// `last` arrived or `wait` passed.
fn listen(
    sock: UnixDatagram,
    last: &'static str,
    wait: Duration,
) -> thread::JoinHandle<Vec<(Instant, String)>> {
    thread::spawn(move || {
        let _ = sock.set_read_timeout(Some(Duration::from_millis(20)));
        let deadline = Instant::now() + wait;
        let mut got = Vec::new();
        let mut buf = [0_u8; 4096];
        while Instant::now() < deadline && first(&got, last).is_none() {
            if let Ok(n) = sock.recv(&mut buf) {
                got.push((
                    Instant::now(),
                    String::from_utf8_lossy(&buf[..n]).into_owned(),
                ));
            }
        }
        got
    })
}

/// When the first datagram containing `what` came.
fn first(got: &[(Instant, String)], what: &str) -> Option<Instant> {
    got.iter().find(|(_, m)| m.contains(what)).map(|(t, _)| *t)
}

#[test]
fn the_successor_says_ready_before_the_old_haltd_says_stopping() -> Result<()> {
    require_root()?;
    let dir = temp_dir("handover-notify")?;
    let (old_path, new_path) = (dir.join("old.sock"), dir.join("new.sock"));
    let (old_sock, new_sock) = (
        UnixDatagram::bind(&old_path)?,
        UnixDatagram::bind(&new_path)?,
    );
    let (old_env, new_env) = (
        format!("NOTIFY_SOCKET={}", old_path.display()),
        format!("NOTIFY_SOCKET={}", new_path.display()),
    );
    let pair = NetPair::new()?;
    let mut old = Haltd::start_wrapped(&pair, None, &["env", &old_env], &[])?;
    let to_old = listen(old_sock, "STOPPING=1", Duration::from_secs(30));
    let to_new = listen(new_sock, "READY=1", Duration::from_secs(30));
    let new = Haltd::start_successor_wrapped(&pair, &old, &["env", &new_env], &[])?;
    super::exits_cleanly(&mut old, Duration::from_secs(20))?;
    let to_old = to_old.join().map_err(|_| anyhow!("a reader panicked"))?;
    let to_new = to_new.join().map_err(|_| anyhow!("a reader panicked"))?;
    let ready = first(&to_new, "READY=1");
    let stopping = first(&to_old, "STOPPING=1");
    ensure!(
        ready.is_some() && stopping.is_some(),
        "successor said {to_new:?}; old said {to_old:?}"
    );
    ensure!(
        ready < stopping,
        "the old haltd said STOPPING=1 before the successor said READY=1"
    );
    drop(new);
    Ok(())
}
