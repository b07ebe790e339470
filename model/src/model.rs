//! The `stateright` model: actions, transitions and properties.

use stateright::{Model, Property};

use crate::config::{Config, Emitter, Heartbeat};
use crate::kernel::{self, Segment};
use crate::state::{Eval, State, TripMark};

/// One step of one actor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Emitter: userspace counts a new token frame of this size (`begin_frame`), before its
    /// first send.
    Begin(u8),
    /// Emitter: a send call of `size` bytes of which the kernel accepts `accept` if it passes
    /// (0 when the socket's kept verdict is a drop: the send fails without the program).
    Send { size: u8, accept: u8 },
    /// Halter: the first send of the terminal frame (all `T` bytes, with the nonce).
    Terminal { accept: u8 },
    /// Userspace writes the trip into the socket's policy.
    Trip,
    /// Watchdog: the heartbeat goes stale.
    HeartbeatStale,
    /// Watchdog: the heartbeat is fresh again.
    HeartbeatFresh,
    /// TCP: a payload segment (see [`kernel::segment`] for `alt`).
    Transmit { kind: Segment, len: u8, alt: bool },
}

/// The halt gate model for one configuration.
#[derive(Clone, Copy, Debug)]
pub struct GateModel {
    pub cfg: Config,
}

/// Property names, for the tests.
pub mod prop {
    pub const P1: &str = "P1 post-trip frames passed by the send check <= B";
    pub const P2: &str = "P2 bytes beyond the trip point that left <= allowance";
    pub const P2_USER: &str = "P2u bytes beyond userspace's trip write that left <= allowance";
    pub const P3: &str = "P3 frames begun after the trip point delivered whole <= B";
    pub const P3_USER: &str = "P3u frames begun after userspace's trip write delivered <= B";
    pub const NO_DROP_UNTRIPPED: &str = "L1 nothing dropped before any trip point";
    pub const HONEST_NO_DROP: &str = "L2 honest emitter: nothing dropped while the heartbeat lives";
    pub const TERMINAL_DELIVERED: &str = "S1 the terminal can reach the peer";
    pub const POST_TRIP_FRAME_DELIVERED: &str = "S2 a post-trip frame can reach the peer";
    pub const ALL_DELIVERED: &str = "S3 every frame can reach the peer untripped";
    /// Trivially true without TLS.
    pub const TLS_IN_ORDER: &str =
        "P4 honest emitter over TLS: records leave in sealing order, the terminal included";
}

impl GateModel {
    pub fn new(cfg: Config) -> GateModel {
        assert!(cfg.max_stream <= 16, "the peer's byte mask has 16 bits");
        assert!(cfg.max_send >= 1 && cfg.max_event >= 1 && cfg.terminal_len >= 1);
        GateModel { cfg }
    }

    fn disciplined(&self) -> bool {
        self.cfg.emitter != Emitter::Adversarial
    }

    /// Bytes the kernel may accept now: send-buffer space, within the stream bound.
    fn room(&self, s: &State) -> u8 {
        let space = self.cfg.sndbuf.saturating_sub(s.unacked());
        space.min(self.cfg.max_stream - s.accepted)
    }

    /// The send of `size` bytes, one action per number of bytes the kernel may accept.
    fn push_sends(&self, s: &State, size: u8, out: &mut Vec<Action>, terminal: bool) {
        let act = |accept| {
            if terminal {
                Action::Terminal { accept }
            } else {
                Action::Send { size, accept }
            }
        };
        if s.eval == Eval::Drop {
            out.push(act(0));
            return;
        }
        // No room: the sender blocks before the program runs (`sk_stream_wait_memory`).
        for accept in 1..=size.min(self.room(s)) {
            out.push(act(accept));
        }
    }

    fn emitter_actions(&self, s: &State, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        let stopped = self.disciplined() && s.send_failed;
        let may_begin = match cfg.emitter {
            Emitter::Honest => !s.user_tripped,
            Emitter::Disciplined | Emitter::Adversarial => true,
        };
        if !stopped && may_begin && s.pending == 0 && s.frames_counted < cfg.max_frames {
            for size in cfg.frame_sizes() {
                out.push(Action::Begin(size));
            }
        }
        if self.disciplined() {
            if !stopped && s.pending > 0 {
                self.push_sends(s, s.pending, out, false);
            }
        } else {
            for size in cfg.send_sizes() {
                self.push_sends(s, size, out, false);
            }
        }
        let halter_may = if self.disciplined() {
            !stopped && s.pending == 0
        } else {
            true
        };
        if s.user_tripped && !s.terminal_started && halter_may {
            self.push_sends(s, cfg.terminal_len, out, true);
        }
    }

