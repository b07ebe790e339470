//! The haltd halt gate: an `sk_msg` program on the send path of every governed client socket.
//!
//! Once a stream is tripped (by the daemon through `TRIPS`, or by the gate itself when the
//! watchdog heartbeat is lost, or because the socket's slot now belongs to another stream), at
//! most the post-trip budget of further sends may leave, then one terminal frame carrying the
//! trip's nonce, then nothing. A send the gate drops fails with `EACCES` and the kernel never
//! runs the program for that socket again, so a drop is final.
//!
//! The program runs once per send call (large sends are split into several runs of about
//! 544 KiB); it keeps no logging on this path, only per-CPU verdict counters and one ring-buffer
//! event per socket, on its first drop. Map layouts and who writes what: `haltd-common`.
#![no_std]
#![no_main]

use core::ptr;

use aya_ebpf::{
    bindings::sk_action,
    btf_maps::{Array, PerCpuArray, RingBuf, SkStorage, SockHash},
    helpers::{
        bpf_ktime_get_ns,
        generated::{bpf_msg_pull_data, bpf_sk_storage_get},
    },
    macros::{btf_map, sk_msg},
    programs::SkMsgContext,
};
use haltd_common::{
    trip_reason, verdict, HaltEvent, Heartbeat, SockState, TripEntry, DEFAULT_MAX_STREAMS,
    NONCE_LEN, NONCE_OFFSET, TERMINAL_PREFIX_LEN,
};

/// Governed sockets by stream slot. The program is attached to this map; its values are never
/// read here (the program identifies the stream through `SOCK_STATE`).
#[btf_map]
static GOVERNED: SockHash<u32, { DEFAULT_MAX_STREAMS as usize }> = SockHash::new();

/// Per-socket state, written by userspace by fd before the socket enters `GOVERNED`.
#[btf_map]
static SOCK_STATE: SkStorage<SockState> = SkStorage::new();

/// Per-slot trip state; capacity overridden by the daemon at load time.
#[btf_map]
static TRIPS: Array<TripEntry, { DEFAULT_MAX_STREAMS as usize }> = Array::new();

/// The watchdog's heartbeat.
#[btf_map]
static HEARTBEAT: Array<Heartbeat, 1> = Array::new();

/// Sends by verdict, per CPU so the hot path never contends on a cache line.
#[btf_map]
static VERDICTS: PerCpuArray<u64, { verdict::COUNT as usize }> = PerCpuArray::new();

/// One event per socket, on its first drop. 256 KiB holds over 6000 unread events; when full,
/// events are lost but the verdict counters still count every drop.
#[btf_map]
static HALT_EVENTS: RingBuf<HaltEvent, { 256 * 1024 }> = RingBuf::new();

const SK_PASS: u32 = sk_action::SK_PASS;
const SK_DROP: u32 = sk_action::SK_DROP;

#[sk_msg]
pub fn halt_gate(ctx: SkMsgContext) -> u32 {
    let v = decide(&ctx);
    if let Some(count) = VERDICTS.get_ptr_mut(v) {
        // SAFETY: a per-CPU array element of this CPU; sk_msg runs with preemption disabled
        // for the whole program, so nothing else writes it concurrently.
        unsafe { *count += 1 };
    }
    match v {
        verdict::PASS | verdict::PASS_POST_TRIP | verdict::PASS_TERMINAL => SK_PASS,
        _ => SK_DROP,
    }
}

#[inline(always)]
fn decide(ctx: &SkMsgContext) -> u32 {
    // SAFETY: `ctx.msg` is the kernel's `sk_msg_md` for this run, valid for the whole program.
    let sk = unsafe { (*ctx.msg).__bindgen_anon_3.sk };
    // SAFETY: `SOCK_STATE` is a map definition the loader relocates to the map fd; `sk` comes
    // from the context, the only socket pointer the verifier accepts here.
    let st = unsafe {
        bpf_sk_storage_get(
            ptr::from_ref(&SOCK_STATE).cast_mut().cast(),
            sk.cast(),
            ptr::null_mut(),
            0,
        )
    }
    .cast::<SockState>();
    if st.is_null() {
        // Governed but never given state: a daemon bug. Fail closed.
        return verdict::DROP_NO_STATE;
    }
    // SAFETY: non-null storage of this socket; sends on one socket are serialised by the socket
    // lock, so this run is its only writer.
    let st = unsafe { &mut *st };
    let v = gate(ctx, st);
    if matches!(
        v,
        verdict::DROP_BUDGET | verdict::DROP_BYTES | verdict::DROP_AFTER_TERMINAL
    ) && st.dropped == 0
    {
        st.dropped = 1;
        // The cause belongs to this stream only if the slot still holds its generation.
        let cause = match TRIPS.get(st.slot) {
            Some(t) if t.generation == st.generation => t.cause,
            _ => 0,
        };
        let event = HaltEvent {
            slot: st.slot,
            generation: st.generation,
            verdict: v,
            trip_reason: st.trip_reason,
            frames: st.frames,
            post_trip_frames: st.post_trip_frames,
            cause,
            // SAFETY: no preconditions.
            ts_ns: unsafe { bpf_ktime_get_ns() },
        };
        // A full ring buffer loses the event; the verdict counter still records the drop.
        let _ = HALT_EVENTS.output(event, 0);
    }
    v
}

