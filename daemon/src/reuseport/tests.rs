use std::{
    io::ErrorKind,
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsFd,
    time::Duration,
};

use super::*;

/// Two listeners of one group on a loopback port, the second joined last.
fn pair() -> (TcpListener, TcpListener, SocketAddr) {
    let first = listen(
        bind("127.0.0.1:0".parse().expect("addr"), Sharing::Alone).expect("bind"),
        64,
    )
    .expect("listen");
    let addr = first.local_addr().expect("addr");
    let second = listen(bind(addr, Sharing::TakeOver).expect("bind beside"), 64).expect("listen");
    for l in [&first, &second] {
        l.set_nonblocking(true).expect("nonblocking");
    }
    (first, second, addr)
}

/// Connections each listener has waiting.
fn queued(l: &TcpListener) -> usize {
    let mut n = 0;
    loop {
        match l.accept() {
            Ok(_) => n += 1,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return n,
            Err(e) => panic!("accept: {e}"),
        }
    }
}

#[test]
fn a_start_without_take_over_refuses_a_port_in_use() {
    let (_first, _second, addr) = pair();
    let err = bind(addr, Sharing::Alone).expect_err("the port is in use");
    assert_eq!(err.kind(), ErrorKind::AddrInUse);
}

#[test]
fn steering_sends_every_new_connection_to_the_newest_listener() {
    let (first, second, addr) = pair();
    steer_to_newest(second.as_fd()).expect("steer");
    let conns: Vec<TcpStream> = (0..32)
        .map(|_| TcpStream::connect(addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(accept_queue_len(first.as_fd()).expect("tcp_info"), 0);
    assert_eq!(accept_queue_len(second.as_fd()).expect("tcp_info"), 32);
    assert_eq!((queued(&first), queued(&second)), (0, 32));
    unsteer(second.as_fd()).expect("unsteer");
    unsteer(second.as_fd()).expect("a second unsteer finds nothing and is fine");
    drop(conns);
}

#[test]
fn a_listener_shut_down_accepts_no_more_and_its_group_serves_on() {
    let (first, second, addr) = pair();
    shut_down(first.as_fd()).expect("shutdown");
    let _conns: Vec<TcpStream> = (0..16)
        .map(|_| TcpStream::connect(addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    assert!(first.accept().is_err(), "a shut-down listener accepted");
    assert_eq!(
        queued(&second),
        16,
        "the other listener takes every connection"
    );
}
