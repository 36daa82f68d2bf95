//! `/proc/PID/maps`: which file is mapped where in a process.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::Error;

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapEntry {
    /// First address of the mapping (inclusive).
    pub start: u64,
    /// End of the mapping (exclusive).
    pub end: u64,
    pub perms: Perms,
    /// Offset in the file of the byte mapped at `start` (page aligned).
    pub offset: u64,
    /// Device of the mapped file as (major, minor).
    pub dev: (u32, u32),
    /// Inode of the mapped file; 0 for anonymous mappings.
    pub inode: u64,
    pub path: MapPath,
}

/// The `rwxp` column.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Perms {
    pub read: bool,
    pub write: bool,
    pub exec: bool,
    /// `s` (shared) rather than `p` (private, copy-on-write).
    pub shared: bool,
}

/// The last column of a maps line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapPath {
    /// No name: anonymous memory (this includes JIT code).
    Anonymous,
    /// A kernel-provided name such as `[stack]`, `[heap]`, `[vdso]` or `[anon:name]`.
    Pseudo(String),
    /// A file, as seen from the process's mount namespace. `deleted` is set when the kernel
    /// appended ` (deleted)`: the file was removed or replaced after it was mapped.
    File { path: PathBuf, deleted: bool },
}

const DELETED_SUFFIX: &[u8] = b" (deleted)";

impl MapEntry {
    /// Parse one line (without its trailing newline).
    pub fn parse_line(line: &[u8]) -> Result<MapEntry, &'static str> {
        let mut rest = line;
        let range = next_field(&mut rest).ok_or("missing address range")?;
        let perms = next_field(&mut rest).ok_or("missing permissions")?;
        let offset = next_field(&mut rest).ok_or("missing offset")?;
        let dev = next_field(&mut rest).ok_or("missing device")?;
        let inode = next_field(&mut rest).ok_or("missing inode")?;

        let (start, end) = split_once(range, b'-').ok_or("address range without `-`")?;
        let start = parse_hex(start).ok_or("bad start address")?;
        let end = parse_hex(end).ok_or("bad end address")?;
        if end < start {
            return Err("end address below start address");
        }
        let perms = match perms {
            [r, w, x, p] => Perms {
                read: *r == b'r',
                write: *w == b'w',
                exec: *x == b'x',
                shared: *p == b's',
            },
            _ => return Err("permissions are not four characters"),
        };
        let offset = parse_hex(offset).ok_or("bad offset")?;
        let (major, minor) = split_once(dev, b':').ok_or("device without `:`")?;
        let dev = (
            parse_hex(major)
                .and_then(|v| u32::try_from(v).ok())
                .ok_or("bad device")?,
            parse_hex(minor)
                .and_then(|v| u32::try_from(v).ok())
                .ok_or("bad device")?,
        );
        let inode = std::str::from_utf8(inode)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or("bad inode")?;

        // The kernel pads with spaces up to a column, then prints the name verbatim, so a
        // name may itself contain spaces.
        let name = trim_start(rest);
        let path = if name.is_empty() {
            MapPath::Anonymous
        } else if name.first() == Some(&b'/') {
            let (name, deleted) = match name.strip_suffix(DELETED_SUFFIX) {
                Some(name) => (name, true),
                None => (name, false),
            };
            MapPath::File {
                path: PathBuf::from(OsStr::from_bytes(name)),
                deleted,
            }
        } else {
            MapPath::Pseudo(String::from_utf8_lossy(name).into_owned())
        };
        Ok(MapEntry {
            start,
            end,
            perms,
            offset,
            dev,
            inode,
            path,
        })
    }

    /// The mapped file, if this is a file mapping.
    pub fn file_path(&self) -> Option<&Path> {
        match &self.path {
            MapPath::File { path, .. } => Some(path),
            _ => None,
        }
    }

    pub fn contains(&self, addr: u64) -> bool {
        self.start <= addr && addr < self.end
    }
}

/// Parse a whole maps file. `source` only names the file in errors.
pub fn parse_maps(text: &[u8], source: &Path) -> Result<Vec<MapEntry>, Error> {
    let mut entries = Vec::new();
    for (index, line) in text.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let entry = MapEntry::parse_line(line).map_err(|reason| Error::Maps {
            path: source.to_path_buf(),
            line: index + 1,
            reason,
        })?;
        entries.push(entry);
    }
    Ok(entries)
}

/// Read and parse `/proc/PID/maps`.
pub fn read_maps(pid: u32) -> Result<Vec<MapEntry>, Error> {
    let path = PathBuf::from(format!("/proc/{pid}/maps"));
    let text = std::fs::read(&path).map_err(|source| Error::Io {
        path: path.clone(),
        source,
    })?;
    parse_maps(&text, &path)
}

