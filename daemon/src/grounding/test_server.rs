//! A scripted HTTP/1.1 server on loopback for the arms' tests: it answers each connection
//! with the next scripted reply (the last one repeats), records each request, and can stall
//! before answering to prove a deadline fires while an arm waits.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener},
    sync::{Arc, Mutex},
    time::Duration,
};

/// One scripted reply.
#[derive(Debug, Clone)]
pub enum Reply {
    /// Status and JSON body.
    Json(u16, String),
    /// Waits this long, then answers `{}`.
    Stall(Duration),
}

/// One request as received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    /// Path and query, as sent.
    pub target: String,
    pub body: String,
}

/// The server: its address and what it saw.
#[derive(Debug)]
pub struct Server {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    pub fn start(script: Vec<Reply>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let addr = listener.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        std::thread::spawn(move || {
            for (i, conn) in listener.incoming().enumerate() {
                let Ok(conn) = conn else { return };
                let reply = script[i.min(script.len() - 1)].clone();
                let log = Arc::clone(&log);
                std::thread::spawn(move || serve(conn, &reply, &log));
            }
        });
        Server { addr, seen }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }
}

fn serve(conn: std::net::TcpStream, reply: &Reply, log: &Mutex<Vec<Seen>>) {
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("").to_owned(),
    );
    let mut length = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0; length];
    let _ = reader.read_exact(&mut body);
    log.lock().expect("lock").push(Seen {
        method,
        target,
        body: String::from_utf8_lossy(&body).into_owned(),
    });
    let (status, json) = match reply {
        Reply::Json(status, json) => (*status, json.clone()),
        Reply::Stall(d) => {
            std::thread::sleep(*d);
            (200, "{}".to_owned())
        }
    };
    let mut conn = reader.into_inner();
    let _ = write!(
        conn,
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{json}",
        json.len()
    );
}
