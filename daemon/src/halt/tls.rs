//! The halt's side of client TLS (`--tls-cert`): the terminal record sealed at the trip, before
//! the kernel trip is written, and the terminal frame as it goes on the wire
//! (architecture.md §6, "The gate on ciphertext").

use super::{HaltCore, PreparedTerminal, TurnMeta};
use crate::{stream::SlotSnapshot, wire::StreamId};

/// On a client TLS connection, seals the terminal record now, before the trip is written
/// (issue 12): the gate's terminal allowance then matches its first 16 ciphertext bytes,
/// and the frame is that record and `close_notify`, sent as sealed
/// ([`HaltCore::terminal_wire`]). Its `post_trip_tokens` is 0: a stream that halts sends no
/// token after its trip (records sealed after this one would not open at the client
/// anyway). Returns the terminal's length on the wire, the gate's nonce and framing; with
/// no terminal sealed, length 0 and no nonce (no terminal passes: fail closed).
pub(crate) fn seal_at_trip(
    shared: &HaltCore,
    id: StreamId,
    terminal: &PreparedTerminal,
    plain_nonce: [u8; haltd_common::NONCE_LEN],
) -> (usize, [u8; haltd_common::NONCE_LEN], u32) {
    let tls = shared.meta(id.slot).client_tls.clone();
    let Some(tls) = tls else {
        return (
            terminal.bytes.len(),
            plain_nonce,
            haltd_common::framing::PLAIN,
        );
    };
    let mut plain = Vec::new();
    terminal.write(0, &mut plain);
    let mut sealed = Vec::new();
    let prefix = crate::client_tls::lock(&tls).seal_terminal(&plain, &mut sealed);
    let nonce = prefix.unwrap_or_else(|| {
        sealed.clear();
        [0; haltd_common::NONCE_LEN]
    });
    let len = sealed.len();
    shared.meta(id.slot).sealed_terminal = Some(sealed);
    (len, nonce, haltd_common::framing::TLS)
}

impl HaltCore {
    /// The terminal frame as it goes on the wire: [`HaltCore::terminal_frame`], or on a client
    /// TLS connection its records: as sealed at the trip, or (a trip without the kernel gate)
    /// sealed now. Empty when a TLS terminal cannot be sealed (the stream ends without it).
    pub fn terminal_wire(&self, snap: &SlotSnapshot, out: &mut Vec<u8>) {
        let (tls, sealed) = {
            let mut meta = self.meta(snap.id.slot);
            (meta.client_tls.clone(), meta.sealed_terminal.take())
        };
        let Some(tls) = tls else {
            return self.terminal_frame(snap, out);
        };
        if let Some(sealed) = sealed {
            out.clear();
            out.extend_from_slice(&sealed);
            return;
        }
        let mut plain = Vec::new();
        self.terminal_frame(snap, &mut plain);
        if crate::client_tls::lock(&tls)
            .seal_terminal(&plain, out)
            .is_none()
        {
            out.clear();
        }
    }
}

impl TurnMeta {
    /// A new stream's facts, on a connection with this TLS session (or none).
    pub fn for_connection(client_tls: Option<crate::client_tls::SharedTls>) -> Self {
        TurnMeta {
            client_tls,
            ..TurnMeta::default()
        }
    }
}
