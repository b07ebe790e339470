//! The kernel gate: loads the `sk_msg` halt gate (`ebpf/haltd-ebpf`) and drives its maps.
//!
//! Every accepted client socket is *governed* before its first send: its [`SockState`] goes into
//! `SOCK_STATE`, then the socket into `GOVERNED` (which the program is attached to), then the
//! slot's untripped [`TripEntry`] into `TRIPS`. From then on each send on the socket runs the
//! program, which lets at most the trip's budget of frames out once the stream is tripped
//! (through [`KernelGate::trip`], or by the program itself when [`KernelGate::beat`] stops), then
//! one terminal frame carrying the trip's nonce, then nothing — whatever userspace does.
//!
//! Map semantics and the one-writer-per-field rule: `haltd_common`.
//!
//! # Threads
//!
//! [`KernelGate`] is `Send + Sync`; each map sits behind its own mutex. Locks are taken per
//! connection ([`KernelGate::govern`]), per trip ([`KernelGate::trip`]), per heartbeat and per
//! metrics scrape, never per token: the per-send work is the kernel's.
use std::{
    os::fd::{AsRawFd, BorrowedFd},
    path::PathBuf,
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use aya::{
    maps::{Array, MapData, MapError, PerCpuArray, RingBuf, SkStorage, SockHash},
    programs::{ProgramError, SkMsg},
    Ebpf, EbpfError, EbpfLoader,
};
use haltd_common::{
    verdict, HaltEvent, Heartbeat, SockState, TripEntry, MAP_GOVERNED, MAP_HALT_EVENTS,
    MAP_HEARTBEAT, MAP_SOCK_STATE, MAP_TRIPS, MAP_VERDICTS, PROGRAM_NAME,
};

/// `BPF_NOEXIST`: insert only if the key is absent.
const BPF_NOEXIST: u64 = 1;

/// Where the gate's BPF object comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateObject {
    /// The object embedded at build time (`HALTD_BPF_OBJECT`, set by `cargo xtask build`).
    Embedded,
    /// An object file on disk (`--bpf-object`).
    Path(PathBuf),
}

/// How to load the gate.
#[derive(Debug, Clone)]
pub struct GateConfig {
    pub object: GateObject,
    /// Capacity of `GOVERNED` and `TRIPS`: stream slots are `0..max_streams`.
    pub max_streams: u32,
    /// A heartbeat older than this makes the gate treat every governed stream as tripped.
    pub heartbeat_deadline: Duration,
    /// Frames each stream may still send once the gate saw the heartbeat lost.
    pub budget_frames: u32,
    /// Bytes each stream may still send once the gate saw the heartbeat lost.
    pub budget_bytes: u64,
}

/// Errors of the kernel gate. Every one is an internal (node) fault: a stream that cannot be
/// governed must not be served.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    #[error(
        "this haltd binary has no embedded BPF object (it was built without HALTD_BPF_OBJECT); \
         build it with `cargo xtask build`, or pass --bpf-object PATH"
    )]
    NoEmbeddedObject,
    #[error("loading BPF object {object}")]
    Load {
        object: String,
        #[source]
        source: Box<EbpfError>,
    },
    #[error("BPF object has no program {name}")]
    MissingProgram { name: &'static str },
    #[error("BPF object has no map {name}")]
    MissingMap { name: &'static str },
    #[error("{op} BPF program {name}")]
    Program {
        op: &'static str,
        name: &'static str,
        #[source]
        source: Box<ProgramError>,
    },
    #[error("{op} BPF map {map}")]
    Map {
        op: &'static str,
        map: &'static str,
        #[source]
        source: Box<MapError>,
    },
    #[error("enabling BPF run-time statistics")]
    Stats {
        #[source]
        source: Box<aya::sys::SyscallError>,
    },
    #[error("stream slot {slot} out of range (max_streams {max_streams})")]
    SlotOutOfRange { slot: u32, max_streams: u32 },
    #[error("stream slot {slot} still holds an open governed socket")]
    SlotInUse { slot: u32 },
}

impl GateError {
    fn map(op: &'static str, map: &'static str) -> impl FnOnce(MapError) -> Self {
        move |source| Self::Map {
            op,
            map,
            source: Box::new(source),
        }
    }

    fn program(op: &'static str) -> impl FnOnce(ProgramError) -> Self {
        move |source| Self::Program {
            op,
            name: PROGRAM_NAME,
            source: Box::new(source),
        }
    }
}

/// The loaded and attached gate. Dropping it detaches the program (sk_msg attachments are not
/// links), so the daemon keeps it for its whole life.
pub struct KernelGate {
    governed: Mutex<SockHash<MapData, u32>>,
    sock_state: Mutex<SkStorage<MapData, SockState>>,
    trips: Mutex<Array<MapData, TripEntry>>,
    heartbeat: Mutex<Array<MapData, Heartbeat>>,
    verdicts: PerCpuArray<MapData, u64>,
    halt_events: Mutex<RingBuf<MapData>>,
    max_streams: u32,
    heartbeat_template: Heartbeat,
    /// Holds the attached program; declared last so the maps above close first.
    ebpf: Mutex<Ebpf>,
}

// The daemon shares one gate between its loops and the watchdog.
const _: () = {
    const fn shared<T: Send + Sync>() {}
    shared::<KernelGate>();
};

impl std::fmt::Debug for KernelGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelGate")
            .field("max_streams", &self.max_streams)
            .field("heartbeat", &self.heartbeat_template)
            .finish_non_exhaustive()
    }
}

