//! What the fuzz harnesses (`tests/fuzz_*.rs`) share: how many cases to run, the committed seed
//! corpus, byte-level mutations of real inputs, and a watchdog that turns a hang into a failure
//! that names its input.
//!
//! Each harness runs a few hundred cases by default (all of them together well under a minute);
//! `PGSCOPE_FUZZ_CASES=N` runs N cases per property instead (`make fuzz`). A found crash or hang
//! is fixed in the symbolizer and its input kept under `tests/corpus/<harness>/`, which every run
//! replays first.

#![allow(dead_code)] // each harness uses a different part

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::Config;

/// A case that takes longer than this (debug build, shared 2-core machine) is a hang.
const CASE_LIMIT: Duration = Duration::from_secs(30);

/// The number of cases of one property: `PGSCOPE_FUZZ_CASES` when set, else `default`.
pub fn cases(default: u32) -> u32 {
    match std::env::var("PGSCOPE_FUZZ_CASES") {
        Ok(value) => value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("PGSCOPE_FUZZ_CASES={value:?} is not a number of cases")),
        Err(_) => default,
    }
}

/// proptest's configuration for a harness: `cases(default)` cases, no regression files
/// written next to the sources (found inputs go to the corpus by hand, minimised).
pub fn config(default: u32) -> Config {
    Config {
        cases: cases(default),
        failure_persistence: None,
        max_shrink_iters: 512,
        ..Config::default()
    }
}

/// The committed seed inputs of one harness, sorted by name: `tests/corpus/<name>/*`.
pub fn corpus(name: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(name);
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read the seed corpus {}: {e}", dir.display()))
        .map(|entry| entry.expect("corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    entries.sort();
    assert!(!entries.is_empty(), "the seed corpus {} is empty", dir.display());
    entries
        .into_iter()
        .map(|path| {
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            (path, bytes)
        })
        .collect()
}

/// One change to a file's bytes. Offsets are taken modulo the length of the region they aim
/// at, so every mutation lands somewhere.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// Flip one bit.
    Flip { region: usize, at: usize, bit: u8 },
    /// Write `width` bytes (1, 2, 4 or 8) of an extreme value.
    Extreme {
        region: usize,
        at: usize,
        width: usize,
        value: u64,
    },
    /// Cut the file to `len` bytes (modulo its length).
    Truncate { len: usize },
}

/// Values that break length and offset arithmetic.
pub const EXTREMES: &[u64] = &[
    0,
    1,
    7,
    0x7f,
    0x80,
    0xff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    0x1_0000_0000,
    i64::MAX as u64,
    u64::MAX,
    u64::MAX - 7,
];

/// Mutations aimed at `regions` (byte ranges of the input worth hitting: headers, tables),
/// at most `max` of them.
pub fn mutations(regions: usize, max: usize) -> impl Strategy<Value = Vec<Mutation>> {
    let region = 0..regions.max(1);
    let one = prop_oneof![
        4 => (region.clone(), any::<usize>(), 0u8..8).prop_map(|(region, at, bit)| Mutation::Flip { region, at, bit }),
        4 => (region, any::<usize>(), prop::sample::select(vec![1usize, 2, 4, 8]), prop::sample::select(EXTREMES))
            .prop_map(|(region, at, width, value)| Mutation::Extreme { region, at, width, value }),
        1 => any::<usize>().prop_map(|len| Mutation::Truncate { len }),
    ];
    prop::collection::vec(one, 1..=max)
}

/// Apply `mutations` to a copy of `base`; `regions` are ranges of `base`.
pub fn mutate(base: &[u8], regions: &[std::ops::Range<usize>], mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = base.to_vec();
    let whole = 0..base.len();
    for mutation in mutations {
        let region = |index: usize| {
            regions
                .get(index % regions.len().max(1))
                .unwrap_or(&whole)
                .clone()
        };
        match *mutation {
            Mutation::Flip { region: r, at, bit } => {
                let range = region(r);
                if let Some(byte) = pick(&range, at, 1).and_then(|i| bytes.get_mut(i)) {
                    *byte ^= 1 << bit;
                }
            }
            Mutation::Extreme {
                region: r,
                at,
                width,
                value,
            } => {
                let range = region(r);
                if let Some(i) = pick(&range, at, width).filter(|i| i + width <= bytes.len()) {
                    bytes[i..i + width].copy_from_slice(&value.to_le_bytes()[..width]);
                }
            }
            Mutation::Truncate { len } => {
                let keep = len % (bytes.len() + 1);
                bytes.truncate(keep);
            }
        }
    }
    bytes
}

fn pick(range: &std::ops::Range<usize>, at: usize, width: usize) -> Option<usize> {
    let span = range
        .end
        .checked_sub(range.start)?
        .checked_sub(width)?
        .checked_add(1)?;
    Some(range.start + at % span)
}

/// A deterministic stream of numbers for the parts of a case proptest need not shrink.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

struct Running {
    harness: &'static str,
    started: Instant,
    input: Vec<u8>,
}

static RUNNING: OnceLock<Mutex<Vec<Running>>> = OnceLock::new();

/// Marks one case as running until dropped; see [`watch`].
pub struct CaseGuard {
    slot: usize,
}

impl Drop for CaseGuard {
    fn drop(&mut self) {
        if let Some(running) = RUNNING.get() {
            let mut list = running.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(entry) = list.get_mut(self.slot) {
                entry.started = Instant::now() + Duration::from_secs(1 << 30);
            }
        }
    }
}

/// Start watching one case: if it is still running after [`CASE_LIMIT`], its input is written
/// to `target/fuzz-hangs/<harness>-<n>` and the process aborts (a hang cannot be unwound).
pub fn watch(harness: &'static str, input: &[u8]) -> CaseGuard {
    let running = RUNNING.get_or_init(|| {
        std::thread::spawn(watchdog);
        Mutex::new(Vec::new())
    });
    let mut list = running.lock().unwrap_or_else(|e| e.into_inner());
    let entry = Running {
        harness,
        started: Instant::now(),
        input: input.to_vec(),
    };
    // Reuse a finished slot (one per test thread at a time).
    let far = Instant::now() + Duration::from_secs(1 << 29);
    let slot = match list.iter().position(|r| r.started > far) {
        Some(slot) => {
            list[slot] = entry;
            slot
        }
        None => {
            list.push(entry);
            list.len() - 1
        }
    };
    CaseGuard { slot }
}

fn watchdog() {
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let Some(running) = RUNNING.get() else { continue };
        let list = running.lock().unwrap_or_else(|e| e.into_inner());
        for (i, case) in list.iter().enumerate() {
            if Instant::now() > case.started && case.started.elapsed() > CASE_LIMIT {
                let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz-hangs");
                let _ = std::fs::create_dir_all(&dir);
                let file = dir.join(format!("{}-{i}", case.harness));
                let _ = std::fs::write(&file, &case.input);
                eprintln!(
                    "fuzz harness `{}`: a case ran longer than {CASE_LIMIT:?} (a hang); its input is in {}",
                    case.harness,
                    file.display()
                );
                std::process::abort();
            }
        }
    }
}
