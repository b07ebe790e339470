//! Degraded mode's "ask first" (spec 000 §4.2 step 4, "ask before answering"): with
//! `--degraded-ask-first TEXT`, the first turn of each scope after it entered degraded mode
//! is answered with TEXT instead of the model: a turn like any other (opened, governed by the
//! detectors and the kernel gate, recorded, in the surface's own shape, batch with B = 0 as
//! every degraded turn), whose source is the text ([`FixedSource`]); no upstream exchange,
//! no built-in model, no grounding. [`Modes::ask_first`](crate::modes::Modes::ask_first)
//! decides which turn that is.

use std::{io, sync::Arc};

use crate::{
    dataplane::{turn::Turn, turn::TurnSource, Step},
    scope::Identity,
    source::fixed::FixedSource,
    stream::Mode,
    wire::Ask,
};

impl Step<'_> {
    /// Whether this degraded turn of `who` is answered with the clarification (and, if so,
    /// the scope counts as asked from now).
    pub(in crate::dataplane) fn asks_first(&self, who: &Identity, degraded: bool) -> bool {
        degraded
            && !self.io.shared.cfg.args.degraded_ask_first.is_empty()
            && self.io.shared.modes.ask_first(who)
    }

    /// Runs the turn with the clarification as its source, under the model name the
    /// request named.
    pub(in crate::dataplane) fn start_asking(
        &mut self,
        ask: &Ask,
        model: Arc<str>,
        who: &Identity,
        (mode, policy): (Mode, crate::policy::TurnPolicy),
    ) -> io::Result<()> {
        let (gov, failed) = self.turn_governor(&policy.route.detectors);
        let top_n = if ask.logprobs {
            ask.top_logprobs as usize
        } else {
            0
        };
        let text = &self.io.shared.cfg.args.degraded_ask_first;
        let source = TurnSource::Fixed(FixedSource::new(text, top_n));
        let identity = crate::safety::ModelIdentity::new(&model, "");
        let enc = self.encoder(ask, model, (false, false));
        let mut turn = Turn::new(source, ask, who.conversation, true, enc, gov, policy);
        // No model spoke: its identity cannot have changed within the turn.
        turn.identity_before = Some(identity.clone());
        turn.identity_after = Some(identity);
        self.run_local_turn(turn, failed, mode)
    }
}
