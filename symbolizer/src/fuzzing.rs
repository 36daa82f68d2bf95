//! Entry points for the fuzz harnesses (`tests/fuzz_*.rs`) into parsers that the public API
//! reaches only through the network or the environment. Not part of the API.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::debuginfod::{Config, Debuginfod};
use crate::elf::ElfData;
use crate::Error;

/// Asks the debuginfod servers `servers` for the debug file of the ELF file at `module`, as the
/// symbolizer does when `DEBUGINFOD_URLS` is set, with a fresh client caching under
/// `cache_dir` and every wait bounded by `timeout`. Returns the path of the accepted (checked)
/// debug file, or None when no server provided one.
pub fn debuginfod_debug_file(
    servers: Vec<String>,
    cache_dir: &Path,
    module: &Path,
    timeout: Duration,
) -> Result<Option<PathBuf>, Error> {
    let elf = ElfData::open(module)?;
    let client = Debuginfod::new(Config {
        urls: servers,
        cache_dir: cache_dir.to_path_buf(),
        timeout: Some(timeout),
        max_time: timeout.saturating_mul(2),
    });
    Ok(client.debug_file(&elf, module).map(|debug| debug.path))
}

/// The code addresses that machine code `code`, placed at `start`, stores into
/// `PlanState.ExecProcNode`, as the executor-node naming reads an `ExecInit*` function; None
/// when the bytes do not decode.
pub fn exec_proc_node_stores(code: &[u8], start: u64) -> Option<Vec<u64>> {
    let function = start..start.saturating_add(code.len() as u64);
    crate::exec_nodes::stored_at_exec_proc_node(code, &function).map(|stored| stored.into_iter().collect())
}

/// The executor-node functions named in the ELF file `bytes` (labelled `label`) where no symbol
/// names them, by start address: what frames in them are called.
pub fn exec_node_names(label: PathBuf, bytes: Vec<u8>) -> Result<Vec<(u64, String)>, Error> {
    let module = module_of(label, bytes)?;
    let mut names: Vec<(u64, String)> = module
        .exec_nodes()
        .derived
        .iter()
        .map(|(start, name)| (*start, name.to_string()))
        .collect();
    names.sort();
    Ok(names)
}

/// Functions named without a symbol, by start address, with the name frames in them get.
pub type NamedFunctions = Vec<(u64, String)>;

/// The functions the tables of function pointers `tables` name in the ELF file `bytes`
/// (labelled `label`) where no symbol names them, by start address, with why any table named
/// nothing: what frames in them are called.
pub fn pointer_table_names(
    label: PathBuf,
    bytes: Vec<u8>,
    tables: &[crate::PointerTable],
) -> Result<(NamedFunctions, Vec<crate::TableError>), Error> {
    let module = module_of(label, bytes)?;
    let (named, errors) = module.name_pointer_tables(tables);
    let names = named
        .into_iter()
        .map(|(start, name)| (start, name.to_string()))
        .collect();
    Ok((names, errors))
}

/// The ELF file `bytes` (labelled `label`) as a module, with no debug file looked for.
fn module_of(label: PathBuf, bytes: Vec<u8>) -> Result<crate::module::ModuleData, Error> {
    let elf = ElfData::from_bytes(label.clone(), bytes)?;
    let search = crate::debuginfo::DebugSearch {
        mapped_path: &label,
        root: Path::new("/nonexistent"),
        debug_dirs: &[],
        debuginfod: None,
    };
    Ok(crate::module::ModuleData::new(elf, &label, 0, &search))
}
