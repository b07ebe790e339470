//! The kernel gate: loads the halt-gate BPF programs (`ebpf/haltd-ebpf`) and drives their maps.
//!
//! Every accepted client socket is *governed* before its first send. A connection accepted on
//! a governed port (the client listener, see [`KernelGate::govern_port`]) is put into
//! `GOVERNED` by `halt_adopt` the moment it is established; any other socket is inserted by
//! [`KernelGate::govern`] itself (it must still be established then). Either way
//! [`KernelGate::govern`] then writes the socket's first [`SockPolicy`], and from then on
//! every send runs `halt_gate` and every segment `halt_egress`: once the stream is tripped
//! (through [`KernelGate::set_policy`], or by the programs themselves when [`KernelGate::beat`]
//! stops), at most the stream's budget of token frames leaves, then one terminal frame
//! carrying the trip's nonce, and no byte beyond the stream's post-trip ceiling — whatever
//! userspace does with the socket afterwards. What exactly is bounded, and under which
//! assumptions: docs/architecture.md.
//!
//! Map semantics and the one-writer-per-field rule: `haltd_common`.
//!
//! # Threads
//!
//! [`KernelGate`] is `Send + Sync`; each map sits behind its own mutex. Locks are taken per
//! connection ([`KernelGate::govern`]), per turn and per trip ([`KernelGate::set_policy`]),
//! per heartbeat and per metrics scrape, never per token: the per-send and per-segment work is
//! the kernel's.
use std::{
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use aya::{
    maps::{Array, HashMap, MapData, MapError, PerCpuArray, RingBuf, SkStorage, SockHash},
    programs::{CgroupSkb, FlowDissector, ProgramError, SkMsg, SockOps, TestRun, TestRunOptions},
    Ebpf, EbpfError, EbpfLoader,
};
use haltd_common::{
    verdict, EgressState, HaltEvent, Heartbeat, SockPolicy, SockState, MAP_EGRESS_STATE,
    MAP_GOVERNED, MAP_GOVERNED_PORTS, MAP_HALT_EVENTS, MAP_HEARTBEAT, MAP_SOCK_POLICY,
    MAP_SOCK_STATE, MAP_VERDICTS, PROGRAM_ADOPT, PROGRAM_CLOCK, PROGRAM_EGRESS, PROGRAM_GATE,
    PROGRAM_STAMP,
};

mod cgroup;
pub use cgroup::{Owner as LeafOwner, RemovedLeaf};
pub mod held;
pub mod metrics;
pub mod selftest;

/// `BPF_NOEXIST`: insert only if the key is absent.
const BPF_NOEXIST: u64 = 1;
/// `SO_COOKIE`: the socket's 64-bit cookie, the key of `GOVERNED`.
const SO_COOKIE: libc::c_int = 57;
/// `BPF_CGROUP_INET_EGRESS` and `BPF_CGROUP_SOCK_OPS`.
const ATTACH_INET_EGRESS: u32 = 1;
const ATTACH_SOCK_OPS: u32 = 3;

/// Where the gate's BPF object comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateObject {
    /// The object embedded at build time by `daemon/build.rs` (or `HALTD_BPF_OBJECT`).
    Embedded,
    /// An object file on disk (`--bpf-object`).
    Path(PathBuf),
}

/// How to load the gate.
#[derive(Debug, Clone)]
pub struct GateConfig {
    pub object: GateObject,
    /// Capacity of `GOVERNED`: governed sockets open at once (connections still waiting to be
    /// accepted count, since `halt_adopt` governs them at establishment).
    pub max_sockets: u32,
    /// A heartbeat older than this makes the gate treat every governed stream as tripped.
    pub heartbeat_deadline: Duration,
}

