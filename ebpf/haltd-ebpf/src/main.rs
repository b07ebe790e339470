//! The haltd halt gate: the BPF programs that bound what a tripped stream may still send.
//!
//! * `halt_gate` (`sk_msg`, attached to `GOVERNED`) judges every send call the kernel runs it
//!   for: post-trip frames, their size, the terminal frame. A drop fails the send with
//!   `EACCES`, and the kernel never runs the program for that socket again.
//! * `halt_egress` (`cgroup_skb/egress`, attached to haltd's cgroup) judges every TCP segment
//!   of a governed socket by its stream offset against the post-trip byte ceiling. It caches
//!   nothing, so it also bounds the sends `halt_gate` never saw (the kernel keeps an earlier
//!   verdict while a push stays partial).
//! * `halt_adopt` (`sock_ops`, attached to haltd's cgroup) governs every connection accepted
//!   on a governed port at establishment, before the client can half-close it.
//! * `heartbeat_stamp` and `clock_read` (flow dissectors never attached, run by `BPF_PROG_RUN`) stamp the
//!   watchdog's heartbeat and read the clock the checks use (`bpf_ktime_get_ns`).
//!
//! The decisions themselves are `haltd_common::decide`, shared with the model of the gate.
//! Nothing logs on these paths: per-CPU counters, and one ring-buffer event per socket on its
//! first drop.
#![no_std]
#![no_main]

use core::ptr;

use aya_ebpf::{
    bindings::{
        bpf_sock, sk_action, BPF_NOEXIST, BPF_SK_STORAGE_GET_F_CREATE,
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
    },
    btf_maps::{Array, HashMap, PerCpuArray, RingBuf, SkStorage, SockHash},
    helpers::{
        bpf_ktime_get_ns,
        generated::{
            bpf_get_socket_cookie, bpf_msg_pull_data, bpf_sk_fullsock, bpf_sk_storage_get,
            bpf_tcp_sock,
        },
    },
    macros::{btf_map, cgroup_skb, flow_dissector, sk_msg, sock_ops},
    programs::{FlowDissectorContext, SkBuffContext, SkMsgContext, SockOpsContext},
};
use haltd_common::{
    decide::{self, SegmentView, SendView},
    framing, trip_reason, verdict, EgressState, HaltEvent, Heartbeat, SockPolicy, SockState,
    DEFAULT_MAX_SOCKETS, MAX_GOVERNED_PORTS, NONCE_LEN, NONCE_OFFSET, TERMINAL_PREFIX_LEN,
    TLS_NONCE_OFFSET, TLS_TERMINAL_PREFIX_LEN,
};

/// Governed sockets by socket cookie. `halt_gate` is attached to this map.
#[btf_map]
static GOVERNED: SockHash<u64, { DEFAULT_MAX_SOCKETS as usize }> = SockHash::new();

/// Local ports whose accepted connections `halt_adopt` governs.
#[btf_map]
static GOVERNED_PORTS: HashMap<u32, u32, { MAX_GOVERNED_PORTS as usize }> = HashMap::new();

/// The send check's per-socket state.
#[btf_map]
static SOCK_STATE: SkStorage<SockState> = SkStorage::new();

/// Userspace's per-socket policy and trip.
#[btf_map]
static SOCK_POLICY: SkStorage<SockPolicy> = SkStorage::new();

/// The egress check's per-socket state.
#[btf_map]
static EGRESS_STATE: SkStorage<EgressState> = SkStorage::new();

/// The watchdog's heartbeat, in the kernel's clock.
#[btf_map]
static HEARTBEAT: Array<Heartbeat, 1> = Array::new();

/// Counters by outcome, per CPU so the hot path never contends on a cache line.
#[btf_map]
static VERDICTS: PerCpuArray<u64, { verdict::COUNT as usize }> = PerCpuArray::new();

/// One event per socket, on its first drop. 256 KiB holds over 5000 unread events; when full,
/// events are lost but the counters still count every drop.
#[btf_map]
static HALT_EVENTS: RingBuf<HaltEvent, { 256 * 1024 }> = RingBuf::new();

