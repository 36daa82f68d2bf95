//! Reading a file the user named (`--config`, `report --from`, `pyroscope.ca_file`): only a
//! regular file, and only up to a cap. `/dev/zero`, a FIFO nobody writes to, or a runaway file
//! would otherwise make pgscope read (or wait) forever, or fill its memory.

use std::fs::Metadata;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Largest agent configuration file: a real one is a few KiB.
pub const CONFIG_MAX_BYTES: u64 = 1 << 20;
/// Largest PEM bundle for `pyroscope.ca_file`: the whole Mozilla bundle is ~220 KiB.
pub const CA_MAX_BYTES: u64 = 1 << 20;
/// Largest recording `report --from` reads. Recordings are JSON of distinct stacks, not of
/// samples: a 10 s `trace --instance --off-cpu --probes LockRelationOid,GetCachedPlan` of
/// pgbench (2 clients, 99 Hz) measured 652 KiB, and distinct stacks grow far slower than the
/// duration. 1 GiB leaves room for hour-long traces of busy hosts, while parsing one still
/// fits in a few GiB of memory.
pub const RECORDING_MAX_BYTES: u64 = 1 << 30;

/// The whole file at `path`, which must be a regular file of at most `cap` bytes. `what`
/// names the file in errors (`the config file`, `pyroscope.ca_file`).
pub fn read(path: &Path, what: &str, cap: u64) -> Result<Vec<u8>> {
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, before the
    // type could be checked. It changes nothing for a regular file.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .with_context(|| format!("cannot open {what} `{}`", path.display()))?;
    // The type and size of what was opened, not of what the path named a moment before.
    let metadata = file
        .metadata()
        .with_context(|| format!("cannot stat {what} `{}`", path.display()))?;
    if !metadata.is_file() {
        bail!(
            "{what} `{}` is {}, not a regular file: give the path of a file",
            path.display(),
            kind(&metadata)
        );
    }
    if metadata.len() > cap {
        bail!(
            "{what} `{}` is {}, over the {} limit for {what}",
            path.display(),
            size(metadata.len()),
            size(cap)
        );
    }
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    // One byte more than allowed: a file that grows while read is caught too.
    file.take(cap + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {what} `{}`", path.display()))?;
    if bytes.len() as u64 > cap {
        bail!(
            "{what} `{}` grew past the {} limit for {what} while being read",
            path.display(),
            size(cap)
        );
    }
    Ok(bytes)
}

/// Like [`read`], for a text file: it must be UTF-8.
pub fn read_to_string(path: &Path, what: &str, cap: u64) -> Result<String> {
    String::from_utf8(read(path, what, cap)?).map_err(|error| {
        anyhow::anyhow!(
            "{what} `{}` is not UTF-8 text: {}",
            path.display(),
            error.utf8_error()
        )
    })
}

fn kind(metadata: &Metadata) -> &'static str {
    let kind = metadata.file_type();
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Bytes in the largest binary unit that keeps the number at least 1.
fn size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, scale) in UNITS {
        if bytes >= scale {
            return if bytes.is_multiple_of(scale) {
                format!("{} {unit}", bytes / scale)
            } else {
                format!("{:.1} {unit}", bytes as f64 / scale as f64)
            };
        }
    }
    format!("{bytes} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::fs::File;
    use std::time::{Duration, Instant};

    fn error_of(path: &Path, cap: u64) -> String {
        format!("{:#}", read(path, "the test file", cap).expect_err("refused"))
    }

    #[test]
    fn a_regular_file_within_the_cap_is_read_whole() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("f");
        std::fs::write(&path, b"0123456789").expect("write");
        assert_eq!(read(&path, "the test file", 10).expect("read"), b"0123456789");
        assert_eq!(
            read_to_string(&path, "the test file", 64).expect("read"),
            "0123456789"
        );
    }

    #[test]
    fn a_directory_is_refused_with_its_kind() {
        let dir = tempfile::tempdir().expect("temp dir");
        let error = error_of(dir.path(), 1024);
        assert!(error.contains("is a directory, not a regular file"), "{error}");
        assert!(error.contains(&dir.path().display().to_string()), "{error}");
    }

    #[test]
    fn dev_zero_is_refused_at_once() {
        let started = Instant::now();
        let error = error_of(Path::new("/dev/zero"), CONFIG_MAX_BYTES);
        assert!(error.contains("`/dev/zero` is a character device"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_fifo_without_writer_is_refused_without_waiting() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("fifo");
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL in a temp path");
        // SAFETY: mkfifo reads a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo");
        // Without O_NONBLOCK the open would block for ever: run it on a thread and bound it.
        let (done, result) = std::sync::mpsc::channel();
        let fifo = path.clone();
        std::thread::spawn(move || {
            let _ = done.send(read(&fifo, "the test file", 1024).map_err(|e| format!("{e:#}")));
        });
        let outcome = result
            .recv_timeout(Duration::from_secs(10))
            .expect("reading a FIFO without a writer returned within 10 s");
        let error = outcome.expect_err("a FIFO is refused");
        assert!(error.contains("is a FIFO, not a regular file"), "{error}");
    }

    #[test]
    fn an_oversize_file_is_refused_with_its_size_and_the_cap() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("sparse");
        // Sparse: 3 GiB long without using the disk.
        let file = File::create(&path).expect("create");
        file.set_len(3 << 30).expect("set_len");
        let error = error_of(&path, RECORDING_MAX_BYTES);
        assert!(
            error.contains("is 3 GiB, over the 1 GiB limit for the test file"),
            "{error}"
        );
        std::fs::write(&path, vec![b'x'; 1536]).expect("write");
        let error = error_of(&path, 1024);
        assert!(error.contains("is 1.5 KiB, over the 1 KiB limit"), "{error}");
        // At the cap exactly is fine.
        assert_eq!(read(&path, "the test file", 1536).expect("read").len(), 1536);
    }

    #[test]
    fn a_missing_file_names_the_path() {
        let error = error_of(Path::new("/nonexistent/pgscope.toml"), 1024);
        assert!(
            error.contains("cannot open the test file `/nonexistent/pgscope.toml`"),
            "{error}"
        );
    }

    #[test]
    fn text_must_be_utf8() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("bin");
        std::fs::write(&path, [0xff, 0xfe, 0x00]).expect("write");
        let error = format!(
            "{:#}",
            read_to_string(&path, "the test file", 64).expect_err("refused")
        );
        assert!(error.contains("is not UTF-8 text"), "{error}");
    }
}
