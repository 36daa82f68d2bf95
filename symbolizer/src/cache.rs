//! The cache of parsed modules: a thousand backends of one binary cost one parse.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::debuginfo::{under_root, DebugSearch};
use crate::debuginfod::{self, Debuginfod};
use crate::elf::ElfData;
use crate::maps::{MapEntry, MapPath};
use crate::module::{ModuleData, ModuleId};
use crate::vdso;

/// Where the files of one process can be read from.
pub(crate) struct FileSource {
    /// The process's root directory: `/proc/PID/root` (other mount namespaces), or a
    /// directory given by the caller for offline use.
    pub root: PathBuf,
    /// `/proc/PID/map_files`, which still opens files that were deleted or replaced.
    pub map_files: Option<PathBuf>,
}

/// A mapped file as the kernel identifies it. The path and deleted flag are part of the key
/// so that a reused inode number of a replaced file does not alias the old build.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct FileKey {
    dev: (u32, u32),
    inode: u64,
    path: PathBuf,
    deleted: bool,
}

#[derive(Default)]
pub(crate) struct ModuleCache {
    debug_dirs: Vec<PathBuf>,
    debuginfod: Option<&'static Debuginfod>,
    by_file: HashMap<FileKey, Arc<ModuleData>>,
    by_id: HashMap<ModuleId, Arc<ModuleData>>,
    /// The vDSO of this kernel, read from our own process (None inside: not available).
    vdso: Option<Option<Arc<ModuleData>>>,
}

impl ModuleCache {
    pub fn new(debug_dirs: Vec<PathBuf>) -> ModuleCache {
        ModuleCache {
            debug_dirs,
            debuginfod: debuginfod::from_env(),
            ..ModuleCache::default()
        }
    }

    /// Every module read so far.
    pub fn modules(&self) -> impl Iterator<Item = &Arc<ModuleData>> {
        self.by_id.values()
    }

    pub fn get(&self, id: &ModuleId) -> Option<&Arc<ModuleData>> {
        self.by_id.get(id)
    }

    /// The module for a file mapping (`entry` is its first executable mapping).
    pub fn for_mapping(&mut self, entry: &MapEntry, source: &FileSource) -> Arc<ModuleData> {
        let MapPath::File { path, deleted } = &entry.path else {
            return self.vdso_or_unreadable(entry);
        };
        let key = FileKey {
            dev: entry.dev,
            inode: entry.inode,
            path: path.clone(),
            deleted: *deleted,
        };
        if let Some(module) = self.by_file.get(&key) {
            return module.clone();
        }
        let module = match open_mapped_file(entry, path, source) {
            Some(elf) => {
                // Same build seen under another path or inode (another container): share it.
                let id = ModuleId::for_file(elf.build_id.as_deref(), path, entry.inode);
                match self.by_id.get(&id) {
                    Some(existing) => existing.clone(),
                    None => {
                        let search = DebugSearch {
                            mapped_path: path,
                            root: &source.root,
                            debug_dirs: &self.debug_dirs,
                            debuginfod: self.debuginfod,
                        };
                        Arc::new(ModuleData::new(elf, path, entry.inode, &search))
                    }
                }
            }
            // Not cached by file: the next process mapping it may be readable.
            None => {
                let module = Arc::new(ModuleData::unreadable(path, entry.inode));
                self.by_id.entry(module.id.clone()).or_insert(module).clone()
            }
        };
        if module.elf.is_some() {
            self.by_file.insert(key, module.clone());
        }
        self.by_id.entry(module.id.clone()).or_insert(module.clone());
        module
    }

    fn vdso_or_unreadable(&mut self, entry: &MapEntry) -> Arc<ModuleData> {
        let vdso = self
            .vdso
            .get_or_insert_with(|| {
                let elf = vdso::read_own_vdso()?;
                let search = DebugSearch {
                    mapped_path: Path::new("[vdso]"),
                    root: Path::new("/"),
                    debug_dirs: &[],
                    // The kernel's vDSO: named from its own dynamic symbols.
                    debuginfod: None,
                };
                Some(Arc::new(ModuleData::new(elf, Path::new("[vdso]"), 0, &search)))
            })
            .clone();
        let is_vdso = matches!(&entry.path, MapPath::Pseudo(name) if name == "[vdso]");
        let module = match vdso {
            Some(vdso) if is_vdso && vdso::same_size(entry) => vdso,
            _ => Arc::new(ModuleData::unreadable(
                Path::new(&pseudo_name(&entry.path)),
                entry.inode,
            )),
        };
        self.by_id.entry(module.id.clone()).or_insert(module).clone()
    }
}

fn pseudo_name(path: &MapPath) -> String {
    match path {
        MapPath::Anonymous => "[anon]".to_string(),
        MapPath::Pseudo(name) => name.clone(),
        MapPath::File { path, .. } => path.display().to_string(),
    }
}

/// Open the file behind a mapping: through the process's root first; if that fails or finds
/// a different inode (deleted or replaced file), through `/proc/PID/map_files`.
fn open_mapped_file(entry: &MapEntry, path: &Path, source: &FileSource) -> Option<ElfData> {
    let via_root = under_root(&source.root, path);
    let by_path = File::open(&via_root).ok();
    let inode_matches = by_path
        .as_ref()
        .and_then(|f| f.metadata().ok())
        .is_some_and(|m| entry.inode == 0 || m.ino() == entry.inode);
    let via_map_files = || {
        let dir = source.map_files.as_ref()?;
        let link = dir.join(format!("{:x}-{:x}", entry.start, entry.end));
        Some((File::open(&link).ok()?, link))
    };
    let (file, opened) = match by_path {
        Some(file) if inode_matches => (file, via_root),
        // The inode differs on some overlay filesystems too: prefer map_files, else the path.
        by_path => match (via_map_files(), by_path) {
            (Some((file, link)), _) => (file, link),
            (None, Some(file)) => (file, via_root),
            (None, None) => {
                tracing::debug!(path = %path.display(), "cannot open mapped file");
                return None;
            }
        },
    };
    match ElfData::from_file(&file, &opened) {
        Ok(elf) => Some(elf),
        Err(err) => {
            tracing::debug!(error = %err, "cannot load mapped file");
            None
        }
    }
}
