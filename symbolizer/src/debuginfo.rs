//! Finding a module's separate debug file (`.gnu_debuglink` or build-id tree, then debuginfod)
//! and checking that it belongs to exactly this build.

use std::path::{Component, Path, PathBuf};

use crate::debuginfod::Debuginfod;
use crate::elf::{hex, ElfData};

/// The system-wide debug root; always searched.
const SYSTEM_DEBUG_DIR: &str = "/usr/lib/debug";

/// Where to look for debug files of one module.
pub(crate) struct DebugSearch<'a> {
    /// The module's path as the process sees it (from its maps).
    pub mapped_path: &'a Path,
    /// The process's root directory (`/proc/PID/root`, or `/` offline).
    pub root: &'a Path,
    /// Extra roots from [`crate::SymbolizerOptions::debug_dirs`] (host paths).
    pub debug_dirs: &'a [PathBuf],
    /// The debuginfod client, when `DEBUGINFOD_URLS` is set.
    pub debuginfod: Option<&'a Debuginfod>,
}

/// Find and open the debug file of `elf`. Build-id lookups come first (exact), then
/// `.gnu_debuglink` names, then debuginfod servers. A candidate is accepted only if it has a
/// symbol table, and its build-id matches the module's (or, when either lacks one, its CRC32
/// matches the debuglink's).
pub(crate) fn find_debug_file(elf: &ElfData, search: &DebugSearch<'_>) -> Option<ElfData> {
    find_local_debug_file(elf, search).or_else(|| {
        // A file with its own symbol table gets no names from a debug file: no download.
        if elf.has_symtab {
            return None;
        }
        let fetched = search.debuginfod?.debug_file(elf, search.mapped_path)?;
        if !fetched.has_symtab {
            tracing::debug!(debug_file = %fetched.path.display(), "debug file has no symbol table");
            return None;
        }
        Some(fetched)
    })
}

fn find_local_debug_file(elf: &ElfData, search: &DebugSearch<'_>) -> Option<ElfData> {
    let mut roots = vec![
        under_root(search.root, Path::new(SYSTEM_DEBUG_DIR)),
        PathBuf::from(SYSTEM_DEBUG_DIR),
    ];
    roots.extend(search.debug_dirs.iter().cloned());
    roots.dedup();

    if let Some(id) = elf.build_id.as_deref().filter(|id| id.len() >= 2) {
        let (dir, rest) = (hex(&id[..1]), hex(&id[1..]));
        for root in &roots {
            let candidate = root.join(".build-id").join(&dir).join(format!("{rest}.debug"));
            if let Some(debug) = accept(elf, &candidate, None) {
                return Some(debug);
            }
        }
    }

    let (name, crc) = elf.debuglink.as_ref()?;
    let dir = search.mapped_path.parent().unwrap_or(Path::new("/"));
    let mut candidates = vec![
        under_root(search.root, &dir.join(name)),
        under_root(search.root, &dir.join(".debug").join(name)),
    ];
    for root in &roots {
        candidates.push(under_root(root, dir).join(name));
    }
    for debug_dir in search.debug_dirs {
        candidates.push(debug_dir.join(name));
    }
    candidates.dedup();
    candidates
        .iter()
        .find_map(|candidate| accept(elf, candidate, Some(*crc)))
}

fn accept(elf: &ElfData, candidate: &Path, debuglink_crc: Option<u32>) -> Option<ElfData> {
    if !candidate.is_file() {
        return None;
    }
    let debug = match ElfData::open(candidate) {
        Ok(debug) => debug,
        Err(err) => {
            tracing::debug!(error = %err, "ignoring debug file candidate");
            return None;
        }
    };
    let matches = match (&elf.build_id, &debug.build_id, debuglink_crc) {
        (Some(want), Some(have), _) => want == have,
        (_, _, Some(crc)) => crc32(debug.data()) == crc,
        _ => false,
    };
    if !matches {
        tracing::debug!(
            module = %elf.path.display(),
            candidate = %candidate.display(),
            "debug file is from another build; ignoring it"
        );
        return None;
    }
    if !debug.has_symtab {
        tracing::debug!(candidate = %candidate.display(), "debug file has no symbol table");
        return None;
    }
    Some(debug)
}

/// `root` joined with an absolute `path` (`Path::join` would replace root).
pub(crate) fn under_root(root: &Path, path: &Path) -> PathBuf {
    let mut out = root.to_path_buf();
    for component in path.components() {
        match component {
            Component::Normal(part) => out.push(part),
            Component::ParentDir => out.push(".."),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// The CRC-32 (IEEE, reflected) that `.gnu_debuglink` stores.
pub(crate) fn crc32(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !data
        .iter()
        .fold(!0u32, |crc, &b| TABLE[usize::from((crc as u8) ^ b)] ^ (crc >> 8))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_known_values() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b"The quick brown fox jumps over the lazy dog"), 0x414F_A339);
    }

    #[test]
    fn under_root_keeps_absolute_paths_inside_root() {
        assert_eq!(
            under_root(Path::new("/proc/42/root"), Path::new("/usr/lib/x.so")),
            PathBuf::from("/proc/42/root/usr/lib/x.so")
        );
        assert_eq!(
            under_root(Path::new("/"), Path::new("/a/b")),
            PathBuf::from("/a/b")
        );
    }
}
