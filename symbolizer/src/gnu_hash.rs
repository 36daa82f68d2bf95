//! The number of dynamic symbols a `DT_GNU_HASH` table covers, read with checked arithmetic.
//!
//! `object`'s `GnuHashTable::symbol_table_length` counts past the last bucket's chain with a
//! plain `u32` addition: a corrupted table whose symbol offset and buckets sit near `u32::MAX`
//! overflows it (a panic in a debug build, found by `fuzz_elf` at 100000 cases; a wrong count in
//! a release one). The table is read here instead: `nbuckets`, `symoffset`, `bloom_size`,
//! `bloom_shift` (u32 each), the bloom words (u64 each on ELF64), the buckets, then one chain
//! word per symbol from `symoffset` on, the last of a chain marked by its low bit.

/// Size of the table's header: four `u32`.
const HEADER: usize = 16;

/// How many entries of the dynamic symbol table the GNU hash table `bytes` (ELF64, little
/// endian, running to the end of its segment) covers: the index after the last chain's end.
/// None when the table is empty (no symbol in a bucket) or inconsistent.
pub(crate) fn symbol_count(bytes: &[u8]) -> Option<u32> {
    let word = |index: usize| -> Option<u32> {
        let at = index.checked_mul(4)?;
        let raw = bytes.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes(raw.try_into().ok()?))
    };
    let (nbuckets, symoffset, bloom_size) = (word(0)?, word(1)?, word(2)?);
    // The bloom filter's words are 8 bytes on ELF64: two u32 words each.
    let buckets_at = (HEADER / 4).checked_add(usize::try_from(bloom_size).ok()?.checked_mul(2)?)?;
    let mut last = 0u32;
    for bucket in 0..usize::try_from(nbuckets).ok()? {
        last = last.max(word(buckets_at.checked_add(bucket)?)?);
    }
    // Buckets hold symbol indexes from `symoffset` on; 0 is an empty bucket.
    if last == 0 || last < symoffset {
        return None;
    }
    let chains_at = buckets_at.checked_add(usize::try_from(nbuckets).ok()?)?;
    let mut index = last;
    loop {
        let chain = chains_at.checked_add(usize::try_from(index - symoffset).ok()?)?;
        let value = word(chain)?;
        index = index.checked_add(1)?;
        if value & 1 != 0 {
            return Some(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn table(nbuckets: u32, symoffset: u32, bloom: &[u64], buckets: &[u32], chains: &[u32]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for word in [nbuckets, symoffset, bloom.len() as u32, 6] {
            bytes.extend(word.to_le_bytes());
        }
        bloom.iter().for_each(|w| bytes.extend(w.to_le_bytes()));
        buckets.iter().for_each(|w| bytes.extend(w.to_le_bytes()));
        chains.iter().for_each(|w| bytes.extend(w.to_le_bytes()));
        bytes
    }

    #[test]
    fn counts_to_the_end_of_the_last_buckets_chain() {
        // Symbols 0, 1 and 2 unhashed (symoffset 3); bucket 0's chain is 3, 4, bucket 1's is
        // 5, 6, 7: eight entries in all.
        let bytes = table(2, 3, &[0], &[3, 5], &[0, 1, 0, 0, 1]);
        assert_eq!(symbol_count(&bytes), Some(8));
    }

    /// On real files the count is `object`'s (which overflows only on corrupted tables).
    #[test]
    fn agrees_with_object_on_the_systems_libraries() {
        use object::read::elf::GnuHashTable;
        use object::{Object as _, ObjectSection as _};
        for path in [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/lib/x86_64-linux-gnu/libm.so.6",
        ] {
            let data = std::fs::read(path).expect("the system's C library is readable");
            let file = object::File::parse(&*data).expect("an ELF file");
            let section = file.section_by_name(".gnu.hash").expect("a .gnu.hash section");
            let bytes = section.data().expect("its bytes");
            let table = GnuHashTable::<object::elf::FileHeader64<object::LittleEndian>>::parse(
                object::LittleEndian,
                bytes,
            )
            .expect("a GNU hash table");
            let expected = table.symbol_table_length(object::LittleEndian);
            assert!(expected.is_some(), "{path}: object counts no symbol");
            assert_eq!(symbol_count(bytes), expected, "{path}");
        }
    }

    #[test]
    fn an_empty_table_counts_nothing() {
        assert_eq!(symbol_count(&table(2, 1, &[0], &[0, 0], &[])), None);
    }

    #[test]
    fn a_chain_running_past_u32_max_is_refused_not_overflowed() {
        let base = u32::MAX - 2;
        let bytes = table(1, base, &[0], &[u32::MAX - 1], &[0, 0, 0, 0]);
        assert_eq!(symbol_count(&bytes), None);
    }

    #[test]
    fn a_chain_without_its_end_mark_is_refused() {
        assert_eq!(symbol_count(&table(1, 1, &[0], &[1], &[0, 0])), None);
    }

    proptest! {
        #[test]
        fn any_bytes_give_an_answer_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = symbol_count(&bytes);
        }

        #[test]
        fn headers_near_the_limits_give_an_answer_without_panicking(
            nbuckets in prop_oneof![0u32..4, Just(u32::MAX)],
            symoffset in prop_oneof![0u32..8, (u32::MAX - 8)..=u32::MAX],
            bloom in prop_oneof![0u32..2, Just(u32::MAX)],
            rest in proptest::collection::vec(any::<u32>(), 0..16),
        ) {
            let mut bytes = Vec::new();
            for word in [nbuckets, symoffset, bloom, 6].iter().chain(&rest) {
                bytes.extend(word.to_le_bytes());
            }
            let _ = symbol_count(&bytes);
        }
    }
}