const SK_PASS: u32 = sk_action::SK_PASS;
const SK_DROP: u32 = sk_action::SK_DROP;
/// `cgroup_skb` return values: 1 lets the packet go, 0 drops it (TCP keeps the data queued
/// and retries later, when it is judged again).
const CG_PASS: i32 = 1;
const CG_DROP: i32 = 0;
const IPPROTO_TCP: u8 = 6;

#[inline(always)]
fn count(v: u32) {
    if let Some(c) = VERDICTS.get_ptr_mut(v) {
        // SAFETY: a per-CPU array element of this CPU; BPF programs run with migration
        // disabled, and a program that is preempted on this CPU by another one only loses a
        // count, never corrupts memory.
        unsafe { *c += 1 };
    }
}

#[inline(always)]
fn now() -> u64 {
    // SAFETY: no preconditions.
    unsafe { bpf_ktime_get_ns() }
}

/// A socket's storage in `map`, created zeroed when `create`.
#[inline(always)]
fn storage<T>(map: &SkStorage<T>, sk: *mut bpf_sock, create: bool) -> *mut T {
    let flags = if create {
        u64::from(BPF_SK_STORAGE_GET_F_CREATE)
    } else {
        0
    };
    // SAFETY: `map` is a map definition the loader relocates to the map fd; `sk` is a socket
    // pointer of the program's context, of a type the verifier accepts for this helper.
    unsafe {
        bpf_sk_storage_get(
            ptr::from_ref(map).cast_mut().cast(),
            sk.cast(),
            ptr::null_mut(),
            flags,
        )
    }
    .cast::<T>()
}

#[inline(always)]
fn heartbeat_lost(now_ns: u64) -> bool {
    decide::heartbeat_lost(HEARTBEAT.get(0), now_ns)
}

#[sk_msg]
pub fn halt_gate(ctx: SkMsgContext) -> u32 {
    // SAFETY: `ctx.msg` is the kernel's `sk_msg_md` for this run, valid for the whole program.
    let sk = unsafe { (*ctx.msg).__bindgen_anon_3.sk };
    let st = storage(&SOCK_STATE, sk, false);
    if st.is_null() {
        // Governed but never given state: a daemon bug. Fail closed.
        count(verdict::DROP_NO_STATE);
        return SK_DROP;
    }
    // SAFETY: non-null storage of this socket; sends on one socket are serialised by the
    // socket lock, so this run is its only writer.
    let st = unsafe { &mut *st };
    let policy = storage(&SOCK_POLICY, sk, false);
    // SAFETY: non-null storage of this socket, written only by userspace, whose updates link a
    // new element in whole (never a half-written value).
    let policy = unsafe { policy.as_ref() };
    let now_ns = now();
    let eg = storage(&EGRESS_STATE, sk, false);
    // SAFETY: non-null storage of this socket; only `latched_ceiling` is read, an aligned
    // 8-byte field the egress check writes once (0 to non-zero).
    let egress_latched = unsafe { eg.as_ref() }.is_some_and(|eg| eg.latched_ceiling != 0);
    let view = SendView {
        size: u64::from(ctx.size()),
        now_ns,
        heartbeat_lost: heartbeat_lost(now_ns),
        egress_latched,
    };
    let tls = policy.is_some_and(|p| p.framing == framing::TLS);
    let v = decide::send_verdict(st, policy, view, |nonce| {
        if tls {
            carries_tls_nonce(&ctx, nonce)
        } else {
            carries_nonce(&ctx, nonce)
        }
    });
    count(v);
    if verdict::passes(v) {
        return SK_PASS;
    }
    if verdict::is_trip_drop(v) && st.dropped == 0 {
        st.dropped = 1;
        let (stream_tag, cause) = match policy {
            Some(p) => (p.stream_tag, p.cause),
            None => (0, 0),
        };
        let event = HaltEvent {
            stream_tag,
            verdict: v,
            trip_reason: st.trip_reason,
            frames: st.frames,
            post_trip_frames: st.post_trip_frames,
            cause,
            _pad: 0,
            ts_ns: now_ns,
        };
        // A full ring buffer loses the event; the counter still records the drop.
        let _ = HALT_EVENTS.output(event, 0);
    }
    SK_DROP
}

