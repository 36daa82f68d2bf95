//! Unwinding and symbolizing user-stack snapshots of (PostgreSQL) processes, plus kernel
//! symbols.
//!
//! BPF hands over, per sample, the user registers and a copy of the stack from `sp` upward.
//! [`Symbolizer::unwind`] walks that copy with `.eh_frame` CFI (framehop), falling back to
//! frame pointers where a module has no unwind info, and returns [`Location`]s that stay
//! valid after the process exits. [`Symbolizer::symbolize`] names them.
//!
//! # Naming rules (stripped binaries)
//! An address is never named after the nearest exported symbol if it lies in another
//! function: the `.eh_frame` FDE containing it gives the function start, and the name is a
//! symbol starting exactly there (`.symtab` or the debug file's `.symtab` before `.dynsym`;
//! among aliases global before weak before local, then the shortest, then alphabetical),
//! else a sized symbol containing the address, else a name identified without a symbol (by the
//! caller through [`Symbolizer::name_function`], or an executor node function `Exec<Node>`
//! found by decoding the exported `ExecInit<Node>` that installs it), else
//! `module+0x<function start>`. Without an FDE: a sized symbol containing the address, else
//! `module+0x<address>`.
//!
//! # framehop behaviour worth knowing
//! - The first frame is the sampled `ip` itself (not minus 1); later frames are return
//!   addresses minus 1.
//! - Frame-pointer fallback is framehop's own: for addresses in no known module (JIT code),
//!   in a module without `.eh_frame`, or before the first FDE, it uses `rbp` (`[rbp]` =
//!   caller's `rbp`, `[rbp+8]` = return address). For an address in a gap between FDEs of a
//!   module that has `.eh_frame`, it assumes the first frame is at a function entry
//!   (return address at `[sp]`) and uses `rbp` for the others.
//! - framehop ends a walk the same way at `_start` (`.cfi_undefined rip`) and when its
//!   frame-pointer fallback meets `rbp == 0`; this crate reports the latter as
//!   [`UnwindEnd::NoUnwindInfo`] unless the module has no `.eh_frame` at all.
//! - framehop accepts any return address; this crate ends the walk with
//!   [`UnwindEnd::Error`] (without that frame) when one is not in executable memory.
//! - Signal frames (`__restore_rt`) unwind through their CFI, but the interrupted frame is
//!   then looked up at its address minus 1 like any return address.
//!
//! # Use
//! ```no_run
//! use symbolizer::{Symbolizer, SymbolizerOptions, UserRegs};
//!
//! let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
//! # let (pid, regs, stack) = (1, UserRegs::default(), Vec::<u8>::new());
//! let stack = symbolizer.unwind(pid, &regs, &stack);
//! for location in &stack.frames {
//!     let frame = symbolizer.symbolize(location);
//!     println!("{}!{}", frame.module, frame.name);
//! }
//! // When the process exits:
//! symbolizer.forget_process(pid);
//! ```
//! The process must still exist when its first sample is unwound (its maps and files are
//! read then); [`Symbolizer::unwind_as`] covers short-lived forked children.

mod cache;
mod callees;
mod debuginfo;
mod debuginfod;
mod demangle;
mod eh_frame_hdr;
mod elf;
mod error;
mod exec_nodes;
mod expr_interp;
mod functions;
#[doc(hidden)]
pub mod fuzzing;
mod globals;
mod gnu_hash;
mod kernel;
mod maps;
mod module;
mod pointer_tables;
mod probe_point;
mod process;
mod segments;
mod symbols;
mod unwind;
mod vdso;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use framehop::x86_64::CacheX86_64;

pub use callees::{Callees, CalleesError};
pub use error::Error;
pub use globals::executable_globals;
pub use kernel::KernelSymbols;
pub use maps::{parse_maps, read_maps, MapEntry, MapPath, Perms};
pub use module::{ModuleId, ModuleSummary};
pub use pointer_tables::{PointerTable, Slot, TableAt, TableError};
pub use probe_point::{check_probe_point, ProbePoint, ProbePointError};
pub use unwind::MAX_DEPTH;

use cache::{FileSource, ModuleCache};
use process::ProcessState;

/// framehop's cache generations are 16 bits: replace the rule cache well before they wrap.
const MODULES_PER_RULE_CACHE: u64 = 16_384;

/// Entries in the symbolize cache before it is cleared.
const NAME_CACHE_LIMIT: usize = 1 << 20;

