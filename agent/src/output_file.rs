//! Files pgscope writes for the operator (flamegraphs, folded stacks, pprof, JSON, recordings,
//! reports). They can hold SQL literals — the text of DO blocks and of statements
//! pg_stat_statements did not normalize — so they are created readable by their owner only
//! (0600) unless `--output-mode` says otherwise, and an existing file gets the mode too.
//! Every path is checked before profiling starts: a typo must not cost a trace.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::{File, OpenOptions, Permissions};
use std::io::{BufWriter, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context, Result};

/// The permission bits of a file pgscope writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputMode(u32);

impl OutputMode {
    /// Owner read and write only: the files may hold query texts with their literals.
    pub const PRIVATE: OutputMode = OutputMode(0o600);

    pub fn bits(self) -> u32 {
        self.0
    }
}

impl Default for OutputMode {
    fn default() -> Self {
        Self::PRIVATE
    }
}

impl FromStr for OutputMode {
    type Err = String;

    /// Octal permission bits as `chmod` takes them: `600`, `0640`, `0o644`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let digits = text.strip_prefix("0o").unwrap_or(text);
        let bits = u32::from_str_radix(digits, 8)
            .map_err(|_| format!("`{text}` is not an octal file mode such as 0600 or 0640"))?;
        // Set-id and sticky bits have no business on a data file.
        if bits > 0o777 {
            return Err(format!(
                "`{text}` sets more than the read/write/execute bits: give a mode up to 0777"
            ));
        }
        if bits & 0o200 == 0 {
            return Err(format!(
                "`{text}` leaves the owner unable to write the file: give at least 0200 (e.g. 0600)"
            ));
        }
        Ok(Self(bits))
    }
}

/// Writes `bytes` to `path` with `mode`.
pub fn write(path: &Path, mode: OutputMode, bytes: &[u8]) -> Result<()> {
    write_with(path, mode, |writer| writer.write_all(bytes))
}

/// Writes `path` with `mode`, `fill` writing through a buffer.
///
/// A file is written beside its final name and renamed over it when complete: pgscope runs as
/// root, and writing through the path could follow a symlink planted in a shared directory
/// (the rename replaces the link, not its target); a reader that had the old file open never
/// sees the new contents; and a failure leaves the old file whole, not half written. What is
/// not a file — `/dev/stdout`, a FIFO — is written in place, its mode left alone.
pub fn write_with<E>(
    path: &Path,
    mode: OutputMode,
    fill: impl FnOnce(&mut BufWriter<File>) -> Result<(), E>,
) -> Result<()>
where
    E: std::error::Error + Send + Sync + 'static,
{
    // What the path names in the end: a stream (`/dev/stdout` is a symlink to one) is written
    // in place; a disk never.
    let target = std::fs::metadata(path).ok().map(|m| m.file_type());
    if target.is_some_and(|t| t.is_block_device()) {
        anyhow::bail!("`{}` is a block device: give the path of a file", path.display());
    }
    let writes_in_place = target.is_some_and(|t| t.is_fifo() || t.is_char_device() || t.is_socket());
    if writes_in_place {
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .with_context(|| format!("cannot open `{}` for writing", path.display()))?;
        return fill_and_flush(BufWriter::new(file), path, fill);
    }
    let staging = staging_path(path);
    let written = create_new(&staging, mode)
        .and_then(|file| fill_and_flush(BufWriter::new(file), path, fill))
        .and_then(|()| {
            std::fs::rename(&staging, path)
                .with_context(|| format!("cannot move the new `{}` into place", path.display()))
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&staging);
    }
    written
}

fn fill_and_flush<E>(
    mut writer: BufWriter<File>,
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<File>) -> Result<(), E>,
) -> Result<()>
where
    E: std::error::Error + Send + Sync + 'static,
{
    fill(&mut writer).with_context(|| format!("writing `{}`", path.display()))?;
    writer
        .flush()
        .with_context(|| format!("writing `{}`", path.display()))
}

/// A name beside `path` that no one else uses: hidden, with pgscope's PID.
fn staging_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.pgscope-{}.tmp", std::process::id()))
}

/// A new file (never an existing one, nor through a symlink) with exactly `mode`.
fn create_new(path: &Path, mode: OutputMode) -> Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode.bits())
        .open(path)
        .with_context(|| format!("cannot create `{}`", path.display()))?;
    // The umask may have taken bits away.
    file.set_permissions(Permissions::from_mode(mode.bits()))
        .with_context(|| format!("cannot set the mode of `{}`", path.display()))?;
    Ok(file)
}

/// One file a run is asked to write: the option that named it and its path.
#[derive(Clone, Debug)]
pub struct Planned {
    pub option: String,
    pub path: PathBuf,
}

impl Planned {
    pub fn new(option: impl Into<String>, path: &Path) -> Self {
        Self {
            option: option.into(),
            path: path.to_path_buf(),
        }
    }
}

