//! Fuzzing the `/proc/kallsyms` parser. Properties: any bytes give symbols or an error, never a
//! panic; for well-formed input, a lookup names the preferred text symbol at the greatest
//! address not above the one asked (global before local, then the shorter name, then the
//! alphabetically first), as a plain model computes it.

mod fuzz_support;

use fuzz_support::{config, corpus, watch};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use symbolizer::KernelSymbols;

fn parse_and_look_up(text: &[u8], queries: &[u64]) {
    let _guard = watch("kallsyms", text);
    if let Ok(symbols) = KernelSymbols::from_reader(text) {
        for &addr in queries {
            symbols.lookup(addr);
        }
    }
}

#[test]
fn corpus_and_mutations_parse_without_panic() {
    let seeds: Vec<Vec<u8>> = corpus("kallsyms").into_iter().map(|(_, bytes)| bytes).collect();
    for text in &seeds {
        parse_and_look_up(text, &[0, 1, 0xffff_ffff_8100_0fff, u64::MAX]);
    }
    let mutated = (
        prop::sample::select(seeds),
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..10),
    )
        .prop_map(|(mut text, edits)| {
            for (at, byte) in edits {
                if text.is_empty() {
                    break;
                }
                let i = at % text.len();
                text[i] = match byte % 3 {
                    0 => b" \t\nTtWwD0f"[usize::from(byte) % 10],
                    1 => byte,
                    _ => text[i] ^ (1 << (byte % 8)),
                };
            }
            text
        });
    let strategy = (
        prop_oneof![mutated, prop::collection::vec(any::<u8>(), 0..200)],
        prop::collection::vec(any::<u64>(), 0..8),
    );
    let mut runner = TestRunner::new(config(2000));
    let result = runner.run(&strategy, |(text, queries)| {
        parse_and_look_up(&text, &queries);
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

#[test]
fn lookups_match_a_model() {
    let symbol = (
        0u64..64,
        prop::sample::select(vec!["T", "t", "W", "w", "D", "r"]),
        "[a-z_]{1,6}",
    );
    let strategy = (
        prop::collection::vec(symbol, 1..40),
        prop::collection::vec(0u64..80, 1..20),
    );
    let mut runner = TestRunner::new(config(500));
    let result = runner.run(&strategy, |(symbols, queries)| {
        let base = 0xffff_ffff_8100_0000u64;
        let text: String = symbols
            .iter()
            .map(|(offset, kind, name)| format!("{:016x} {kind} {name}\n", base + offset * 16))
            .collect();
        let parsed = match KernelSymbols::from_reader(text.as_bytes()) {
            Ok(parsed) => parsed,
            Err(err) => return Err(TestCaseError::fail(format!("{err}: {text}"))),
        };
        for q in queries {
            let addr = base + q * 16 + 3;
            let best = symbols
                .iter()
                .filter(|(offset, kind, _)| base + offset * 16 <= addr && "TtWw".contains(*kind))
                .map(|(offset, kind, name)| {
                    (
                        std::cmp::Reverse(*offset),
                        *kind == "t" || *kind == "w",
                        name.len(),
                        name.clone(),
                    )
                })
                .min()
                .map(|(_, _, _, name)| name);
            prop_assert_eq!(parsed.lookup(addr).map(str::to_string), best, "{}", text);
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