/// Locks a map. A panic while holding the lock cannot leave a map half-written (every write is
/// one syscall), so a poisoned lock is still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn take<T>(
    ebpf: &mut Ebpf,
    name: &'static str,
    convert: impl FnOnce(aya::maps::Map) -> Result<T, MapError>,
) -> Result<T, GateError> {
    let map = ebpf.take_map(name).ok_or(GateError::MissingMap { name })?;
    convert(map).map_err(GateError::map("opening", name))
}

impl KernelGate {
    /// Loads the object, sizes the per-stream maps, verifies and attaches `halt_gate` to
    /// `GOVERNED`, and writes the heartbeat parameters with no beat yet (so governed streams
    /// are tripped until the first [`KernelGate::beat`]).
    pub fn load(cfg: &GateConfig) -> Result<Self, GateError> {
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries(MAP_GOVERNED, cfg.max_streams)
            .map_max_entries(MAP_TRIPS, cfg.max_streams);
        let (loaded, object) = match &cfg.object {
            GateObject::Embedded => {
                let bytes = embedded_object();
                if bytes.is_empty() {
                    return Err(GateError::NoEmbeddedObject);
                }
                (loader.load(bytes), "(embedded)".to_owned())
            }
            GateObject::Path(path) => (loader.load_file(path), path.display().to_string()),
        };
        let mut ebpf = loaded.map_err(|source| GateError::Load {
            object,
            source: Box::new(source),
        })?;

        // The program must be loaded before any map is taken out of `ebpf`: taking maps first
        // made the program's map references resolve to the wrong map (see the toolchain notes).
        let prog: &mut SkMsg = ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or(GateError::MissingProgram { name: PROGRAM_NAME })?
            .try_into()
            .map_err(GateError::program("finding"))?;
        prog.load().map_err(GateError::program("loading"))?;

        let governed = take(&mut ebpf, MAP_GOVERNED, SockHash::try_from)?;
        let sock_state = take(&mut ebpf, MAP_SOCK_STATE, SkStorage::try_from)?;
        let trips = take(&mut ebpf, MAP_TRIPS, Array::try_from)?;
        let mut heartbeat = take(&mut ebpf, MAP_HEARTBEAT, Array::try_from)?;
        let verdicts = take(&mut ebpf, MAP_VERDICTS, PerCpuArray::try_from)?;
        let halt_events = take(&mut ebpf, MAP_HALT_EVENTS, RingBuf::try_from)?;

        let heartbeat_template = Heartbeat {
            last_ns: 0,
            deadline_ns: u64::try_from(cfg.heartbeat_deadline.as_nanos()).unwrap_or(u64::MAX),
            budget_frames: cfg.budget_frames,
            _pad: 0,
            budget_bytes: cfg.budget_bytes,
        };
        heartbeat
            .set(0, heartbeat_template, 0)
            .map_err(GateError::map("writing", MAP_HEARTBEAT))?;

        let prog: &mut SkMsg = ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or(GateError::MissingProgram { name: PROGRAM_NAME })?
            .try_into()
            .map_err(GateError::program("finding"))?;
        prog.attach(governed.fd())
            .map_err(GateError::program("attaching"))?;

        Ok(Self {
            governed: Mutex::new(governed),
            sock_state: Mutex::new(sock_state),
            trips: Mutex::new(trips),
            heartbeat: Mutex::new(heartbeat),
            verdicts,
            halt_events: Mutex::new(halt_events),
            max_streams: cfg.max_streams,
            heartbeat_template,
            ebpf: Mutex::new(ebpf),
        })
    }

