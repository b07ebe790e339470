//! The store's SQL: opening the file (mode 0600, WAL, full sync), the schema and its
//! migrations, and the statements that read and write it.
//!
//! Schema version 5:
//!
//! - `meta(name TEXT PRIMARY KEY, value TEXT NOT NULL)`: `ledger_seq`, `ledger_hash` (the last
//!   ledger record the store reflects), `node_check` (the fingerprint of the node key) and
//!   `runtime_policy` (the switches of `haltctl detector mode` and `haltctl profile set`, a
//!   JSON document `policy::Overrides` owns; no schema step: a row of `meta`);
//! - `degraded(scope TEXT PRIMARY KEY, since_unix_ms, until_unix_ms NULL, cause, stream_id)`
//!   (version 1);
//! - `conversations(key TEXT PRIMARY KEY, turns_committed, tokens_committed,
//!   tool_calls_committed, last_committed_turn NULL, turns_failed)` (version 2);
//! - `circuits(key, id, source, retained, body)`, primary key `(key, id, source)`, and
//!   `dispatched(reference TEXT PRIMARY KEY, body)` (version 3): TokenCircuit's memory and the
//!   dispatched calls of failed turns, each body a JSON document whose fields
//!   `circuit::persist` and `circuit::dispatched` own (a field added later has a default);
//! - `client_keys(id TEXT PRIMARY KEY, body)` and `key_usage(id TEXT PRIMARY KEY, body)`
//!   (version 4): the key store's keys (`keys.rs`: name, secret hashes, revocation, limits)
//!   and each key's counts (`limits.rs` `StoredUsage`), each body a JSON document;
//! - `incident_labels(incident_seq INTEGER PRIMARY KEY, body)` (version 5): the operators'
//!   labels of incidents (`labels.rs` `Labelled`), by the incident record's seq.
//!
//! The migration rule: each version `n` has one step from `n - 1` ([`MIGRATIONS`]), run in
//! order in one transaction at open; a file whose `user_version` is above [`VERSION`] is
//! refused.

use std::{fs::OpenOptions, os::unix::fs::OpenOptionsExt, path::Path};

use rusqlite::{params, Connection, OptionalExtension, Transaction};

use super::{
    Change, CircuitRow, ClientKeyRow, ConversationRow, DispatchedRow, IncidentLabelRow, Point,
    ScopeRow, Snapshot, StateError,
};

/// The schema this haltd writes.
pub const VERSION: i64 = 5;

/// Step `i` takes the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
     CREATE TABLE degraded (
         scope TEXT PRIMARY KEY,
         since_unix_ms INTEGER NOT NULL,
         until_unix_ms INTEGER,
         cause TEXT NOT NULL,
         stream_id TEXT NOT NULL
     );",
    "CREATE TABLE conversations (
         key TEXT PRIMARY KEY,
         turns_committed INTEGER NOT NULL,
         tokens_committed INTEGER NOT NULL,
         tool_calls_committed INTEGER NOT NULL,
         last_committed_turn TEXT,
         turns_failed INTEGER NOT NULL
     );",
    "CREATE TABLE circuits (
         key TEXT NOT NULL,
         id TEXT NOT NULL,
         source TEXT NOT NULL,
         retained INTEGER NOT NULL,
         body TEXT NOT NULL,
         PRIMARY KEY (key, id, source)
     );
     CREATE TABLE dispatched (reference TEXT PRIMARY KEY, body TEXT NOT NULL);",
    "CREATE TABLE client_keys (id TEXT PRIMARY KEY, body TEXT NOT NULL);
     CREATE TABLE key_usage (id TEXT PRIMARY KEY, body TEXT NOT NULL);",
    "CREATE TABLE incident_labels (incident_seq INTEGER PRIMARY KEY, body TEXT NOT NULL);",
];

fn sql<'p>(path: &'p Path, op: &'static str) -> impl FnOnce(rusqlite::Error) -> StateError + 'p {
    move |source| StateError::Sqlite {
        path: path.to_owned(),
        op,
        source,
    }
}

/// Opens `path`, creating it with mode 0600, and brings its schema to [`VERSION`].
pub fn open(path: &Path) -> Result<Connection, StateError> {
    // Created here, not by SQLite, so that it is never readable by others; SQLite gives its
    // WAL and shared-memory files the database file's mode.
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| StateError::Io {
            path: path.to_owned(),
            op: "creating it",
            source,
        })?;
    let mut conn = Connection::open(path).map_err(sql(path, "opening it"))?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(sql(path, "setting WAL"))?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(sql(path, "setting synchronous = FULL"))?;
    // A second process (an upgrade's new haltd) may hold the write lock for a moment.
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(sql(path, "setting the busy timeout"))?;
    migrate(&mut conn, path)?;
    Ok(conn)
}

