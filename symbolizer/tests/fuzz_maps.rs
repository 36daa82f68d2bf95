//! Fuzzing the `/proc/PID/maps` parser, and the placement of modules from whatever maps say
//! (overlapping, empty, misaligned or absurd mappings of real files).
//! Properties: parsing never panics and keeps `start <= end`; any valid line survives a
//! print-and-parse round trip; unwinding against any parsed maps never panics.

mod fuzz_support;
mod support;

use std::path::{Path, PathBuf};

use fuzz_support::{config, corpus, watch, XorShift};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use support::Fixtures;
use symbolizer::{parse_maps, MapEntry, MapPath, Perms, Symbolizer, SymbolizerOptions, UserRegs, MAX_DEPTH};

/// The kernel's format (`show_map_vma`), with the path column padded as it pads it.
fn print(entry: &MapEntry) -> String {
    let p = entry.perms;
    let perms = format!(
        "{}{}{}{}",
        if p.read { 'r' } else { '-' },
        if p.write { 'w' } else { '-' },
        if p.exec { 'x' } else { '-' },
        if p.shared { 's' } else { 'p' },
    );
    let name = match &entry.path {
        MapPath::Anonymous => String::new(),
        MapPath::Pseudo(name) => name.clone(),
        MapPath::File { path, deleted } => {
            format!("{}{}", path.display(), if *deleted { " (deleted)" } else { "" })
        }
    };
    format!(
        "{:x}-{:x} {perms} {:08x} {:02x}:{:02x} {:<26} {name}",
        entry.start, entry.end, entry.offset, entry.dev.0, entry.dev.1, entry.inode
    )
}

fn entry() -> impl Strategy<Value = MapEntry> {
    let path = prop_oneof![
        Just(MapPath::Anonymous),
        "\\[[a-z:_]{1,12}\\]".prop_map(MapPath::Pseudo),
        ("/[ -~]{0,40}[!-~]", any::<bool>()).prop_map(|(path, deleted)| MapPath::File {
            path: PathBuf::from(path),
            deleted,
        }),
    ];
    (
        any::<u64>(),
        any::<u64>(),
        any::<[bool; 4]>(),
        any::<u64>(),
        any::<(u32, u32)>(),
        any::<u64>(),
        path,
    )
        .prop_map(|(a, b, [read, write, exec, shared], offset, dev, inode, path)| {
            // A file name that itself ends in " (deleted)" cannot be told apart; so can't the
            // kernel's output.
            let path = match path {
                MapPath::File { path, deleted } if path.to_string_lossy().ends_with(" (deleted)") => {
                    MapPath::File {
                        path: path.join("x"),
                        deleted,
                    }
                }
                path => path,
            };
            MapEntry {
                start: a.min(b),
                end: a.max(b),
                perms: Perms {
                    read,
                    write,
                    exec,
                    shared,
                },
                offset,
                dev,
                inode: if matches!(path, MapPath::File { .. }) {
                    inode
                } else {
                    0
                },
                path,
            }
        })
}

#[test]
fn valid_lines_round_trip() {
    let mut runner = TestRunner::new(config(500));
    let result = runner.run(&entry(), |entry| {
        let line = print(&entry);
        let parsed = MapEntry::parse_line(line.as_bytes())
            .map_err(|e| TestCaseError::fail(format!("{line:?}: {e}")))?;
        prop_assert_eq!(parsed, entry, "{:?}", line);
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

fn check_parse(text: &[u8]) -> Vec<MapEntry> {
    let _guard = watch("maps", text);
    match parse_maps(text, Path::new("fuzz")) {
        Ok(entries) => {
            assert!(entries.iter().all(|e| e.start <= e.end));
            entries
        }
        Err(err) => {
            assert!(!err.to_string().is_empty());
            Vec::new()
        }
    }
}

/// Mutated corpus text: bytes flipped, replaced by separators, lines duplicated.
fn mutated_text() -> impl Strategy<Value = Vec<u8>> {
    let seeds: Vec<Vec<u8>> = corpus("maps").into_iter().map(|(_, bytes)| bytes).collect();
    (
        prop::sample::select(seeds),
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..12),
    )
        .prop_map(|(mut text, edits)| {
            for (at, byte) in edits {
                if text.is_empty() {
                    break;
                }
                let i = at % text.len();
                text[i] = match byte % 4 {
                    0 => b" -:\n\t0f"[usize::from(byte) % 7],
                    1 => byte,
                    _ => text[i] ^ (1 << (byte % 8)),
                };
            }
            text
        })
}

#[test]
fn corpus_and_mutations_parse_without_panic() {
    for (_, text) in corpus("maps") {
        check_parse(&text);
    }
    let mut runner = TestRunner::new(config(2000));
    let strategy = prop_oneof![mutated_text(), prop::collection::vec(any::<u8>(), 0..300)];
    let result = runner.run(&strategy, |text| {
        check_parse(&text);
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

#[test]
fn unwinding_against_arbitrary_maps_of_real_files_never_panics() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let snapshot = fixtures.run(&exe, "plain");
    let files = [
        exe,
        fixtures.path("libfp.so"),
        PathBuf::from("/usr/lib/postgresql/15/lib/pg_stat_statements.so"),
    ];
    // The corpus maps too (their files mostly do not exist here).
    for (_, text) in corpus("maps") {
        let maps = check_parse(&text);
        let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
        for m in &maps {
            let regs = UserRegs {
                ip: m.start,
                sp: m.end.wrapping_sub(64),
                bp: m.start,
            };
            let walk = symbolizer.unwind_with_maps(&maps, Path::new("/"), &regs, &snapshot.stack);
            assert!(!walk.frames.is_empty() && walk.frames.len() <= MAX_DEPTH);
        }
    }

    let mapping = (0usize..3, 0u64..0x40, 0u64..0x40, 0u64..0x40, any::<[bool; 2]>());
    let strategy = (prop::collection::vec(mapping, 0..8), any::<u64>());
    let mut runner = TestRunner::new(config(300));
    let result = runner.run(&strategy, |(mappings, seed)| {
        // Page-granular ranges near the recorded stack's code, so that some placements are
        // plausible, mixed with the process's own stack and libraries.
        let mut maps: Vec<MapEntry> = snapshot
            .maps
            .iter()
            .filter(|m| m.file_path().is_none())
            .cloned()
            .collect();
        let base = snapshot.regs.ip & !0xf_ffff;
        for (file, start, len, offset, [exec, write]) in mappings {
            maps.push(MapEntry {
                start: base + start * 0x1000,
                end: base + (start + len) * 0x1000,
                perms: Perms {
                    read: true,
                    write,
                    exec,
                    shared: false,
                },
                offset: offset * 0x1000,
                dev: (8, 1),
                inode: 7,
                path: MapPath::File {
                    path: files[file].clone(),
                    deleted: false,
                },
            });
        }
        let text: String = maps.iter().map(|m| print(m) + "\n").collect();
        let _guard = watch("maps-unwind", text.as_bytes());
        let mut rng = XorShift(seed | 1);
        let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
        for regs in [
            snapshot.regs,
            UserRegs {
                ip: base + rng.next() % 0x40_000,
                sp: snapshot.regs.sp,
                bp: rng.next(),
            },
        ] {
            let walk = symbolizer.unwind_with_maps(&maps, Path::new("/"), &regs, &snapshot.stack);
            prop_assert!(!walk.frames.is_empty() && walk.frames.len() <= MAX_DEPTH);
            for loc in &walk.frames {
                symbolizer.symbolize(loc);
            }
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
