//! Who can use the admin API: the Unix socket by its mode and group (and every action names
//! its caller's uid and pid), TCP only with the bearer token, state changes only as JSON, and
//! no operator-forged causes of haltd's own failures.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::Path,
    process::{Command, Output},
    sync::mpsc,
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    agent, haltctl_bin, haltd_bin, in_netns, spawn_in_netns, sse, temp_dir, Haltd, NetPair,
    TEST_ADMIN_TOKEN,
};
use serde_json::Value;

/// uid and gid of `nobody` / `nogroup`: a user with no business on the admin API.
const NOBODY: u32 = 65_534;

/// haltctl as `uid:gid` (through setpriv, all other groups dropped), on the admin socket.
fn haltctl_as(ids: Option<(u32, u32)>, sock: &Path, args: &[&str]) -> Result<Output> {
    let mut cmd = match ids {
        Some((uid, gid)) => {
            let mut c = Command::new("setpriv");
            c.args([
                &format!("--reuid={uid}"),
                &format!("--regid={gid}"),
                "--clear-groups",
            ])
            .arg(haltctl_bin()?);
            c
        }
        None => Command::new(haltctl_bin()?),
    };
    cmd.arg("--admin")
        .arg(format!("unix:{}", sock.display()))
        .args(args)
        .output()
        .context("running haltctl")
}

fn admin_records(haltd: &Haltd) -> Result<Vec<Value>> {
    Ok(haltd
        .ledger_records()?
        .into_iter()
        .filter(|r| r["kind"] == "admin")
        .collect())
}

#[test]
fn the_admin_socket_admits_its_group_and_names_every_caller() -> Result<()> {
    let pair = NetPair::new()?;
    let dir = temp_dir("admin-sock")?;
    // Traversable by everyone: only the socket's own mode and group decide.
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
    let sock = dir.join("admin.sock");
    let admin = format!("unix:{}", sock.display());
    let mut haltd = Haltd::start(&pair, &["--admin", &admin, "--admin-group", "0"])?;
    let mode = fs::metadata(&sock)?.permissions().mode() & 0o777;
    ensure!(mode == 0o660, "admin socket mode {mode:o}");

    // nobody cannot list, trip or end degraded mode.
    for args in [
        &["streams"][..],
        &["trip", "hs_ffffffff00000000"],
        &["mode", "full"],
    ] {
        let out = haltctl_as(Some((NOBODY, NOBODY)), &sock, args)?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            out.status.code() == Some(2) && err.contains("Permission denied"),
            "nobody ran haltctl {args:?}: {:?} {err}",
            out.status
        );
        println!("as nobody, haltctl {args:?}: {}", err.trim());
    }
    ensure!(
        admin_records(&haltd)?.is_empty(),
        "a refused caller left admin records"
    );

    // root (uid 0, owner) can; the trip of an unknown stream answers 404 and is recorded.
    let out = haltctl_as(None, &sock, &["trip", "hs_ffffffff00000000"])?;
    ensure!(out.status.code() == Some(1), "root trip: {out:?}");
    let out = haltctl_as(None, &sock, &["mode", "full"])?;
    ensure!(out.status.success(), "root mode full: {out:?}");
    let recs = haltd.wait_record("the admin record of the mode change", |r| {
        r["kind"] == "admin" && r["admin"]["action"] == "mode"
    })?;
    let trip = admin_records(&haltd)?
        .into_iter()
        .find(|r| r["admin"]["action"] == "trip")
        .context("no admin record of the trip")?;
    for (what, r, status) in [("trip", &trip, 404), ("mode", &recs, 200)] {
        let a = &r["admin"];
        ensure!(
            a["actor"]["transport"] == "unix"
                && a["actor"]["uid"] == 0
                && a["actor"]["pid"].as_i64().is_some_and(|p| p > 1)
                && a["status"] == status,
            "{what} record: {r}"
        );
    }
    println!(
        "root's actions recorded: {}; {}",
        trip["admin"], recs["admin"]
    );
    haltd.stop()?;
    Ok(())
}

#[test]
fn a_member_of_the_admin_group_is_admitted_and_recorded_by_uid() -> Result<()> {
    let pair = NetPair::new()?;
    let dir = temp_dir("admin-group")?;
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
    let sock = dir.join("admin.sock");
    let admin = format!("unix:{}", sock.display());
    let mut haltd = Haltd::start(&pair, &["--admin", &admin, "--admin-group", "nogroup"])?;
    let out = haltctl_as(Some((NOBODY, NOBODY)), &sock, &["mode", "full"])?;
    ensure!(out.status.success(), "a member of the admin group: {out:?}");
    let rec = haltd.wait_record("the group member's admin record", |r| r["kind"] == "admin")?;
    ensure!(
        rec["admin"]["actor"]["uid"] == NOBODY && rec["admin"]["actor"]["gid"] == NOBODY,
        "record: {rec}"
    );
    println!("group member's action recorded: {}", rec["admin"]);
    haltd.stop()?;
    Ok(())
}