    /// A send by the emitter, or (`terminal`) the halter's first send of the terminal frame,
    /// and what userspace learns from its result.
    fn emitter_step(&self, s: &mut State, size: u8, accept: u8, terminal: bool) {
        let result = kernel::send(&self.cfg, s, size, terminal, accept);
        if terminal {
            s.terminal_started = true;
            if !self.disciplined() {
                // The halter's send between an adversary's: no frame of the emitter's.
                return;
            }
            // The terminal is the frame in progress now (the halter waited for a frame
            // boundary).
            s.cur_terminal = true;
            s.cur_post_trip = false;
            s.cur_post_user_trip = false;
            s.pending = size;
        }
        let Some(k) = result else {
            s.send_failed = true;
            return;
        };
        if s.pending == 0 {
            // Bytes no frame declared (adversarial emitter only).
            return;
        }
        s.pending = s.pending.saturating_sub(k);
        if s.pending > 0 {
            return;
        }
        let end_bit = 1 << (s.accepted - 1);
        if self.cfg.tls {
            let seq = if s.cur_terminal {
                s.terminal_seq
            } else {
                s.cur_seq
            };
            if seq < s.last_seq_sent {
                s.out_of_order = true;
            }
            s.last_seq_sent = s.last_seq_sent.max(seq);
        }
        if s.cur_terminal {
            s.terminal_end = s.accepted;
        } else if self.disciplined() {
            if s.cur_post_trip {
                s.post_trip_frame_ends |= end_bit;
            }
            if s.cur_post_user_trip {
                s.post_user_trip_frame_ends |= end_bit;
            }
        }
        s.cur_terminal = false;
        s.cur_post_trip = false;
        s.cur_post_user_trip = false;
    }
}