/// Whether the message has the trip's nonce at `NONCE_OFFSET`. An all-zero nonce (the
/// untripped value) never matches, and nor does a message too short to hold it.
#[inline(always)]
fn carries_nonce(ctx: &SkMsgContext, nonce: &[u8; NONCE_LEN]) -> bool {
    let mut any = 0u8;
    for b in nonce {
        any |= *b;
    }
    if any == 0 || ctx.size() < TERMINAL_PREFIX_LEN as u32 {
        return false;
    }
    // Make the prefix linear and directly readable; it may span scatterlist pages.
    // SAFETY: `ctx.msg` is the program's context.
    if unsafe { bpf_msg_pull_data(ctx.msg, 0, TERMINAL_PREFIX_LEN as u32, 0) } != 0 {
        return false;
    }
    // Packet pointers are re-read after the pull, which invalidates earlier ones.
    let data = ctx.data();
    let data_end = ctx.data_end();
    if data + TERMINAL_PREFIX_LEN > data_end {
        return false;
    }
    let mut diff = 0u8;
    for (i, b) in nonce.iter().enumerate() {
        // SAFETY: `data + NONCE_OFFSET + i < data + TERMINAL_PREFIX_LEN <= data_end`, checked
        // above in the form the verifier tracks.
        diff |= unsafe { *((data + NONCE_OFFSET + i) as *const u8) } ^ *b;
    }
    diff == 0
}

/// TLS framing: whether the message has the trip's nonce (the first 16 ciphertext bytes of
/// the sealed terminal record) at `TLS_NONCE_OFFSET`, after the record header. The same
/// checks as [`carries_nonce`], at fixed offsets the verifier tracks.
#[inline(always)]
fn carries_tls_nonce(ctx: &SkMsgContext, nonce: &[u8; NONCE_LEN]) -> bool {
    let mut any = 0u8;
    for b in nonce {
        any |= *b;
    }
    if any == 0 || ctx.size() < TLS_TERMINAL_PREFIX_LEN as u32 {
        return false;
    }
    // SAFETY: `ctx.msg` is the program's context.
    if unsafe { bpf_msg_pull_data(ctx.msg, 0, TLS_TERMINAL_PREFIX_LEN as u32, 0) } != 0 {
        return false;
    }
    let data = ctx.data();
    let data_end = ctx.data_end();
    if data + TLS_TERMINAL_PREFIX_LEN > data_end {
        return false;
    }
    let mut diff = 0u8;
    for (i, b) in nonce.iter().enumerate() {
        // SAFETY: `data + TLS_NONCE_OFFSET + i < data + TLS_TERMINAL_PREFIX_LEN <= data_end`,
        // checked above in the form the verifier tracks.
        diff |= unsafe { *((data + TLS_NONCE_OFFSET + i) as *const u8) } ^ *b;
    }
    diff == 0
}

