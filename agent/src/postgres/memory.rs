//! Reading a Postgres process's memory from outside, for values its probes only point to
//! (e.g. the `__FILE__` and `__func__` strings of an `s_lock` call site) and names that live in
//! the server (extension LWLock tranches, background workers' types).

use std::fs::File;
use std::os::unix::fs::FileExt;

use anyhow::{bail, Context, Result};

/// `buf.len()` bytes at `address` in process `pid`.
fn read_exact(pid: u32, address: u64, buf: &mut [u8]) -> Result<()> {
    let path = format!("/proc/{pid}/mem");
    let mem = File::open(&path).with_context(|| format!("cannot open {path}"))?;
    mem.read_exact_at(buf, address)
        .with_context(|| format!("cannot read {} bytes of {path} at {address:#x}", buf.len()))
}

/// `buf.len()` bytes at `address` in process `pid`, read in one go.
pub fn read_into(pid: u32, address: u64, buf: &mut [u8]) -> Result<()> {
    read_exact(pid, address, buf)
}

/// The native-endian `u64` (e.g. a pointer) at `address` in process `pid`.
pub fn read_u64(pid: u32, address: u64) -> Result<u64> {
    let mut bytes = [0u8; 8];
    read_exact(pid, address, &mut bytes)?;
    Ok(u64::from_ne_bytes(bytes))
}

/// The native-endian `i32` (a C `int`) at `address` in process `pid`.
pub fn read_i32(pid: u32, address: u64) -> Result<i32> {
    let mut bytes = [0u8; 4];
    read_exact(pid, address, &mut bytes)?;
    Ok(i32::from_ne_bytes(bytes))
}

/// The NUL-terminated string at `address` in process `pid`, at most `max_len` bytes long.
/// Invalid UTF-8 is replaced rather than refused: the caller shows it to a person.
pub fn read_c_string(pid: u32, address: u64, max_len: usize) -> Result<String> {
    if address == 0 {
        bail!("null string pointer");
    }
    let path = format!("/proc/{pid}/mem");
    let mem = File::open(&path).with_context(|| format!("cannot open {path}"))?;
    let mut bytes = vec![0u8; max_len];
    // A string near the end of its mapping makes a long read fail: shrink until it succeeds.
    let mut len = max_len;
    let read = loop {
        match mem.read_at(&mut bytes[..len], address) {
            Ok(n) => break n,
            Err(error) if len > 16 => {
                tracing::trace!(%error, len, "shorter read of process memory");
                len /= 2;
            }
            Err(error) => return Err(error).with_context(|| format!("cannot read {path} at {address:#x}")),
        }
    };
    let text = &bytes[..read];
    let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    Ok(String::from_utf8_lossy(&text[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_string_of_this_process() {
        let text = c"pgscope memory test";
        let read = read_c_string(std::process::id(), text.as_ptr() as u64, 256).expect("readable");
        assert_eq!(read, "pgscope memory test");
    }

    #[test]
    fn reads_a_pointer_of_this_process() {
        let value: u64 = 0x0123_4567_89ab_cdef;
        let pid = std::process::id();
        assert_eq!(
            read_u64(pid, &value as *const u64 as u64).expect("readable"),
            value
        );
        assert!(read_u64(pid, 8).is_err());
        let int: i32 = -75;
        assert_eq!(read_i32(pid, &int as *const i32 as u64).expect("readable"), -75);
    }

    #[test]
    fn null_and_unmapped_addresses_are_errors() {
        assert!(read_c_string(std::process::id(), 0, 64).is_err());
        assert!(read_c_string(std::process::id(), 8, 64).is_err());
    }
}