/// x86_64 user registers at sample time.
#[derive(Clone, Copy, Debug, Default)]
pub struct UserRegs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

/// One frame, resolved to a module and a lookup address in that module's ELF virtual-address
/// space (return addresses already minus 1, so it lies inside the call instruction). For a
/// module whose file could not be read, `addr` is a file offset instead.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    InModule {
        module: ModuleId,
        addr: u64,
    },
    /// Not in any mapped file (anonymous memory such as JIT code, or an unknown address).
    Unmapped {
        addr: u64,
    },
}

/// Why a walk stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnwindEnd {
    /// The root of the stack (`_start`, a thread start, or a zero return address).
    ReachedRoot,
    /// The walk needed bytes beyond the copied snapshot, still inside the stack mapping.
    StackTruncated,
    /// Frame-pointer fallback (no unwind info for the last frame) reached `rbp == 0`.
    NoUnwindInfo,
    /// A garbage frame: a return address outside code, a read outside the stack, or
    /// framehop refusing to loop or move backwards.
    Error,
    /// [`MAX_DEPTH`] frames were collected.
    DepthLimit,
}

/// Frames of one sample, leaf first.
#[derive(Clone, Debug)]
pub struct UnwoundStack {
    pub frames: Vec<Location>,
    pub end: UnwindEnd,
}

/// The name of a frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Function name, `module+0x<function start>`, or `[unknown]`.
    pub name: Arc<str>,
    /// Basename of the module's file (`postgres`, `libc.so.6`), or `[unknown]`.
    pub module: Arc<str>,
}

/// Where debug files are looked for. Besides these, when the environment variable
/// `DEBUGINFOD_URLS` is set, the debug file of a stripped module found nowhere else is fetched
/// from those debuginfod servers into the elfutils client's cache (`DEBUGINFOD_CACHE_PATH`,
/// `DEBUGINFOD_TIMEOUT` and `DEBUGINFOD_MAXTIME` are honoured).
#[derive(Clone, Debug, Default)]
pub struct SymbolizerOptions {
    /// Extra roots holding `.build-id/xx/rest.debug` (and debuglink targets);
    /// `/usr/lib/debug` is always searched.
    pub debug_dirs: Vec<PathBuf>,
}

/// Where a function lives in a file mapped by a process, for attaching a uprobe to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionLocation {
    /// The file as seen from this process: under `/proc/PID/root`, so that files of other mount
    /// namespaces (containers) are reached.
    pub path: PathBuf,
    /// Offset of the function's first instruction in the file.
    pub file_offset: u64,
    /// The debug file the name came from, when not from the file itself.
    pub debug_file: Option<PathBuf>,
}

/// Why [`Symbolizer::find_function`] found nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FindFunctionError {
    #[error("process {pid} is gone or its memory maps are unreadable")]
    NoProcess { pid: u32 },
    #[error("process {pid} has no file `{module}` mapped")]
    ModuleNotMapped { pid: u32, module: String },
    #[error("`{path}` has no symbol `{function}` (stripped, and no debug file was found for it)")]
    NoSymbol { path: PathBuf, function: String },
}

/// Unwinds and symbolizes samples of many processes. Parsed files are shared between
/// processes (keyed by build-id) and kept until the `Symbolizer` is dropped.
pub struct Symbolizer {
    modules: ModuleCache,
    processes: HashMap<u32, ProcessState>,
    cache: CacheX86_64,
    /// [`process::modules_added`] when `cache` was created.
    cache_epoch: u64,
    names: HashMap<Location, Frame>,
    unknown: Frame,
}

impl Symbolizer {
    pub fn new(opts: SymbolizerOptions) -> Self {
        Symbolizer {
            modules: ModuleCache::new(opts.debug_dirs),
            processes: HashMap::new(),
            cache: CacheX86_64::new(),
            cache_epoch: process::modules_added(),
            names: HashMap::new(),
            unknown: Frame {
                name: Arc::from("[unknown]"),
                module: Arc::from("[unknown]"),
            },
        }
    }

