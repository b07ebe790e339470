//! One flight-recorder record: its kinds, its fields (`docs/fhr-schema.md`) and its hash.

use serde::{Deserialize, Serialize};

use crate::ledger::{error::LedgerError, key::LedgerKey};

/// `prev_hash` of the first record.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What a record describes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum RecordKind {
    /// One completed (or halted) turn.
    #[default]
    Turn,
    /// A trip or other incident (G5: one per trip).
    Incident,
    /// Daemon start, stop, config and mode changes.
    Lifecycle,
    /// An earlier haltd ended on an uncontained panic, recorded at the next start from its
    /// crash file ([`crate::crash`]).
    Crash,
    /// An action through the admin API (a trip, the end of degraded mode): what, by whom
    /// (`admin.actor`: the socket peer's uid and pid, or the TCP peer), and its outcome.
    Admin,
    /// A TokenCircuit intervention (a halt with `TOOL_CIRCUIT_OPEN`, or a request answered
    /// without the model) with its diagnostic artifact; `severity: "page"` for an
    /// invariant_violation.
    #[serde(rename = "tool_circuit")]
    ToolCircuit,
}

/// One flight-recorder record. `seq`, `prev_hash` and `hash` are filled by the ledger; `ts`
/// too when left empty.
///
/// `Default` gives `rts_mode = "normal"`, `runtime_mode = "full"` and an *empty*
/// `kernel_gate`, which [`crate::ledger::Ledger::append`] rejects: every record must state whether the kernel
/// gate was enforcing.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Record {
    pub seq: u64,
    pub prev_hash: String,
    /// Omitted from the serialisation the hash is computed over (it is empty there).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hash: String,
    pub kind: RecordKind,
    /// RFC 3339 UTC with milliseconds, when the record was written.
    pub ts: String,
    pub turn_id: Option<String>,
    pub stream_id: Option<String>,
    /// `"stream"` or `"batch"`.
    pub mode: Option<String>,
    pub rts_mode: String,
    /// `"full"` or `"degraded"`.
    pub runtime_mode: String,
    pub latency_bucket: Option<String>,
    pub tig_breach: bool,
    pub watchdog_trip: bool,
    pub timing_incidents: Vec<String>,
    pub failure_codes: Vec<String>,
    pub trip_cause: Option<String>,
    pub trip_token_index: Option<u64>,
    pub halt_tokens_post_trip: Option<u64>,
    pub halt_latency_ms: Option<f64>,
    pub tokens_emitted: u64,
    pub detector_refs: Vec<String>,
    pub safety_verdict: Option<serde_json::Value>,
    /// `"enforcing"` or `"disabled"`.
    pub kernel_gate: String,
    pub budget: Option<u32>,
    pub outcome: Option<String>,
    pub halted_by: Option<String>,
    pub started_at: Option<String>,
    pub ended_at: Option<String>,
    /// Gate counters for the socket, free-form.
    pub kernel: Option<serde_json::Value>,
    pub message: Option<String>,
    // Fields added after the first release are left out when empty, so that records written
    // before them still hash (and verify) the same.
    /// The conversation's key fingerprint (never the key itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<String>,
    /// The degraded scope of the turn (`addr:<fp>`, `header:<fp>`, `apikey:<id>`: `scope.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// With `--client-keys store`: the name of the key the request authenticated with (its
    /// id is `conversation`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_name: Option<String>,
    /// The architecture profile the turn started under (`full` or `mkp`, issue 37).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// The route the turn started under (`[[routes]]`'s name, or `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// TURN-ACID: `"committed"` (ended cleanly; its state was committed) or `"failed"`
    /// (left no state behind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_status: Option<String>,
    /// The upstream exchange of a proxied turn: status, failure, cancellation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<serde_json::Value>,
    /// Tool calls emitted to the client: `dispatched` ones of a failed turn need
    /// reconciliation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// Admin records: `action`, `actor`, `status` and what the action named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<serde_json::Value>,
    /// A change of `runtime_mode` (degraded safe mode): scope, from, to, by, cause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode_change: Option<serde_json::Value>,
    /// An escalation of a scope entering degraded mode (`escalation.rs`): the endpoint, the
    /// outcome, every attempt, and the incident posted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalation: Option<serde_json::Value>,
    /// Per-detector summary of the turn: mode, breaches, failures, what each measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detectors: Option<serde_json::Value>,
    /// Turn records: why the record exists under the sampling policy (spec 000 §6.2):
    /// `{"rate": r}` for a normal turn drawn at rate r, `{"rate": 1.0, "reason": ...}` for
    /// one that is always recorded ([`crate::sampling`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<serde_json::Value>,
    /// Turn records with `--record-token-text`: the turn's output text (bounded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// With `text`: whether the turn produced more than it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_truncated: Option<bool>,
    /// Crash records: what the panic hook wrote (pid, thread, location, message, time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crash: Option<serde_json::Value>,
    /// The first record of a ledger segment after the first (rotation): which segment it
    /// continues. A file may begin at a `seq` other than 0 only with such a record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment: Option<serde_json::Value>,
    /// Lifecycle records of a start that cut a torn tail (a crash mid-write) off the ledger:
    /// where, how many bytes, and what they began with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<serde_json::Value>,
    /// `true` in every record written under `--ledger-no-fsync`: the record was not fsync'd
    /// before haltd answered, so a crash or power loss may have lost the ones after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_fsync: Option<bool>,
    /// TokenCircuit records: the action, its severity, the conversation and the artifact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_circuit: Option<serde_json::Value>,
    /// Turn records of an intervene-mode turn (spec 003): the threshold, window, hold-back
    /// and arm order in force, and one convergence record per grounding round
    /// (docs/fhr-schema.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grounding: Option<serde_json::Value>,
    /// The first record of every segment (file) the ledger writes: the id of the key it is
    /// chained under ([`LedgerKey::id`]), so that a check with the wrong key says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ledger_key_id: Option<String>,
    /// A hand-over between two haltd processes, each writing its own segment (issue 38;
    /// docs/fhr-schema.md §3, "Hand-over"). On the old process's hand-over record, what the
    /// caller says of its successor, e.g. `{"to_pid": 123, "to_segment": "/x/ledger-green.jsonl"}`
    /// (no `from_seq`); on the first record of the successor's segment, which the ledger writes
    /// itself ([`crate::ledger::Ledger::open_linked`]): `{"from_pid", "from_segment", "from_seq"}`,
    /// the record of the old segment it continues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover: Option<serde_json::Value>,
}