#[cgroup_skb(egress)]
pub fn halt_egress(ctx: SkBuffContext) -> i32 {
    // SAFETY: `ctx.skb.skb` is the kernel's `__sk_buff` for this run.
    let sk = unsafe { (*ctx.skb.skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return CG_PASS;
    }
    // SAFETY: a socket pointer from the context, as the helper expects.
    let sk = unsafe { bpf_sk_fullsock(sk) };
    if sk.is_null() {
        // Request and time-wait sockets carry no stream data of a governed connection.
        return CG_PASS;
    }
    let st = storage(&SOCK_STATE, sk, false);
    // SAFETY: non-null storage of this socket; only `stale_frame_limit` is read, an aligned
    // 8-byte field the send check writes once (0 to non-zero).
    let Some(st) = (unsafe { st.as_ref() }) else {
        // Not governed: upstream connections, the admin and metrics listeners.
        return CG_PASS;
    };
    let send_latched = st.stale_frame_limit != 0;
    let Some(payload) = payload(&ctx) else {
        return judge(sk, send_latched, None);
    };
    if payload.len == 0 {
        // SYN, FIN, RST, pure ACKs: no stream bytes.
        return CG_PASS;
    }
    // SAFETY: a full socket pointer from `bpf_sk_fullsock`.
    let tp = unsafe { bpf_tcp_sock(sk) };
    if tp.is_null() {
        return judge(sk, send_latched, None);
    }
    // SAFETY: non-null `bpf_tcp_sock` of this socket; the egress path holds the socket lock,
    // so the three fields are consistent with each other.
    let (snd_una, snd_nxt, bytes_acked) =
        unsafe { ((*tp).snd_una, (*tp).snd_nxt, (*tp).bytes_acked) };
    let start = decide::stream_offset(payload.seq, snd_una, bytes_acked);
    let sent = decide::stream_offset(snd_nxt, snd_una, bytes_acked);
    judge(
        sk,
        send_latched,
        Some((sent, start.saturating_add(u64::from(payload.len)))),
    )
}

/// Where a segment's payload lies.
struct Payload {
    seq: u32,
    len: u32,
}

/// The TCP sequence number and payload length of the packet (IPv4 or IPv6, network header
/// first), or `None` if it cannot be read as TCP.
#[inline(always)]
fn payload(ctx: &SkBuffContext) -> Option<Payload> {
    const ETH_P_IP: u32 = 0x0800;
    const ETH_P_IPV6: u32 = 0x86dd;
    // SAFETY: `ctx.skb.skb` is the kernel's `__sk_buff` for this run.
    let (proto, len) = unsafe { ((*ctx.skb.skb).protocol, (*ctx.skb.skb).len) };
    let proto = u32::from(u16::from_be(proto as u16));
    let ip_len = if proto == ETH_P_IP {
        let vihl: u8 = ctx.load(0).ok()?;
        let l4: u8 = ctx.load(9).ok()?;
        if vihl >> 4 != 4 || l4 != IPPROTO_TCP {
            return None;
        }
        u32::from(vihl & 0x0f) * 4
    } else if proto == ETH_P_IPV6 {
        // The kernel's TCP adds no extension headers of its own; one set by the socket owner
        // makes the segment unreadable here, which fails closed for a tripped stream.
        let next: u8 = ctx.load(6).ok()?;
        if next != IPPROTO_TCP {
            return None;
        }
        40
    } else {
        return None;
    };
    let seq = u32::from_be(ctx.load::<u32>(ip_len as usize + 4).ok()?);
    let doff: u8 = ctx.load(ip_len as usize + 12).ok()?;
    let headers = ip_len + u32::from(doff >> 4) * 4;
    if len < headers {
        return None;
    }
    Some(Payload {
        seq,
        len: len - headers,
    })
}

#[inline(always)]
fn judge(sk: *mut bpf_sock, send_latched: bool, offsets: Option<(u64, u64)>) -> i32 {
    let policy = storage(&SOCK_POLICY, sk, false);
    // SAFETY: non-null storage of this socket, written only by userspace, whole.
    let policy = unsafe { policy.as_ref() };
    let now_ns = now();
    let view = SegmentView {
        now_ns,
        heartbeat_lost: heartbeat_lost(now_ns),
        send_latched,
        offsets,
    };
    let eg = storage(&EGRESS_STATE, sk, true);
    if eg.is_null() {
        // No storage (allocation failed): judge with a fresh state. A latched ceiling is then
        // recomputed per segment, never looser than the first one would have been for a stream
        // userspace tripped, and failing closed without a policy. (A separate path: the
        // verifier does not let an unprivileged loader mix stack and map pointers.)
        let mut scratch = EgressState::default();
        let v = decide::segment_verdict(&mut scratch, policy, view);
        return egress_outcome(v, true, &scratch, policy, now_ns);
    }
    // SAFETY: non-null storage of this socket; the egress path holds the socket lock, so this
    // run is its only writer.
    let eg = unsafe { &mut *eg };
    let first_drop = eg.dropped_segments == 0;
    let v = decide::segment_verdict(eg, policy, view);
    egress_outcome(v, first_drop, eg, policy, now_ns)
}

/// Counts an egress verdict, emits a halt event on a socket's first drop, and returns the
/// program's answer.
#[inline(always)]
fn egress_outcome(
    v: u32,
    first_drop: bool,
    eg: &EgressState,
    policy: Option<&SockPolicy>,
    now_ns: u64,
) -> i32 {
    count(v);
    if v == verdict::EGRESS_PASS {
        return CG_PASS;
    }
    if first_drop {
        let (stream_tag, cause) = match policy {
            Some(p) => (p.stream_tag, p.cause),
            None => (0, 0),
        };
        let event = HaltEvent {
            stream_tag,
            verdict: v,
            trip_reason: match (eg.latch_reason, policy) {
                (trip_reason::NONE, Some(p)) if p.tripped != 0 => trip_reason::TRIPPED,
                (reason, _) => reason,
            },
            // For an egress drop: where the dropped segment ended, and the ceiling.
            frames: eg.dropped_end,
            post_trip_frames: decide::egress_ceiling(eg, policy),
            cause,
            _pad: 0,
            ts_ns: now_ns,
        };
        let _ = HALT_EVENTS.output(event, 0);
    }
    CG_DROP
}

#[sock_ops]
pub fn halt_adopt(ctx: SockOpsContext) -> u32 {
    if ctx.op() != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB {
        return 1;
    }
    let port = ctx.local_port();
    // SAFETY: the value is only tested for presence, never read through the reference.
    if unsafe { GOVERNED_PORTS.get(&port) }.is_none() {
        return 1;
    }
    // SAFETY: `ctx.ops` is the kernel's `bpf_sock_ops` for this run.
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        count(verdict::ADOPT_FAILED);
        return 1;
    }
    // State first: a socket in GOVERNED without state has every send dropped.
    let st = storage(&SOCK_STATE, sk, true);
    if st.is_null() {
        count(verdict::ADOPT_FAILED);
        return 1;
    }
    // SAFETY: `ctx.ops` is this run's context, the argument the helper expects.
    let mut cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    // SAFETY: `ctx.ops` is this run's context.
    match GOVERNED.update(
        &mut cookie,
        unsafe { &mut *ctx.ops },
        u64::from(BPF_NOEXIST),
    ) {
        Ok(()) => {
            // SAFETY: non-null storage of this socket, created above; nothing else writes it
            // before the daemon accepts the connection.
            unsafe { (*st).adopted = 1 };
            count(verdict::ADOPTED);
        }
        Err(_) => count(verdict::ADOPT_FAILED),
    }
    1
}

