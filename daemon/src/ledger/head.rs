//! The ledger's head: the next `seq` and the last record's hash, kept outside the ledger file.
//!
//! The chain alone cannot show records cut off its end: a shorter chain is still a valid
//! chain. The head can: it lives in the state directory (`<--state-dir>/ledger-<id>.head`,
//! mode 0600, `<id>` derived from the ledger's path so one state directory can serve several
//! ledgers), out of reach of whoever can only write the ledger file, and is written after
//! every record is on disk. At start, a file behind its head has lost records.
//!
//! The file has two fixed-size slots written in turn (generation `g` goes to slot `g % 2`), each
//! a JSON object MAC'd with the ledger key: a write torn by a crash spoils at most the slot being
//! written, and the other still holds the head before it. Reading takes the valid slot with the
//! highest generation.

use std::{
    fs::{File, OpenOptions},
    io,
    os::unix::fs::{FileExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{key::LedgerKey, record::GENESIS_HASH};

/// Bytes per slot (a slot is far smaller than a disk sector's 512).
const SLOT: usize = 256;

/// Where the chain ends: the next record's `seq` and the `hash` it must link to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub next_seq: u64,
    pub hash: String,
}

impl Head {
    /// The head of an empty ledger.
    pub fn genesis() -> Self {
        Head {
            next_seq: 0,
            hash: GENESIS_HASH.to_owned(),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Slot {
    gen: u64,
    next_seq: u64,
    hash: String,
    mac: String,
}

/// The head file of one ledger, open for writing.
#[derive(Debug)]
pub struct HeadFile {
    file: File,
    path: PathBuf,
    id: String,
    key: LedgerKey,
    gen: u64,
    /// The file was empty when opened: this ledger never had a head in this state directory.
    new: bool,
}

/// The head file that belongs to `ledger` in `state_dir`, and the ledger's id.
pub fn head_path(state_dir: &Path, ledger: &Path) -> io::Result<(PathBuf, String)> {
    let id = ledger_id(ledger)?;
    Ok((state_dir.join(format!("ledger-{id}.head")), id))
}

/// 16 hex digits of SHA-256 of the ledger's absolute path (its directory resolved).
fn ledger_id(ledger: &Path) -> io::Result<String> {
    let dir = match ledger.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = ledger.file_name().ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "ledger path has no file name")
    })?;
    let abs = dir.canonicalize()?.join(name);
    let digest = Sha256::digest(abs.as_os_str().as_encoded_bytes());
    Ok(hex::encode(&digest[..8]))
}

fn slot_mac(key: &LedgerKey, id: &str, gen: u64, next_seq: u64, hash: &str) -> String {
    key.mac_hex(&[
        b"haltd-ledger-head\0",
        id.as_bytes(),
        &gen.to_be_bytes(),
        &next_seq.to_be_bytes(),
        hash.as_bytes(),
    ])
}

impl HeadFile {
    /// Opens (creating, mode 0600) the head file of `ledger`; returns it with the head it
    /// holds (`None`: no valid slot, e.g. a new file).
    pub fn open(
        state_dir: &Path,
        ledger: &Path,
        key: &LedgerKey,
    ) -> io::Result<(HeadFile, Option<Head>)> {
        let (path, id) = head_path(state_dir, ledger)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)?;
        let mut buf = [0u8; 2 * SLOT];
        let n = read_up_to(&file, &mut buf)?;
        let best = buf[..n]
            .chunks(SLOT)
            .filter_map(|c| parse_slot(c, key, &id))
            .max_by_key(|s| s.gen);
        let head = best.as_ref().map(|s| Head {
            next_seq: s.next_seq,
            hash: s.hash.clone(),
        });
        let gen = best.map_or(0, |s| s.gen);
        let hf = HeadFile {
            file,
            path,
            id,
            key: key.clone(),
            gen,
            new: n == 0,
        };
        Ok((hf, head))
    }

    /// Writes `head` into the next slot, then fsyncs it when `sync`.
    pub fn write(&mut self, head: &Head, sync: bool) -> io::Result<()> {
        let gen = self.gen + 1;
        let slot = Slot {
            gen,
            next_seq: head.next_seq,
            hash: head.hash.clone(),
            mac: slot_mac(&self.key, &self.id, gen, head.next_seq, &head.hash),
        };
        let mut bytes = serde_json::to_vec(&slot).map_err(io::Error::other)?;
        if bytes.len() >= SLOT {
            return Err(io::Error::other("head slot overflows"));
        }
        bytes.resize(SLOT - 1, b' ');
        bytes.push(b'\n');
        self.file.write_all_at(&bytes, (gen % 2) * SLOT as u64)?;
        if sync {
            self.file.sync_data()?;
        }
        self.gen = gen;
        Ok(())
    }

    /// Whether the file was empty when opened (no head was ever written for this ledger in
    /// this state directory), as opposed to holding no valid slot (tampering).
    pub fn is_new(&self) -> bool {
        self.new
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Re-keys the head of the ledger file `from` for its new path `to` (a hand-over moved the file
/// aside: [`super::Ledger::open_linked`]): the head `from` holds, MAC'd for the id of `to`, in
/// a new head file (one that exists is refused, `AlreadyExists`), fsync'd when `sync`. Returns
/// that head; `None`, with nothing written, when `from` has no valid head. The head file of
/// `from` stays: the caller removes it once the ledger file has moved.
pub fn rekey(
    state_dir: &Path,
    from: &Path,
    to: &Path,
    key: &LedgerKey,
    sync: bool,
) -> io::Result<Option<Head>> {
    let Some(head) = read_head(state_dir, from, key)? else {
        return Ok(None);
    };
    let (path, id) = head_path(state_dir, to)?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    let mut hf = HeadFile {
        file,
        path,
        id,
        key: key.clone(),
        gen: 0,
        new: true,
    };
    if let Err(e) = hf.write(&head, sync) {
        let _ = std::fs::remove_file(&hf.path);
        return Err(e);
    }
    Ok(Some(head))
}

/// Reads the head of `ledger` without creating anything (`haltctl ledger verify`): `None` when
/// there is no head file or no valid slot in it.
pub fn read_head(state_dir: &Path, ledger: &Path, key: &LedgerKey) -> io::Result<Option<Head>> {
    let (path, id) = head_path(state_dir, ledger)?;
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    newest_slot(&file, key, &id)
}

/// The head in the valid slot of `file` with the highest generation.
fn newest_slot(file: &File, key: &LedgerKey, id: &str) -> io::Result<Option<Head>> {
    let mut buf = [0u8; 2 * SLOT];
    let n = read_up_to(file, &mut buf)?;
    Ok(buf[..n]
        .chunks(SLOT)
        .filter_map(|c| parse_slot(c, key, id))
        .max_by_key(|s| s.gen)
        .map(|s| Head {
            next_seq: s.next_seq,
            hash: s.hash,
        }))
}

/// Reads a head file given by its path (`haltctl ledger verify --head FILE`, for a copy of a
/// ledger): the ledger it belongs to is named by the file's name, `ledger-<id>.head`, as haltd
/// writes it. `None` when no slot is valid under `key`.
pub fn read_head_file(path: &Path, key: &LedgerKey) -> io::Result<Option<Head>> {
    let id = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("ledger-"))
        .and_then(|n| n.strip_suffix(".head"))
        .filter(|id| id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "a head file is named ledger-<16 hex digits>.head, as haltd writes it in its \
                 state directory: keep the name when copying it",
            )
        })?
        .to_owned();
    newest_slot(&File::open(path)?, key, &id)
}