/// One refused admin request: what it is, its headers, its body, the status it must get.
type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, &'a str, u16);

/// POSTs to the admin API with exactly these headers (no test token added unless given).
fn post(url: &str, headers: &[(&str, &str)], body: &str) -> Result<(u16, String)> {
    let mut req = agent(Duration::from_secs(10)).post(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut resp = req.send(body)?;
    Ok((resp.status().as_u16(), resp.body_mut().read_to_string()?))
}

/// Requests the admin API must refuse, each answered with its status, on a live stream.
fn refused_requests(pair: &NetPair, trip: &str, bearer: &str) -> Result<()> {
    let (trip, bearer) = (trip.to_owned(), bearer.to_owned());
    let answers = in_netns(
        &pair.cli,
        move || -> Result<Vec<(String, u16, String, u16)>> {
            let json = ("content-type", "application/json");
            let cases: [Case<'_>; 5] = [
                ("no token", vec![json, ("authorization", "")], "{}", 401),
                (
                    "wrong token",
                    vec![
                        json,
                        ("authorization", "Bearer haltd-test-admin-token-012345678X"),
                    ],
                    "{}",
                    401,
                ),
                (
                    "a form post",
                    vec![
                        ("authorization", &bearer),
                        ("content-type", "application/x-www-form-urlencoded"),
                    ],
                    "cause=EXFIL_ALERT",
                    415,
                ),
                (
                    "text/plain",
                    vec![("authorization", &bearer), ("content-type", "text/plain")],
                    r#"{"cause":"EXFIL_ALERT"}"#,
                    415,
                ),
                (
                    "a reserved cause",
                    vec![("authorization", &bearer), json],
                    r#"{"cause":"HEARTBEAT_LOST"}"#,
                    400,
                ),
            ];
            cases
                .iter()
                .map(|(what, headers, body, want)| {
                    post(&trip, headers, body).map(|(s, b)| ((*what).to_owned(), s, b, *want))
                })
                .collect()
        },
    )?;
    for (what, status, body, want) in &answers {
        println!("{what}: {status} {body}");
        ensure!(status == want, "{what}: {status} {body}, expected {want}");
    }
    Ok(())
}

#[test]
fn tcp_admin_needs_the_token_and_json() -> Result<()> {
    let pair = NetPair::new()?;
    let mut haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "20000"])?;
    let (tx, rx) = mpsc::channel();
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let streamer = spawn_in_netns(&pair.cli, move || {
        let body = sse::chat_body("admin access", 400, true);
        sse::stream(
            &url,
            &body,
            Duration::from_secs(30),
            sse::report_stream_id(tx),
        )
    });
    let id = rx.recv_timeout(Duration::from_secs(10))?;
    let trip = format!("{}/admin/streams/{id}/trip", haltd.admin_url());
    let bearer = format!("Bearer {TEST_ADMIN_TOKEN}");
    let json = ("content-type", "application/json");
    refused_requests(&pair, &trip, &bearer)?;
    // The stream is still untripped: the proper request trips it now.
    let ok = in_netns(&pair.cli, move || {
        post(&trip, &[("authorization", &bearer), json], "{}")
    })?;
    ensure!(ok.0 == 200, "the authenticated JSON trip: {ok:?}");
    let outcome = streamer.join().expect("streamer thread")?;
    outcome.halted_cleanly("OPERATOR_TRIP")?;
    let gets = in_netns(&pair.cli, {
        let url = format!("{}/admin/streams", haltd.admin_url());
        move || -> Result<u16> {
            let resp = agent(Duration::from_secs(10))
                .get(&url)
                .header("authorization", "")
                .call()?;
            Ok(resp.status().as_u16())
        }
    })?;
    ensure!(gets == 401, "GET /admin/streams without the token: {gets}");
    haltd.stop()?;
    Ok(())
}

#[test]
fn a_tcp_admin_without_a_token_does_not_start() -> Result<()> {
    let out = Command::new(haltd_bin()?)
        .args(["serve", "--admin", "127.0.0.1:18081", "--no-kernel-gate"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    println!("token-less TCP admin: {:?}: {}", out.status, err.trim());
    ensure!(
        out.status.code() == Some(2) && err.contains("--admin-token-file"),
        "{out:?}"
    );
    Ok(())
}
