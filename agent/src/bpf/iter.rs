//! Running a BPF iterator on demand: aya attaches an iterator program but hands out its link
//! only to turn it into one file, read once. A sampler runs its iterator every tick, so the
//! link is created here with the raw `bpf(2)` call and kept, and each run creates a fresh
//! iterator from it (`BPF_ITER_CREATE`) and reads it to the end: the program runs for every
//! object during the read.

use std::fs::File;
use std::io::{self, Read};
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `BPF_LINK_CREATE` and `BPF_ITER_CREATE` (include/uapi/linux/bpf.h).
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_ITER_CREATE: libc::c_long = 33;
/// `enum bpf_attach_type`: BPF_TRACE_ITER.
const BPF_TRACE_ITER: u32 = 28;

/// The `union bpf_attr` member of `BPF_LINK_CREATE`, up to the iterator's fields (the kernel
/// takes the size given and zero-fills the rest).
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    iter_info: u64,
    iter_info_len: u32,
    _pad: u32,
}

/// The `union bpf_attr` member of `BPF_ITER_CREATE`.
#[repr(C)]
struct IterCreateAttr {
    link_fd: u32,
    flags: u32,
}

/// An iterator program attached (its link); dropping it detaches the program.
pub struct IterLink {
    link: OwnedFd,
}

fn bpf(command: libc::c_long, attr: *const u8, size: usize) -> io::Result<OwnedFd> {
    // SAFETY: attr points at a bpf_attr member of `size` bytes, valid for the call; the
    // commands used here return a new descriptor or -1.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, command, attr, size) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

impl IterLink {
    /// Attaches the loaded iterator program `program` (no iterator parameters: every object).
    pub fn attach(program: BorrowedFd<'_>) -> io::Result<Self> {
        let attr = LinkCreateAttr {
            prog_fd: program.as_raw_fd() as u32,
            attach_type: BPF_TRACE_ITER,
            ..LinkCreateAttr::default()
        };
        let link = bpf(
            BPF_LINK_CREATE,
            (&attr as *const LinkCreateAttr).cast(),
            size_of::<LinkCreateAttr>(),
        )?;
        Ok(Self { link })
    }

    /// Runs the program over every object once; returns the bytes it printed (a program that
    /// prints nothing returns 0).
    pub fn run(&self) -> io::Result<usize> {
        let attr = IterCreateAttr {
            link_fd: self.link.as_fd().as_raw_fd() as u32,
            flags: 0,
        };
        let iter = bpf(
            BPF_ITER_CREATE,
            (&attr as *const IterCreateAttr).cast(),
            size_of::<IterCreateAttr>(),
        )?;
        let mut file = File::from(iter);
        let mut buffer = [0u8; 4096];
        let mut total = 0;
        loop {
            match file.read(&mut buffer) {
                Ok(0) => return Ok(total),
                Ok(n) => total += n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error),
            }
        }
    }
}
