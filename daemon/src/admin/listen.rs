//! Where the admin API listens, and binding it.
//!
//! By default a Unix socket (`/run/haltd/admin.sock`, mode 0660): the file system decides who
//! may connect, and every request carries the caller's uid and pid (SO_PEERCRED) into its
//! ledger record. A TCP listener, loopback included, is allowed only with a bearer token
//! (`--admin-token-file`, checked in [`crate::config`]): on a TCP port any local user, and any
//! web page a browser on the node opens, can otherwise reach it.

use std::{
    io,
    os::unix::{
        fs::{FileTypeExt, PermissionsExt},
        net::{UnixListener, UnixStream},
    },
    path::Path,
};

use crate::{config::AdminAddr, reuseport::Sharing};

/// Mode of the admin socket: owner (root) and the admin group may connect.
const SOCKET_MODE: u32 = 0o660;

/// A bound admin listener, not yet handed to tokio.
#[derive(Debug)]
pub enum AdminListener {
    Unix(UnixListener),
    Tcp(std::net::TcpListener),
}

/// Binds the admin listener. A Unix socket gets mode 0660 and, with `group`, that group.
/// `sharing`: [`Sharing::TakeOver`] once the haltd answering there handed over to this one,
/// whose socket then replaces its predecessor's (a TCP listener joins its port's group).
pub fn bind_admin(
    addr: &AdminAddr,
    group: Option<&str>,
    sharing: Sharing,
) -> io::Result<AdminListener> {
    match addr {
        AdminAddr::Tcp(a) => crate::admin::bind(*a, "admin", sharing).map(AdminListener::Tcp),
        AdminAddr::Unix(path) => bind_unix(path, group, sharing)
            .map(AdminListener::Unix)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("binding --admin unix:{}: {e}", path.display()),
                )
            }),
    }
}

fn bind_unix(path: &Path, group: Option<&str>, sharing: Sharing) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // Taking over, the predecessor keeps its socket until this haltd serves: this one binds
    // beside it and takes the name only then ([`take_staged_socket`]), so that a start that
    // fails leaves the running haltd reachable.
    let staged;
    let path = if sharing == Sharing::TakeOver {
        staged = staged_path(path);
        &staged
    } else {
        path
    };
    remove_stale_socket(path)?;
    let listener = UnixListener::bind(path)?;
    let gid = group.map(group_id).transpose()?;
    set_owner_and_mode(path, gid)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Where a successor binds its admin socket until it serves: `PATH.next`.
fn staged_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".next");
    name.into()
}

/// A successor that serves now takes the admin socket's name (`rename(2)` over the
/// predecessor's, which keeps its own connections): `haltctl` reaches this haltd from now on.
pub fn take_staged_socket(addr: &AdminAddr) -> io::Result<()> {
    match addr {
        AdminAddr::Unix(path) => std::fs::rename(staged_path(path), path),
        AdminAddr::Tcp(_) => Ok(()),
    }
}

/// A socket file left by a haltd that is gone is removed; one that answers belongs to a
/// running haltd, and anything else is not ours to delete.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket; not replacing it",
        ));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "another process answers on this socket (is another haltd running?)",
        ));
    }
    std::fs::remove_file(path)
}

fn set_owner_and_mode(path: &Path, gid: Option<libc::gid_t>) -> io::Result<()> {
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
}

/// `--admin-group` (a name or a gid) to its gid.
fn group_id(name: &str) -> io::Result<libc::gid_t> {
    crate::privs::account::group_id(name).map_err(|e| {
        let kind = match e {
            crate::privs::account::LookupError::NoGroup(_) => io::ErrorKind::NotFound,
            _ => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, format!("--admin-group {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_gets_mode_0660_and_a_stale_one_is_replaced() {
        let dir = std::env::temp_dir().join(format!("haltd-admin-{}", std::process::id()));
        let path = dir.join("sub/admin.sock");
        let first = bind_unix(&path, Some("0"), Sharing::Alone).expect("test setup");
        let mode = std::fs::metadata(&path)
            .expect("test setup")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o660);
        // A live socket is not taken over.
        let err = bind_unix(&path, None, Sharing::Alone).expect_err("must fail");
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        drop(first);
        // Its owner gone, the file is stale and replaced.
        let _second = bind_unix(&path, None, Sharing::Alone).expect("test setup");
        // A regular file is never deleted.
        let file = dir.join("not-a-socket");
        std::fs::write(&file, b"x").expect("test setup");
        assert!(bind_unix(&file, None, Sharing::Alone).is_err());
        assert!(file.exists());
        std::fs::remove_dir_all(&dir).expect("test setup");
    }
}
