//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while reading the files this crate parses.
///
/// Unwinding and symbolization themselves never fail: a sample whose files cannot be read
/// still yields frames (`Location::Unmapped`, `module+0x…` names) and an [`crate::UnwindEnd`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or `/proc` entry could not be opened or read.
    #[error("cannot read `{path}`")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file is not a 64-bit little-endian ELF file, or its headers are malformed.
    #[error("cannot parse ELF file `{path}`")]
    Elf {
        path: PathBuf,
        #[source]
        source: object::read::Error,
    },
    /// A line of a `/proc/PID/maps` file does not have the kernel's format.
    #[error("malformed line {line} in `{path}`: {reason}")]
    Maps {
        path: PathBuf,
        line: usize,
        reason: &'static str,
    },
    /// A line of `/proc/kallsyms` does not have the kernel's format.
    #[error("malformed line {line} in `{path}`: {reason}")]
    Kallsyms {
        path: PathBuf,
        line: usize,
        reason: &'static str,
    },
    /// `/proc/kallsyms` shows only zero addresses (kernel.kptr_restrict, or not root).
    #[error(
        "all addresses in `{path}` are zero; run as root and set `kernel.kptr_restrict` to 0 or 1 \
         to get kernel symbols"
    )]
    KallsymsHidden { path: PathBuf },
    /// A process does not map the executable `/proc/PID/exe` points at.
    #[error("process {pid} has no mapping of its executable `{exe}`")]
    ExecutableNotMapped { pid: u32, exe: PathBuf },
}
