//! A raw adversarial sender for the kernel gate: not haltd's emitter, but a socket owner that
//! keeps sending after a trip through every send-family call, with short writes and new
//! frames after short writes, and that books exactly which bytes the kernel accepted for which
//! frame, so that the peer's byte count can be attributed to frames written before and after
//! the trip.
//!
//! Used by `tests/tests/it/adversarial.rs` (seeded schedules against the real gate) and by the
//! halt bench.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
};

use io_uring::{opcode, types, IoUring};
use rand::{rngs::StdRng, Rng};

/// The send-family calls the adversary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Method {
    Write,
    Send,
    SendMore,
    SendMsg,
    Writev,
    SendMmsg,
    SendFile,
    Splice,
    UringSend,
    UringWrite,
    UringSendMsg,
    UringSendZc,
}

impl Method {
    pub const ALL: [Method; 12] = [
        Method::Write,
        Method::Send,
        Method::SendMore,
        Method::SendMsg,
        Method::Writev,
        Method::SendMmsg,
        Method::SendFile,
        Method::Splice,
        Method::UringSend,
        Method::UringWrite,
        Method::UringSendMsg,
        Method::UringSendZc,
    ];
}

/// The outcome of one call: bytes the kernel accepted, or the errno.
pub type CallResult = Result<usize, i32>;

/// What the sender needs besides the socket: an io_uring, a memfd for `sendfile`, a pipe for
/// `splice`.
pub struct Sender {
    fd: RawFd,
    ring: IoUring,
    memfd: OwnedFd,
    pipe_r: OwnedFd,
    pipe_w: OwnedFd,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender")
            .field("fd", &self.fd)
            .finish_non_exhaustive()
    }
}

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn ret(n: isize) -> CallResult {
    if n < 0 {
        Err(errno())
    } else {
        Ok(n as usize)
    }
}

impl Sender {
    /// `fd` must stay open for the sender's life.
    pub fn new(fd: RawFd) -> io::Result<Self> {
        let ring = IoUring::new(8)?;
        // SAFETY: memfd_create with a valid C string; the result is a new fd or -1.
        let memfd = unsafe { libc::memfd_create(c"haltd-adversary".as_ptr(), libc::MFD_CLOEXEC) };
        if memfd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut p = [0; 2];
        // SAFETY: pipe2 writes two fds into `p`.
        if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh descriptors owned by nobody else.
        let (memfd, pipe_r, pipe_w) = unsafe {
            (
                OwnedFd::from_raw_fd(memfd),
                OwnedFd::from_raw_fd(p[0]),
                OwnedFd::from_raw_fd(p[1]),
            )
        };
        Ok(Sender {
            fd,
            ring,
            memfd,
            pipe_r,
            pipe_w,
        })
    }