/// Checks, before any work, that each planned file can be written: its directory exists and
/// takes new files, the path is not a directory, and no two outputs name the same file (the
/// second would overwrite the first). Nothing is created.
pub fn check_all(planned: &[Planned]) -> Result<()> {
    let mut problems = Vec::new();
    let mut seen: HashMap<PathBuf, &Planned> = HashMap::new();
    for output in planned {
        match check(&output.path) {
            Ok(identity) => {
                if let Some(first) = seen.get(&identity) {
                    problems.push(format!(
                        "{} `{}` is the same file as {} `{}`: give each output its own path",
                        output.option,
                        output.path.display(),
                        first.option,
                        first.path.display()
                    ));
                } else {
                    seen.insert(identity, output);
                }
            }
            Err(why) => problems.push(format!("{} `{}`: {why}", output.option, output.path.display())),
        }
    }
    if !problems.is_empty() {
        bail!("these outputs cannot be written:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// The file `path` would be (its directory resolved), or why it cannot be written.
fn check(path: &Path) -> Result<PathBuf, String> {
    let Some(name) = path.file_name() else {
        return Err("names a directory, not a file: add a file name".to_string());
    };
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let resolved = directory
        .canonicalize()
        .map_err(|error| format!("its directory `{}` cannot be used: {error}", directory.display()))?;
    if !resolved.is_dir() {
        return Err(format!("`{}` is not a directory", directory.display()));
    }
    let file = resolved.join(name);
    match std::fs::metadata(&file) {
        Ok(metadata) if metadata.is_dir() => {
            return Err("is a directory: give the path of a file".to_string());
        }
        // An existing file is replaced: it must take writes (a read-only mount, chattr +i).
        Ok(_) => may_write(&file)?,
        // A new file: its directory must take new entries.
        Err(_) => may_write(&resolved)?,
    }
    Ok(file)
}

/// access(2) for writing: as root it still refuses read-only file systems and immutable files.
fn may_write(path: &Path) -> Result<(), String> {
    let c_path =
        CString::new(path.as_os_str().as_bytes()).map_err(|_| "the path holds a NUL byte".to_string())?;
    // SAFETY: c_path is a valid NUL-terminated string for the duration of the call.
    if unsafe { libc::access(c_path.as_ptr(), libc::W_OK) } == 0 {
        return Ok(());
    }
    Err(format!(
        "`{}` is not writable: {}",
        path.display(),
        std::io::Error::last_os_error()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(path: &Path) -> u32 {
        std::fs::metadata(path).expect("stat").permissions().mode() & 0o7777
    }

    #[test]
    fn parses_octal_modes() {
        assert_eq!("600".parse::<OutputMode>(), Ok(OutputMode(0o600)));
        assert_eq!("0640".parse::<OutputMode>(), Ok(OutputMode(0o640)));
        assert_eq!("0o644".parse::<OutputMode>(), Ok(OutputMode(0o644)));
        for bad in ["", "999", "abc", "4755", "0400", "-600", "0x1a4"] {
            assert!(bad.parse::<OutputMode>().is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn new_and_existing_files_get_the_mode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let new = dir.path().join("new.json");
        write(&new, OutputMode::PRIVATE, b"{}").expect("write");
        assert_eq!(mode_of(&new), 0o600);
        let old = dir.path().join("old.svg");
        std::fs::write(&old, b"old").expect("write");
        std::fs::set_permissions(&old, Permissions::from_mode(0o644)).expect("chmod");
        write(&old, OutputMode::PRIVATE, b"new").expect("write");
        assert_eq!(mode_of(&old), 0o600);
        assert_eq!(std::fs::read(&old).expect("read"), b"new");
        let shared = dir.path().join("shared.folded");
        write(&shared, OutputMode(0o640), b"x").expect("write");
        assert_eq!(mode_of(&shared), 0o640);
    }

    #[test]
    fn a_planted_symlink_is_replaced_not_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").expect("write");
        let link = dir.path().join("out.svg");
        std::os::unix::fs::symlink(&victim, &link).expect("symlink");
        write(&link, OutputMode::PRIVATE, b"<svg/>").expect("write");
        assert_eq!(std::fs::read(&victim).expect("read"), b"precious");
        assert!(!std::fs::symlink_metadata(&link).expect("stat").is_symlink());
        assert_eq!(std::fs::read(&link).expect("read"), b"<svg/>");
        assert_eq!(mode_of(&link), 0o600);
    }

    #[test]
    fn a_reader_of_the_old_file_does_not_see_the_new_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("out.json");
        std::fs::write(&path, b"old").expect("write");
        let mut reader = File::open(&path).expect("open");
        write(&path, OutputMode::PRIVATE, b"new secret").expect("write");
        let mut seen = String::new();
        std::io::Read::read_to_string(&mut reader, &mut seen).expect("read");
        assert_eq!(seen, "old");
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("list").collect();
        assert_eq!(left.len(), 1, "a staging file was left behind");
    }

    #[test]
    fn what_is_not_a_file_is_written_in_place() {
        write(Path::new("/dev/null"), OutputMode::PRIVATE, b"x").expect("write /dev/null");
        let mode = std::fs::metadata("/dev/null").expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o666, "the mode of /dev/null was changed");
    }

    #[test]
    fn checks_name_each_bad_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = dir.path().join("out.svg");
        let planned = [
            Planned::new("--svg", &good),
            Planned::new("--json", &dir.path().join("missing/out.json")),
            Planned::new("--folded", dir.path()),
            Planned::new("--pprof", &dir.path().join(".").join("out.svg")),
        ];
        let error = format!("{:#}", check_all(&planned).expect_err("bad paths accepted"));
        assert!(error.contains("--json"), "{error}");
        assert!(error.contains("--folded"), "{error}");
        assert!(error.contains("same file as --svg"), "{error}");
        assert!(!good.exists(), "the check created a file");
        check_all(&planned[..1]).expect("a good path refused");
    }
}