    /// Unwind a user-stack snapshot of process `pid` (the bytes start at `regs.sp`). Reads
    /// `/proc/PID/maps` on first use, and again when an address falls outside the known
    /// mappings: 10 ms after the last read at first, backing off to once a second while the
    /// reads find nothing new. If the process is already gone on first use, the result is
    /// the bare `ip` with [`UnwindEnd::NoUnwindInfo`] (see [`Symbolizer::unwind_as`]).
    pub fn unwind(&mut self, pid: u32, regs: &UserRegs, stack: &[u8]) -> UnwoundStack {
        if !self.ensure_process(pid) {
            return UnwoundStack {
                frames: vec![Location::Unmapped { addr: regs.ip }],
                end: UnwindEnd::NoUnwindInfo,
            };
        }
        self.renew_rule_cache();
        let Some(state) = self.processes.get_mut(&pid) else {
            return UnwoundStack {
                frames: vec![Location::Unmapped { addr: regs.ip }],
                end: UnwindEnd::NoUnwindInfo,
            };
        };
        let source = live_source(pid);
        let modules = &mut self.modules;
        let mut refresh = |state: &mut ProcessState| {
            if state.loaded_at.elapsed() < state.refresh_after {
                return false;
            }
            match read_maps(pid) {
                Ok(maps) if maps == state.maps => {
                    state.loaded_at = std::time::Instant::now();
                    state.refresh_after = ProcessState::next_refresh_after(state.refresh_after, false);
                    false
                }
                Ok(maps) => {
                    *state = ProcessState::new(maps, &source, modules);
                    true
                }
                Err(err) => {
                    tracing::debug!(pid, error = %err, "cannot re-read mappings");
                    false
                }
            }
        };
        unwind::unwind(state, &mut self.cache, regs, stack, Some(&mut refresh))
    }

    /// Like [`Symbolizer::unwind`], but if `pid` exited before its mappings were read, use
    /// those of `layout_pid`: a process `pid` was forked from without `exec`, so with the
    /// same address-space layout (a backend's postmaster). Libraries `pid` loaded itself are
    /// then unknown, and the walk stops there with [`UnwindEnd::Error`] rather than guessing.
    pub fn unwind_as(&mut self, pid: u32, layout_pid: u32, regs: &UserRegs, stack: &[u8]) -> UnwoundStack {
        let pid = if self.ensure_process(pid) { pid } else { layout_pid };
        self.unwind(pid, regs, stack)
    }

    /// Read the mappings of `pid` unless known; false if the process is gone.
    fn ensure_process(&mut self, pid: u32) -> bool {
        if self.processes.contains_key(&pid) {
            return true;
        }
        match read_maps(pid) {
            Ok(maps) => {
                let state = ProcessState::new(maps, &live_source(pid), &mut self.modules);
                self.processes.insert(pid, state);
                true
            }
            Err(err) => {
                tracing::debug!(pid, error = %err, "cannot read mappings");
                false
            }
        }
    }

    fn renew_rule_cache(&mut self) {
        let added = process::modules_added();
        if added.wrapping_sub(self.cache_epoch) > MODULES_PER_RULE_CACHE {
            self.cache = CacheX86_64::new();
            self.cache_epoch = added;
        }
    }

    /// Unwind a snapshot against given mappings instead of a live process: `maps` as parsed
    /// by [`parse_maps`] (e.g. a saved `/proc/PID/maps`), with the mapped files read under
    /// `root` (`/` for this machine's files). Nothing per-process is kept; parsed files are
    /// cached as for live processes.
    pub fn unwind_with_maps(
        &mut self,
        maps: &[MapEntry],
        root: &Path,
        regs: &UserRegs,
        stack: &[u8],
    ) -> UnwoundStack {
        let source = FileSource {
            root: root.to_path_buf(),
            map_files: None,
        };
        let mut state = ProcessState::new(maps.to_vec(), &source, &mut self.modules);
        self.renew_rule_cache();
        unwind::unwind(&mut state, &mut self.cache, regs, stack, None)
    }

    /// Name of a frame: function name if known, else `<module basename>+0x<function start>`;
    /// `[unknown]` for [`Location::Unmapped`].
    pub fn symbolize(&mut self, loc: &Location) -> Frame {
        let Location::InModule { module, addr } = loc else {
            return self.unknown.clone();
        };
        if let Some(frame) = self.names.get(loc) {
            return frame.clone();
        }
        let Some(data) = self.modules.get(module) else {
            return self.unknown.clone();
        };
        let frame = Frame {
            name: data.name_for(*addr),
            module: data.basename.clone(),
        };
        if self.names.len() >= NAME_CACHE_LIMIT {
            self.names.clear();
        }
        self.names.insert(loc.clone(), frame.clone());
        frame
    }

