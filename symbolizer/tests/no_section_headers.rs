//! A binary without section headers (valid: the kernel and the loader need only program
//! headers) still unwinds to the root through `PT_GNU_EH_FRAME`, and its exported functions
//! are named from the dynamic segment.

mod support;

use std::path::{Path, PathBuf};

use support::{names, nm, Fixtures};
use symbolizer::{Location, Symbolizer, SymbolizerOptions, UnwindEnd};

/// `e_shoff`, `e_shnum` and `e_shstrndx` in an `Elf64_Ehdr`.
const E_SHOFF: usize = 0x28;
const E_SHNUM: usize = 0x3c;
const E_SHSTRNDX: usize = 0x3e;

/// A copy of `from` whose section header fields are set by `patch`.
fn patched_copy(fixtures: &Fixtures, from: &Path, name: &str, patch: impl Fn(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(from).expect("read fixture");
    patch(&mut bytes);
    let to = fixtures.path(name);
    std::fs::write(&to, &bytes).expect("write patched fixture");
    let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(&to, mode).expect("chmod patched fixture");
    to
}

fn unwind_and_check(fixtures: &Fixtures, exe: &Path, patched: &Path) {
    let snapshot = fixtures.run(patched, "plain");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = symbolizer.unwind_with_maps(&snapshot.maps, Path::new("/"), &snapshot.regs, &snapshot.stack);
    let names = names(&mut symbolizer, &stack);

    // Complete: through the binary (no frame pointers: only its .eh_frame can do it) and
    // glibc, to the executable's `_start`.
    assert_eq!(stack.end, UnwindEnd::ReachedRoot, "frames: {names:?}");
    assert_eq!(names.last().map(String::as_str), Some("_start"), "{names:?}");
    assert!(names.iter().any(|n| n == "__libc_start_main"), "{names:?}");

    let base = patched.file_name().and_then(|n| n.to_str()).expect("utf-8 name");
    let symbols = nm(exe);
    let expected = [
        format!("{base}+0x{:x}", symbols["leaf_static_c"].0),
        "middle_exported_b".to_string(),
        format!("{base}+0x{:x}", symbols["outer_static_a"].0),
        "main".to_string(),
    ];
    assert_eq!(names[..4], expected, "all frames: {names:?}");
    let Some(Location::InModule { module, .. }) = stack.frames.first() else {
        panic!("leaf frame unmapped: {names:?}");
    };
    let info = symbolizer.module_info(module).expect("module info");
    assert!(
        info.build_id.is_some_and(|id| id.len() == 40),
        "build-id from PT_NOTE"
    );
}

#[test]
fn binary_without_section_headers_unwinds_and_names_exports() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let patched = patched_copy(&fixtures, &exe, "fixture-noshdr", |bytes| {
        bytes[E_SHOFF..E_SHOFF + 8].fill(0);
        bytes[E_SHNUM..E_SHNUM + 2].fill(0);
        bytes[E_SHSTRNDX..E_SHSTRNDX + 2].fill(0);
    });
    unwind_and_check(&fixtures, &exe, &patched);
}

#[test]
fn binary_with_corrupt_section_headers_unwinds_and_names_exports() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    // Section headers said to lie far beyond the end of the file.
    let patched = patched_copy(&fixtures, &exe, "fixture-badshdr", |bytes| {
        bytes[E_SHOFF..E_SHOFF + 8].copy_from_slice(&0x7fff_ffff_0000u64.to_le_bytes());
    });
    unwind_and_check(&fixtures, &exe, &patched);
}

#[test]
fn globals_of_executable_without_section_headers_are_found() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let patched = patched_copy(&fixtures, &exe, "fixture-noshdr-globals", |bytes| {
        bytes[E_SHOFF..E_SHOFF + 8].fill(0);
        bytes[E_SHNUM..E_SHNUM + 2].fill(0);
        bytes[E_SHSTRNDX..E_SHSTRNDX + 2].fill(0);
    });
    let (mut child, snapshot) = fixtures.spawn_waiting(&patched, "plain");
    let found = symbolizer::executable_globals(child.id(), &["sink"]);
    drop(child.stdin.take());
    let status = child.wait().expect("wait for fixture");
    assert!(status.success(), "fixture failed: {status}");

    // A PIE: its first mapping (file offset 0) is at its load bias.
    let bias = snapshot
        .maps
        .iter()
        .find(|m| m.file_path() == Some(patched.as_path()) && m.offset == 0)
        .expect("fixture mapped")
        .start;
    let found = found.expect("globals readable");
    assert_eq!(found.get("sink"), Some(&(bias + nm(&exe)["sink"].0)));
}
