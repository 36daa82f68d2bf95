//! Host preconditions: root, BPF, the unprivileged user Postgres runs as, and the lock that keeps
//! one test cluster alive at a time.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::process::run_checked;

/// The system user test clusters run as: `initdb` and `postgres` refuse to run as root.
pub const TEST_USER: &str = "pgscope-test";

/// Where the kernel exposes its BTF; BPF CO-RE needs it (Linux 5.4+ with `CONFIG_DEBUG_INFO_BTF`).
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// Panics unless the test can load BPF programs: running as root on a kernel with BTF.
/// Tests that need BPF call this first, so they fail with this message instead of passing by
/// skipping or failing later with an obscure one.
pub fn require_root_and_bpf() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert!(
        euid == 0,
        "this test loads BPF programs and must run as root (euid is {euid}); \
         run `sudo -E cargo test -p pgscope-tests -- --test-threads=1`"
    );
    assert!(
        Path::new(VMLINUX_BTF).exists(),
        "`{VMLINUX_BTF}` is missing: this kernel has no BTF (CONFIG_DEBUG_INFO_BTF), which pgscope needs"
    );
}

/// uid and gid of a system user.
#[derive(Debug, Clone, Copy)]
pub struct UserIds {
    pub uid: u32,
    pub gid: u32,
}

/// Returns the ids of [`TEST_USER`], creating it (a system user with no home and no login shell)
/// when it does not exist yet. Needs root.
pub fn ensure_test_user() -> Result<UserIds> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "test clusters need root: the harness creates `{TEST_USER}` and runs Postgres as it; run as root"
        );
    }
    if let Some(ids) = lookup_user(TEST_USER)? {
        return Ok(ids);
    }
    run_checked(
        Command::new("useradd").args([
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            TEST_USER,
        ]),
        Duration::from_secs(30),
    )
    .with_context(|| format!("cannot create the system user `{TEST_USER}` Postgres runs as"))?;
    lookup_user(TEST_USER)?
        .with_context(|| format!("`useradd {TEST_USER}` succeeded but the user is unknown"))
}

fn lookup_user(name: &str) -> Result<Option<UserIds>> {
    let cname = CString::new(name)?;
    // SAFETY: getpwnam receives a valid NUL-terminated string; the returned record is read at
    // once, before any other call that could overwrite the static buffer.
    let pw = unsafe { libc::getpwnam(cname.as_ptr()) };
    if pw.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null pointer returned by getpwnam points to a valid passwd record.
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    Ok(Some(UserIds { uid, gid }))
}

/// Changes the owner of `path` (not recursive).
pub fn chown(path: &Path, ids: UserIds) -> Result<()> {
    std::os::unix::fs::chown(path, Some(ids.uid), Some(ids.gid))
        .with_context(|| format!("cannot chown `{}` to {TEST_USER}", path.display()))
}

/// An exclusive `flock` on a file shared by every test process: whoever holds it may run a
/// cluster. Test binaries run in parallel under `cargo test` and two clusters plus the profiler
/// would fight over 2 cores, skewing every CPU-share assertion.
pub struct ClusterLock {
    _file: File,
}

impl ClusterLock {
    /// Blocks until no other test holds the lock.
    pub fn acquire() -> Result<Self> {
        let path = std::env::temp_dir().join("pgscope-tests.cluster.lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("cannot open lock file `{}`", path.display()))?;
        // SAFETY: the descriptor is valid for the lifetime of `file`; the lock is released when
        // the file is closed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            bail!(
                "cannot lock `{}`: {}",
                path.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(ClusterLock { _file: file })
    }
}
