//! What the property tests over outside input share: how many cases to run, and mutations of
//! real inputs (a seed corpus under `agent/tests/corpus/`), as a fuzzer would make them.
//! Stable Rust has no sanitizer-driven fuzzing: these run in `cargo test`, a bounded number of
//! cases by default, more with `PGSCOPE_FUZZ_CASES=100000` for a longer run.

use std::path::PathBuf;

use proptest::prelude::*;

/// Cases per property: `PGSCOPE_FUZZ_CASES`, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PGSCOPE_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

/// The proptest settings of a harness.
pub fn config(default_cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default_cases),
        // Shrinking a mutated 60 KiB input takes long and a failure is reproduced from its
        // seed anyway.
        max_shrink_iters: 256,
        ..ProptestConfig::default()
    }
}

/// The seed files of one corpus directory (`agent/tests/corpus/<kind>`), sorted by name.
pub fn corpus(kind: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(kind);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|error| panic!("the seed corpus `{}`: {error}", dir.display()))
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no seeds in `{}`", dir.display());
    files
        .into_iter()
        .map(|path| {
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading `{}`: {e}", path.display()));
            (path, bytes)
        })
        .collect()
}

/// Tokens that matter to TOML and JSON parsers, spliced in by [`Mutation::Splice`].
const TOKENS: [&str; 24] = [
    "\"",
    "'",
    "[",
    "]",
    "{",
    "}",
    "=",
    ",",
    ":",
    "\n",
    "\\",
    "\\u0000",
    "-1",
    "0",
    "1e999",
    "18446744073709551616",
    "-9223372036854775809",
    "null",
    "true",
    "nan",
    "[[",
    "\"\"\"",
    "\u{feff}",
    "\u{10ffff}",
];

/// One edit of an input; positions are taken modulo its length.
#[derive(Clone, Debug)]
pub enum Mutation {
    FlipBit {
        at: usize,
        bit: u8,
    },
    Delete {
        at: usize,
        len: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Splice {
        at: usize,
        token: usize,
    },
    /// Copies a range elsewhere (duplicated keys, sections, objects).
    Duplicate {
        from: usize,
        len: usize,
        to: usize,
    },
    /// Deep nesting: `depth` opening brackets.
    Nest {
        at: usize,
        depth: usize,
        open: u8,
    },
    Truncate {
        at: usize,
    },
}

pub fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        (any::<usize>(), 1usize..64).prop_map(|(at, len)| Mutation::Delete { at, len }),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<usize>(), 0..TOKENS.len()).prop_map(|(at, token)| Mutation::Splice { at, token }),
        (any::<usize>(), 1usize..256, any::<usize>()).prop_map(|(from, len, to)| Mutation::Duplicate {
            from,
            len,
            to
        }),
        (any::<usize>(), 1usize..5000, prop_oneof![Just(b'['), Just(b'{')])
            .prop_map(|(at, depth, open)| Mutation::Nest { at, depth, open }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
    ]
}

/// `seed` with `mutations` applied in order.
pub fn mutate(seed: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for mutation in mutations {
        let len = bytes.len();
        let pos = |at: usize| if len == 0 { 0 } else { at % (len + 1) };
        match mutation {
            Mutation::FlipBit { at, bit } => {
                if len > 0 {
                    bytes[at % len] ^= 1 << bit;
                }
            }
            Mutation::Delete { at, len: count } => {
                let start = pos(*at);
                let end = (start + count).min(len);
                bytes.drain(start..end);
            }
            Mutation::Insert { at, bytes: new } => {
                let at = pos(*at);
                bytes.splice(at..at, new.iter().copied());
            }
            Mutation::Splice { at, token } => {
                let at = pos(*at);
                bytes.splice(at..at, TOKENS[*token].bytes());
            }
            Mutation::Duplicate { from, len: count, to } => {
                let start = pos(*from);
                let copy = bytes[start..(start + count).min(len)].to_vec();
                let to = pos(*to);
                bytes.splice(to..to, copy);
            }
            Mutation::Nest { at, depth, open } => {
                let at = pos(*at);
                bytes.splice(at..at, std::iter::repeat_n(*open, *depth));
            }
            Mutation::Truncate { at } => bytes.truncate(pos(*at)),
        }
    }
    bytes
}
