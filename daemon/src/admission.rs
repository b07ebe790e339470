//! Admission of client connections: what a hostile or careless client may hold.
//!
//! Every accepted connection takes a slot of the stream table (the kernel gate governs it
//! from establishment), and keeps it until it closes. Two caps keep clients that never finish
//! their request (slowloris) from holding the table, checked at accept, before a slot is
//! taken:
//!
//! * **per source address** (`--max-conns-per-addr`, 0 = no cap): open connections from one
//!   IP address; more get `429` and are closed.
//! * **request phase** (`--request-phase-share`, percent of `--max-streams`): connections that
//!   have not yet sent a whole request; more get `503` and are closed. A connection leaves the
//!   request phase when its request is routed or answered with an error, or when it closes.
//!   A kept connection (HTTP keep-alive) waiting for its next request is not in the request
//!   phase (`--client-idle-timeout-ms` bounds that wait); it enters it again with the first
//!   byte of that request, and is refused with `503` then if the phase is full.
//!
//! Together with the absolute request deadline (`--request-timeout-ms` from accept to the
//! end of the body, `dataplane/request.rs`), a trickling client holds at most its share of
//! the table, for at most the request timeout.
//!
//! The per-address counts are a map behind a mutex, taken once at accept and once at close,
//! never per token.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        atomic::{AtomicU32, Ordering::SeqCst},
        Mutex, PoisonError,
    },
};

/// Why a connection was refused at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its address already has `--max-conns-per-addr` connections open.
    PerAddress,
    /// `--request-phase-share` of the table is taken by connections still sending requests.
    RequestPhase,
}

/// The two caps and what they count.
#[derive(Debug)]
pub struct Admission {
    per_addr_cap: u32,
    request_cap: u32,
    per_addr: Mutex<HashMap<IpAddr, u32>>,
    in_request: AtomicU32,
}

impl Admission {
    /// `per_addr_cap` 0 means no per-address cap; `request_cap` is the most connections in
    /// their request phase at once (at least 1).
    pub fn new(per_addr_cap: u32, request_cap: u32) -> Self {
        Admission {
            per_addr_cap,
            request_cap: request_cap.max(1),
            per_addr: Mutex::new(HashMap::new()),
            in_request: AtomicU32::new(0),
        }
    }

    /// The request-phase cap for `max_streams` slots and a share in percent (1..=100).
    pub fn request_cap(max_streams: u32, share_pct: u32) -> u32 {
        let cap = u64::from(max_streams) * u64::from(share_pct) / 100;
        u32::try_from(cap).unwrap_or(u32::MAX).max(1)
    }

    /// Admits a new connection from `addr` (unknown: only the request-phase cap applies):
    /// it counts against its address and the request phase until [`Admission::leave_request`]
    /// and [`Admission::release`].
    pub fn admit(&self, addr: Option<IpAddr>) -> Result<(), Refusal> {
        self.enter_request()?;
        if let (Some(addr), true) = (addr, self.per_addr_cap > 0) {
            let mut map = self.per_addr.lock().unwrap_or_else(PoisonError::into_inner);
            let n = map.entry(addr).or_insert(0);
            if *n >= self.per_addr_cap {
                drop(map);
                self.leave_request();
                return Err(Refusal::PerAddress);
            }
            *n += 1;
        }
        Ok(())
    }

    /// A kept connection begins its next request (its first byte arrived): it counts against
    /// the request phase again until [`Admission::leave_request`]. An idle kept connection
    /// does not count: only its address's open connections do.
    pub fn enter_request(&self) -> Result<(), Refusal> {
        self.in_request
            .fetch_update(SeqCst, SeqCst, |n| (n < self.request_cap).then_some(n + 1))
            .map(drop)
            .map_err(|_| Refusal::RequestPhase)
    }

    /// A connection left its request phase (once per request).
    pub fn leave_request(&self) {
        let _ = self
            .in_request
            .fetch_update(SeqCst, SeqCst, |n| Some(n.saturating_sub(1)));
    }

    /// A connection admitted earlier from `addr` closed.
    pub fn release(&self, addr: Option<IpAddr>) {
        let (Some(addr), true) = (addr, self.per_addr_cap > 0) else {
            return;
        };
        let mut map = self.per_addr.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = map.get_mut(&addr) {
            *n -= 1;
            if *n == 0 {
                map.remove(&addr);
            }
        }
    }

    /// Connections in their request phase now.
    pub fn in_request(&self) -> u32 {
        self.in_request.load(SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().expect("a test address"))
    }

    #[test]
    fn the_per_address_cap_counts_open_connections_of_one_address() {
        let a = Admission::new(2, 100);
        assert_eq!(a.admit(ip("10.0.0.1")), Ok(()));
        assert_eq!(a.admit(ip("10.0.0.1")), Ok(()));
        assert_eq!(a.admit(ip("10.0.0.1")), Err(Refusal::PerAddress));
        // A refusal takes nothing: the request phase holds the two admitted only.
        assert_eq!(a.in_request(), 2);
        assert_eq!(a.admit(ip("10.0.0.2")), Ok(()));
        a.release(ip("10.0.0.1"));
        assert_eq!(a.admit(ip("10.0.0.1")), Ok(()));
    }

    #[test]
    fn the_request_phase_cap_frees_as_requests_complete() {
        let a = Admission::new(0, 2);
        assert_eq!(a.admit(ip("10.0.0.1")), Ok(()));
        assert_eq!(a.admit(ip("10.0.0.2")), Ok(()));
        assert_eq!(a.admit(ip("10.0.0.3")), Err(Refusal::RequestPhase));
        a.leave_request();
        assert_eq!(a.admit(ip("10.0.0.3")), Ok(()));
        assert_eq!(a.in_request(), 2);
        // A kept connection's next request takes its place in the phase again.
        a.leave_request();
        assert_eq!(a.enter_request(), Ok(()));
        assert_eq!(a.enter_request(), Err(Refusal::RequestPhase));
        assert_eq!(a.in_request(), 2);
    }

    #[test]
    fn zero_means_no_per_address_cap_and_the_share_rounds_down_but_not_to_zero() {
        let a = Admission::new(0, 1000);
        for _ in 0..500 {
            assert_eq!(a.admit(ip("10.0.0.1")), Ok(()));
        }
        assert_eq!(Admission::request_cap(4096, 50), 2048);
        assert_eq!(Admission::request_cap(3, 10), 1);
        assert_eq!(Admission::request_cap(10, 100), 10);
    }
}
