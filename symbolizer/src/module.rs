//! A loaded module (one ELF build), shared by every process that maps it, and how a module is
//! named from an address inside it.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use crate::debuginfo::{find_debug_file, DebugSearch};
use crate::elf::{hex, ElfData};
use crate::exec_nodes::ExecNodes;
use crate::functions::FunctionRanges;
use crate::pointer_tables::{self, PointerTable, TableError};
use crate::symbols::{Origin, SymbolTable};

/// A loaded ELF file identity (cheap to clone, hashable). Keyed by build-id when the file has
/// one, else by the path and inode the process mapped it from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModuleId(Arc<ModuleKey>);

#[derive(Debug, PartialEq, Eq, Hash)]
enum ModuleKey {
    BuildId(Box<[u8]>),
    File { path: PathBuf, inode: u64 },
}

impl ModuleId {
    pub(crate) fn for_file(build_id: Option<&[u8]>, path: &Path, inode: u64) -> ModuleId {
        ModuleId(Arc::new(match build_id {
            Some(id) if !id.is_empty() => ModuleKey::BuildId(id.into()),
            _ => ModuleKey::File {
                path: path.to_path_buf(),
                inode,
            },
        }))
    }
}

impl fmt::Display for ModuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.0 {
            ModuleKey::BuildId(id) => write!(f, "build-id {}", hex(id)),
            ModuleKey::File { path, inode } => write!(f, "{} (inode {inode})", path.display()),
        }
    }
}

/// What is known about a module's symbols, for a one-time "missing symbols" hint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleSummary {
    /// The path the module was first seen at, as the process saw it.
    pub path: PathBuf,
    /// Hex build-id, if the file has one.
    pub build_id: Option<String>,
    /// Whether the file itself has a non-empty `.symtab` (not stripped).
    pub has_symtab: bool,
    /// The separate debug file whose `.symtab` is used, if one was found.
    pub debug_file: Option<PathBuf>,
}

/// One ELF build, shared (via `Arc`) by all processes mapping it.
pub(crate) struct ModuleData {
    pub id: ModuleId,
    pub path: PathBuf,
    pub basename: Arc<str>,
    /// None when the file could not be opened or parsed; frames then get `module+0x…` names
    /// from file offsets.
    pub elf: Option<ElfData>,
    debug: Option<ElfData>,
    functions: OnceLock<FunctionRanges>,
    symbols: OnceLock<SymbolTable>,
    /// Functions no symbol names but the caller identified otherwise (by their start address),
    /// e.g. `pgss_store` through pg_stat_statements' hook functions.
    identified: Mutex<HashMap<u64, Arc<str>>>,
    /// The executor's per-node functions, named from the `ExecInit*` functions installing them.
    exec_nodes: OnceLock<ExecNodes>,
}

impl ModuleData {
    /// A module whose file was read; looks for its debug file right away, while the process
    /// (and so `/proc/PID/root`) still exists.
    pub fn new(elf: ElfData, path: &Path, inode: u64, search: &DebugSearch<'_>) -> ModuleData {
        let debug = find_debug_file(&elf, search);
        if let Some(found) = &debug {
            tracing::debug!(module = %path.display(), debug_file = %found.path.display(), "using debug file");
        }
        ModuleData {
            id: ModuleId::for_file(elf.build_id.as_deref(), path, inode),
            path: path.to_path_buf(),
            basename: basename(path),
            elf: Some(elf),
            debug,
            functions: OnceLock::new(),
            symbols: OnceLock::new(),
            identified: Mutex::new(HashMap::new()),
            exec_nodes: OnceLock::new(),
        }
    }

    /// A module whose file could not be read.
    pub fn unreadable(path: &Path, inode: u64) -> ModuleData {
        ModuleData {
            id: ModuleId::for_file(None, path, inode),
            path: path.to_path_buf(),
            basename: basename(path),
            elf: None,
            debug: None,
            functions: OnceLock::new(),
            symbols: OnceLock::new(),
            identified: Mutex::new(HashMap::new()),
            exec_nodes: OnceLock::new(),
        }
    }

    pub fn summary(&self) -> ModuleSummary {
        ModuleSummary {
            path: self.path.clone(),
            build_id: self.elf.as_ref().and_then(ElfData::build_id_hex),
            has_symtab: self.elf.as_ref().is_some_and(|e| e.has_symtab),
            debug_file: self.debug.as_ref().map(|d| d.path.clone()),
        }
    }

    /// FDE ranges of the module's `.eh_frame` (parsed on first use).
    pub fn functions(&self) -> &FunctionRanges {
        self.functions.get_or_init(|| match &self.elf {
            Some(elf) => FunctionRanges::from_elf(elf),
            None => FunctionRanges::default(),
        })
    }