// Flow dissector programs, never attached: `BPF_PROG_RUN` of a flow dissector runs the program
// over a copy of the input bytes, with no socket or socket buffer to build (a socket filter's
// test run allocates both), so a beat costs the watchdog little; loading one needs only
// CAP_BPF + CAP_NET_ADMIN (a raw tracepoint would need CAP_PERFMON). `BPF_OK` (0) is the
// only answer a flow dissector may give.
#[flow_dissector]
pub fn heartbeat_stamp(_ctx: FlowDissectorContext) -> u32 {
    if let Some(hb) = HEARTBEAT.get_ptr_mut(0) {
        // SAFETY: the array's only element; this program is its field's only writer, and an
        // aligned 8-byte store is never seen half-done.
        unsafe { (*hb).last_ns = now() };
    }
    0
}

#[flow_dissector]
pub fn clock_read(_ctx: FlowDissectorContext) -> u32 {
    if let Some(hb) = HEARTBEAT.get_ptr_mut(0) {
        // SAFETY: as in `heartbeat_stamp`, for the `read_ns` field.
        unsafe { (*hb).read_ns = now() };
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // BPF cannot unwind or abort; the verifier rejects any reachable call to this, so a panic
    // path that survives optimisation fails at load time rather than at run time.
    loop {}
}