/// Errors of the kernel gate. Every one is an internal (node) fault: a stream that cannot be
/// governed must not be served.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    #[error(
        "this haltd binary's embedded BPF object is empty; rebuild it (`cargo build -p haltd` \
         builds and embeds the gate), or pass --bpf-object PATH"
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
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("enabling BPF run-time statistics")]
    Stats {
        #[source]
        source: Box<aya::sys::SyscallError>,
    },
    #[error("the socket cannot be governed: {0}")]
    Ungovernable(&'static str),
    #[error("the gate's start-up self-test failed: {0}")]
    SelfTest(#[source] Box<SelfTestError>),
}

/// Why the start-up self-test ([`selftest::run`]) failed.
#[derive(Debug, thiserror::Error)]
pub enum SelfTestError {
    #[error("{step}: {source}")]
    Io {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{step}: {source}")]
    Gate {
        step: &'static str,
        #[source]
        source: GateError,
    },
    #[error("{0}")]
    NotEnforced(String),
}

impl GateError {
    fn map(op: &'static str, map: &'static str) -> impl FnOnce(MapError) -> Self {
        move |source| Self::Map {
            op,
            map,
            source: Box::new(source),
        }
    }

    fn program(op: &'static str, name: &'static str) -> impl FnOnce(ProgramError) -> Self {
        move |source| Self::Program {
            op,
            name,
            source: Box::new(source),
        }
    }

    fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Io { op, source }
    }
}

/// How a socket came under the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Governed {
    /// `halt_adopt` put it into `GOVERNED` when the connection was established.
    Adopted,
    /// [`KernelGate::govern`] inserted it.
    Inserted,
}

/// What the gate holds about one socket, for records and diagnostics.
#[derive(Clone, Copy, Debug, Default)]
pub struct SocketView {
    pub state: Option<SockState>,
    pub policy: Option<SockPolicy>,
    pub egress: Option<EgressState>,
}

/// The kernel's clock and heartbeat, as the gate's programs see them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelClock {
    /// `bpf_ktime_get_ns` now.
    pub now_ns: u64,
    /// The last heartbeat, in the same clock; 0 = none yet.
    pub heartbeat_ns: u64,
    pub deadline_ns: u64,
}

impl KernelClock {
    /// Age of the heartbeat the gate sees; `None` before the first.
    pub fn heartbeat_age(&self) -> Option<Duration> {
        (self.heartbeat_ns != 0)
            .then(|| Duration::from_nanos(self.now_ns.saturating_sub(self.heartbeat_ns)))
    }

    /// Whether the gate treats the heartbeat as lost (the programs' own rule).
    pub fn heartbeat_lost(&self) -> bool {
        let hb = Heartbeat {
            last_ns: self.heartbeat_ns,
            deadline_ns: self.deadline_ns,
            read_ns: 0,
        };
        haltd_common::decide::heartbeat_lost(Some(&hb), self.now_ns)
    }
}

/// The loaded and attached gate. Dropping it detaches `halt_gate` from `GOVERNED` only once
/// the map itself goes, which the attached cgroup programs prevent: the gate keeps policing
/// the sockets it governs after the daemon exits (see `cgroup`).
pub struct KernelGate {
    governed: Mutex<SockHash<MapData, u64>>,
    ports: Mutex<HashMap<MapData, u32, u32>>,
    sock_state: Mutex<SkStorage<MapData, SockState>>,
    sock_policy: Mutex<SkStorage<MapData, SockPolicy>>,
    egress_state: Mutex<SkStorage<MapData, EgressState>>,
    heartbeat: Mutex<Array<MapData, Heartbeat>>,
    verdicts: PerCpuArray<MapData, u64>,
    halt_events: Mutex<RingBuf<MapData>>,
    max_sockets: u32,
    deadline_ns: u64,
    cgroup: cgroup::Leaf,
    /// Holds the programs; declared last so the maps above close first.
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
            .field("max_sockets", &self.max_sockets)
            .field("deadline_ns", &self.deadline_ns)
            .field("cgroup", &self.cgroup.path)
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

fn program<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, GateError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(GateError::MissingProgram { name })?
        .try_into()
        .map_err(GateError::program("finding", name))
}

fn load_object(cfg: &GateConfig) -> Result<Ebpf, GateError> {
    let mut loader = EbpfLoader::new();
    loader.map_max_entries(MAP_GOVERNED, cfg.max_sockets);
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
    loaded.map_err(|source| GateError::Load {
        object,
        source: Box::new(source),
    })
}

