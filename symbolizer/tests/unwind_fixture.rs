//! Unwinding real stack snapshots of C fixtures built at test time, offline (saved maps plus
//! the binaries on disk) and against live processes.

mod support;

use std::io::Write;
use std::path::Path;

use support::{addr, names, nm, tool, Fixtures, Snapshot};
use symbolizer::{
    Location, ModuleSummary, Symbolizer, SymbolizerOptions, UnwindEnd, UnwoundStack, UserRegs, MAX_DEPTH,
};

const CHAIN: [&str; 4] = ["leaf_static_c", "middle_exported_b", "outer_static_a", "main"];

/// The leaf frames are exactly `expected`.
fn assert_prefix<S: AsRef<str> + std::fmt::Debug>(names: &[String], expected: &[S]) {
    let got: Vec<&str> = names.iter().take(expected.len()).map(String::as_str).collect();
    let want: Vec<&str> = expected.iter().map(AsRef::as_ref).collect();
    assert_eq!(got, want, "all frames: {names:?}");
}

fn unwind(symbolizer: &mut Symbolizer, snapshot: &Snapshot) -> UnwoundStack {
    symbolizer.unwind_with_maps(&snapshot.maps, Path::new("/"), &snapshot.regs, &snapshot.stack)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .expect("file name")
        .to_string_lossy()
        .into_owned()
}

/// The stack ends in glibc's start code and the executable's `_start`, which is reached only
/// by unwinding glibc (built without frame pointers) with its `.eh_frame`.
fn assert_reaches_root(names: &[String], stack: &UnwoundStack, start_name: &str) {
    assert_eq!(stack.end, UnwindEnd::ReachedRoot, "frames: {names:?}");
    assert!(
        names.iter().any(|n| n == "__libc_start_main"),
        "no __libc_start_main in {names:?}"
    );
    assert_eq!(names.last().map(String::as_str), Some(start_name), "{names:?}");
}

#[test]
fn unstripped_pie_unwinds_through_glibc_to_root() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let snapshot = fixtures.run(&exe, "plain");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = unwind(&mut symbolizer, &snapshot);
    let names = names(&mut symbolizer, &stack);

    assert_prefix(&names, &CHAIN);
    assert_reaches_root(&names, &stack, "_start");
    for loc in &stack.frames[..4] {
        assert_eq!(&*symbolizer.symbolize(loc).module, "fixture");
    }
    // Frame addresses are stated addresses inside the named functions; the first is the
    // sampled ip itself, the others return addresses minus one.
    let symbols = nm(&exe);
    for (loc, name) in stack.frames.iter().zip(CHAIN) {
        let (start, size) = symbols[name];
        let a = addr(loc);
        assert!(
            start <= a && a < start + size,
            "{name}: {a:#x} not in {start:#x}+{size:#x}"
        );
    }
    let Some(Location::InModule { module, .. }) = stack.frames.first() else {
        panic!("leaf frame unmapped");
    };
    let info = symbolizer.module_info(module).expect("module info");
    assert!(info.has_symtab);
    assert_eq!(info.debug_file, None);
    assert_eq!(info.path, exe);
    assert!(info.build_id.is_some_and(|id| id.len() == 40));
}

#[test]
fn non_pie_executable_unwinds_to_root() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture-nopie", &["-no-pie", "-fno-pie"]);
    let snapshot = fixtures.run(&exe, "plain");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = unwind(&mut symbolizer, &snapshot);
    let names = names(&mut symbolizer, &stack);

    assert_prefix(&names, &CHAIN);
    assert_reaches_root(&names, &stack, "_start");
    let (start, size) = nm(&exe)["leaf_static_c"];
    assert!(start >= 0x400000, "not a fixed-address executable");
    assert!((start..start + size).contains(&addr(&stack.frames[0])));
}

#[test]
fn stripped_binary_names_static_functions_by_their_start() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let stripped = fixtures.stripped_copy(&exe, "fixture-stripped");
    let snapshot = fixtures.run(&stripped, "plain");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = unwind(&mut symbolizer, &snapshot);
    let names = names(&mut symbolizer, &stack);

    let symbols = nm(&exe);
    // The neighbour really precedes the leaf: a nearest-exported-symbol lookup would have
    // said `exported_neighbour+0x…`.
    let neighbour = symbols["exported_neighbour"].0;
    let leaf = symbols["leaf_static_c"].0;
    assert!(
        neighbour < leaf && leaf - neighbour <= 0x20,
        "fixture layout changed"
    );

    let expected = [
        format!("fixture-stripped+0x{leaf:x}"),
        "middle_exported_b".to_string(),
        format!("fixture-stripped+0x{:x}", symbols["outer_static_a"].0),
        "main".to_string(),
    ];
    assert_prefix(&names, &expected);
    assert!(!names.iter().any(|n| n.contains("exported_neighbour")));
    // -rdynamic exports `_start` too (as Postgres's -Wl,-E does).
    assert_reaches_root(&names, &stack, "_start");

    let info = leaf_module_info(&symbolizer, &stack);
    assert!(!info.has_symtab);
    assert_eq!(info.debug_file, None);
}