fn read_up_to(file: &File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], n as u64)? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// A slot whose MAC checks out, or `None`.
fn parse_slot(bytes: &[u8], key: &LedgerKey, id: &str) -> Option<Slot> {
    let s: Slot = serde_json::from_slice(bytes.trim_ascii()).ok()?;
    key.verify_hex(
        &[
            b"haltd-ledger-head\0",
            id.as_bytes(),
            &s.gen.to_be_bytes(),
            &s.next_seq.to_be_bytes(),
            s.hash.as_bytes(),
        ],
        &s.mac,
    )
    .then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_round_trips_and_survives_a_torn_slot() {
        let dir = std::env::temp_dir().join(format!("haltd-head-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let ledger = dir.join("fhr.jsonl");
        let key = LedgerKey::from_bytes([3; 32]);
        let (mut hf, none) = HeadFile::open(&dir, &ledger, &key).expect("open");
        assert_eq!(none, None);
        let h1 = Head {
            next_seq: 1,
            hash: "a".repeat(64),
        };
        let h2 = Head {
            next_seq: 2,
            hash: "b".repeat(64),
        };
        hf.write(&h1, true).expect("write");
        hf.write(&h2, true).expect("write");
        assert_eq!(read_head(&dir, &ledger, &key).expect("read"), Some(h2));
        // Tear the slot of generation 2: the head before it is still there.
        hf.file.write_all_at(b"XXXX", 12).expect("tear");
        assert_eq!(
            read_head(&dir, &ledger, &key).expect("read"),
            Some(h1.clone())
        );
        // Another key (or a forged slot) reads as no head.
        let other = LedgerKey::from_bytes([4; 32]);
        assert_eq!(read_head(&dir, &ledger, &other).expect("read"), None);
        let (_, again) = HeadFile::open(&dir, &ledger, &key).expect("reopen");
        assert_eq!(again, Some(h1));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