impl KernelGate {
    /// Loads the object and verifies every program, sizes `GOVERNED`, writes the heartbeat
    /// deadline with no beat yet (so governed streams are tripped until the first
    /// [`KernelGate::beat`]), attaches `halt_gate` to `GOVERNED`, moves this process into a
    /// cgroup leaf of its own and attaches `halt_egress` and `halt_adopt` there.
    ///
    /// Call it before opening the sockets to govern: a socket belongs to the cgroup of the
    /// process that created it (an accepted one, to its listener's).
    pub fn load(cfg: &GateConfig) -> Result<Self, GateError> {
        let mut ebpf = load_object(cfg)?;
        // Programs are loaded before any map is taken out of `ebpf`: taking maps first made
        // the programs' map references resolve to the wrong map (see the toolchain notes).
        program::<SkMsg>(&mut ebpf, PROGRAM_GATE)?
            .load()
            .map_err(GateError::program("loading", PROGRAM_GATE))?;
        program::<CgroupSkb>(&mut ebpf, PROGRAM_EGRESS)?
            .load()
            .map_err(GateError::program("loading", PROGRAM_EGRESS))?;
        program::<SockOps>(&mut ebpf, PROGRAM_ADOPT)?
            .load()
            .map_err(GateError::program("loading", PROGRAM_ADOPT))?;
        for name in [PROGRAM_STAMP, PROGRAM_CLOCK] {
            program::<FlowDissector>(&mut ebpf, name)?
                .load()
                .map_err(GateError::program("loading", name))?;
        }

        let governed = take(&mut ebpf, MAP_GOVERNED, SockHash::try_from)?;
        let ports = take(&mut ebpf, MAP_GOVERNED_PORTS, HashMap::try_from)?;
        let sock_state = take(&mut ebpf, MAP_SOCK_STATE, SkStorage::try_from)?;
        let sock_policy = take(&mut ebpf, MAP_SOCK_POLICY, SkStorage::try_from)?;
        let egress_state = take(&mut ebpf, MAP_EGRESS_STATE, SkStorage::try_from)?;
        let mut heartbeat = take(&mut ebpf, MAP_HEARTBEAT, Array::try_from)?;
        let verdicts = take(&mut ebpf, MAP_VERDICTS, PerCpuArray::try_from)?;
        let halt_events = take(&mut ebpf, MAP_HALT_EVENTS, RingBuf::try_from)?;

        let deadline_ns = u64::try_from(cfg.heartbeat_deadline.as_nanos()).unwrap_or(u64::MAX);
        heartbeat
            .set(
                0,
                Heartbeat {
                    last_ns: 0,
                    deadline_ns,
                    read_ns: 0,
                },
                0,
            )
            .map_err(GateError::map("writing", MAP_HEARTBEAT))?;

        program::<SkMsg>(&mut ebpf, PROGRAM_GATE)?
            .attach(governed.fd())
            .map_err(GateError::program("attaching", PROGRAM_GATE))?;

        let leaf =
            cgroup::make_leaf().map_err(GateError::io("placing haltd in a cgroup v2 leaf"))?;
        for (name, attach_type) in [
            (PROGRAM_EGRESS, ATTACH_INET_EGRESS),
            (PROGRAM_ADOPT, ATTACH_SOCK_OPS),
        ] {
            let prog = ebpf
                .program(name)
                .ok_or(GateError::MissingProgram { name })?;
            let fd = prog
                .fd()
                .map_err(GateError::program("attaching", name))?
                .as_fd()
                .as_raw_fd();
            // SAFETY: the program fd stays open for this call (`ebpf` holds it).
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            cgroup::prog_attach(leaf.fd.as_fd(), fd, attach_type)
                .map_err(GateError::io("attaching a gate program to haltd's cgroup"))?;
        }

        Ok(Self {
            governed: Mutex::new(governed),
            ports: Mutex::new(ports),
            sock_state: Mutex::new(sock_state),
            sock_policy: Mutex::new(sock_policy),
            egress_state: Mutex::new(egress_state),
            heartbeat: Mutex::new(heartbeat),
            verdicts,
            halt_events: Mutex::new(halt_events),
            max_sockets: cfg.max_sockets,
            deadline_ns,
            cgroup: leaf,
            ebpf: Mutex::new(ebpf),
        })
    }

    /// Capacity of `GOVERNED`.
    pub fn max_sockets(&self) -> u32 {
        self.max_sockets
    }

    /// The cgroup the egress and adoption programs are attached to.
    pub fn cgroup(&self) -> &Path {
        &self.cgroup.path
    }

