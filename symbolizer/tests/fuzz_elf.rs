//! Fuzzing the ELF loader and the `.eh_frame`/`.eh_frame_hdr` unwinder with corrupted real
//! files: the C fixtures, Debian's `pg_stat_statements.so` and the first MiBs of its
//! `postgres`. Each case flips bits, writes extreme values into headers and tables, or
//! truncates the file, then unwinds real and random stacks through it and names every frame.
//! Property: no panic, no hang, a bounded walk, whatever the file says.

mod fuzz_support;
mod support;

use std::ops::Range;
use std::path::{Path, PathBuf};

use fuzz_support::{config, corpus, mutate, mutations, watch, Mutation, XorShift};
use object::read::elf::{ElfFile64, FileHeader as _, ProgramHeader as _};
use object::{LittleEndian, Object, ObjectSection};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use support::{Fixtures, Snapshot};
use symbolizer::{
    parse_maps, MapEntry, MapPath, Symbolizer, SymbolizerOptions, UnwindEnd, UserRegs, MAX_DEPTH,
};

const PG_LIB: &str = "/usr/lib/postgresql/15/lib/pg_stat_statements.so";
const PG_BIN: &str = "/usr/lib/postgresql/15/bin/postgres";
/// How much of `postgres` is kept: headers, dynamic symbols and the start of its code.
const PG_HEAD: usize = 2 << 20;

/// Where synthetic mappings of a file without a recorded run are placed.
const BASE: u64 = 0x7f10_0000_0000;
const STACK: u64 = 0x7ffd_0000_0000;
const STACK_LEN: u64 = 0x2_0000;

/// One real file to corrupt, with a stack that goes through it.
struct Target {
    name: &'static str,
    bytes: Vec<u8>,
    /// Byte ranges worth aiming at: headers and the sections the symbolizer reads.
    regions: Vec<Range<usize>>,
    /// The process layout, the file's mappings to be pointed at the corrupted copy.
    maps: Vec<MapEntry>,
    original: PathBuf,
    /// A recorded stack through the file, if it was run.
    snapshot: Option<(UserRegs, Vec<u8>)>,
}

impl Target {
    fn recorded(name: &'static str, file: &Path, snapshot: &Snapshot) -> Target {
        let bytes = std::fs::read(file).expect("read fixture");
        Target {
            name,
            regions: regions(&bytes),
            bytes,
            maps: snapshot.maps.clone(),
            original: file.to_path_buf(),
            snapshot: Some((snapshot.regs, snapshot.stack.clone())),
        }
    }

    /// A file mapped at [`BASE`] as the loader would, beside a stack mapping.
    fn synthetic(name: &'static str, file: &Path, keep: usize) -> Target {
        let mut bytes = std::fs::read(file)
            .unwrap_or_else(|e| panic!("{} is needed for this test (postgresql-15): {e}", file.display()));
        let regions = regions(&bytes);
        let header = object::elf::FileHeader64::<LittleEndian>::parse(&*bytes).expect("real ELF");
        let mut text = String::new();
        for ph in header
            .program_headers(LittleEndian, &*bytes)
            .expect("program headers")
        {
            if ph.p_type(LittleEndian) != object::elf::PT_LOAD {
                continue;
            }
            let (vaddr, memsz) = (ph.p_vaddr(LittleEndian), ph.p_memsz(LittleEndian));
            let start = BASE + (vaddr & !0xfff);
            let end = (BASE + vaddr + memsz + 0xfff) & !0xfff;
            let flags = ph.p_flags(LittleEndian);
            let perms = format!(
                "{}{}{}p",
                if flags & object::elf::PF_R != 0 { 'r' } else { '-' },
                if flags & object::elf::PF_W != 0 { 'w' } else { '-' },
                if flags & object::elf::PF_X != 0 { 'x' } else { '-' },
            );
            let offset = ph.p_offset(LittleEndian) & !0xfff;
            text += &format!(
                "{start:x}-{end:x} {perms} {offset:08x} 08:01 4242 {}\n",
                file.display()
            );
        }
        text += &format!(
            "{STACK:x}-{:x} rw-p 00000000 00:00 0  [stack]\n",
            STACK + STACK_LEN
        );
        bytes.truncate(keep);
        let regions = regions.into_iter().filter_map(|r| clip(r, keep)).collect();
        Target {
            name,
            bytes,
            regions,
            maps: parse_maps(text.as_bytes(), Path::new("synthetic")).expect("synthetic maps"),
            original: file.to_path_buf(),
            snapshot: None,
        }
    }

