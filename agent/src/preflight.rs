//! Checks that the machine can run the probes, with one sentence on what to do when it cannot:
//! privileges, BTF, tracefs (mounted here when missing) and the locked-memory limit.

use std::path::Path;

use anyhow::{bail, Result};
use tracing::{debug, info};

/// Capability bits from `include/uapi/linux/capability.h`.
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;
const CAP_SYS_PTRACE: u32 = 19;

const TRACEFS: &str = "/sys/kernel/tracing";
const DEBUGFS_TRACING: &str = "/sys/kernel/debug/tracing";

/// Runs every check the trace command needs, in the order a user would fix them.
pub fn check_all() -> Result<()> {
    check_privileges()?;
    check_btf()?;
    ensure_tracefs()?;
    raise_memlock_limit();
    Ok(())
}

fn effective_capabilities() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let hex = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .map(str::trim)
        .unwrap_or("0");
    Ok(u64::from_str_radix(hex, 16).unwrap_or(0))
}

fn check_privileges() -> Result<()> {
    let caps = effective_capabilities()?;
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    let bpf_ok = has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON));
    if !bpf_ok || !has(CAP_SYS_PTRACE) {
        bail!(
            "pgscope needs root (or CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE) to load BPF programs \
             and read Postgres processes' memory maps: run it with sudo"
        );
    }
    Ok(())
}

fn check_btf() -> Result<()> {
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        bail!(
            "this kernel exposes no BTF (/sys/kernel/btf/vmlinux is missing): pgscope needs a \
             kernel built with CONFIG_DEBUG_INFO_BTF (Debian 11+, RHEL 8.2+, Ubuntu 20.10+)"
        );
    }
    Ok(())
}

/// Tracepoint programs are attached by their id under tracefs; mount it when it is missing.
pub fn ensure_tracefs() -> Result<()> {
    if Path::new(TRACEFS).join("events").is_dir() || Path::new(DEBUGFS_TRACING).join("events").is_dir() {
        return Ok(());
    }
    info!("tracefs is not mounted; mounting it on {TRACEFS}");
    let target = std::ffi::CString::new(TRACEFS)?;
    let fstype = std::ffi::CString::new("tracefs")?;
    let source = std::ffi::CString::new("nodev")?;
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let error = std::io::Error::last_os_error();
        bail!(
            "tracefs is not mounted and mounting it failed ({error}): run \
             `mount -t tracefs nodev {TRACEFS}` as root, or in a container mount the host's {TRACEFS}"
        );
    }
    Ok(())
}

/// Kernels before 5.11 charge BPF maps against RLIMIT_MEMLOCK; newer ones ignore it.
fn raise_memlock_limit() {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit only reads the struct passed by reference.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        debug!(
            "could not raise RLIMIT_MEMLOCK: {}",
            std::io::Error::last_os_error()
        );
    }
}