#[test]
fn debuglink_debug_file_restores_static_names() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let debug_dir = fixtures.path(".debug");
    std::fs::create_dir_all(&debug_dir).expect("mkdir .debug");
    let debug_file = debug_dir.join("fixture-dl.debug");
    only_keep_debug(&exe, &debug_file);
    let stripped = fixtures.stripped_copy(&exe, "fixture-dl");
    add_debuglink(&stripped, &debug_file);

    let snapshot = fixtures.run(&stripped, "plain");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = unwind(&mut symbolizer, &snapshot);
    let names = names(&mut symbolizer, &stack);

    assert_prefix(&names, &CHAIN);
    assert_reaches_root(&names, &stack, "_start");
    let info = leaf_module_info(&symbolizer, &stack);
    assert!(!info.has_symtab);
    assert_eq!(info.debug_file, Some(debug_file));
}

#[test]
fn build_id_tree_in_debug_dir_restores_static_names() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let stripped = fixtures.stripped_copy(&exe, "fixture-bid");
    let snapshot = fixtures.run(&stripped, "plain");

    let mut probe = Symbolizer::new(SymbolizerOptions::default());
    let stack = unwind(&mut probe, &snapshot);
    let build_id = leaf_module_info(&probe, &stack).build_id.expect("build-id");
    let debug_root = fixtures.path("debug-root");
    let debug_file = debug_root
        .join(".build-id")
        .join(&build_id[..2])
        .join(format!("{}.debug", &build_id[2..]));
    std::fs::create_dir_all(debug_file.parent().expect("parent")).expect("mkdir build-id dir");
    only_keep_debug(&exe, &debug_file);

    let mut symbolizer = Symbolizer::new(SymbolizerOptions {
        debug_dirs: vec![debug_root],
    });
    let stack = unwind(&mut symbolizer, &snapshot);
    let names = names(&mut symbolizer, &stack);
    assert_prefix(&names, &CHAIN);
    assert_reaches_root(&names, &stack, "_start");
    assert_eq!(leaf_module_info(&symbolizer, &stack).debug_file, Some(debug_file));
}

#[test]
fn debug_file_of_another_build_is_ignored() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let other = fixtures.build_exe("fixture-other", &["-DOTHER_BUILD=1"]);
    let debug_file = fixtures.path("fixture-mismatch.debug");
    only_keep_debug(&exe, &debug_file);
    let stripped = fixtures.stripped_copy(&exe, "fixture-mismatch");
    add_debuglink(&stripped, &debug_file);
    // Same name, other build: its build-id differs, so it must not name anything.
    only_keep_debug(&other, &debug_file);

    let snapshot = fixtures.run(&stripped, "plain");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = unwind(&mut symbolizer, &snapshot);
    let names = names(&mut symbolizer, &stack);
    let leaf = nm(&exe)["leaf_static_c"].0;
    assert_eq!(
        names[0],
        format!("fixture-mismatch+0x{leaf:x}"),
        "frames: {names:?}"
    );
    assert_eq!(leaf_module_info(&symbolizer, &stack).debug_file, None);
}

#[test]
fn frame_pointer_fallback_through_library_without_unwind_info() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let snapshot = fixtures.run(&exe, "via-lib");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = unwind(&mut symbolizer, &snapshot);
    let names = names(&mut symbolizer, &stack);

    let expected = [
        "leaf_static_c",
        "fp_inner",
        "fp_outer",
        "middle_exported_b",
        "outer_static_a",
        "main",
    ];
    assert_prefix(&names, &expected);
    assert_eq!(&*symbolizer.symbolize(&stack.frames[1]).module, "libfp.so");
    assert_reaches_root(&names, &stack, "_start");
}

#[test]
fn first_frame_in_library_without_unwind_info() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let snapshot = fixtures.run(&exe, "in-lib");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = unwind(&mut symbolizer, &snapshot);
    let names = names(&mut symbolizer, &stack);

    let expected = [
        "fp_inner",
        "fp_outer",
        "middle_exported_b",
        "outer_static_a",
        "main",
    ];
    assert_prefix(&names, &expected);
    assert_reaches_root(&names, &stack, "_start");
}

