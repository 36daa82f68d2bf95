//! `Symbolizer::direct_callees` on a stripped shared library loaded into this test process, the
//! way pgscope finds a static function of a stripped Postgres extension from its hook functions.

mod support;

use std::collections::{BTreeSet, HashMap};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use object::{Object, ObjectSection};
use support::{nm, tool};
use symbolizer::{CalleesError, Symbolizer, SymbolizerOptions};

const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/callees.c");

/// File offsets of the functions in `.text` of `lib`, by name, from its own symbol table: the
/// answer the symbol-less method must reproduce.
fn offsets_by_name(lib: &Path) -> HashMap<String, u64> {
    let bytes = std::fs::read(lib).expect("read the unstripped library");
    let file = object::File::parse(&*bytes).expect("parse the unstripped library");
    let text = file.section_by_name(".text").expect(".text");
    let (text_offset, _) = text.file_range().expect(".text has file bytes");
    let svma = text.address()..text.address() + text.size();
    nm(lib)
        .into_iter()
        .filter(|(_, (addr, _))| svma.contains(addr))
        .map(|(name, (addr, _))| (name, addr - svma.start + text_offset))
        .collect()
}

/// Loads `lib` into this process for good (its code must stay mapped while inspected) and
/// returns the address of each of `names`.
fn load(lib: &Path, names: &[&str]) -> HashMap<String, u64> {
    let path = CString::new(lib.as_os_str().as_bytes()).expect("path without NUL");
    // SAFETY: the fixture has no constructors beyond the compiler's, and is never unloaded.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!handle.is_null(), "dlopen {} failed", lib.display());
    names
        .iter()
        .map(|name| {
            let symbol = CString::new(*name).expect("name without NUL");
            // SAFETY: looking up a symbol of a handle that stays open.
            let addr = unsafe { libc::dlsym(handle, symbol.as_ptr()) };
            assert!(!addr.is_null(), "{name} not exported");
            (name.to_string(), addr as u64)
        })
        .collect()
}

#[test]
fn callees_of_a_stripped_library_are_its_static_functions_called_directly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lib = dir.path().join("libcallees.so");
    let stripped = dir.path().join("libcallees-stripped.so");
    tool(
        "cc",
        &[
            "-O2",
            "-fPIC",
            "-shared",
            "-Wl,--build-id",
            "-o",
            &lib.display().to_string(),
            SOURCE,
        ]
        .map(String::from),
    );
    std::fs::copy(&lib, &stripped).expect("copy the library");
    tool("strip", &["--strip-all".into(), stripped.display().to_string()]);
    let by_name = offsets_by_name(&lib);
    let name_of: HashMap<u64, &str> = by_name.iter().map(|(n, o)| (*o, n.as_str())).collect();
    let exported = load(&stripped, &["first_hook", "second_hook", "sink"]);

    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let pid = std::process::id();
    for (hook, expected) in [
        // A loop, an indirect call, a PLT call to `exported_helper`, and `store` as a tail call.
        ("first_hook", ["only_first", "store"]),
        ("second_hook", ["store", "tail_target"]),
    ] {
        let found = symbolizer
            .direct_callees(pid, exported[hook])
            .unwrap_or_else(|e| panic!("{hook}: {e}"));
        assert_eq!(found.function_offset, by_name[hook], "{hook} starts elsewhere");
        assert!(found
            .path
            .ends_with(stripped.strip_prefix("/").expect("absolute")));
        let names: BTreeSet<&str> = found
            .callees
            .iter()
            .map(|offset| name_of.get(offset).copied().unwrap_or("<not a function start>"))
            .collect();
        assert_eq!(
            names,
            BTreeSet::from(expected),
            "callees of {hook}: {:#x?}",
            found.callees
        );
    }

    // Data of the library: no FDE covers it.
    let err = symbolizer
        .direct_callees(pid, exported["sink"])
        .expect_err("a variable is no function");
    assert!(matches!(err, CalleesError::NoExtent { .. }), "{err}");
    let heap = Box::new(0u64);
    let err = symbolizer
        .direct_callees(pid, &*heap as *const u64 as u64)
        .expect_err("the heap is no file");
    assert!(matches!(err, CalleesError::NoFile { .. }), "{err}");
}