    /// Finds function `function` in the file named `module` (a basename such as
    /// `pg_stat_statements.so`) mapped by process `pid`, using the file's own symbol tables and
    /// its separate debug file: static functions of stripped libraries are found when a debug
    /// file is installed (build-id tree, `.gnu_debuglink`, or a configured debug dir).
    pub fn find_function(
        &mut self,
        pid: u32,
        module: &str,
        function: &str,
    ) -> Result<FunctionLocation, FindFunctionError> {
        if !self.ensure_process(pid) {
            return Err(FindFunctionError::NoProcess { pid });
        }
        let state = self
            .processes
            .get(&pid)
            .ok_or(FindFunctionError::NoProcess { pid })?;
        let placed = state
            .modules
            .iter()
            .find(|m| &*m.module.basename == module)
            .ok_or_else(|| FindFunctionError::ModuleNotMapped {
                pid,
                module: module.to_string(),
            })?;
        let data = &placed.module;
        let file_offset = data
            .function_file_offset(function)
            .ok_or_else(|| FindFunctionError::NoSymbol {
                path: data.path.clone(),
                function: function.to_string(),
            })?;
        Ok(FunctionLocation {
            path: path_in_process(pid, &data.path),
            file_offset,
            debug_file: data.summary().debug_file,
        })
    }

    /// Names the function whose first instruction is at `file_offset` of the file `module` (a
    /// basename) mapped by process `pid`, when it was identified without a symbol (`pgss_store`
    /// through pg_stat_statements' hook functions): frames in it are named `name` wherever no
    /// symbol names them, in every process mapping that file. False when the file is not mapped
    /// there or no function starts at that offset.
    pub fn name_function(&mut self, pid: u32, module: &str, file_offset: u64, name: &str) -> bool {
        if !self.ensure_process(pid) {
            return false;
        }
        let Some(state) = self.processes.get(&pid) else {
            return false;
        };
        let Some(placed) = state.modules.iter().find(|m| &*m.module.basename == module) else {
            return false;
        };
        let data = &placed.module;
        let Some(svma) = data.elf.as_ref().and_then(|elf| elf.code_svma(file_offset)) else {
            return false;
        };
        let named = data.identify(svma, name);
        // Frames named before now kept their `file+0x…` name in the cache.
        self.names.clear();
        named
    }

    /// Names the static functions that the tables of function pointers `tables` of the file
    /// `module` (a basename) mapped by process `pid` hold, where no symbol names them, in every
    /// process mapping that file (see [`PointerTable`]). Returns how many functions were named
    /// and why any table named nothing; None when the file is not mapped there.
    pub fn name_pointer_tables(
        &mut self,
        pid: u32,
        module: &str,
        tables: &[PointerTable],
    ) -> Option<(usize, Vec<TableError>)> {
        if !self.ensure_process(pid) {
            return None;
        }
        let state = self.processes.get(&pid)?;
        let placed = state.modules.iter().find(|m| &*m.module.basename == module)?;
        let (named, errors) = placed.module.name_pointer_tables(tables);
        // Frames named before now kept their `file+0x…` name in the cache.
        self.names.clear();
        Some((named.len(), errors))
    }

    /// The functions that the function containing `addr` calls directly, read from its machine
    /// code; `addr` is an address in process `pid`, such as a function pointer read from its
    /// memory. The function's extent comes from its `.eh_frame` FDE, so this needs no symbol
    /// and works on stripped files.
    pub fn direct_callees(&mut self, pid: u32, addr: u64) -> Result<Callees, CalleesError> {
        if !self.ensure_process(pid) {
            return Err(CalleesError::NoProcess { pid });
        }
        let state = self.processes.get(&pid).ok_or(CalleesError::NoProcess { pid })?;
        let no_file = || CalleesError::NoFile { pid, addr };
        let placed = state.module_for(addr).ok_or_else(no_file)?;
        // The path this process maps the file at: a module is shared by build-id with other
        // processes, whose path may be another container's.
        let mapped_path = state
            .mapping_for(addr)
            .and_then(MapEntry::file_path)
            .ok_or_else(no_file)?;
        let data = &placed.module;
        let elf = data.elf.as_ref().ok_or_else(|| CalleesError::Unreadable {
            path: data.path.clone(),
        })?;
        let svma = addr.wrapping_sub(placed.bias);
        let function = data
            .functions()
            .lookup(svma)
            .ok_or_else(|| CalleesError::NoExtent {
                path: data.path.clone(),
                svma,
            })?;
        let targets = callees::in_elf(elf, &function)?;
        // Both lie in `.text`, inside an executable segment (checked when decoding).
        let function_offset =
            elf.code_file_offset(function.start)
                .ok_or_else(|| CalleesError::CodeNotInFile {
                    path: data.path.clone(),
                    start: function.start,
                    end: function.end,
                })?;
        Ok(Callees {
            path: path_in_process(pid, mapped_path),
            function_offset,
            callees: targets
                .into_iter()
                .filter_map(|target| elf.code_file_offset(target))
                .collect(),
        })
    }