#[test]
fn short_snapshot_ends_as_truncated() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let snapshot = fixtures.run(&exe, "plain");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let full = unwind(&mut symbolizer, &snapshot);
    assert_eq!(full.end, UnwindEnd::ReachedRoot);

    for len in [0, 8, 24, 64, 200] {
        let short = Snapshot {
            regs: snapshot.regs,
            stack: snapshot.stack[..len].to_vec(),
            maps: snapshot.maps.clone(),
        };
        let stack = unwind(&mut symbolizer, &short);
        assert_eq!(stack.end, UnwindEnd::StackTruncated, "len {len}");
        assert!(stack.frames.len() < full.frames.len(), "len {len}");
        assert_eq!(stack.frames[..], full.frames[..stack.frames.len()], "len {len}");
    }
}

#[test]
fn garbage_registers_and_stacks_never_panic() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let snapshot = fixtures.run(&exe, "plain");
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);

    let code: Vec<_> = snapshot.maps.iter().filter(|m| m.perms.exec).collect();
    for round in 0..2000 {
        let mut stack = vec![0u8; (rng.next() % 4096) as usize];
        for chunk in stack.chunks_mut(8) {
            // Mix plausible code addresses, stack addresses and noise.
            let word = match rng.next() % 4 {
                0 => {
                    let m = code[(rng.next() as usize) % code.len()];
                    m.start + rng.next() % (m.end - m.start)
                }
                1 => snapshot.regs.sp.wrapping_add(rng.next() % 8192),
                2 => 0,
                _ => rng.next(),
            };
            let bytes = word.to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
        let regs = match round % 3 {
            0 => snapshot.regs,
            1 => UserRegs {
                ip: snapshot.regs.ip,
                sp: snapshot.regs.sp,
                bp: rng.next(),
            },
            _ => UserRegs {
                ip: rng.next(),
                sp: rng.next(),
                bp: rng.next(),
            },
        };
        let stack = symbolizer.unwind_with_maps(&snapshot.maps, Path::new("/"), &regs, &stack);
        assert!(!stack.frames.is_empty() && stack.frames.len() <= MAX_DEPTH);
        for loc in &stack.frames {
            symbolizer.symbolize(loc);
        }
    }
}

#[test]
fn live_process_is_unwound_through_proc() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let (child, snapshot) = fixtures.spawn_waiting(&exe, "plain");
    let pid = child.id();
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = symbolizer.unwind(pid, &snapshot.regs, &snapshot.stack);
    // A sample of a process that is already gone, unwound with the layout of its parent.
    let gone = u32::MAX;
    let bare = symbolizer.unwind(gone, &snapshot.regs, &snapshot.stack);
    let inherited = symbolizer.unwind_as(gone, pid, &snapshot.regs, &snapshot.stack);
    finish(child);
    let names = names(&mut symbolizer, &stack);
    assert_prefix(&names, &CHAIN);
    assert_reaches_root(&names, &stack, "_start");
    assert_eq!(bare.end, UnwindEnd::NoUnwindInfo);
    assert_eq!(
        bare.frames,
        [Location::Unmapped {
            addr: snapshot.regs.ip
        }]
    );
    assert_eq!(inherited.frames, stack.frames);

    // The process is gone: its locations still resolve, and it can be forgotten.
    symbolizer.forget_process(pid);
    assert_eq!(&*symbolizer.symbolize(&stack.frames[0]).name, "leaf_static_c");
}

#[test]
fn deleted_binary_of_live_process_is_read_through_map_files() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let doomed = fixtures.path("fixture-deleted");
    std::fs::copy(&exe, &doomed).expect("copy fixture");
    let (child, snapshot) = fixtures.spawn_waiting(&doomed, "plain");
    std::fs::remove_file(&doomed).expect("delete running binary");

    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let stack = symbolizer.unwind(child.id(), &snapshot.regs, &snapshot.stack);
    finish(child);
    let names = names(&mut symbolizer, &stack);
    // Reading /proc/PID/map_files needs root or CAP_SYS_ADMIN.
    assert_prefix(&names, &CHAIN);
    assert_reaches_root(&names, &stack, "_start");
}

fn finish(mut child: std::process::Child) {
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.flush();
    }
    let status = child.wait().expect("wait for fixture");
    assert!(status.success(), "fixture failed: {status}");
}

fn leaf_module_info(symbolizer: &Symbolizer, stack: &UnwoundStack) -> ModuleSummary {
    match stack.frames.first() {
        Some(Location::InModule { module, .. }) => symbolizer.module_info(module).expect("module info"),
        other => panic!("leaf frame is {other:?}"),
    }
}

fn only_keep_debug(exe: &Path, debug_file: &Path) {
    tool(
        "objcopy",
        &[
            "--only-keep-debug".into(),
            exe.display().to_string(),
            debug_file.display().to_string(),
        ],
    );
}

fn add_debuglink(stripped: &Path, debug_file: &Path) {
    tool(
        "objcopy",
        &[
            format!("--add-gnu-debuglink={}", debug_file.display()),
            stripped.display().to_string(),
        ],
    );
    assert!(file_name(debug_file).ends_with(".debug"));
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}