    /// The maps with the file's mappings pointed at `copy`.
    fn maps_for(&self, copy: &Path) -> Vec<MapEntry> {
        let mut maps = self.maps.clone();
        for entry in &mut maps {
            if entry.file_path() == Some(self.original.as_path()) {
                entry.path = MapPath::File {
                    path: copy.to_path_buf(),
                    deleted: false,
                };
            }
        }
        maps
    }
}

fn clip(range: Range<usize>, len: usize) -> Option<Range<usize>> {
    let end = range.end.min(len);
    (range.start < end).then_some(range.start..end)
}

/// The ELF header, program and section header tables, and the sections read for unwinding,
/// symbols, build-id and debuglink.
fn regions(bytes: &[u8]) -> Vec<Range<usize>> {
    let elf = ElfFile64::<LittleEndian>::parse(bytes).expect("real ELF");
    let header = elf.elf_header();
    let e = LittleEndian;
    let table = |offset: u64, count: u16, size: u16| {
        let start = offset as usize;
        start..start + usize::from(count) * usize::from(size)
    };
    let mut regions = vec![
        0..64,
        table(
            header.e_phoff.get(e),
            header.e_phnum.get(e),
            header.e_phentsize.get(e),
        ),
        table(
            header.e_shoff.get(e),
            header.e_shnum.get(e),
            header.e_shentsize.get(e),
        ),
    ];
    for name in [
        ".eh_frame_hdr",
        ".eh_frame",
        ".dynamic",
        ".dynsym",
        ".dynstr",
        ".gnu.hash",
        ".note.gnu.build-id",
        ".gnu_debuglink",
        ".symtab",
    ] {
        if let Some((offset, size)) = elf.section_by_name(name).and_then(|s| s.file_range()) {
            // The first bytes of long tables are where their structure is.
            regions.push(offset as usize..(offset + size.min(4096)) as usize);
        }
    }
    regions.retain(|r| r.start < r.end && r.end <= bytes.len());
    regions
}

/// Random registers and stack words that point into the file's code and the stack, as a
/// sample of a busy process would, mixed with noise.
fn random_stack(maps: &[MapEntry], rng: &mut XorShift) -> (UserRegs, Vec<u8>) {
    let code: Vec<&MapEntry> = maps.iter().filter(|m| m.perms.exec).collect();
    let stack = maps
        .iter()
        .find(|m| m.path == MapPath::Pseudo("[stack]".into()))
        .expect("a stack mapping");
    let code_addr = |rng: &mut XorShift| match code.as_slice() {
        [] => rng.next(),
        code => {
            let m = code[(rng.next() as usize) % code.len()];
            m.start + rng.next() % (m.end - m.start).max(1)
        }
    };
    let sp = stack.end - 0x1000 - (rng.next() % 0x800) * 8;
    let mut bytes = vec![0u8; (rng.next() % 0x1000) as usize];
    for chunk in bytes.chunks_mut(8) {
        let word = match rng.next() % 4 {
            0 | 1 => code_addr(rng),
            2 => sp.wrapping_add(rng.next() % 0x1000),
            _ => rng.next(),
        };
        chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
    }
    let regs = UserRegs {
        ip: code_addr(rng),
        sp,
        bp: sp.wrapping_add(rng.next() % 0x1000),
    };
    (regs, bytes)
}

/// Unwind the recorded stack and a few random ones through `bytes` in place of the target's
/// file, and name every frame.
fn run_case(target: &Target, dir: &Path, bytes: &[u8], seed: u64) {
    let _guard = watch("elf", bytes);
    let copy = dir.join(format!("corrupt-{}", target.name));
    std::fs::write(&copy, bytes).expect("write corrupted copy");
    let maps = target.maps_for(&copy);
    let mut rng = XorShift(seed | 1);
    let mut stacks: Vec<(UserRegs, Vec<u8>)> = target.snapshot.iter().cloned().collect();
    stacks.extend((0..3).map(|_| random_stack(&maps, &mut rng)));

    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    for (regs, stack) in &stacks {
        let walk = symbolizer.unwind_with_maps(&maps, Path::new("/"), regs, stack);
        assert!(!walk.frames.is_empty() && walk.frames.len() <= MAX_DEPTH);
        if walk.end == UnwindEnd::DepthLimit {
            assert_eq!(walk.frames.len(), MAX_DEPTH);
        }
        for loc in &walk.frames {
            let frame = symbolizer.symbolize(loc);
            assert!(!frame.name.is_empty() && !frame.module.is_empty());
            if let symbolizer::Location::InModule { module, .. } = loc {
                assert!(symbolizer.module_info(module).is_some());
            }
        }
    }
}

