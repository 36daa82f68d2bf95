//! Reading a BPF task-storage map from user space: aya has no type for it, and its keys are
//! pidfds (the kernel finds the task through the descriptor), so this is the raw `bpf(2)` call.

use std::io;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `BPF_MAP_LOOKUP_ELEM` (include/uapi/linux/bpf.h).
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;

/// The `union bpf_attr` member of map element commands.
#[repr(C)]
pub(super) struct ElemAttr {
    pub(super) map_fd: u32,
    pub(super) _pad: u32,
    pub(super) key: u64,
    pub(super) value: u64,
    pub(super) flags: u64,
}

/// The value `map` holds for the thread-group leader `pid`; None when the process is gone or
/// has no value.
///
/// # Safety
/// `V` must be the map's value type: plain old data of exactly the map's value size.
pub unsafe fn lookup<V: Copy>(map: BorrowedFd<'_>, pid: u32) -> io::Result<Option<V>> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if raw < 0 {
        let error = io::Error::last_os_error();
        return match error.raw_os_error() {
            Some(libc::ESRCH) => Ok(None),
            _ => Err(error),
        };
    }
    // SAFETY: the descriptor was just returned by pidfd_open and is owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    let key: i32 = pidfd.as_raw_fd();
    let mut value = MaybeUninit::<V>::zeroed();
    let attr = ElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: &key as *const i32 as u64,
        value: value.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: attr points at valid key and value buffers of the map's sizes (the caller
    // guarantees V's) for the duration of the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_LOOKUP_ELEM,
            &attr as *const ElemAttr,
            size_of::<ElemAttr>(),
        )
    };
    if rc < 0 {
        let error = io::Error::last_os_error();
        return match error.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ESRCH) => Ok(None),
            _ => Err(error),
        };
    }
    // SAFETY: the kernel filled the value (the call succeeded) and V is plain old data.
    Ok(Some(unsafe { value.assume_init() }))
}