    /// The executor's per-node functions of every file read so far, by the name frames in them
    /// get (`ExecSeqScan`, `MultiExecHash`), with their plan node type (`SeqScan`, `Hash`). On
    /// a stripped Postgres they are named by decoding the exported `ExecInit<Node>` functions
    /// that install them into `PlanState.ExecProcNode` (see the crate docs).
    pub fn plan_node_functions(&self) -> BTreeMap<Arc<str>, Arc<str>> {
        self.modules
            .modules()
            .flat_map(|module| module.exec_nodes().node_types.clone())
            .collect()
    }

    /// Forget per-process state (mappings, unwinder) of an exited process; parsed files stay
    /// cached. Call it on every exit: pids are reused, and a stale layout is only noticed
    /// when an address falls outside it.
    pub fn forget_process(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    /// Whether the module's file had a symbol table and a debug file (for a one-time
    /// "missing symbols" hint).
    pub fn module_info(&self, module: &ModuleId) -> Option<ModuleSummary> {
        self.modules.get(module).map(|m| m.summary())
    }
}

// The agent moves the symbolizer between tasks.
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Symbolizer>();
    assert_send::<KernelSymbols>();
};

/// `path` (as process `pid` sees it) reached through `/proc/PID/root`, so that files of other
/// mount namespaces (containers) are reached.
fn path_in_process(pid: u32, path: &Path) -> PathBuf {
    let relative = path.strip_prefix("/").unwrap_or(path);
    PathBuf::from(format!("/proc/{pid}/root")).join(relative)
}

fn live_source(pid: u32) -> FileSource {
    FileSource {
        root: PathBuf::from(format!("/proc/{pid}/root")),
        map_files: Some(PathBuf::from(format!("/proc/{pid}/map_files"))),
    }
}

#[cfg(test)]
mod find_function_tests {
    use super::*;

    #[no_mangle]
    #[inline(never)]
    pub extern "C" fn pgscope_find_function_probe(x: u64) -> u64 {
        x.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17)
    }

    #[test]
    fn file_offset_points_at_the_functions_code() {
        let exe = std::env::current_exe().expect("test executable");
        let basename = exe.file_name().and_then(|n| n.to_str()).expect("utf-8 name");
        let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
        let pid = std::process::id();
        let found = symbolizer
            .find_function(pid, basename, "pgscope_find_function_probe")
            .expect("the test binary has a symbol table");
        let file = std::fs::read(&found.path).expect("readable through /proc/PID/root");
        let offset = found.file_offset as usize;
        let in_file = file.get(offset..offset + 16).expect("offset inside the file");
        let function: extern "C" fn(u64) -> u64 = pgscope_find_function_probe;
        // SAFETY: reading 16 bytes of this process's own mapped code.
        let in_memory = unsafe { std::slice::from_raw_parts(function as *const u8, 16) };
        assert_eq!(in_file, in_memory);
        assert_eq!(function(1), pgscope_find_function_probe(1));
    }

    #[test]
    fn missing_module_and_symbol_are_told_apart() {
        let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
        let pid = std::process::id();
        let err = symbolizer
            .find_function(pid, "pg_stat_statements.so", "pgss_store")
            .expect_err("not mapped");
        assert!(matches!(err, FindFunctionError::ModuleNotMapped { .. }), "{err}");
        let exe = std::env::current_exe().expect("test executable");
        let basename = exe.file_name().and_then(|n| n.to_str()).expect("utf-8 name");
        let err = symbolizer
            .find_function(pid, basename, "no_such_function_xyz")
            .expect_err("no symbol");
        assert!(matches!(err, FindFunctionError::NoSymbol { .. }), "{err}");
    }
}
