//! Runtime addresses of a process's global variables, for reading them from outside (BPF or
//! `process_vm_readv`): Postgres exports the state of a backend — `MyBEEntry`,
//! `my_wait_event_info`, `MyBackendType` — as globals of its executable.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;

use object::{Object, ObjectSymbol};

use crate::elf::ElfData;
use crate::error::Error;
use crate::maps::{read_maps, MapPath};

/// Finds each of `names` among the symbols (`.dynsym`, then `.symtab`) of the executable of
/// process `pid` and returns its address in that process. Names not found are absent from the
/// result. The file is opened through `/proc/PID/map_files`, so this works for processes in
/// other mount namespaces and for executables replaced on disk since they started.
pub fn executable_globals(pid: u32, names: &[&str]) -> Result<HashMap<String, u64>, Error> {
    let exe_link = PathBuf::from(format!("/proc/{pid}/exe"));
    let exe = std::fs::read_link(&exe_link).map_err(|source| Error::Io {
        path: exe_link,
        source,
    })?;
    let exe_text = exe.to_string_lossy();
    let exe_path = PathBuf::from(exe_text.trim_end_matches(" (deleted)"));
    let maps = read_maps(pid)?;
    let mapping = maps
        .iter()
        .find(|m| matches!(&m.path, MapPath::File { path, .. } if *path == exe_path))
        .ok_or_else(|| Error::ExecutableNotMapped {
            pid,
            exe: exe_path.clone(),
        })?;
    let link = PathBuf::from(format!(
        "/proc/{pid}/map_files/{:x}-{:x}",
        mapping.start, mapping.end
    ));
    let file = File::open(&link).map_err(|source| Error::Io {
        path: link.clone(),
        source,
    })?;
    let elf = ElfData::from_file(&file, &exe_path)?;
    let bias = elf
        .bias_for_mapping(mapping.start, mapping.offset, mapping.perms.exec)
        .ok_or_else(|| Error::ExecutableNotMapped {
            pid,
            exe: exe_path.clone(),
        })?;
    let mut found = HashMap::new();
    if !elf.has_section_headers {
        // No `.dynsym` section: the loader's view of the same table.
        for symbol in elf.segment_dynamic_symbols() {
            let Ok(name) = std::str::from_utf8(symbol.name) else {
                continue;
            };
            if names.contains(&name) && !found.contains_key(name) {
                found.insert(name.to_string(), symbol.addr.wrapping_add(bias));
            }
        }
        return Ok(found);
    }
    let object = elf.object()?;
    for symbol in object.dynamic_symbols().chain(object.symbols()) {
        let Ok(name) = symbol.name() else { continue };
        if symbol.is_definition() && names.contains(&name) && !found.contains_key(name) {
            found.insert(name.to_string(), symbol.address().wrapping_add(bias));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test binary's own global, read back through its resolved address.
    #[no_mangle]
    #[used]
    static PGSCOPE_GLOBALS_PROBE: u64 = 0x5eed_cafe_f00d_beef;

    #[test]
    fn resolves_an_exported_global_of_this_process() {
        let found = executable_globals(
            std::process::id(),
            &["PGSCOPE_GLOBALS_PROBE", "no_such_symbol_xyz"],
        )
        .expect("own executable is readable");
        let addr = found["PGSCOPE_GLOBALS_PROBE"];
        assert_eq!(addr, std::ptr::addr_of!(PGSCOPE_GLOBALS_PROBE) as u64);
        assert!(!found.contains_key("no_such_symbol_xyz"));
    }

    #[test]
    fn missing_process_is_an_io_error() {
        let err = executable_globals(u32::MAX - 7, &["x"]).expect_err("no such process");
        assert!(matches!(err, Error::Io { .. }), "{err}");
    }
}
