//! `haltctl`'s parts that are more than argument parsing (`src/bin/haltctl/` wires them):
//!
//! * [`out`]: writing to standard output, ending quietly when the reader went away
//!   (`haltctl ledger show | head`);
//! * [`settings`]: where haltctl finds the daemon: its flags and variables, else the
//!   `admin`, `admin_token_file`, `state_dir` and `ledger` of haltd's own config file
//!   (`--config` / `HALTD_CONFIG`), else the defaults;
//! * [`render`]: the human tables of the admin API's answers (`--json` prints them as they
//!   came);
//! * [`reader`]: `haltctl ledger show` and `tail`;
//! * [`verify`]: `haltctl ledger verify` and its exit codes;
//! * [`reanchor`]: `haltctl ledger reanchor`, the operator's acceptance of a ledger whose head
//!   is missing;
//! * [`circuit`]: the admin requests of `haltctl circuit show` and `haltctl reconcile`;
//! * [`fingerprint`]: `haltctl key fingerprint`, a key's fingerprint as haltd computes it.

pub mod circuit;
pub mod fingerprint;
pub mod keys;
pub mod out;
pub mod policy;
pub mod reader;
pub mod reanchor;
pub mod render;
pub mod settings;
pub mod verify;
