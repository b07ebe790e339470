//! Which phase of the turn pipeline runs next, decided without I/O from the connection's
//! emitter and the turn's hold queue: the order the pipeline keeps between what is staged,
//! what the exfiltration scanner released, the end of the text and the source's next item.
//!
//! [`next_phase`] is what `pipeline.rs` `pump_phases` asks each time round its loop; the
//! driver then does the phase (a send, the end of the turn, a poll of the source).

use crate::dataplane::{
    conn::emit::Emitter,
    turn::hold::{Hold, Pending},
};

/// The next phase of a turn's pipeline.
#[derive(Debug)]
pub(in crate::dataplane) enum Phase {
    /// Nothing now: a send is in flight (its completion steps the turn again), the connection
    /// closes, a token waits for its score, or the turn for a grounding round.
    Wait,
    /// The staged token events go out first: a held frame or the end waits for their send.
    SendStaged,
    /// A frame the scanner released goes out, in order, before anything new.
    Released(Pending),
    /// The text is complete and nothing is held any more: the post-hoc grounding round if one
    /// is due, then the final frame.
    End,
    /// The source's next item.
    Poll,
}

/// The phase that comes next. `closing`: the connection began to close; `waiting`: a token is
/// parked for its score or the turn waits for a grounding round. Takes the released frame out
/// of the queue when that is the answer.
pub(in crate::dataplane) fn next_phase(
    emit: &Emitter,
    closing: bool,
    waiting: bool,
    hold: &mut Hold,
) -> Phase {
    if !emit.idle() || closing || waiting {
        return Phase::Wait;
    }
    if emit.staged() > 0 && (!hold.queue.is_empty() || hold.ending) {
        return Phase::SendStaged;
    }
    if let Some(p) = hold.pop_released() {
        return Phase::Released(p);
    }
    if hold.ending {
        return Phase::End;
    }
    Phase::Poll
}

/// What the pipeline does after taking one thing from the source.
pub(in crate::dataplane) enum Next {
    /// Nothing went out: take the next (a paced source waits for its timer first).
    Poll,
    /// An operation is under way (a send, a halt, a failure's reply): stop here.
    Stop,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{dataplane::conn::outbox::SendKind, upstream::framing::Split, wire::Channel};

    /// A hold queue with `texts` pushed as whole tokens, the scanner having released `released`
    /// bytes of them.
    fn hold(texts: &[&str], released: usize) -> Hold {
        let mut h = Hold::default();
        let mut offset = 0;
        for t in texts {
            h.scanned += t.len();
            h.push_text(
                (*t).to_owned(),
                (Split::Token, Channel::Content),
                None,
                offset,
                0,
            );
            offset += t.len();
        }
        h.release(released);
        h
    }

    fn text(p: &Phase) -> Option<&str> {
        match p {
            Phase::Released(p) => Some(&p.text[p.pos..]),
            _ => None,
        }
    }

    #[test]
    fn a_send_in_flight_a_close_or_a_wait_stops_the_pipeline() {
        let mut h = hold(&["a"], 1);
        let mut e = Emitter::default();
        e.begin_send(SendKind::Token);
        assert!(matches!(next_phase(&e, false, false, &mut h), Phase::Wait));
        let e = Emitter::default();
        assert!(matches!(next_phase(&e, true, false, &mut h), Phase::Wait));
        assert!(matches!(next_phase(&e, false, true, &mut h), Phase::Wait));
        assert_eq!(h.queue.len(), 1, "nothing was taken while waiting");
    }

    #[test]
    fn staged_events_go_before_held_frames_and_the_end() {
        let mut e = Emitter::default();
        e.stage(1);
        let mut h = hold(&["a"], 1);
        assert!(matches!(
            next_phase(&e, false, false, &mut h),
            Phase::SendStaged
        ));
        let mut ending = hold(&[], 0);
        ending.ending = true;
        assert!(matches!(
            next_phase(&e, false, false, &mut ending),
            Phase::SendStaged
        ));
        // Nothing queued and the text goes on: the staged events wait for more tokens.
        let mut empty = hold(&[], 0);
        assert!(matches!(
            next_phase(&e, false, false, &mut empty),
            Phase::Poll
        ));
    }

    #[test]
    fn released_frames_go_in_order_then_the_source_or_the_end() {
        let e = Emitter::default();
        let mut h = hold(&["ab", "c", "de"], 3);
        assert_eq!(text(&next_phase(&e, false, false, &mut h)), Some("ab"));
        assert_eq!(text(&next_phase(&e, false, false, &mut h)), Some("c"));
        // "de" is held (not released): the source's next item comes first.
        assert!(matches!(next_phase(&e, false, false, &mut h), Phase::Poll));
        h.release(2);
        h.ending = true;
        assert_eq!(text(&next_phase(&e, false, false, &mut h)), Some("de"));
        assert!(matches!(next_phase(&e, false, false, &mut h), Phase::End));
    }
}