fn migrate(conn: &mut Connection, path: &Path) -> Result<(), StateError> {
    let tx = conn.transaction().map_err(sql(path, "migrating"))?;
    let found: i64 = tx
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(sql(path, "reading the schema version"))?;
    if found > VERSION {
        return Err(StateError::Newer {
            path: path.to_owned(),
            found,
            known: VERSION,
        });
    }
    for step in &MIGRATIONS[usize::try_from(found).unwrap_or(0)..] {
        tx.execute_batch(step).map_err(sql(path, "migrating"))?;
    }
    tx.pragma_update(None, "user_version", VERSION)
        .map_err(sql(path, "writing the schema version"))?;
    tx.commit().map_err(sql(path, "migrating"))
}

fn meta(conn: &Connection, path: &Path, name: &str) -> Result<Option<String>, StateError> {
    conn.query_row("SELECT value FROM meta WHERE name = ?1", [name], |r| {
        r.get(0)
    })
    .optional()
    .map_err(sql(path, "reading meta"))
}

fn set_meta(tx: &Transaction<'_>, path: &Path, name: &str, value: &str) -> Result<(), StateError> {
    tx.execute(
        "INSERT INTO meta (name, value) VALUES (?1, ?2)
         ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        params![name, value],
    )
    .map(drop)
    .map_err(sql(path, "writing meta"))
}

/// The degraded scopes the store holds.
pub fn load_scopes(conn: &Connection, path: &Path) -> Result<Vec<ScopeRow>, StateError> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT scope, since_unix_ms, until_unix_ms, cause, stream_id FROM degraded
             ORDER BY scope",
        )
        .map_err(sql(path, "reading the degraded scopes"))?;
    stmt.query_map([], |r| {
        Ok(ScopeRow {
            scope: r.get(0)?,
            since_unix_ms: r.get(1)?,
            until_unix_ms: r.get(2)?,
            cause: r.get(3)?,
            stream_id: r.get(4)?,
        })
    })
    .and_then(Iterator::collect)
    .map_err(sql(path, "reading the degraded scopes"))
}

/// A read-only connection to the store, for what a peer (the other haltd of a hand-over)
/// writes: `PRAGMA data_version` on it changes whenever another connection commits.
pub fn open_reader(path: &Path) -> Result<Connection, StateError> {
    let conn = Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(sql(path, "opening it to read the peer's changes"))?;
    conn.busy_timeout(std::time::Duration::from_millis(200))
        .map_err(sql(path, "setting the busy timeout"))?;
    Ok(conn)
}

/// `PRAGMA data_version`: changes when a connection other than `conn` commits.
pub fn data_version(conn: &Connection, path: &Path) -> Result<i64, StateError> {
    conn.pragma_query_value(None, "data_version", |r| r.get(0))
        .map_err(sql(path, "reading data_version"))
}

/// Everything the store holds.
pub fn load(conn: &Connection, path: &Path) -> Result<Snapshot, StateError> {
    let seq = meta(conn, path, "ledger_seq")?;
    let hash = meta(conn, path, "ledger_hash")?;
    let ledger = match (seq, hash) {
        (Some(seq), Some(hash)) => Some(Point {
            seq: seq.parse().map_err(|_| StateError::Corrupt {
                path: path.to_owned(),
                reason: format!("ledger_seq {seq:?} is not a number"),
            })?,
            hash,
        }),
        _ => None,
    };
    let scopes = load_scopes(conn, path)?;
    let mut stmt = conn
        .prepare(
            "SELECT key, turns_committed, tokens_committed, tool_calls_committed,
                 last_committed_turn, turns_failed FROM conversations ORDER BY key",
        )
        .map_err(sql(path, "reading the conversations"))?;
    let conversations = stmt
        .query_map([], |r| {
            Ok(ConversationRow {
                key: r.get(0)?,
                turns_committed: r.get(1)?,
                tokens_committed: r.get(2)?,
                tool_calls_committed: r.get(3)?,
                last_committed_turn: r.get(4)?,
                turns_failed: r.get(5)?,
            })
        })
        .and_then(Iterator::collect)
        .map_err(sql(path, "reading the conversations"))?;
    Ok(Snapshot {
        ledger,
        node_check: meta(conn, path, "node_check")?,
        scopes,
        conversations,
        circuits: load_circuits(conn, path)?,
        dispatched: load_dispatched(conn, path)?,
        client_keys: load_rows(conn, path, "client_keys")?,
        key_usage: load_rows(conn, path, "key_usage")?,
        runtime_policy: match meta(conn, path, "runtime_policy")? {
            Some(text) => Some(body(path, "meta", &text)?),
            None => None,
        },
        incident_labels: load_labels(conn, path)?,
    })
}

