//! Static functions of a stripped Postgres named through the tables of function pointers that
//! hold them: the executor's tuple-slot callbacks (`TTSOpsBufferHeapTuple.getsomeattrs` is
//! `tts_buffer_heap_getsomeattrs`, where a scan deforms its tuples) and the heap table access
//! method (`heapam_methods.index_fetch_tuple` is `heapam_index_fetch_tuple`, where every index
//! scan fetches its heap tuple). Each major's layouts and function names are generated into its
//! `vNN/pointer_tables.rs` by `scripts/gen-pg-pointer-tables.py` from that major's headers and a
//! build with symbols; the symbolizer reads the tables' relocations (see
//! `symbolizer::PointerTable`).

use symbolizer::{Slot, Symbolizer};
use tracing::debug;

use super::VersionTable;

/// The executable whose data holds the tables.
const EXECUTABLE: &str = "postgres";

/// One field of a table: its offset, its name, and the function of the source it holds.
pub(crate) const fn slot(offset: u64, field: &'static str, function: &'static str) -> Slot {
    Slot {
        offset,
        field,
        function,
    }
}

/// Names the static functions the tables of `table`'s major hold in the `postgres` executable of
/// process `pid`, in every process mapping it, where no symbol names them (a stripped build).
/// Returns how many were named; a table that does not match the major's layout names nothing,
/// and why is logged.
pub fn name_in_stacks(symbolizer: &mut Symbolizer, pid: u32, table: &VersionTable) -> usize {
    let Some((named, errors)) = symbolizer.name_pointer_tables(pid, EXECUTABLE, table.pointer_tables) else {
        debug!(
            pid,
            "no `{EXECUTABLE}` mapped: tables of function pointers not read"
        );
        return 0;
    };
    for error in errors {
        debug!(
            pid,
            major = table.major,
            "a table of function pointers names nothing: {error}"
        );
    }
    named
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::PathBuf;
    use std::process::Command;

    use symbolizer::fuzzing::pointer_table_names;

    use crate::postgres::{header_check, table_for};

    /// Fewest static functions each major's tables name in a stripped build: the four slot
    /// tables hold about 40, the heap access method about 25.
    const MIN_NAMED: usize = 50;

    /// The upstream builds keep `.symtab`: stripped of it, the names the tables give must be the
    /// ones their symbol table gives at the same addresses, in 14, 16, 17 and 18.
    #[test]
    fn stripped_upstream_builds_get_their_own_symbols_names() {
        for (major, dir) in header_check::upstream_dirs() {
            let Some(table) = table_for(*major).ok() else {
                continue;
            };
            let postgres = dir.join("bin/postgres");
            let scratch = tempfile::tempdir().expect("a temp dir");
            let stripped = scratch.path().join("postgres");
            let status = Command::new("objcopy")
                .arg("--strip-all")
                .arg(&postgres)
                .arg(&stripped)
                .status()
                .expect("objcopy (binutils) is needed");
            assert!(status.success(), "objcopy --strip-all {}", postgres.display());
            let bytes = std::fs::read(&stripped).expect("the stripped copy");
            let (named, errors) = pointer_table_names(stripped.clone(), bytes, table.pointer_tables)
                .expect("the stripped copy parses");
            assert!(errors.is_empty(), "{major}: {errors:?}");
            let truth = symbols_of(&postgres);
            let wrong: Vec<String> = named
                .iter()
                .filter(|(address, name)| !truth.get(address).is_some_and(|n| n.contains(name)))
                .map(|(address, name)| format!("{name} at {address:#x} is {:?}", truth.get(address)))
                .collect();
            assert!(wrong.is_empty(), "{major}: wrong names: {wrong:?}");
            assert!(
                named.len() >= MIN_NAMED,
                "{major}: only {} named: {named:?}",
                named.len()
            );
        }
    }

    /// Every symbol of `binary` by address, as `nm` lists them (functions, static ones too).
    fn symbols_of(binary: &std::path::Path) -> BTreeMap<u64, Vec<String>> {
        let nm = Command::new("nm")
            .arg("--defined-only")
            .arg(binary)
            .output()
            .expect("nm (binutils) is needed");
        assert!(nm.status.success(), "nm {}", binary.display());
        let mut truth: BTreeMap<u64, Vec<String>> = BTreeMap::new();
        for line in String::from_utf8_lossy(&nm.stdout).lines() {
            let mut fields = line.split_whitespace();
            let (Some(address), Some(_), Some(name)) = (fields.next(), fields.next(), fields.next()) else {
                continue;
            };
            if let Ok(address) = u64::from_str_radix(address, 16) {
                truth.entry(address).or_default().push(name.to_string());
            }
        }
        truth
    }

    /// The distro's 15 is stripped: its tables must match the 15 layout and name the hot
    /// static functions (their names are checked against the symbols of a build of the same
    /// source by `tests/tests/pointer_tables.rs`).
    #[test]
    fn the_stripped_distro_15_gets_its_static_functions_named() {
        let table = table_for(15).expect("supported");
        let path = PathBuf::from("/usr/lib/postgresql/15/bin/postgres");
        let bytes = std::fs::read(&path).expect("the distro PostgreSQL 15 (`make deps`)");
        let (named, errors) = pointer_table_names(path, bytes, table.pointer_tables).expect("parses");
        assert!(errors.is_empty(), "{errors:?}");
        let names: Vec<&str> = named.iter().map(|(_, name)| name.as_str()).collect();
        for hot in [
            "tts_buffer_heap_getsomeattrs",
            "heapam_index_fetch_tuple",
            "tts_virtual_clear",
        ] {
            assert!(names.contains(&hot), "{hot} not named: {names:?}");
        }
        assert!(named.len() >= MIN_NAMED, "only {} named: {names:?}", named.len());
    }
}