/// A corpus entry: `base NAME`, then `set OFFSET WIDTH VALUE`, `flip OFFSET BIT`,
/// `truncate LEN` lines (numbers decimal or 0x-hex; an offset may be `.section+N`, from the
/// section's place in the base file; `#` comments).
fn replay(entry: &[u8], path: &Path, targets: &[Target], dir: &Path) {
    let text = String::from_utf8_lossy(entry);
    let num = |s: &str| {
        let parsed = match s.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => s.parse(),
        };
        parsed.unwrap_or_else(|_| panic!("{}: bad number {s:?}", path.display()))
    };
    let mut target = None;
    let mut bytes = Vec::new();
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["base", name] => {
                let found = targets.iter().find(|t| t.name == *name);
                let found = found.unwrap_or_else(|| panic!("{}: no base {name}", path.display()));
                bytes = found.bytes.clone();
                target = Some(found);
            }
            ["set", offset, width, value] => {
                let (at, width) = (offset_in(&bytes, offset, &num), num(width) as usize);
                if at + width <= bytes.len() {
                    bytes[at..at + width].copy_from_slice(&num(value).to_le_bytes()[..width]);
                }
            }
            ["flip", offset, bit] => {
                let at = offset_in(&bytes, offset, &num);
                if let Some(byte) = bytes.get_mut(at) {
                    *byte ^= 1 << num(bit);
                }
            }
            ["truncate", len] => bytes.truncate(num(len) as usize),
            _ => panic!("{}: cannot read line {line:?}", path.display()),
        }
    }
    let target = target.unwrap_or_else(|| panic!("{}: no `base` line", path.display()));
    run_case(target, dir, &bytes, 0x5eed);
}

/// `N`, or `.section+N` relative to where the section's bytes are in `bytes`.
fn offset_in(bytes: &[u8], text: &str, num: &dyn Fn(&str) -> u64) -> usize {
    let Some((section, rest)) = text.split_once('+').filter(|(s, _)| s.starts_with('.')) else {
        return num(text) as usize;
    };
    let elf = ElfFile64::<LittleEndian>::parse(bytes).expect("corpus base parses");
    let (start, _) = elf
        .section_by_name(section)
        .and_then(|s| s.file_range())
        .unwrap_or_else(|| panic!("corpus base has no {section}"));
    (start + num(rest)) as usize
}

fn targets(fixtures: &Fixtures) -> Vec<Target> {
    let exe = fixtures.build_exe("fixture", &[]);
    let plain = fixtures.run(&exe, "plain");
    let via_lib = fixtures.run(&exe, "via-lib");
    vec![
        Target::recorded("fixture", &exe, &plain),
        Target::recorded("libfp", &fixtures.path("libfp.so"), &via_lib),
        Target::synthetic("pg_stat_statements", Path::new(PG_LIB), usize::MAX),
        Target::synthetic("postgres-head", Path::new(PG_BIN), PG_HEAD),
    ]
}

fn fuzz(target: &Target, dir: &Path, default_cases: u32) {
    let mut runner = TestRunner::new(config(default_cases));
    let strategy = (mutations(target.regions.len(), 8), any::<u64>());
    let result = runner.run(&strategy, |(muts, seed): (Vec<Mutation>, u64)| {
        let bytes = mutate(&target.bytes, &target.regions, &muts);
        run_case(target, dir, &bytes, seed);
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{}: {failure}", target.name);
    }
}

#[test]
fn corpus_replays_without_panic() {
    let fixtures = Fixtures::new();
    let targets = targets(&fixtures);
    for (path, entry) in corpus("elf") {
        replay(&entry, &path, &targets, fixtures.dir.path());
    }
}

#[test]
fn corrupted_fixtures_never_panic() {
    let fixtures = Fixtures::new();
    let targets = targets(&fixtures);
    fuzz(&targets[0], fixtures.dir.path(), 150);
    fuzz(&targets[1], fixtures.dir.path(), 100);
}

#[test]
fn corrupted_postgres_files_never_panic() {
    let fixtures = Fixtures::new();
    let targets = targets(&fixtures);
    fuzz(&targets[2], fixtures.dir.path(), 100);
    fuzz(&targets[3], fixtures.dir.path(), 25);
}