fn load_labels(conn: &Connection, path: &Path) -> Result<Vec<IncidentLabelRow>, StateError> {
    let mut stmt = conn
        .prepare("SELECT incident_seq, body FROM incident_labels ORDER BY incident_seq")
        .map_err(sql(path, "reading the incident labels"))?;
    let rows: Vec<(u64, String)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .and_then(Iterator::collect)
        .map_err(sql(path, "reading the incident labels"))?;
    rows.into_iter()
        .map(|(incident_seq, text)| {
            Ok(IncidentLabelRow {
                incident_seq,
                body: body(path, "incident_labels", &text)?,
            })
        })
        .collect()
}

/// A body column's JSON.
fn body(path: &Path, table: &str, text: &str) -> Result<serde_json::Value, StateError> {
    serde_json::from_str(text).map_err(|e| StateError::Corrupt {
        path: path.to_owned(),
        reason: format!("a {table} row's body is not JSON: {e}"),
    })
}

fn load_circuits(conn: &Connection, path: &Path) -> Result<Vec<CircuitRow>, StateError> {
    let mut stmt = conn
        .prepare("SELECT key, id, source, retained, body FROM circuits ORDER BY key, id, source")
        .map_err(sql(path, "reading TokenCircuit's conversations"))?;
    let rows: Vec<(String, String, String, bool, String)> = stmt
        .query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })
        .and_then(Iterator::collect)
        .map_err(sql(path, "reading TokenCircuit's conversations"))?;
    rows.into_iter()
        .map(|(key, id, source, retained, text)| {
            Ok(CircuitRow {
                key,
                id,
                source,
                retained,
                body: body(path, "circuits", &text)?,
            })
        })
        .collect()
}

fn load_dispatched(conn: &Connection, path: &Path) -> Result<Vec<DispatchedRow>, StateError> {
    let mut stmt = conn
        .prepare("SELECT reference, body FROM dispatched ORDER BY reference")
        .map_err(sql(path, "reading the dispatched calls"))?;
    let rows: Vec<(String, String)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .and_then(Iterator::collect)
        .map_err(sql(path, "reading the dispatched calls"))?;
    rows.into_iter()
        .map(|(reference, text)| {
            Ok(DispatchedRow {
                reference,
                body: body(path, "dispatched", &text)?,
            })
        })
        .collect()
}

/// The rows of `table` (`client_keys` or `key_usage`: an id and a JSON body).
fn load_rows(
    conn: &Connection,
    path: &Path,
    table: &'static str,
) -> Result<Vec<ClientKeyRow>, StateError> {
    let mut stmt = conn
        .prepare(&format!("SELECT id, body FROM {table} ORDER BY id"))
        .map_err(sql(path, "reading the client keys"))?;
    let rows: Vec<(String, String)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .and_then(Iterator::collect)
        .map_err(sql(path, "reading the client keys"))?;
    rows.into_iter()
        .map(|(id, text)| {
            Ok(ClientKeyRow {
                id,
                body: body(path, table, &text)?,
            })
        })
        .collect()
}

fn write_change(tx: &Transaction<'_>, path: &Path, change: &Change) -> Result<(), StateError> {
    match change {
        Change::Degrade(row) => tx.execute(
            "INSERT INTO degraded (scope, since_unix_ms, until_unix_ms, cause, stream_id)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (scope) DO UPDATE SET since_unix_ms = excluded.since_unix_ms,
                 until_unix_ms = excluded.until_unix_ms, cause = excluded.cause,
                 stream_id = excluded.stream_id",
            params![
                row.scope,
                row.since_unix_ms,
                row.until_unix_ms,
                row.cause,
                row.stream_id
            ],
        ),
        Change::End(scope) => tx.execute("DELETE FROM degraded WHERE scope = ?1", [scope]),
        Change::Conversation(c) => tx.execute(
            "INSERT INTO conversations (key, turns_committed, tokens_committed,
                 tool_calls_committed, last_committed_turn, turns_failed)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT (key) DO UPDATE SET turns_committed = excluded.turns_committed,
                 tokens_committed = excluded.tokens_committed,
                 tool_calls_committed = excluded.tool_calls_committed,
                 last_committed_turn = excluded.last_committed_turn,
                 turns_failed = excluded.turns_failed",
            params![
                c.key,
                c.turns_committed,
                c.tokens_committed,
                c.tool_calls_committed,
                c.last_committed_turn,
                c.turns_failed
            ],
        ),
        Change::Circuit(c) => tx.execute(
            "INSERT INTO circuits (key, id, source, retained, body) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (key, id, source) DO UPDATE SET retained = excluded.retained,
                 body = excluded.body",
            params![c.key, c.id, c.source, c.retained, c.body.to_string()],
        ),
        Change::CircuitGone(key, id, source) => tx.execute(
            "DELETE FROM circuits WHERE key = ?1 AND id = ?2 AND source = ?3",
            params![key, id, source],
        ),
        Change::Dispatched(d) => tx.execute(
            "INSERT INTO dispatched (reference, body) VALUES (?1, ?2)
             ON CONFLICT (reference) DO UPDATE SET body = excluded.body",
            params![d.reference, d.body.to_string()],
        ),
        Change::ClientKey(k) => tx.execute(
            "INSERT INTO client_keys (id, body) VALUES (?1, ?2)
             ON CONFLICT (id) DO UPDATE SET body = excluded.body",
            params![k.id, k.body.to_string()],
        ),
        Change::KeyUsage(k) => tx.execute(
            "INSERT INTO key_usage (id, body) VALUES (?1, ?2)
             ON CONFLICT (id) DO UPDATE SET body = excluded.body",
            params![k.id, k.body.to_string()],
        ),
        Change::RuntimePolicy(v) => {
            return set_meta(tx, path, "runtime_policy", &v.to_string());
        }
        Change::IncidentLabel(l) => tx.execute(
            "INSERT INTO incident_labels (incident_seq, body) VALUES (?1, ?2)
             ON CONFLICT (incident_seq) DO UPDATE SET body = excluded.body",
            params![l.incident_seq, l.body.to_string()],
        ),
    }
    .map(drop)
    .map_err(sql(path, change.op()))
}