fn next_field<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let trimmed = trim_start(rest);
    let len = trimmed.iter().position(|&b| b == b' ').unwrap_or(trimmed.len());
    if len == 0 {
        return None;
    }
    let (field, tail) = trimmed.split_at(len);
    *rest = tail;
    Some(field)
}

fn trim_start(s: &[u8]) -> &[u8] {
    let skip = s.iter().take_while(|&&b| b == b' ' || b == b'\t').count();
    &s[skip..]
}

fn split_once(s: &[u8], sep: u8) -> Option<(&[u8], &[u8])> {
    let i = s.iter().position(|&b| b == sep)?;
    Some((&s[..i], &s[i + 1..]))
}

fn parse_hex(s: &[u8]) -> Option<u64> {
    u64::from_str_radix(std::str::from_utf8(s).ok()?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c8a00000-55d0c8a86000 r--p 00000000 08:01 1311042                    /usr/lib/postgresql/15/bin/postgres
55d0c8a86000-55d0c8e2f000 r-xp 00086000 08:01 1311042                    /usr/lib/postgresql/15/bin/postgres
55d0ca1b2000-55d0ca2f4000 rw-p 00000000 00:00 0                          [heap]
7f31a8000000-7f31a8021000 rw-s 00000000 00:01 2052                       /dev/shm/PostgreSQL.1234 (deleted)
7f31a9c00000-7f31a9c28000 r-xp 00028000 fd:00 393218                     /opt/my dir/lib with spaces.so
7f31aa000000-7f31aa010000 rwxp 00000000 00:00 0 
7ffd5a3e5000-7ffd5a406000 rw-p 00000000 00:00 0                          [stack]
7ffd5a5f1000-7ffd5a5f3000 r-xp 00000000 00:00 0                          [vdso]
";

    #[test]
    fn parses_file_anonymous_pseudo_and_deleted_lines() {
        let maps = parse_maps(MAPS.as_bytes(), Path::new("maps")).expect("valid maps");
        assert_eq!(maps.len(), 8);

        let text = &maps[1];
        assert_eq!((text.start, text.end), (0x55d0c8a86000, 0x55d0c8e2f000));
        assert_eq!(text.offset, 0x86000);
        assert_eq!(text.dev, (8, 1));
        assert_eq!(text.inode, 1311042);
        assert!(text.perms.read && text.perms.exec && !text.perms.write && !text.perms.shared);
        assert_eq!(
            text.path,
            MapPath::File {
                path: PathBuf::from("/usr/lib/postgresql/15/bin/postgres"),
                deleted: false
            }
        );

        assert_eq!(maps[2].path, MapPath::Pseudo("[heap]".into()));
        assert!(maps[3].perms.shared);
        assert_eq!(
            maps[3].path,
            MapPath::File {
                path: PathBuf::from("/dev/shm/PostgreSQL.1234"),
                deleted: true
            }
        );
        assert_eq!(
            maps[4].file_path(),
            Some(Path::new("/opt/my dir/lib with spaces.so"))
        );
        assert_eq!(maps[4].dev, (0xfd, 0));
        assert_eq!(maps[5].path, MapPath::Anonymous);
        assert!(maps[5].perms.exec);
        assert_eq!(maps[6].path, MapPath::Pseudo("[stack]".into()));
        assert!(maps[6].contains(0x7ffd5a405ff8));
        assert!(!maps[6].contains(0x7ffd5a406000));
        assert_eq!(maps[7].path, MapPath::Pseudo("[vdso]".into()));
    }

    #[test]
    fn rejects_malformed_lines_with_line_number() {
        let text = b"55d0c8a00000-55d0c8a86000 r--p 00000000 08:01 1 /x\nnot a maps line\n";
        let err = parse_maps(text, Path::new("/proc/1/maps")).expect_err("malformed");
        match err {
            Error::Maps { line, .. } => assert_eq!(line, 2),
            other => panic!("unexpected error {other:?}"),
        }
        assert!(MapEntry::parse_line(b"2000-1000 r--p 0 00:00 0").is_err());
        assert!(MapEntry::parse_line(b"1000-2000 r-p 0 00:00 0").is_err());
        assert!(MapEntry::parse_line(b"1000-2000 r--p 0 0000 0").is_err());
    }

    #[test]
    fn reads_own_maps() {
        let maps = read_maps(std::process::id()).expect("own maps");
        assert!(maps.iter().any(|m| m.path == MapPath::Pseudo("[stack]".into())));
        assert!(maps.iter().any(|m| m.perms.exec && m.file_path().is_some()));
    }
}