    /// Capacity of the per-stream maps: valid slots are `0..max_streams()`.
    pub fn max_streams(&self) -> u32 {
        self.max_streams
    }

    /// Puts `sock` under the gate as stream `slot`, generation `generation`. Call once per
    /// connection, before its first send.
    ///
    /// Fails with [`GateError::SlotInUse`] while another open socket holds `slot`: replacing it
    /// would silently stop policing that socket. A governed socket is never removed from
    /// `GOVERNED` by userspace; the kernel removes it when the socket closes.
    pub fn govern(
        &self,
        sock: BorrowedFd<'_>,
        slot: u32,
        generation: u32,
    ) -> Result<(), GateError> {
        if slot >= self.max_streams {
            return Err(GateError::SlotOutOfRange {
                slot,
                max_streams: self.max_streams,
            });
        }
        let fd = sock.as_raw_fd();
        // 1. State first: once in GOVERNED, a socket without state has all its sends dropped.
        lock(&self.sock_state)
            .insert(
                &fd,
                SockState {
                    slot,
                    generation,
                    ..SockState::default()
                },
                0,
            )
            .map_err(GateError::map("writing", MAP_SOCK_STATE))?;
        // 2. Then the socket, but never over another open one.
        lock(&self.governed)
            .insert(slot, fd, BPF_NOEXIST)
            .map_err(|e| match e {
                MapError::SyscallError(ref s)
                    if s.io_error.raw_os_error() == Some(libc::EEXIST) =>
                {
                    GateError::SlotInUse { slot }
                }
                e => GateError::map("inserting", MAP_GOVERNED)(e),
            })?;
        // 3. Last the slot's trip entry: only now does the slot belong to this stream. Until this
        // write, the socket sees the previous generation and is treated as tripped (fail closed);
        // the caller does not send in between.
        lock(&self.trips)
            .set(
                slot,
                TripEntry {
                    generation,
                    ..TripEntry::default()
                },
                0,
            )
            .map_err(GateError::map("writing", MAP_TRIPS))
    }

    /// Writes `TRIPS[slot]`: the trip of one stream (see [`TripEntry`] for the absolute frame
    /// limit). Called once per trip.
    ///
    /// An array update is a plain copy that the program may read half-done, so a trip of an
    /// untripped entry is written in two steps: first the new limits, budget and nonce with
    /// `tripped` still 0 (the program ignores them while untripped), then the same with
    /// `tripped` set, which differs from what is there in that one aligned word only. The
    /// program thus never sees `tripped` with the previous entry's limit of 0.
    pub fn trip(&self, slot: u32, entry: TripEntry) -> Result<(), GateError> {
        if slot >= self.max_streams {
            return Err(GateError::SlotOutOfRange {
                slot,
                max_streams: self.max_streams,
            });
        }
        let mut trips = lock(&self.trips);
        if entry.tripped != 0 {
            // Only userspace writes TRIPS, and only under this lock, so `current` stays current.
            let current = trips
                .get(&slot, 0)
                .map_err(GateError::map("reading", MAP_TRIPS))?;
            let already = current.tripped != 0 && current.generation == entry.generation;
            // Never untrip a tripped stream, not even for the length of one write.
            if !already {
                trips
                    .set(
                        slot,
                        TripEntry {
                            tripped: 0,
                            ..entry
                        },
                        0,
                    )
                    .map_err(GateError::map("writing", MAP_TRIPS))?;
            }
        }
        trips
            .set(slot, entry, 0)
            .map_err(GateError::map("writing", MAP_TRIPS))
    }