    /// The leftover cgroup leaves of earlier haltd processes this load removed.
    pub fn removed_leaves(&self) -> &[RemovedLeaf] {
        &self.cgroup.removed
    }

    /// A clean stop's last step: moves haltd back to the cgroup it was started in and removes
    /// its leaf (`gate/cgroup.rs`, `Leaf::leave`). The programs keep policing the sockets
    /// still charged to the leaf; sockets made afterwards are not governed.
    pub fn leave_cgroup(&self) -> Result<(), GateError> {
        self.cgroup
            .leave()
            .map_err(GateError::io("removing haltd's cgroup leaf"))
    }

    /// Makes `halt_adopt` govern every connection accepted on local port `port` from now on.
    pub fn govern_port(&self, port: u16) -> Result<(), GateError> {
        lock(&self.ports)
            .insert(u32::from(port), 1, 0)
            .map_err(GateError::map("writing", MAP_GOVERNED_PORTS))
    }

    /// Stops adopting connections on `port` (the self-test's port, once it is done).
    pub fn ungovern_port(&self, port: u16) -> Result<(), GateError> {
        match lock(&self.ports).remove(&u32::from(port)) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(GateError::map("removing from", MAP_GOVERNED_PORTS)(e)),
        }
    }

    /// Puts `sock` under the gate with its first `policy`. Call once per connection, before
    /// its first send.
    ///
    /// A connection `halt_adopt` governed at establishment only gets its policy. Any other
    /// socket gets its state, then goes into `GOVERNED`, which the kernel accepts only for an
    /// established socket. A socket that already sent through the gate is refused.
    pub fn govern(&self, sock: BorrowedFd<'_>, policy: &SockPolicy) -> Result<Governed, GateError> {
        let fd = sock.as_raw_fd();
        // Read, then release the lock: the arms below take it again.
        let existing = lock(&self.sock_state).get(&fd, 0);
        let how = match existing {
            Ok(st) if st.frames != 0 => {
                return Err(GateError::Ungovernable(
                    "the socket sent before it was governed",
                ))
            }
            Ok(st) if st.adopted != 0 => Governed::Adopted,
            Ok(_) => self.insert(sock)?,
            Err(MapError::KeyNotFound) => {
                // State first: once in GOVERNED, a socket without state has its sends dropped.
                lock(&self.sock_state)
                    .insert(&fd, SockState::default(), 0)
                    .map_err(GateError::map("writing", MAP_SOCK_STATE))?;
                match self.insert(sock) {
                    Ok(how) => how,
                    Err(e) => {
                        // Not governed after all: take the state back, so the egress check
                        // does not treat the socket as a governed one without a policy.
                        let _ = lock(&self.sock_state).remove(&fd);
                        return Err(e);
                    }
                }
            }
            Err(e) => return Err(GateError::map("reading", MAP_SOCK_STATE)(e)),
        };
        self.set_policy(sock, policy)?;
        Ok(how)
    }

    fn insert(&self, sock: BorrowedFd<'_>) -> Result<Governed, GateError> {
        let cookie = socket_cookie(sock).map_err(GateError::io("reading SO_COOKIE"))?;
        match lock(&self.governed).insert(cookie, sock.as_raw_fd(), BPF_NOEXIST) {
            Ok(()) => Ok(Governed::Inserted),
            Err(MapError::SyscallError(ref s)) => match s.io_error.raw_os_error() {
                Some(libc::EOPNOTSUPP) => Err(GateError::Ungovernable(
                    "the connection is no longer established (the client half-closed or \
                     closed it before it was governed)",
                )),
                Some(libc::E2BIG | libc::ENOSPC | libc::ENOMEM) => {
                    Err(GateError::Ungovernable("the gate's socket map is full"))
                }
                Some(libc::EEXIST) => Err(GateError::Ungovernable(
                    "the socket is in the gate's map without gate state",
                )),
                _ => Err(GateError::Io {
                    op: "inserting a socket into GOVERNED",
                    source: std::io::Error::from_raw_os_error(
                        s.io_error.raw_os_error().unwrap_or(libc::EIO),
                    ),
                }),
            },
            Err(e) => Err(GateError::map("inserting into", MAP_GOVERNED)(e)),
        }
    }

    /// Replaces the socket's policy (at turn start, and at the trip). The kernel links the
    /// new value in whole, so the programs see the old policy or the new one, never a mix.
    pub fn set_policy(&self, sock: BorrowedFd<'_>, policy: &SockPolicy) -> Result<(), GateError> {
        lock(&self.sock_policy)
            .insert(&sock.as_raw_fd(), *policy, 0)
            .map_err(GateError::map("writing", MAP_SOCK_POLICY))
    }

    /// The socket's policy as the gate holds it.
    pub fn policy(&self, sock: BorrowedFd<'_>) -> Result<Option<SockPolicy>, GateError> {
        match lock(&self.sock_policy).get(&sock.as_raw_fd(), 0) {
            Ok(p) => Ok(Some(p)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(GateError::map("reading", MAP_SOCK_POLICY)(e)),
        }
    }

    /// The watchdog's heartbeat: `heartbeat_stamp` writes the kernel's own clock into
    /// `HEARTBEAT`, the clock the checks compare it with, whatever time namespace haltd is in.
    pub fn beat(&self) -> Result<(), GateError> {
        self.run(PROGRAM_STAMP)
    }

    /// The kernel's clock and the heartbeat as the gate sees them (`clock_read`, then a read
    /// of `HEARTBEAT`): what `/healthz` reports.
    pub fn clock(&self) -> Result<KernelClock, GateError> {
        self.run(PROGRAM_CLOCK)?;
        let hb = lock(&self.heartbeat)
            .get(&0, 0)
            .map_err(GateError::map("reading", MAP_HEARTBEAT))?;
        Ok(KernelClock {
            now_ns: hb.read_ns,
            heartbeat_ns: hb.last_ns,
            deadline_ns: hb.deadline_ns,
        })
    }

    fn run(&self, name: &'static str) -> Result<(), GateError> {
        // A flow dissector's test run wants at least an Ethernet header of input.
        let packet = [0u8; 64];
        let ebpf = lock(&self.ebpf);
        let prog: &FlowDissector = ebpf
            .program(name)
            .ok_or(GateError::MissingProgram { name })?
            .try_into()
            .map_err(GateError::program("finding", name))?;
        prog.test_run(TestRunOptions {
            data_in: Some(&packet),
            ..TestRunOptions::default()
        })
        .map_err(GateError::program("running", name))?;
        Ok(())
    }

    /// Counters by outcome since load, summed over CPUs, indexed by [`verdict`].
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

    /// What the gate holds about `sock` (all `None` if it was never governed).
    pub fn socket(&self, sock: BorrowedFd<'_>) -> Result<SocketView, GateError> {
        let fd = sock.as_raw_fd();
        Ok(SocketView {
            state: optional(lock(&self.sock_state).get(&fd, 0), MAP_SOCK_STATE)?,
            policy: optional(lock(&self.sock_policy).get(&fd, 0), MAP_SOCK_POLICY)?,
            egress: optional(lock(&self.egress_state).get(&fd, 0), MAP_EGRESS_STATE)?,
        })
    }

    /// The kernel's statistics of the send check (`halt_gate`). `runs` and `run_time` only
    /// advance while BPF run statistics are on (see [`enable_run_stats`]).
    pub fn program_stats(&self) -> Result<GateProgramStats, GateError> {
        let ebpf = lock(&self.ebpf);
        let info = ebpf
            .program(PROGRAM_GATE)
            .ok_or(GateError::MissingProgram { name: PROGRAM_GATE })?
            .info()
            .map_err(GateError::program("querying", PROGRAM_GATE))?;
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
            // The programs only ever output whole `HaltEvent`s; anything else is skipped.
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

fn optional<T>(r: Result<T, MapError>, map: &'static str) -> Result<Option<T>, GateError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(e) => Err(GateError::map("reading", map)(e)),
    }
}

/// The socket's cookie (`SO_COOKIE`), unique for the kernel's lifetime.
pub fn socket_cookie(sock: BorrowedFd<'_>) -> std::io::Result<u64> {
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`, a live u64.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// What the kernel reports about the send check's program.
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

/// The gate object embedded at build time; empty when the daemon was built without
/// `HALTD_BPF_OBJECT` (see `daemon/build.rs`).
pub fn embedded_object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/haltd-gate.bpf.o"))
}