impl Change {
    /// What writing it is, for an error.
    fn op(&self) -> &'static str {
        match self {
            Change::Degrade(_) | Change::End(_) => "writing a degraded scope",
            Change::Conversation(_) => "writing a conversation's committed state",
            Change::Circuit(_) | Change::CircuitGone(..) => "writing TokenCircuit's memory",
            Change::Dispatched(_) => "writing a dispatched call",
            Change::ClientKey(_) => "writing a client key",
            Change::KeyUsage(_) => "writing a key's usage",
            Change::RuntimePolicy(_) => "writing the runtime policy",
            Change::IncidentLabel(_) => "writing an incident label",
        }
    }
}

fn set_point(tx: &Transaction<'_>, path: &Path, point: &Point) -> Result<(), StateError> {
    set_meta(tx, path, "ledger_seq", &point.seq.to_string())?;
    set_meta(tx, path, "ledger_hash", &point.hash)
}

/// Applies each batch's changes and moves the point to its point, in order, all in one
/// transaction.
pub fn apply(
    conn: &mut Connection,
    path: &Path,
    batches: &[(Option<Point>, Vec<Change>)],
) -> Result<(), StateError> {
    let tx = conn
        .transaction()
        .map_err(sql(path, "beginning a change"))?;
    for (point, changes) in batches {
        for c in changes {
            write_change(&tx, path, c)?;
        }
        if let Some(p) = point {
            set_point(&tx, path, p)?;
        }
    }
    tx.commit().map_err(sql(path, "committing a change"))
}

/// Replaces everything the store holds with `held`, in one transaction.
pub fn replace(conn: &mut Connection, path: &Path, held: &Snapshot) -> Result<(), StateError> {
    let tx = conn
        .transaction()
        .map_err(sql(path, "beginning a change"))?;
    tx.execute("DELETE FROM degraded", [])
        .map_err(sql(path, "clearing the degraded scopes"))?;
    for table in [
        "conversations",
        "circuits",
        "dispatched",
        "client_keys",
        "key_usage",
        "incident_labels",
    ] {
        tx.execute(&format!("DELETE FROM {table}"), [])
            .map_err(sql(path, "clearing a table"))?;
    }
    for row in &held.scopes {
        write_change(&tx, path, &Change::Degrade(row.clone()))?;
    }
    for c in &held.conversations {
        write_change(&tx, path, &Change::Conversation(c.clone()))?;
    }
    for c in &held.circuits {
        write_change(&tx, path, &Change::Circuit(c.clone()))?;
    }
    for d in &held.dispatched {
        write_change(&tx, path, &Change::Dispatched(d.clone()))?;
    }
    for k in &held.client_keys {
        write_change(&tx, path, &Change::ClientKey(k.clone()))?;
    }
    for k in &held.key_usage {
        write_change(&tx, path, &Change::KeyUsage(k.clone()))?;
    }
    for l in &held.incident_labels {
        write_change(&tx, path, &Change::IncidentLabel(l.clone()))?;
    }
    if let Some(p) = &held.ledger {
        set_point(&tx, path, p)?;
    }
    if let Some(check) = &held.node_check {
        set_meta(&tx, path, "node_check", check)?;
    }
    if let Some(v) = &held.runtime_policy {
        set_meta(&tx, path, "runtime_policy", &v.to_string())?;
    }
    tx.commit().map_err(sql(path, "committing a change"))
}
