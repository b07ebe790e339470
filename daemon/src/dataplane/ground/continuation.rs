//! Resuming a proxied turn after a grounding round's rewind (issue 16 point 4): the running
//! upstream request is cancelled and re-issued as a continuation, with the grounding as a
//! bracketed system segment and the kept prefix as the assistant's message
//! ([`crate::grounding::resume_request`]: vLLM's `continue_final_message` or llama.cpp's
//! prefill, as `[grounding] continuation` says).
//!
//! The old exchange is abandoned (its socket shut down, which makes vLLM abort the
//! generation; its queued items dropped) and the new request waits until no operation of the
//! old socket is in flight: a completion of the old socket must never be taken for the new
//! one. [`Step::maybe_reissue`] runs after every completion of a connection with a
//! re-issue pending; once the old socket is idle it is closed and the new request goes out
//! through the usual `open_upstream` (a pooled connection or a new one). The client's stream
//! stays open meanwhile (its head went out already, and goes out only once): the resumed
//! tokens are spliced after the kept prefix by the same pipeline.

use std::io;

use crate::dataplane::driver::op;
use crate::dataplane::ground;
use crate::dataplane::upstream_io;
use crate::dataplane::upstream_io::Purpose;
use crate::dataplane::Step;
use crate::grounding::{plan::bracketed, resume_request::resume_body, Round};

impl Step<'_> {
    /// Prepares the continuation of a proxied turn whose last `dropped` tokens are rewound:
    /// the request body is built and the old exchange abandoned. `false` (nothing changed):
    /// no continuation, or the kept prefix is not known whole.
    pub(in crate::dataplane) fn resume_upstream(&mut self, dropped: usize, round: &Round) -> bool {
        let Some(plan) = self.io.shared.grounding.as_ref() else {
            return false;
        };
        let continuation = plan.continuation;
        let conn = &mut *self.conn;
        let Some(turn) = conn.turn.as_mut() else {
            return false;
        };
        let Some(keep) = turn.hold.back.as_ref().map(|b| b.start()) else {
            return false;
        };
        if turn.out_text_truncated {
            return false;
        }
        let Some(queued) = ground::queued_text(turn, 0, keep) else {
            return false;
        };
        let kept = format!("{}{queued}", turn.out_text);
        let kept_tokens = turn.tokens_generated.saturating_sub(dropped as u64);
        let Some(g) = turn.grounding.as_mut() else {
            return false;
        };
        let Some(seed) = g.seed.as_ref() else {
            return false;
        };
        let segment = bracketed(&round.snippets);
        let Ok(body) = resume_body(
            &seed.body,
            seed.endpoint,
            continuation,
            &segment,
            (&kept, kept_tokens),
        ) else {
            return false;
        };
        g.reissue = Some(body);
        if let Some(s) = turn.source.upstream_mut() {
            s.restart();
        }
        if let Some(up) = conn.up.as_mut() {
            // Abandoned: shut down at once (the generation stops), never pooled, nothing
            // more read for the turn.
            up.finished = true;
            up.discard();
            if let Some(target) = up.connect_op {
                let e = io_uring::opcode::AsyncCancel::new(target).build();
                // A failed submission leaves the connect to its deadline.
                let _ = self.submit(op::OpKind::Cancel, op::OpBuf::None, e);
            }
        }
        true
    }

    /// A re-issue is pending and the old upstream socket has no operation in flight: it is
    /// closed, and the continuation request goes out.
    pub(in crate::dataplane) fn maybe_reissue(&mut self) -> io::Result<()> {
        let conn = &mut *self.conn;
        let pending = conn
            .turn
            .as_ref()
            .and_then(|t| t.grounding.as_ref())
            .is_some_and(|g| g.reissue.is_some());
        if !pending || conn.closing {
            return Ok(());
        }
        if let Some(up) = conn.up.as_ref() {
            let busy = up.connect_op.is_some()
                || up.send_op.is_some()
                || up.recv_op.is_some()
                || up.links > 0;
            if busy {
                return Ok(());
            }
        }
        if let Some(old) = conn.up.take() {
            // SAFETY: no operation is in flight on the abandoned socket (checked above), and
            // nothing else holds its descriptor.
            unsafe { libc::close(old.fd()) };
        }
        let Some(g) = conn.turn.as_mut().and_then(|t| t.grounding.as_mut()) else {
            return Ok(());
        };
        let (Some(body), Some(seed)) = (g.reissue.take(), g.seed.as_ref()) else {
            return Ok(());
        };
        let (api_path, auth, system_prompt) = (
            seed.api_path,
            seed.authorization.clone(),
            seed.system_prompt.clone(),
        );
        let request = upstream_io::UpstreamRequest {
            purpose: Purpose::Turn,
            api_path,
            method: "POST",
            authorization: auth.as_deref(),
            body: Some(&body),
        };
        tracing::debug!(stream_id = %conn.id, "re-issuing the upstream request as a grounded continuation");
        self.open_upstream(&request, system_prompt)
    }
}
