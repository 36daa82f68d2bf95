//! Fuzzing the naming of functions through tables of function pointers. Property: the distro's
//! `postgres`, with its relocations, dynamic symbols, `.eh_frame`, data and the code of the
//! function returning the heap access method corrupted, gives names or an error, never a panic,
//! and only names the layout lists, each for one function.

mod fuzz_support;

use std::collections::HashSet;
use std::ops::Range;
use std::path::PathBuf;

use fuzz_support::{config, mutate, mutations, watch};
use object::{Object, ObjectSection, ObjectSymbol};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use symbolizer::fuzzing::pointer_table_names;
use symbolizer::{PointerTable, Slot, TableAt};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin/postgres";

/// A few slots of 15's layouts: enough to exercise both ways of finding a table.
const TTS_SLOTS: &[Slot] = &[
    Slot {
        offset: 24,
        field: "clear",
        function: "tts_buffer_heap_clear",
    },
    Slot {
        offset: 32,
        field: "getsomeattrs",
        function: "tts_buffer_heap_getsomeattrs",
    },
];
const HEAPAM_SLOTS: &[Slot] = &[
    Slot {
        offset: 8,
        field: "slot_callbacks",
        function: "heapam_slot_callbacks",
    },
    Slot {
        offset: 112,
        field: "index_fetch_tuple",
        function: "heapam_index_fetch_tuple",
    },
];
const TABLES: &[PointerTable] = &[
    PointerTable {
        at: TableAt::Symbol("TTSOpsBufferHeapTuple"),
        struct_name: "TupleTableSlotOps",
        size: 96,
        tag: None,
        slots: TTS_SLOTS,
    },
    PointerTable {
        at: TableAt::ReturnedBy("GetHeapamTableAmRoutine"),
        struct_name: "TableAmRoutine",
        size: 368,
        tag: Some(428),
        slots: HEAPAM_SLOTS,
    },
];

/// The distro `postgres` and the byte ranges worth corrupting.
fn postgres() -> (Vec<u8>, Vec<Range<usize>>) {
    let bytes = std::fs::read(PG_BIN)
        .unwrap_or_else(|e| panic!("{PG_BIN} is needed for this test (postgresql-15): {e}"));
    let file = object::File::parse(&*bytes).expect("real ELF");
    let mut regions: Vec<Range<usize>> = Vec::new();
    regions.push(0..64);
    for name in [
        ".dynsym",
        ".dynstr",
        ".rela.dyn",
        ".eh_frame",
        ".eh_frame_hdr",
        ".data.rel.ro",
    ] {
        let section = file.section_by_name(name).expect("section present");
        let (offset, size) = section.file_range().expect("bytes in the file");
        regions.push(offset as usize..(offset + size) as usize);
    }
    let text = file.section_by_name(".text").expect(".text");
    let (text_offset, _) = text.file_range().expect("bytes in the file");
    let getter = file
        .dynamic_symbols()
        .find(|s| s.name() == Ok("GetHeapamTableAmRoutine"))
        .expect("exported");
    let start = (getter.address() - text.address() + text_offset) as usize;
    regions.push(start..start + 16);
    (bytes, regions)
}

#[test]
fn corrupted_postgres_never_panics_nor_names_outside_the_layout() {
    let (bytes, regions) = postgres();
    let (clean, errors) =
        pointer_table_names(PathBuf::from(PG_BIN), bytes.clone(), TABLES).expect("the real file parses");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(clean.len(), 4, "{clean:?}");
    let listed: HashSet<&str> = TABLES
        .iter()
        .flat_map(|t| t.slots.iter().map(|s| s.function))
        .collect();
    let mut runner = TestRunner::new(config(24));
    let result = runner.run(&mutations(regions.len(), 8), |mutations| {
        let corrupted = mutate(&bytes, &regions, &mutations);
        let _guard = watch("pointer_tables_elf", format!("{mutations:?}").as_bytes());
        if let Ok((names, _)) = pointer_table_names(PathBuf::from("corrupted-postgres"), corrupted, TABLES) {
            let distinct: HashSet<&str> = names.iter().map(|(_, n)| n.as_str()).collect();
            prop_assert_eq!(distinct.len(), names.len(), "one function per name: {:?}", names);
            prop_assert!(names.iter().all(|(_, n)| listed.contains(n.as_str())));
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