#[inline(always)]
fn gate(ctx: &SkMsgContext, st: &mut SockState) -> u32 {
    if st.terminal_sent != 0 {
        return verdict::DROP_AFTER_TERMINAL;
    }
    st.frames += 1;
    let n = st.frames;
    let size = u64::from(ctx.size());

    // The slot's trip entry, if it still belongs to this socket's stream.
    let trip = match TRIPS.get(st.slot) {
        Some(t) if t.generation == st.generation => Some(t),
        _ => None,
    };
    let user_tripped = trip.is_some_and(|t| t.tripped != 0 && n > t.pre_trip_frames);

    let hb_bytes = heartbeat_budget(st, n);

    // Untripped, or a frame userspace handed to the kernel before the trip (in flight when
    // the trip was written): pass it as it would have passed before the trip.
    let pre_trip = match trip {
        Some(t) => t.tripped == 0 || n <= t.pre_trip_frames,
        None => false,
    };
    if pre_trip && st.stale_frame_limit == 0 {
        return verdict::PASS;
    }

    first_tripped_send(st, trip.is_none(), user_tripped);

    // The terminal allowance: only a trip from userspace has a nonce, and only a frame that
    // carries it (which token frames never do) is let through once more.
    if let Some(t) = trip {
        if t.tripped != 0 && size <= u64::from(t.terminal_max_bytes) && carries_nonce(ctx, &t.nonce)
        {
            st.terminal_sent = 1;
            return verdict::PASS_TERMINAL;
        }
    }

    // Effective budget: the tightest of every reason the stream is tripped for.
    let mut frame_limit = u64::MAX;
    let mut byte_budget = u64::MAX;
    match trip {
        None => frame_limit = 0,
        // Only for post-trip frames: a pre-trip frame here is tripped by the heartbeat alone.
        Some(t) if user_tripped => {
            frame_limit = t.frame_limit;
            byte_budget = t.budget_bytes;
        }
        Some(_) => {}
    }
    if st.stale_frame_limit != 0 {
        frame_limit = min(frame_limit, st.stale_frame_limit - 1);
        byte_budget = min(byte_budget, hb_bytes);
    }

    if n > frame_limit {
        return verdict::DROP_BUDGET;
    }
    if st.post_trip_bytes + size > byte_budget {
        return verdict::DROP_BYTES;
    }
    st.post_trip_frames += 1;
    st.post_trip_bytes += size;
    verdict::PASS_POST_TRIP
}

/// Checks the watchdog heartbeat; the first time this socket sees it lost (or never written),
/// fixes the socket's own frame limit at `n - 1 + budget_frames`, stored plus one so that
/// 0 keeps meaning "never set". Sticky: a socket that saw the beat lost stays tripped.
/// Returns the heartbeat's byte budget.
#[inline(always)]
fn heartbeat_budget(st: &mut SockState, n: u64) -> u64 {
    let (last_ns, deadline_ns, frames, bytes) = match HEARTBEAT.get(0) {
        Some(hb) => (
            hb.last_ns,
            hb.deadline_ns,
            u64::from(hb.budget_frames),
            hb.budget_bytes,
        ),
        None => (0, 0, 0, 0),
    };
    if st.stale_frame_limit == 0 {
        // SAFETY: no preconditions.
        let now = unsafe { bpf_ktime_get_ns() };
        let stale = last_ns == 0 || now > last_ns.saturating_add(deadline_ns);
        if stale {
            st.stale_frame_limit = n - 1 + frames + 1;
        }
    }
    bytes
}

/// Records when and why the gate first saw this socket's stream tripped.
#[inline(always)]
fn first_tripped_send(st: &mut SockState, stale_slot: bool, user_tripped: bool) {
    if st.first_post_trip_ns != 0 {
        return;
    }
    // SAFETY: no preconditions.
    st.first_post_trip_ns = unsafe { bpf_ktime_get_ns() };
    st.trip_reason = if user_tripped {
        trip_reason::TRIPPED
    } else if stale_slot {
        trip_reason::STALE_SLOT
    } else {
        trip_reason::HEARTBEAT
    };
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

#[inline(always)]
fn min(a: u64, b: u64) -> u64 {
    if a < b {
        a
    } else {
        b
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // BPF cannot unwind or abort; the verifier rejects any reachable call to this, so a panic
    // path that survives optimisation fails at load time rather than at run time.
    loop {}
}
