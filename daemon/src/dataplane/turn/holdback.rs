//! The hold-back window of a turn whose surprise detector runs in `intervene` mode (spec 003;
//! issue 16 point 1): the last W tokens are held before the client sees them, so that a
//! high-surprise span can be rewound without the client ever having seen it.
//!
//! It is a cap on what the hold queue (`hold.rs`) lets out, on top of the exfiltration
//! scanner's: the queue releases text up to the smaller of the two. The window keeps where
//! each of its tokens ends in the turn's scanned text, in a fixed ring allocated once at turn
//! start (W entries), so the per-token cost is one store and no allocation. When a token
//! leaves the window (the W+1-th pushes it out), the text up to its end may go; at the end of
//! the source's text the window lets everything go ([`HoldBack::open`]). A trip drops the
//! hold queue whole, so a trip during the hold-back releases nothing held, and the kernel's
//! budget B counts only frames that were sent.
//!
//! A rewind ([`HoldBack::rewind`]) drops the held tokens from the window's start: the text
//! from [`HoldBack::limit`] on is taken back, and the window starts empty again.

/// The last W tokens' end offsets and what may go out.
#[derive(Debug)]
pub struct HoldBack {
    /// End offset (in the turn's scanned text) of each held token, a ring of W entries.
    ends: Box<[usize]>,
    /// Next entry of `ends` to write.
    head: usize,
    /// Tokens held now (at most W).
    len: usize,
    /// Text up to here may go out: where the last token to leave the window ended.
    limit: usize,
    /// The source's text ended: nothing is held any more.
    open: bool,
}

impl HoldBack {
    /// An empty window of `w` tokens (at least 1), starting at text offset `start`. The only
    /// allocation: at turn start.
    pub fn new(w: usize, start: usize) -> Self {
        HoldBack {
            ends: vec![0; w.max(1)].into_boxed_slice(),
            head: 0,
            len: 0,
            limit: start,
            open: false,
        }
    }

    /// Tokens held now.
    pub fn held(&self) -> usize {
        self.len
    }

    /// A token whose text ends at `end` joined the window; the oldest leaves it when it is
    /// full, and the text up to that one's end may go out. No allocation.
    pub fn push(&mut self, end: usize) {
        let w = self.ends.len();
        if self.len == w {
            self.limit = self.limit.max(self.ends[self.head]);
        } else {
            self.len += 1;
        }
        self.ends[self.head] = end;
        self.head = (self.head + 1) % w;
    }

    /// Text up to this offset may go out (everything, once open).
    pub fn limit(&self) -> usize {
        if self.open {
            usize::MAX
        } else {
            self.limit
        }
    }

    /// Where the window starts: the end of the kept prefix a rewind keeps.
    pub fn start(&self) -> usize {
        self.limit
    }

    /// The source's text is complete: the held tokens may go.
    pub fn open(&mut self) {
        self.open = true;
    }

    /// Drops the held tokens: the window is empty and starts at the kept prefix's end, which
    /// it returns (the caller truncates its text there).
    pub fn rewind(&mut self) -> usize {
        self.len = 0;
        self.head = 0;
        self.open = false;
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_w_tokens_are_held_and_each_new_one_lets_the_oldest_go() {
        let mut hb = HoldBack::new(3, 0);
        for (i, end) in [2, 5, 9].into_iter().enumerate() {
            hb.push(end);
            assert_eq!(
                hb.limit(),
                0,
                "token {i}: nothing out while W are not exceeded"
            );
        }
        assert_eq!(hb.held(), 3);
        hb.push(10);
        assert_eq!(hb.limit(), 2, "the first token left the window");
        hb.push(14);
        assert_eq!(hb.limit(), 5);
        assert_eq!(hb.held(), 3);
        hb.open();
        assert_eq!(hb.limit(), usize::MAX, "the end lets everything go");
    }

    #[test]
    fn a_rewind_keeps_the_prefix_before_the_window_and_starts_empty() {
        let mut hb = HoldBack::new(2, 4);
        for end in [6, 8, 11] {
            hb.push(end);
        }
        assert_eq!(hb.start(), 6);
        assert_eq!(hb.rewind(), 6, "the held tokens (6..11) are dropped");
        assert_eq!(hb.held(), 0);
        hb.push(9);
        hb.push(12);
        assert_eq!(
            hb.limit(),
            6,
            "nothing of the resumed text goes before W new tokens"
        );
        hb.push(13);
        assert_eq!(hb.limit(), 9);
    }

    #[test]
    fn a_window_of_one_holds_exactly_the_last_token() {
        let mut hb = HoldBack::new(1, 0);
        hb.push(3);
        assert_eq!(hb.limit(), 0);
        hb.push(7);
        assert_eq!(hb.limit(), 3);
    }
}
