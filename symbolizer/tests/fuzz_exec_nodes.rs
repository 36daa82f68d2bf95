//! Fuzzing the naming of executor node functions (`ExecInit<Node>` decoding). Properties: any
//! bytes decode to a set of stored addresses or to no answer, never a panic; the distro's
//! `postgres`, with its `ExecInit*` code, symbol tables and `.eh_frame` corrupted, gives names
//! or an error, never a panic, and never two functions of one name.

mod fuzz_support;

use std::collections::HashSet;
use std::ops::Range;
use std::path::PathBuf;

use fuzz_support::{config, mutate, mutations, watch};
use object::{Object, ObjectSection, ObjectSymbol};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use symbolizer::fuzzing::{exec_node_names, exec_proc_node_stores};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin/postgres";

/// The distro `postgres` and the byte ranges worth corrupting: the ELF header, the dynamic
/// symbol tables, `.eh_frame`(`_hdr`) and the code of every `ExecInit*`.
fn postgres() -> (Vec<u8>, Vec<Range<usize>>) {
    let bytes = std::fs::read(PG_BIN)
        .unwrap_or_else(|e| panic!("{PG_BIN} is needed for this test (postgresql-15): {e}"));
    let file = object::File::parse(&*bytes).expect("real ELF");
    let mut regions: Vec<Range<usize>> = Vec::new();
    regions.push(0..64);
    for name in [".dynsym", ".dynstr", ".eh_frame", ".eh_frame_hdr"] {
        let section = file.section_by_name(name).expect("section present");
        let (offset, size) = section.file_range().expect("bytes in the file");
        regions.push(offset as usize..(offset + size) as usize);
    }
    let text = file.section_by_name(".text").expect(".text");
    let (text_offset, _) = text.file_range().expect("bytes in the file");
    for symbol in file.dynamic_symbols() {
        if !symbol.name().is_ok_and(|n| n.starts_with("ExecInit")) || symbol.size() == 0 {
            continue;
        }
        let start = (symbol.address() - text.address() + text_offset) as usize;
        regions.push(start..start + symbol.size() as usize);
    }
    (bytes, regions)
}

/// The real code of `ExecInitSeqScan` and its address: a seed that stores one function.
fn exec_init_seq_scan(bytes: &[u8]) -> (Vec<u8>, u64) {
    let file = object::File::parse(bytes).expect("real ELF");
    let symbol = file
        .dynamic_symbols()
        .find(|s| s.name() == Ok("ExecInitSeqScan"))
        .expect("exported");
    let text = file.section_by_name(".text").expect(".text");
    let (text_offset, _) = text.file_range().expect("bytes in the file");
    let start = (symbol.address() - text.address() + text_offset) as usize;
    (
        bytes[start..start + symbol.size() as usize].to_vec(),
        symbol.address(),
    )
}

#[test]
fn arbitrary_code_never_panics() {
    let (bytes, _) = postgres();
    let (seed, address) = exec_init_seq_scan(&bytes);
    assert_eq!(
        exec_proc_node_stores(&seed, address).map(|s| s.len()),
        Some(1),
        "ExecInitSeqScan stores ExecSeqScan"
    );
    let flipped = (
        Just(seed),
        prop::collection::vec((any::<usize>(), any::<u8>()), 1..12),
    )
        .prop_map(|(mut code, edits)| {
            for (at, byte) in edits {
                let i = at % code.len();
                code[i] ^= byte;
            }
            code
        });
    let strategy = (
        prop_oneof![flipped, prop::collection::vec(any::<u8>(), 0..400)],
        prop_oneof![Just(address), any::<u64>()],
    );
    let mut runner = TestRunner::new(config(2000));
    let result = runner.run(&strategy, |(code, start)| {
        let _guard = watch("exec_nodes_code", &code);
        if let Some(stored) = exec_proc_node_stores(&code, start) {
            // rip-relative addresses: at most one per instruction, each of 7 bytes or more.
            prop_assert!(stored.len() <= code.len() / 7 + 1);
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

#[test]
fn corrupted_postgres_never_panics_nor_names_twice() {
    let (bytes, regions) = postgres();
    let clean = exec_node_names(PathBuf::from(PG_BIN), bytes.clone()).expect("the real file parses");
    assert!(clean.iter().any(|(_, n)| n == "ExecSeqScan"), "{clean:?}");
    assert!(clean.iter().any(|(_, n)| n == "SeqNext"), "{clean:?}");
    let mut runner = TestRunner::new(config(24));
    let result = runner.run(&mutations(regions.len(), 8), |mutations| {
        let corrupted = mutate(&bytes, &regions, &mutations);
        let _guard = watch("exec_nodes_elf", format!("{mutations:?}").as_bytes());
        if let Ok(names) = exec_node_names(PathBuf::from("corrupted-postgres"), corrupted) {
            let distinct: HashSet<&str> = names.iter().map(|(_, n)| n.as_str()).collect();
            prop_assert_eq!(distinct.len(), names.len(), "one function per name: {:?}", names);
            // `Exec<Node>`, or a scan's access method (`SeqNext`).
            prop_assert!(names
                .iter()
                .all(|(_, n)| n.starts_with("Exec") || n.ends_with("Next")));
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