impl Default for Record {
    fn default() -> Self {
        Self {
            seq: 0,
            prev_hash: String::new(),
            hash: String::new(),
            kind: RecordKind::default(),
            ts: String::new(),
            turn_id: None,
            stream_id: None,
            mode: None,
            rts_mode: "normal".to_owned(),
            runtime_mode: "full".to_owned(),
            latency_bucket: None,
            tig_breach: false,
            watchdog_trip: false,
            timing_incidents: Vec::new(),
            failure_codes: Vec::new(),
            trip_cause: None,
            trip_token_index: None,
            halt_tokens_post_trip: None,
            halt_latency_ms: None,
            tokens_emitted: 0,
            detector_refs: Vec::new(),
            safety_verdict: None,
            kernel_gate: String::new(),
            budget: None,
            outcome: None,
            halted_by: None,
            started_at: None,
            ended_at: None,
            kernel: None,
            message: None,
            conversation: None,
            scope: None,
            key_name: None,
            profile: None,
            route: None,
            turn_status: None,
            upstream: None,
            tool_calls: Vec::new(),
            admin: None,
            mode_change: None,
            escalation: None,
            detectors: None,
            sampling: None,
            text: None,
            text_truncated: None,
            crash: None,
            segment: None,
            recovery: None,
            no_fsync: None,
            tool_circuit: None,
            grounding: None,
            ledger_key_id: None,
            handover: None,
        }
    }
}

impl Record {
    /// The record's hash as defined for the chain: hex HMAC-SHA-256 under the ledger key of
    /// the serialisation without `hash` (whatever `self.hash` currently holds is ignored).
    pub fn compute_hash(&self, key: &LedgerKey) -> Result<String, LedgerError> {
        let canonical = if self.hash.is_empty() {
            serde_json::to_vec(self)
        } else {
            let mut unhashed = self.clone();
            unhashed.hash.clear();
            serde_json::to_vec(&unhashed)
        }
        .map_err(|source| LedgerError::Serialize { source })?;
        Ok(key.mac_hex(&[&canonical]))
    }

