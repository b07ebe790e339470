//! `--user` and `--group`: the unprivileged account haltd switches to after loading the gate.
//!
//! The names are resolved when the flags are validated (a missing user is a configuration
//! error, exit 2). The switch itself ([`switch_to`]) runs while the main thread is the only
//! thread: it sets the supplementary groups of the user (as `login` and systemd's `User=` do),
//! then the group, then the user, all three ids (real, effective, saved), with keep-caps on so
//! that the capabilities the watchdog still needs survive until [`super::drop_thread`].
//! Everything haltd opens after the switch (the ledger, the state directory, the crash file)
//! is opened as that user, so they must be the user's.

use std::{ffi::CString, io};

use super::PrivError;

/// A resolved `--user` (and `--group`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: libc::uid_t,
    /// `--group`, or the user's primary group.
    pub gid: libc::gid_t,
}

/// Why `--user` or `--group` does not resolve.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("{0:?}: no such user")]
    NoUser(String),
    #[error("{0:?}: no such group")]
    NoGroup(String),
    #[error("{0:?}: a name with a NUL byte")]
    Nul(String),
    #[error("looking up {name:?}: {source}")]
    Io {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("{0:?} is root: --user names the unprivileged account to switch to")]
    Root(String),
}

/// The getpw*_r / getgr*_r buffer: 16 KiB holds any sane entry.
const NSS_BUF: usize = 16 * 1024;

impl Account {
    /// Resolves `user` (a name or a uid with a passwd entry) and `group` (a name or a gid;
    /// default: the user's primary group).
    pub fn resolve(user: &str, group: Option<&str>) -> Result<Self, LookupError> {
        let (name, uid, primary) = passwd(user)?;
        if uid == 0 {
            return Err(LookupError::Root(user.to_owned()));
        }
        let gid = match group {
            Some(g) => group_id(g)?,
            None => primary,
        };
        Ok(Self { name, uid, gid })
    }
}

/// A passwd entry: (name, uid, primary gid).
fn passwd(user: &str) -> Result<(String, libc::uid_t, libc::gid_t), LookupError> {
    let cname = CString::new(user).map_err(|_| LookupError::Nul(user.to_owned()))?;
    // SAFETY: `passwd` is plain data; all-zero is a valid value to be overwritten.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; NSS_BUF];
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    let rc = match user.parse::<libc::uid_t>() {
        // SAFETY: every pointer is valid for the call; `buf` outlives it and `out` points
        // into `pw` or is null.
        Ok(uid) => unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut out) },
        // SAFETY: as above, with a NUL-terminated name.
        Err(_) => unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pw,
                buf.as_mut_ptr(),
                buf.len(),
                &mut out,
            )
        },
    };
    if rc != 0 {
        return Err(LookupError::Io {
            name: user.to_owned(),
            source: io::Error::from_raw_os_error(rc),
        });
    }
    if out.is_null() {
        return Err(LookupError::NoUser(user.to_owned()));
    }
    // SAFETY: on success `pw_name` points at a NUL-terminated string inside `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(pw.pw_name) }
        .to_string_lossy()
        .into_owned();
    Ok((name, pw.pw_uid, pw.pw_gid))
}

/// A group name (or a numeric gid) to its gid.
pub fn group_id(group: &str) -> Result<libc::gid_t, LookupError> {
    if let Ok(gid) = group.parse::<libc::gid_t>() {
        return Ok(gid);
    }
    let cname = CString::new(group).map_err(|_| LookupError::Nul(group.to_owned()))?;
    // SAFETY: `group` is plain data; all-zero is a valid value to be overwritten.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; NSS_BUF];
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buf` outlives it and `out` points into
    // `grp` or is null.
    let rc = unsafe {
        libc::getgrnam_r(
            cname.as_ptr(),
            &mut grp,
            buf.as_mut_ptr(),
            buf.len(),
            &mut out,
        )
    };
    if rc != 0 {
        return Err(LookupError::Io {
            name: group.to_owned(),
            source: io::Error::from_raw_os_error(rc),
        });
    }
    if out.is_null() {
        return Err(LookupError::NoGroup(group.to_owned()));
    }
    Ok(grp.gr_gid)
}

/// Switches the process to `account`, keeping its capabilities: supplementary groups, gid,
/// uid (real, effective and saved), with keep-caps set across the uid change, then the
/// effective set raised again from the permitted one (a uid change clears it). Call it while
/// the calling thread is the only thread ([`super::only_thread`]).
pub fn switch_to(account: &Account) -> Result<(), PrivError> {
    let fail = |op: &'static str| {
        let source = io::Error::last_os_error();
        PrivError::Switch {
            user: account.name.clone(),
            uid: account.uid,
            gid: account.gid,
            op,
            source,
        }
    };
    let cname = CString::new(account.name.as_str()).map_err(|_| PrivError::Switch {
        user: account.name.clone(),
        uid: account.uid,
        gid: account.gid,
        op: "the user name",
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })?;
    caps::securebits::set_keepcaps(true).map_err(super::caps_err("setting keep-caps"))?;
    // SAFETY: plain syscalls (through libc) with valid arguments; `cname` outlives the call.
    unsafe {
        if libc::initgroups(cname.as_ptr(), account.gid) != 0 {
            return Err(fail("initgroups"));
        }
        if libc::setresgid(account.gid, account.gid, account.gid) != 0 {
            return Err(fail("setresgid"));
        }
        if libc::setresuid(account.uid, account.uid, account.uid) != 0 {
            return Err(fail("setresuid"));
        }
    }
    caps::securebits::set_keepcaps(false).map_err(super::caps_err("clearing keep-caps"))?;
    let permitted = caps::read(None, caps::CapSet::Permitted)
        .map_err(super::caps_err("reading the permitted set"))?;
    caps::set(None, caps::CapSet::Effective, &permitted).map_err(super::caps_err(
        "raising the effective set after the switch",
    ))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_groups_resolve_by_name_and_number_and_a_missing_one_is_named() {
        // uid 0 has a passwd entry everywhere; it is refused as the account to switch to.
        assert!(matches!(
            Account::resolve("root", None),
            Err(LookupError::Root(_))
        ));
        assert!(matches!(
            Account::resolve("0", None),
            Err(LookupError::Root(_))
        ));
        let missing = Account::resolve("haltd-no-such-user-x", None).expect_err("a missing user");
        assert!(matches!(missing, LookupError::NoUser(_)), "{missing}");
        assert_eq!(
            missing.to_string(),
            "\"haltd-no-such-user-x\": no such user"
        );
        assert_eq!(group_id("0").ok(), Some(0));
        assert_eq!(group_id("root").ok(), Some(0));
        assert!(matches!(
            group_id("haltd-no-such-group-x"),
            Err(LookupError::NoGroup(_))
        ));
        assert!(matches!(group_id("a\0b"), Err(LookupError::Nul(_))));
    }
}
