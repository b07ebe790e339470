//! Admission of client connections: what a hostile or careless client may hold.
//!
//! Every accepted connection takes a slot of the stream table (the kernel gate governs it
//! from establishment), and keeps it until it closes. Two caps keep clients that never finish
//! their request (slowloris) from holding the table, checked at accept, before a slot is
//! taken:
//!
//! * **per source address group** (`--max-conns-per-addr`, 0 = no cap): open connections from
//!   one group of addresses; more get `429` and are closed. IPv4 addresses are grouped by their
//!   first `--addr-prefix-v4` bits (32: each address alone), IPv6 addresses by their first
//!   `--addr-prefix-v6` bits (64: a /64, what one host or one customer usually gets, so that one
//!   client cannot take the table by cycling through the addresses of its own /64). An
//!   IPv4-mapped IPv6 address counts as its IPv4 address.
//! * **request phase** (`--request-phase-share`, percent of `--max-streams`): connections that
//!   have not yet sent a whole request; more get `503` and are closed. A connection leaves the
//!   request phase when its request is routed or answered with an error, or when it closes.
//!   A kept connection (HTTP keep-alive) waiting for its next request is not in the request
//!   phase (`--client-idle-timeout-ms` bounds that wait); it enters it again with the first
//!   byte of that request, and is refused with `503` then if the phase is full.
//!
//! Together with the absolute request deadline (`--request-timeout-ms` from accept to the
//! end of the body, `dataplane/conn/request.rs`), a trickling client holds at most its share of
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

/// How client addresses are grouped for the per-address cap: the prefix lengths, in bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddrGroups {
    /// `--addr-prefix-v4` (1..=32).
    pub v4: u8,
    /// `--addr-prefix-v6` (1..=128).
    pub v6: u8,
}

impl Default for AddrGroups {
    /// Each IPv4 address alone, IPv6 addresses by /64.
    fn default() -> Self {
        AddrGroups { v4: 32, v6: 64 }
    }
}

impl AddrGroups {
    /// The group `addr` counts in: the address with every bit past the prefix cleared (an
    /// IPv4-mapped IPv6 address is taken as its IPv4 address first).
    pub fn group(self, addr: IpAddr) -> IpAddr {
        let addr = match addr {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
            v4 => v4,
        };
        match addr {
            IpAddr::V4(a) => {
                let keep = u32::MAX
                    .checked_shl(32 - u32::from(self.v4.min(32)))
                    .unwrap_or(0);
                IpAddr::V4((u32::from(a) & keep).into())
            }
            IpAddr::V6(a) => {
                let keep = u128::MAX
                    .checked_shl(128 - u32::from(self.v6.min(128)))
                    .unwrap_or(0);
                IpAddr::V6((u128::from(a) & keep).into())
            }
        }
    }
}

/// The two caps and what they count.
#[derive(Debug)]
pub struct Admission {
    per_addr_cap: u32,
    groups: AddrGroups,
    request_cap: u32,
    /// Open connections per address group ([`AddrGroups::group`]).
    per_addr: Mutex<HashMap<IpAddr, u32>>,
    in_request: AtomicU32,
}

impl Admission {
    /// `per_addr_cap` 0 means no per-address cap; `request_cap` is the most connections in
    /// their request phase at once (at least 1). Addresses count in their `groups`.
    pub fn new(per_addr_cap: u32, groups: AddrGroups, request_cap: u32) -> Self {
        Admission {
            per_addr_cap,
            groups,
            request_cap: request_cap.max(1),
            per_addr: Mutex::new(HashMap::new()),
            in_request: AtomicU32::new(0),
        }
    }

    /// The request-phase cap for `max_streams` slots and a share in percent (1..=100).
    /// How addresses are grouped (the address scopes of degraded mode group them the same
    /// way, `scope.rs`).
    pub fn groups(&self) -> AddrGroups {
        self.groups
    }

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
            let n = map.entry(self.groups.group(addr)).or_insert(0);
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
        let group = self.groups.group(addr);
        let mut map = self.per_addr.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = map.get_mut(&group) {
            *n -= 1;
            if *n == 0 {
                map.remove(&group);
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
        let a = Admission::new(2, AddrGroups::default(), 100);
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
        let a = Admission::new(0, AddrGroups::default(), 2);
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

    fn addr(s: &str) -> IpAddr {
        s.parse().expect("a test address")
    }

    #[test]
    fn addresses_count_in_their_prefix_group() {
        let g = AddrGroups::default();
        // IPv4: each address alone by default; a /24 when asked.
        assert_ne!(g.group(addr("10.0.0.1")), g.group(addr("10.0.0.2")));
        let g24 = AddrGroups { v4: 24, v6: 64 };
        assert_eq!(g24.group(addr("10.0.0.1")), addr("10.0.0.0"));
        // IPv6: one /64 is one group; the next /64 is another.
        let a = g.group(addr("2001:db8:0:1::1"));
        assert_eq!(a, g.group(addr("2001:db8:0:1:ffff:1234:5678:9abc")));
        assert_ne!(a, g.group(addr("2001:db8:0:2::1")));
        // An IPv4-mapped address is its IPv4 address.
        assert_eq!(g.group(addr("::ffff:10.0.0.1")), g.group(addr("10.0.0.1")));
        // Whole-width prefixes keep every bit; 1 keeps one.
        let full = AddrGroups { v4: 32, v6: 128 };
        assert_eq!(full.group(addr("2001:db8::7")), addr("2001:db8::7"));
        let one = AddrGroups { v4: 1, v6: 1 };
        assert_eq!(one.group(addr("200.1.2.3")), addr("128.0.0.0"));
        assert_eq!(one.group(addr("fe80::1")), addr("8000::"));
    }

    #[test]
    fn one_v6_host_cycling_its_addresses_meets_the_cap_of_its_64() {
        let a = Admission::new(2, AddrGroups::default(), 100);
        assert_eq!(a.admit(ip("2001:db8::1")), Ok(()));
        assert_eq!(a.admit(ip("2001:db8::2")), Ok(()));
        assert_eq!(a.admit(ip("2001:db8::3")), Err(Refusal::PerAddress));
        assert_eq!(a.admit(ip("2001:db8:0:1::1")), Ok(()), "another /64");
        a.release(ip("2001:db8::1"));
        assert_eq!(a.admit(ip("2001:db8::9")), Ok(()));
    }

    #[test]
    fn zero_means_no_per_address_cap_and_the_share_rounds_down_but_not_to_zero() {
        let a = Admission::new(0, AddrGroups::default(), 1000);
        for _ in 0..500 {
            assert_eq!(a.admit(ip("10.0.0.1")), Ok(()));
        }
        assert_eq!(Admission::request_cap(4096, 50), 2048);
        assert_eq!(Admission::request_cap(3, 10), 1);
        assert_eq!(Admission::request_cap(10, 100), 10);
    }
}