    /// The first record of a segment that continues another process's segment after a
    /// hand-over: the `seq` of the old segment's hand-over record it links to
    /// (`handover.from_seq`).
    pub fn handover_from_seq(&self) -> Option<u64> {
        self.handover.as_ref()?.get("from_seq")?.as_u64()
    }

    /// An old process's hand-over record: a `handover` field that names no `from_seq` (the
    /// point a successor's segment may fork from).
    pub fn is_handover_record(&self) -> bool {
        self.handover
            .as_ref()
            .is_some_and(|h| h.get("from_seq").is_none())
    }

    /// Rejects records whose enumerated string fields hold something else.
    pub(super) fn validate(&self) -> Result<(), LedgerError> {
        fn one_of(
            field: &'static str,
            value: &str,
            allowed: &'static [&'static str],
        ) -> Result<(), LedgerError> {
            if allowed.contains(&value) {
                Ok(())
            } else {
                Err(LedgerError::InvalidRecord {
                    field,
                    value: value.to_owned(),
                    allowed,
                })
            }
        }
        one_of("kernel_gate", &self.kernel_gate, &["enforcing", "disabled"])?;
        one_of("runtime_mode", &self.runtime_mode, &["full", "degraded"])?;
        if let Some(mode) = &self.mode {
            one_of("mode", mode, &["stream", "batch"])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record written before `handover` existed, as the writer wrote it (key `[7; 32]`).
    const OLD_LINE: &str = r#"{"seq":41,"prev_hash":"abababababababababababababababababababababababababababababababab","hash":"5aea32e1308d3d1e7a90d3e5662c326f82ccf21690d201ea1084640f2d207d71","kind":"lifecycle","ts":"2026-01-01T00:00:00.000Z","turn_id":null,"stream_id":null,"mode":null,"rts_mode":"normal","runtime_mode":"full","latency_bucket":null,"tig_breach":false,"watchdog_trip":false,"timing_incidents":[],"failure_codes":[],"trip_cause":null,"trip_token_index":null,"halt_tokens_post_trip":null,"halt_latency_ms":null,"tokens_emitted":0,"detector_refs":[],"safety_verdict":null,"kernel_gate":"enforcing","budget":8,"outcome":null,"halted_by":null,"started_at":null,"ended_at":null,"kernel":null,"message":"haltd stopping","segment":{"continues_hash":"cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd","continues_seq":40},"no_fsync":true,"ledger_key_id":"0123456789abcdef"}"#;

    /// Fields added later (`handover` the latest) leave a record that does not set them
    /// serialised, and so hashed, exactly as before them.
    #[test]
    fn an_old_record_hashes_as_it_did() {
        let key = LedgerKey::from_bytes([7; 32]);
        let old: Record = serde_json::from_str(OLD_LINE).expect("an old record parses");
        assert_eq!(old.handover, None);
        assert_eq!(serde_json::to_string(&old).expect("json"), OLD_LINE);
        assert_eq!(old.compute_hash(&key).expect("hash"), old.hash);
        let built = Record {
            seq: 41,
            prev_hash: "ab".repeat(32),
            kind: RecordKind::Lifecycle,
            ts: "2026-01-01T00:00:00.000Z".to_owned(),
            kernel_gate: "enforcing".to_owned(),
            budget: Some(8),
            message: Some("haltd stopping".to_owned()),
            segment: Some(
                serde_json::json!({"continues_seq": 40, "continues_hash": "cd".repeat(32)}),
            ),
            no_fsync: Some(true),
            ledger_key_id: Some("0123456789abcdef".to_owned()),
            ..Record::default()
        };
        assert_eq!(built.compute_hash(&key).expect("hash"), old.hash);
        // Set, it comes last, and is hashed.
        let handed = Record {
            handover: Some(serde_json::json!({"to_pid": 7})),
            ..built
        };
        let line = serde_json::to_string(&handed).expect("json");
        assert!(line.ends_with(r#","handover":{"to_pid":7}}"#), "{line}");
        assert_ne!(handed.compute_hash(&key).expect("hash"), old.hash);
        assert!(handed.is_handover_record());
        assert_eq!(handed.handover_from_seq(), None);
    }
}
