//! What a connection writes, below the connection itself: the frame buffer reused from frame
//! to frame, and what the send in flight carries ([`SendKind`]), which decides what happens
//! when it completes. The turn and the upstream exchange use these without the connection.

/// What the send in flight carries, which decides what happens when it completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::dataplane) enum SendKind {
    Continue100,
    Head,
    Token,
    /// The last frame of a turn that ends normally.
    Final,
    /// An error or health response; the connection closes after it.
    Reply,
    Terminal,
    /// An interim `100 Continue` to a client that half-closed while its proxied turn waits on
    /// the upstream (see `watch::on_watch`).
    Probe,
    /// A TLS handshake flight (`client_tls.rs`).
    Handshake,
    /// TLS `close_notify` before haltd closes a connection whose stream did not halt
    /// (`client_tls.rs`); the close goes on when it completes.
    CloseNotify,
}

/// Initial capacity of a connection's frame buffer, allocated with its first frame: a token
/// event fits; a larger frame (a batch body, an error) grows it, and it is reused.
const FRAME_CAPACITY: usize = 512;

/// The frame buffer, emptied for the next frame (a new one if a send still had it, which
/// the callers' `sending` checks rule out).
pub(in crate::dataplane) fn frame(wbuf: &mut Option<Vec<u8>>) -> &mut Vec<u8> {
    let b = wbuf.get_or_insert_with(|| Vec::with_capacity(FRAME_CAPACITY));
    b.clear();
    b
}

/// The most token events one send carries: tokens the upstream delivered together go out in
/// one frame, up to this many (`pipeline.rs`, staging).
pub(in crate::dataplane) const STAGE_MAX: usize = 16;

/// Bytes of the frame in the buffer.
pub(in crate::dataplane) fn frame_len(wbuf: &Option<Vec<u8>>) -> usize {
    wbuf.as_ref().map_or(0, Vec::len)
}