    /// Whether the module has `.eh_frame` at all (if not, unwinding in it uses frame pointers).
    pub fn has_unwind_info(&self) -> bool {
        self.elf.as_ref().is_some_and(|e| e.eh_frame.is_some())
    }

    fn symbols(&self) -> &SymbolTable {
        self.symbols.get_or_init(|| {
            let mut table = SymbolTable::default();
            for (file, origin) in [
                (self.elf.as_ref(), Origin::SymTab),
                (self.debug.as_ref(), Origin::SymTab),
                (self.elf.as_ref(), Origin::DynSym),
            ] {
                let Some(file) = file else { continue };
                if !file.has_section_headers {
                    // Its `.dynsym` is reached through the dynamic segment instead.
                    if origin == Origin::DynSym {
                        table.add_dynamic_segment(&file.segment_dynamic_symbols(), |svma| file.is_code(svma));
                    }
                    continue;
                }
                match file.object() {
                    Ok(object) => table.add(&object, origin),
                    Err(err) => tracing::debug!(error = %err, "cannot read symbols"),
                }
            }
            table.finish();
            table
        })
    }

    /// File offset of the first instruction of function `name`, from the same symbol tables
    /// that name frames (the file's `.symtab`, its debug file's, then `.dynsym`). This is what a
    /// uprobe attaches to.
    pub fn function_file_offset(&self, name: &str) -> Option<u64> {
        let svma = self.symbols().address_of(name)?;
        self.elf.as_ref()?.code_file_offset(svma)
    }

    /// Names the function that starts at `svma` (an FDE's start): its frames get `name` where
    /// no symbol names them. False when no function starts there.
    pub fn identify(&self, svma: u64, name: &str) -> bool {
        if self.functions().lookup(svma).is_none_or(|f| f.start != svma) {
            return false;
        }
        // A poisoned lock only means another thread panicked mid-insert: the map is still whole.
        let mut identified = self.identified.lock().unwrap_or_else(|e| e.into_inner());
        identified.insert(svma, Arc::from(name));
        true
    }

    /// Names the static functions the tables of function pointers `tables` hold (see
    /// [`crate::pointer_tables`]) where no symbol names them. Returns the functions named, by
    /// start, and why any table named nothing.
    pub fn name_pointer_tables(&self, tables: &[PointerTable]) -> (Vec<(u64, Arc<str>)>, Vec<TableError>) {
        let Some(elf) = &self.elf else {
            return (Vec::new(), Vec::new());
        };
        let (named, errors) = pointer_tables::name_functions(elf, self.symbols(), self.functions(), tables);
        let mut identified = self.identified.lock().unwrap_or_else(|e| e.into_inner());
        let mut added = Vec::new();
        for (start, name) in named {
            // A function identified otherwise (pgss_store by its hooks) keeps that name.
            if let std::collections::hash_map::Entry::Vacant(entry) = identified.entry(start) {
                let name: Arc<str> = Arc::from(name);
                entry.insert(name.clone());
                added.push((start, name));
            }
        }
        added.sort();
        (added, errors)
    }

    fn identified_at(&self, start: u64) -> Option<Arc<str>> {
        let identified = self.identified.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(name) = identified.get(&start) {
            return Some(name.clone());
        }
        self.exec_nodes().derived.get(&start).cloned()
    }

    /// The executor's per-node functions of this module (decoded on first use; empty for a
    /// module that exports no `ExecInit*`).
    pub fn exec_nodes(&self) -> &ExecNodes {
        self.exec_nodes.get_or_init(|| match &self.elf {
            Some(elf) => ExecNodes::derive(elf, self.symbols(), self.functions(), &self.basename),
            None => ExecNodes::default(),
        })
    }

    /// The name of the function containing `svma` (see the crate docs for the rules).
    pub fn name_for(&self, svma: u64) -> Arc<str> {
        let symbols = self.symbols();
        if let Some(function) = self.functions().lookup(svma) {
            if let Some(name) = symbols.at(function.start) {
                return readable(name);
            }
            if let Some(name) = symbols.containing(svma) {
                return readable(name);
            }
            if let Some(name) = self.identified_at(function.start) {
                return name;
            }
            return Arc::from(format!("{}+0x{:x}", self.basename, function.start));
        }
        if let Some(name) = symbols.containing(svma) {
            return readable(name);
        }
        Arc::from(format!("{}+0x{:x}", self.basename, svma))
    }
}

/// A symbol's name as frames show it: demangled where it is a C++ or Rust one.
fn readable(name: &Arc<str>) -> Arc<str> {
    match crate::demangle::demangled(name) {
        Some(text) => Arc::from(text),
        None => name.clone(),
    }
}

fn basename(path: &Path) -> Arc<str> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_else(|| path.to_string_lossy());
    Arc::from(name.as_ref())
}