impl Model for GateModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            frames_counted: 0,
            bytes_counted: 0,
            pending: 0,
            cur_terminal: false,
            cur_post_trip: false,
            cur_post_user_trip: false,
            send_failed: false,
            terminal_started: false,
            user_tripped: false,
            hb_fresh: true,
            eval: Eval::None,
            sock: haltd_common::SockState {
                adopted: 1,
                ..Default::default()
            },
            policy: kernel::turn_start_policy(&self.cfg),
            egress: Default::default(),
            accepted: 0,
            snd_nxt: 0,
            rcv: 0,
            trip: None,
            user_trip: None,
            hb_seen: false,
            post_trip_passes: 0,
            left: 0,
            post_trip_frame_ends: 0,
            post_user_trip_frame_ends: 0,
            terminal_end: 0,
            drop_before_trip: false,
            honest_drop: false,
            sealed: 0,
            cur_seq: 0,
            terminal_seq: 0,
            last_seq_sent: 0,
            out_of_order: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        self.emitter_actions(s, out);
        if !s.user_tripped {
            out.push(Action::Trip);
        }
        match cfg.heartbeat {
            Heartbeat::Live => {}
            Heartbeat::Sticky | Heartbeat::Flicker | Heartbeat::RecoverAfterTrip if s.hb_fresh => {
                out.push(Action::HeartbeatStale);
            }
            Heartbeat::Flicker => out.push(Action::HeartbeatFresh),
            Heartbeat::RecoverAfterTrip if s.user_tripped => out.push(Action::HeartbeatFresh),
            Heartbeat::Sticky | Heartbeat::RecoverAfterTrip => {}
        }
        let unsent = s.accepted - s.snd_nxt;
        for len in 1..=unsent.min(cfg.mss) {
            out.push(Action::Transmit {
                kind: Segment::New,
                len,
                alt: false,
            });
            if cfg.net_loss || cfg.drop_advances {
                out.push(Action::Transmit {
                    kind: Segment::New,
                    len,
                    alt: true,
                });
            }
        }
        let in_flight = s.snd_nxt - s.delivered();
        for len in 1..=in_flight.min(cfg.mss) {
            out.push(Action::Transmit {
                kind: Segment::Retransmit,
                len,
                alt: false,
            });
            if cfg.net_loss {
                out.push(Action::Transmit {
                    kind: Segment::Retransmit,
                    len,
                    alt: true,
                });
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let cfg = &self.cfg;
        let mut s = last.clone();
        match action {
            Action::Begin(size) => {
                if cfg.tls {
                    // Counted and sealed in one hold of the session's lock.
                    s.sealed += 1;
                    s.cur_seq = s.sealed;
                }
                s.frames_counted += 1;
                s.bytes_counted += size;
                s.pending = size;
                s.cur_terminal = false;
                s.cur_post_trip = s.trip.is_some();
                s.cur_post_user_trip = s.user_tripped;
            }
            Action::Send { size, accept } => self.emitter_step(&mut s, size, accept, false),
            Action::Terminal { accept } => {
                self.emitter_step(&mut s, cfg.terminal_len, accept, true);
            }
            Action::Trip => {
                s.policy = kernel::trip_policy(cfg, &mut s);
                s.user_tripped = true;
                let mark = TripMark {
                    accepted: s.accepted,
                    pending: s.pending,
                    by_user: true,
                };
                s.user_trip = Some(mark);
                s.trip.get_or_insert(mark);
            }
            Action::HeartbeatStale => s.hb_fresh = false,
            Action::HeartbeatFresh => s.hb_fresh = true,
            Action::Transmit { kind, len, alt } => {
                let passed = kernel::segment(cfg, &mut s, kind, len, alt);
                // `alt` is a network loss on a passed segment (only where the network may lose
                // segments), and means nothing on a dropped retransmission.
                let meaningful = if passed {
                    cfg.net_loss
                } else {
                    kind == Segment::New && cfg.drop_advances
                };
                if alt && !meaningful {
                    return None;
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let cfg = &self.cfg;
        let mut props = vec![
            Property::always(prop::P1, |m: &GateModel, s: &State| {
                s.post_trip_passes <= m.cfg.budget
            }),
            Property::always(prop::P2, |m: &GateModel, s: &State| {
                m.within_byte_allowance(s, s.trip)
            }),
            Property::always(prop::P2_USER, |m: &GateModel, s: &State| {
                m.within_byte_allowance(s, s.user_trip)
            }),
            Property::always(prop::NO_DROP_UNTRIPPED, |_: &GateModel, s: &State| {
                !s.drop_before_trip
            }),
        ];
        if self.disciplined() {
            props.push(Property::always(prop::P3, |m: &GateModel, s: &State| {
                s.frames_delivered(s.post_trip_frame_ends) <= u32::from(m.cfg.budget)
            }));
            props.push(Property::always(
                prop::P3_USER,
                |m: &GateModel, s: &State| {
                    s.frames_delivered(s.post_user_trip_frame_ends) <= u32::from(m.cfg.budget)
                },
            ));
            props.push(Property::sometimes(
                prop::TERMINAL_DELIVERED,
                |_: &GateModel, s: &State| s.terminal_end > 0 && s.delivered() >= s.terminal_end,
            ));
            props.push(Property::sometimes(
                prop::ALL_DELIVERED,
                |m: &GateModel, s: &State| {
                    s.trip.is_none()
                        && s.frames_counted == m.cfg.max_frames
                        && s.pending == 0
                        && s.delivered() == s.bytes_counted
                },
            ));
        }
        if cfg.emitter == Emitter::Honest {
            props.push(Property::always(
                prop::HONEST_NO_DROP,
                |_: &GateModel, s: &State| !s.honest_drop,
            ));
            props.push(Property::always(
                prop::TLS_IN_ORDER,
                |_: &GateModel, s: &State| !s.out_of_order,
            ));
        }
        if cfg.emitter == Emitter::Disciplined && cfg.budget > 0 {
            props.push(Property::sometimes(
                prop::POST_TRIP_FRAME_DELIVERED,
                |_: &GateModel, s: &State| s.frames_delivered(s.post_user_trip_frame_ends) > 0,
            ));
        }
        props
    }
}

impl GateModel {
    /// P2 from `trip`: the bytes at stream offsets at or beyond the trip point that passed the
    /// egress check (a superset of those the peer got) are at most `B × E`, plus the rest of
    /// the frame in progress at the trip point, plus `T` once userspace tripped the stream.
    pub fn within_byte_allowance(&self, s: &State, trip: Option<TripMark>) -> bool {
        let Some(trip) = trip else {
            return true;
        };
        let terminal = if s.user_tripped {
            self.cfg.terminal_len
        } else {
            0
        };
        let allowance = self.cfg.token_allowance() + trip.pending + terminal;
        s.left.saturating_sub(trip.accepted) <= allowance
    }
}
