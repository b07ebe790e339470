//! What one model run explores: the bounds, who sends, how the heartbeat behaves, and which
//! mistake (if any) is injected into the kernel's decisions.

/// Who makes the send calls on the governed socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Emitter {
    /// haltd's emitter as it is meant to run: each send is a new whole frame or the rest of the
    /// frame in progress, it begins no frame once the stream is tripped (it finishes the frame
    /// in progress, then the halter sends the terminal), and it stops after a failed send.
    Honest,
    /// haltd's emitter under the `emitter-ignores-halt` fault: the same send discipline as
    /// [`Emitter::Honest`], but it keeps beginning frames after the trip (and after the
    /// terminal) until a send fails.
    Disciplined,
    /// Any send calls: new frames after short writes, bytes that no frame declared, several
    /// frames' worth in one send, any size up to [`Config::max_send`], never stopping. It never
    /// has the nonce: only the halter writes the terminal frame.
    Adversarial,
}

/// How the watchdog's heartbeat behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Heartbeat {
    /// Always fresh: the watchdog never stalls.
    Live,
    /// It may go stale at any step and then stays stale (watchdog or process stopped for good).
    Sticky,
    /// It may go stale and fresh again at any step, any number of times.
    Flicker,
    /// It may go stale at any step, and comes back only after userspace wrote the trip: what
    /// haltd's watchdog does when it finds its own heartbeat older than the deadline (it trips
    /// every open stream before it beats again).
    RecoverAfterTrip,
}

/// A mistake injected into the model's kernel (or trip write), to show that the checker finds
/// what it is meant to find. Each wraps the real `haltd_common::decide` functions; none edits
/// them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mistake {
    /// No egress check: every segment passes (the fix for the backpressure bypass removed).
    NoEgressCheck,
    /// The terminal allowance without the nonce: any send of the terminal's exact length is
    /// taken for the terminal (the send check is told every message carries the nonce).
    TerminalWithoutNonce,
    /// The frame limit off by one: the send check sees `pre_trip_frames + 1`, so one frame
    /// after the trip passes as pre-trip.
    PreTripOffByOne,
    /// The heartbeat latches not sticky: both checks forget what they latched as soon as they
    /// run with the heartbeat fresh again.
    LatchNotSticky,
    /// The trip write's egress ceiling counts only the bytes the kernel accepted, not the whole
    /// frame in progress.
    CeilingWithoutFrameInProgress,
    /// The two checks do not share their latches: each one latches only on a lost heartbeat it
    /// sees itself (the gate as first written, before the model found the gap).
    UnsharedLatches,
}

/// One configuration of the model. Sizes are in abstract units (one unit stands for any
/// number of bytes); the kernel sees them as byte counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// B: post-trip token frames the stream may send.
    pub budget: u8,
    /// E: the largest token frame; token frames have sizes `1..=E`.
    pub max_event: u8,
    /// T: the terminal frame's exact length.
    pub terminal_len: u8,
    /// Largest send an adversarial emitter makes.
    pub max_send: u8,
    /// Send-buffer capacity: unacknowledged bytes the socket holds (accepted, not yet delivered).
    pub sndbuf: u8,
    /// Largest segment TCP sends.
    pub mss: u8,
    /// Bound on the stream: bytes the kernel accepts in all (at most 16).
    pub max_stream: u8,
    /// Bound on the token frames userspace begins.
    pub max_frames: u8,
    /// Whether the network may lose a segment that passed the egress check (TCP retransmits).
    pub net_loss: bool,
    /// Whether TCP may count a dropped new segment as sent (`snd_nxt` moves on, the bytes are
    /// retransmitted later): what happens when the drop is reported as congestion
    /// (`NET_XMIT_CN`) rather than as an error, after which TCP retransmits on its timer.
    pub drop_advances: bool,
    pub emitter: Emitter,
    pub heartbeat: Heartbeat,
    pub mistake: Option<Mistake>,
    /// Client TLS (`--tls-cert`): every frame is one record, sealed with the next sequence
    /// number when userspace counts it; the trip write seals the terminal record first and
    /// keys the allowance by its ciphertext prefix ([`crate::kernel::record_prefix`]), which a
    /// record of any other sequence number does not carry.
    pub tls: bool,
}

impl Config {
    /// The configuration for haltd's own emitters ([`Emitter::Honest`],
    /// [`Emitter::Disciplined`]): B as given, token frames of 1 or 2 units (E = 2), a terminal
    /// of 3, a send buffer of 3, segments of at most 2, at most `B + 2` frames and a stream of
    /// at most `2E + B × E + T + 1` units (room for a pre-trip frame, the frame in progress,
    /// the allowance and one unit more).
    pub fn small(budget: u8, emitter: Emitter, heartbeat: Heartbeat) -> Config {
        let (max_event, terminal_len) = (2, 3);
        Config {
            budget,
            max_event,
            terminal_len,
            max_send: 3,
            sndbuf: 3,
            mss: 2,
            max_stream: 2 * max_event + budget * max_event + terminal_len + 1,
            max_frames: budget + 2,
            net_loss: false,
            drop_advances: true,
            emitter,
            heartbeat,
            mistake: None,
            tls: false,
        }
    }

    /// The configuration for the [`Emitter::Adversarial`] emitter, whose choices multiply the
    /// states: token frames of 1 unit (E = 1), sends of 1 or 2 (so a send can be larger than
    /// E, and can be short), a terminal of 2, a send buffer of 2, at most `B + 1` frames and a
    /// stream of at most `E + B × E + T + 1` units.
    pub fn adversarial(budget: u8, heartbeat: Heartbeat) -> Config {
        let (max_event, terminal_len) = (1, 2);
        Config {
            max_event,
            terminal_len,
            max_send: 2,
            sndbuf: 2,
            max_stream: max_event + budget * max_event + terminal_len + 1,
            max_frames: budget + 1,
            ..Config::small(budget, Emitter::Adversarial, heartbeat)
        }
    }

    /// [`Config::adversarial`] with token frames of up to 2 units and sends of up to 3 (a
    /// post-trip token frame can be short-written too), a terminal of 2: about 15 times the
    /// states.
    pub fn adversarial_wide(budget: u8, heartbeat: Heartbeat) -> Config {
        let (max_event, terminal_len) = (2, 2);
        Config {
            max_event,
            terminal_len,
            max_send: 3,
            max_stream: max_event + budget * max_event + terminal_len + 1,
            ..Config::adversarial(budget, heartbeat)
        }
    }

    /// The same configuration over client TLS (frames are records, the allowance keyed by the
    /// terminal record's ciphertext prefix).
    pub fn over_tls(self) -> Config {
        Config { tls: true, ..self }
    }

    /// The same configuration with a mistake injected.
    pub fn with_mistake(self, mistake: Mistake) -> Config {
        Config {
            mistake: Some(mistake),
            ..self
        }
    }

    /// Token frame sizes an emitter may begin.
    pub fn frame_sizes(&self) -> std::ops::RangeInclusive<u8> {
        1..=self.max_event
    }

    /// Sizes of an adversarial emitter's sends.
    pub fn send_sizes(&self) -> std::ops::RangeInclusive<u8> {
        1..=self.max_send
    }

    /// `B × E`: the post-trip token bytes the stream may send.
    pub fn token_allowance(&self) -> u8 {
        self.budget * self.max_event
    }

    pub(crate) fn has(&self, mistake: Mistake) -> bool {
        self.mistake == Some(mistake)
    }
}