    /// Sends the concatenation of `parts` with `method`; returns the bytes accepted.
    pub fn send(&mut self, method: Method, parts: &[&[u8]]) -> CallResult {
        let whole: Vec<u8> = parts.concat();
        if whole.is_empty() {
            return Ok(0);
        }
        let iov: Vec<libc::iovec> = parts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| libc::iovec {
                iov_base: p.as_ptr().cast_mut().cast(),
                iov_len: p.len(),
            })
            .collect();
        let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
        // SAFETY (all arms): the buffers and iovecs outlive the calls, which read at most the
        // lengths given; `self.fd` is an open socket.
        match method {
            Method::Write => {
                // SAFETY: as above (all arms).
                ret(unsafe { libc::write(self.fd, whole.as_ptr().cast(), whole.len()) })
            }
            Method::Send => {
                // SAFETY: as above (all arms).
                ret(unsafe { libc::send(self.fd, whole.as_ptr().cast(), whole.len(), flags) })
            }
            // SAFETY: as above (all arms).
            Method::SendMore => ret(unsafe {
                libc::send(
                    self.fd,
                    whole.as_ptr().cast(),
                    whole.len(),
                    flags | libc::MSG_MORE,
                )
            }),
            Method::SendMsg => {
                // SAFETY: all zeroes is a valid `msghdr` (integers and null pointers).
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov.as_ptr().cast_mut();
                msg.msg_iovlen = iov.len();
                // SAFETY: as above (all arms).
                ret(unsafe { libc::sendmsg(self.fd, &msg, flags) })
            }
            // SAFETY: as above (all arms).
            Method::Writev => ret(unsafe { libc::writev(self.fd, iov.as_ptr(), iov.len() as i32) }),
            Method::SendMmsg => self.sendmmsg(parts),
            Method::SendFile => self.sendfile(&whole),
            Method::Splice => self.splice(&whole),
            Method::UringSend => self.uring(
                opcode::Send::new(types::Fd(self.fd), whole.as_ptr(), whole.len() as u32)
                    .flags(flags)
                    .build(),
                false,
            ),
            Method::UringWrite => self.uring(
                opcode::Write::new(types::Fd(self.fd), whole.as_ptr(), whole.len() as u32)
                    .offset(u64::MAX)
                    .rw_flags(libc::RWF_NOWAIT)
                    .build(),
                false,
            ),
            Method::UringSendMsg => {
                // SAFETY: all zeroes is a valid `msghdr` (integers and null pointers).
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov.as_ptr().cast_mut();
                msg.msg_iovlen = iov.len();
                self.uring(
                    opcode::SendMsg::new(types::Fd(self.fd), &msg)
                        .flags(flags as u32)
                        .build(),
                    false,
                )
            }
            Method::UringSendZc => self.uring(
                opcode::SendZc::new(types::Fd(self.fd), whole.as_ptr(), whole.len() as u32)
                    .flags(flags)
                    .build(),
                true,
            ),
        }
    }

    /// `sendmmsg` with each part its own message; returns the bytes of the messages sent.
    fn sendmmsg(&mut self, parts: &[&[u8]]) -> CallResult {
        let iov: Vec<libc::iovec> = parts
            .iter()
            .map(|p| libc::iovec {
                iov_base: p.as_ptr().cast_mut().cast(),
                iov_len: p.len(),
            })
            .collect();
        // SAFETY: zeroed mmsghdrs are valid; each points at one live iovec.
        let mut msgs: Vec<libc::mmsghdr> = iov
            .iter()
            .map(|v| {
                // SAFETY: all zeroes is a valid `mmsghdr` (integers and null pointers).
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_iov = std::ptr::from_ref(v).cast_mut();
                m.msg_hdr.msg_iovlen = 1;
                m
            })
            .collect();
        // SAFETY: `msgs` and the buffers outlive the call.
        let n = unsafe {
            libc::sendmmsg(
                self.fd,
                msgs.as_mut_ptr(),
                msgs.len() as u32,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            return Err(errno());
        }
        Ok(msgs[..n as usize].iter().map(|m| m.msg_len as usize).sum())
    }

    fn sendfile(&mut self, whole: &[u8]) -> CallResult {
        let mfd = self.memfd.as_raw_fd();
        // SAFETY: plain file calls on our memfd with a live buffer.
        unsafe {
            if libc::ftruncate(mfd, 0) != 0
                || libc::pwrite(mfd, whole.as_ptr().cast(), whole.len(), 0) != whole.len() as isize
            {
                return Err(errno());
            }
            let mut off: libc::off_t = 0;
            ret(libc::sendfile(self.fd, mfd, &mut off, whole.len()))
        }
    }

    fn splice(&mut self, whole: &[u8]) -> CallResult {
        let (r, w) = (self.pipe_r.as_raw_fd(), self.pipe_w.as_raw_fd());
        // SAFETY: plain pipe and splice calls on our descriptors with a live buffer.
        unsafe {
            let put = libc::write(w, whole.as_ptr().cast(), whole.len());
            if put < 0 {
                return Err(errno());
            }
            let moved = libc::splice(
                r,
                std::ptr::null_mut(),
                self.fd,
                std::ptr::null_mut(),
                put as usize,
                libc::SPLICE_F_NONBLOCK,
            );
            let err = errno();
            // Whatever stayed in the pipe was not sent: drain it so the next call starts clean.
            let mut sink = [0u8; 4096];
            while libc::read(r, sink.as_mut_ptr().cast(), sink.len()) > 0 {}
            if moved < 0 {
                Err(err)
            } else {
                Ok(moved as usize)
            }
        }
    }

    fn uring(&mut self, entry: io_uring::squeue::Entry, zero_copy: bool) -> CallResult {
        // Non-blocking flags make a full socket answer EAGAIN; the linked timeout is a safety
        // net so that a call the kernel parks anyway cannot hang the sender.
        let ts = types::Timespec::new().nsec(20_000_000);
        let timeout = opcode::LinkTimeout::new(&ts).build().user_data(2);
        // SAFETY: the entry's buffers and `ts` outlive the wait below, which covers every
        // completion the entries produce (a zero-copy send's notification included).
        unsafe {
            let mut sq = self.ring.submission();
            if sq
                .push(&entry.flags(io_uring::squeue::Flags::IO_LINK).user_data(1))
                .is_err()
                || sq.push(&timeout).is_err()
            {
                return Err(libc::EBUSY);
            }
        }
        let mut timeout_done = false;
        let mut result = None;
        let mut pending_notif = false;
        loop {
            if let Err(e) = self.ring.submit_and_wait(1) {
                return Err(e.raw_os_error().unwrap_or(libc::EIO));
            }
            for cqe in self.ring.completion() {
                if cqe.user_data() == 2 {
                    timeout_done = true;
                    continue;
                }
                let more = io_uring::cqueue::more(cqe.flags());
                if io_uring::cqueue::notif(cqe.flags()) {
                    pending_notif = false;
                } else {
                    result = Some(cqe.result());
                    pending_notif = zero_copy && more;
                }
            }
            if result.is_some() && !pending_notif && timeout_done {
                break;
            }
        }
        let r = match result.unwrap_or(-libc::EIO) {
            // Cancelled by the linked timeout: the socket stayed full.
            r if r == -libc::ECANCELED => -libc::EAGAIN,
            r => r,
        };
        if r < 0 {
            Err(-r)
        } else {
            Ok(r as usize)
        }
    }
}