    /// The watchdog's heartbeat: `now_monotonic_ns` from [`monotonic_ns`].
    pub fn beat(&self, now_monotonic_ns: u64) -> Result<(), GateError> {
        let hb = Heartbeat {
            last_ns: now_monotonic_ns,
            ..self.heartbeat_template
        };
        lock(&self.heartbeat)
            .set(0, hb, 0)
            .map_err(GateError::map("writing", MAP_HEARTBEAT))
    }

    /// Sends by verdict since load, summed over CPUs, indexed by [`verdict`].
    pub fn verdict_totals(&self) -> Result<[u64; verdict::COUNT as usize], GateError> {
        let mut totals = [0u64; verdict::COUNT as usize];
        for (i, total) in (0u32..).zip(totals.iter_mut()) {
            let per_cpu = self
                .verdicts
                .get(&i, 0)
                .map_err(GateError::map("reading", MAP_VERDICTS))?;
            *total = per_cpu.iter().copied().fold(0u64, u64::wrapping_add);
        }
        Ok(totals)
    }

    /// The gate's state of `sock`, or `None` if it was never governed.
    pub fn socket_state(&self, sock: BorrowedFd<'_>) -> Result<Option<SockState>, GateError> {
        match lock(&self.sock_state).get(&sock.as_raw_fd(), 0) {
            Ok(st) => Ok(Some(st)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(GateError::map("reading", MAP_SOCK_STATE)(e)),
        }
    }

    /// The kernel's statistics of the loaded program. `runs` and `run_time` only advance while
    /// BPF run statistics are on (see [`enable_run_stats`]).
    pub fn program_stats(&self) -> Result<GateProgramStats, GateError> {
        let ebpf = lock(&self.ebpf);
        let info = ebpf
            .program(PROGRAM_NAME)
            .ok_or(GateError::MissingProgram { name: PROGRAM_NAME })?
            .info()
            .map_err(GateError::program("querying"))?;
        Ok(GateProgramStats {
            runs: info.run_count(),
            run_time: info.run_time(),
            verified_instructions: info.verified_instruction_count(),
            jited_bytes: info.size_jitted(),
        })
    }

    /// Hands every halt event queued so far to `f`, without blocking; returns how many.
    pub fn drain_halt_events(&self, f: &mut dyn FnMut(HaltEvent)) -> Result<usize, GateError> {
        let mut ring = lock(&self.halt_events);
        let mut n = 0;
        while let Some(item) = ring.next() {
            // The program only ever outputs whole `HaltEvent`s; anything else is skipped.
            if item.len() == size_of::<HaltEvent>() {
                // SAFETY: `item` holds exactly `size_of::<HaltEvent>()` bytes, and `HaltEvent`
                // is plain integers (any bit pattern is valid); read_unaligned needs no
                // alignment.
                let event = unsafe { item.as_ptr().cast::<HaltEvent>().read_unaligned() };
                f(event);
                n += 1;
            }
        }
        Ok(n)
    }
}

/// What the kernel reports about the loaded gate program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateProgramStats {
    /// Program runs (one per send, more for sends over about 544 KiB) while stats were on.
    pub runs: u64,
    /// Total time in the program while stats were on.
    pub run_time: Duration,
    /// Instructions the verifier processed at load; `None` if the kernel does not say.
    pub verified_instructions: Option<u32>,
    /// Size of the JIT-compiled program in bytes.
    pub jited_bytes: u32,
}

/// Turns on the kernel's BPF run-time statistics (for every BPF program on the machine) until
/// the returned fd is closed. They cost two clock reads per program run: for benchmarks and
/// diagnosis, not for normal service.
pub fn enable_run_stats() -> Result<std::os::fd::OwnedFd, GateError> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|source| GateError::Stats {
        source: Box::new(source),
    })
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns`, which the gate compares
/// heartbeats with.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux, so
    // the call cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    // Both fields are non-negative for CLOCK_MONOTONIC.
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// The gate object embedded at build time; empty when the daemon was built without
/// `HALTD_BPF_OBJECT` (see `daemon/build.rs`).
pub fn embedded_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/haltd-gate.bpf.o"))
}
