//! Root-only scenario tests: haltd in one network namespace, clients in another, measured at
//! the client. Run serially (`cargo xtask test` passes `--test-threads=1`): they share kernel
//! state (BPF maps and programs, namespaces).

use std::process::Command;

use anyhow::{ensure, Result};
use haltd_tests::{checked, in_netns, netns_exists, NetPair};

/// The harness itself: a namespace pair where the client reaches the server over the veth and
/// nothing else, and that leaves nothing behind.
#[test]
fn harness_smoke() -> Result<()> {
    let (srv, cli) = {
        let pair = NetPair::new()?;
        ensure!(
            netns_exists(&pair.srv) && netns_exists(&pair.cli),
            "namespaces were not created"
        );
        let target = pair.srv_ip.to_string();
        checked(Command::new("ip").args([
            "netns", "exec", &pair.cli, "ping", "-c", "1", "-W", "2", &target,
        ]))?;
        // The client namespace has only the /30 and loopback: no default route.
        let routes = checked(Command::new("ip").args(["-n", &pair.cli, "route", "show"]))?;
        ensure!(
            !routes.contains("default"),
            "client namespace has a default route: {routes}"
        );
        let outside = Command::new("ip")
            .args([
                "netns",
                "exec",
                &pair.cli,
                "ping",
                "-c",
                "1",
                "-W",
                "1",
                "192.0.2.1",
            ])
            .output()?;
        ensure!(
            !outside.status.success(),
            "client namespace reached 192.0.2.1"
        );
        // in_netns really runs in the namespace: the thread sees the veth, not the root links.
        let links = in_netns(&pair.cli, || {
            std::fs::read_dir("/sys/class/net").map(|d| d.count())
        });
        ensure!(links.is_ok(), "reading links in the namespace");
        let here = in_netns(&pair.cli, || {
            std::net::TcpListener::bind((pair.cli_ip, 0)).is_ok()
        });
        ensure!(
            here,
            "cannot bind the client address inside the client namespace"
        );
        (pair.srv.clone(), pair.cli.clone())
    };
    ensure!(
        !netns_exists(&srv) && !netns_exists(&cli),
        "namespaces left behind after drop"
    );
    Ok(())
}