/// One frame: an id and its bytes (each byte tells its frame, for debugging a failure).
#[derive(Debug, Clone)]
pub struct Frame {
    pub id: u32,
    pub bytes: Vec<u8>,
    /// Bytes of it the kernel accepted so far.
    pub accepted: usize,
    /// Its first accepted byte came after the trip.
    pub post_trip: bool,
}

impl Frame {
    pub fn new(id: u32, len: usize) -> Self {
        let mut bytes = format!("data: {{\"frame\":{id},\"pad\":\"").into_bytes();
        let fill = b'a' + (id % 26) as u8;
        while bytes.len() + 4 < len {
            bytes.push(fill);
        }
        bytes.extend_from_slice(b"\"}\n\n");
        Frame {
            id,
            bytes,
            accepted: 0,
            post_trip: false,
        }
    }

    pub fn rest(&self) -> &[u8] {
        &self.bytes[self.accepted..]
    }
}

/// A frame size between 64 B and 64 KiB, log-uniform.
pub fn frame_size(rng: &mut StdRng) -> usize {
    let exp: f64 = rng.random_range(6.0..16.0);
    (2f64.powf(exp) as usize).clamp(64, 65_536)
}

/// A contiguous run of accepted bytes of one frame, in stream order.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub frame: u32,
    pub len: usize,
    /// The run's frame was first written after the trip.
    pub post_trip: bool,
    /// The run was accepted after the trip (the rest of a frame in progress at the trip, or a
    /// post-trip frame).
    pub after_trip: bool,
}

/// The stream as the kernel accepted it.
#[derive(Debug, Default)]
pub struct Book {
    pub runs: Vec<Run>,
    pub accepted: u64,
}

impl Book {
    /// Books `n` accepted bytes of the sent `frames` (in order, starting at each one's
    /// `accepted`), marking frames that start now as post-trip when `tripped`.
    pub fn accept(&mut self, frames: &mut [&mut Frame], mut n: usize, tripped: bool) {
        for f in frames.iter_mut() {
            if n == 0 {
                break;
            }
            let take = n.min(f.rest().len());
            if take == 0 {
                continue;
            }
            if f.accepted == 0 {
                f.post_trip = tripped;
            }
            f.accepted += take;
            n -= take;
            self.accepted += take as u64;
            self.runs.push(Run {
                frame: f.id,
                len: take,
                post_trip: f.post_trip,
                after_trip: tripped,
            });
        }
    }

    /// Of the first `received` bytes of the stream: bytes of frames first written after the
    /// trip.
    pub fn post_trip_bytes_within(&self, received: u64) -> u64 {
        let mut off = 0u64;
        let mut post = 0u64;
        for r in &self.runs {
            if off >= received {
                break;
            }
            let take = (r.len as u64).min(received - off);
            if r.post_trip {
                post += take;
            }
            off += r.len as u64;
        }
        post
    }

    /// Bytes of frames first written after the trip that the kernel accepted (whether or not
    /// they reached the peer).
    pub fn post_trip_accepted(&self) -> u64 {
        self.runs
            .iter()
            .filter(|r| r.post_trip)
            .map(|r| r.len as u64)
            .sum()
    }
}
