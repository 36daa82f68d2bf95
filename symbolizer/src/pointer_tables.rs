//! Names for static functions that a stripped build reaches only through a table of function
//! pointers in its data (`TTSOpsBufferHeapTuple.getsomeattrs` holds the static
//! `tts_buffer_heap_getsomeattrs`, `heapam_methods.index_fetch_tuple` the static
//! `heapam_index_fetch_tuple`).
//!
//! The caller gives the table's layout (where each field is and which function of the source
//! it holds: layouts differ between Postgres majors, so they come from the caller's per-major
//! table). The table is found by its exported symbol, or through an exported function that
//! returns its address (`GetHeapamTableAmRoutine`: `lea rax, [rip+X]; ret`). A position-
//! independent file leaves each slot zero and fills it at load time from an
//! `R_X86_64_RELATIVE` relocation, whose addend is the function's stated address; a fixed-
//! address executable holds the address itself. Nothing is guessed: a table whose size or tag
//! disagrees with the layout names nothing, a slot names only a function start (an `.eh_frame`
//! FDE) no symbol names, and a function held by slots that name it differently stays unnamed.

use std::collections::{BTreeMap, HashMap};

use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind, Register};
use object::elf::{ET_EXEC, R_X86_64_RELATIVE};
use object::read::elf::FileHeader;
use object::{Object, ObjectSymbol, RelocationFlags, RelocationTarget, SymbolKind};

use crate::elf::ElfData;
use crate::functions::FunctionRanges;
use crate::symbols::SymbolTable;

/// Where a table of function pointers is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableAt {
    /// An exported data object of this name (`TTSOpsVirtual`), whose size the symbol gives.
    Symbol(&'static str),
    /// A static object whose address the exported function of this name returns, as
    /// `lea rax, [rip+X]` followed by `ret` (`GetHeapamTableAmRoutine`).
    ReturnedBy(&'static str),
}

/// One field of a table that holds a function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Byte offset of the field in its struct.
    pub offset: u64,
    /// The struct field's name (`getsomeattrs`).
    pub field: &'static str,
    /// The name in the source of the function the table puts there
    /// (`tts_buffer_heap_getsomeattrs`).
    pub function: &'static str,
}

/// A table of function pointers and the layout of its struct.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PointerTable {
    pub at: TableAt,
    /// The struct's name (`TupleTableSlotOps`), for messages and header checks.
    pub struct_name: &'static str,
    /// `sizeof` the struct: a table found by its symbol must have this size.
    pub size: u64,
    /// The `NodeTag` a node-shaped struct starts with (`T_TableAmRoutine`), where it has one:
    /// a table found through a function must start with it.
    pub tag: Option<u32>,
    pub slots: &'static [Slot],
}

/// Why a table named nothing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TableError {
    #[error("no data symbol `{0}`")]
    NoSymbol(&'static str),
    #[error("`{name}` is {found} bytes, but {struct_name} is {expected} in this major")]
    WrongSize {
        name: &'static str,
        struct_name: &'static str,
        found: u64,
        expected: u64,
    },
    #[error("no function `{0}`, or it does not return one address with `lea rax, [rip+X]; ret`")]
    NotReturned(&'static str),
    #[error("the object `{returned_by}` returns does not start with {struct_name}'s tag {tag}")]
    WrongTag {
        returned_by: &'static str,
        struct_name: &'static str,
        tag: u32,
    },
}

/// The functions the tables name, by start address, in a module whose symbols are `symbols`.
pub(crate) fn name_functions(
    elf: &ElfData,
    symbols: &SymbolTable,
    functions: &FunctionRanges,
    tables: &[PointerTable],
) -> (HashMap<u64, &'static str>, Vec<TableError>) {
    let slots = SlotValues::read(elf);
    let objects = data_objects(elf);
    let mut candidates: BTreeMap<u64, Vec<&'static str>> = BTreeMap::new();
    let mut errors = Vec::new();
    for table in tables {
        let base = match locate(elf, symbols, &objects, &slots, table) {
            Ok(base) => base,
            Err(error) => {
                errors.push(error);
                continue;
            }
        };
        for slot in table.slots {
            let Some(target) = slots.pointer_at(elf, base.wrapping_add(slot.offset)) else {
                continue;
            };
            let starts_a_function = functions.lookup(target).is_some_and(|f| f.start == target);
            if starts_a_function && symbols.at(target).is_none() {
                candidates.entry(target).or_default().push(slot.function);
            }
        }
    }
    let named = candidates
        .into_iter()
        .filter_map(|(start, mut names)| {
            names.sort_unstable();
            names.dedup();
            // Two names for one function: which the frames should get is in the source.
            (names.len() == 1).then(|| (start, names[0]))
        })
        .collect();
    (named, errors)
}

/// The stated address of `table`, checked against its layout.
fn locate(
    elf: &ElfData,
    symbols: &SymbolTable,
    objects: &HashMap<String, (u64, u64)>,
    slots: &SlotValues,
    table: &PointerTable,
) -> Result<u64, TableError> {
    match table.at {
        TableAt::Symbol(name) => {
            let &(address, size) = objects.get(name).ok_or(TableError::NoSymbol(name))?;
            if size != table.size {
                return Err(TableError::WrongSize {
                    name,
                    struct_name: table.struct_name,
                    found: size,
                    expected: table.size,
                });
            }
            Ok(address)
        }
        TableAt::ReturnedBy(function) => {
            let address = symbols
                .address_of(function)
                .and_then(|start| returned_address(elf, start))
                .ok_or(TableError::NotReturned(function))?;
            if let Some(tag) = table.tag {
                if slots.u32_at(elf, address) != Some(tag) {
                    return Err(TableError::WrongTag {
                        returned_by: function,
                        struct_name: table.struct_name,
                        tag,
                    });
                }
            }
            Ok(address)
        }
    }
}

/// The address a function made of `lea rax, [rip+X]; ret` returns.
fn returned_address(elf: &ElfData, start: u64) -> Option<u64> {
    // Two instructions: a 7-byte lea and a ret, plus room for an endbr64 in front.
    let code = elf.code_bytes(&(start..start.checked_add(16)?)).or_else(|| {
        // A function near the end of its segment: take what is there.
        (1..16)
            .rev()
            .find_map(|len| elf.code_bytes(&(start..start + len)))
    })?;
    let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
    let mut instruction = decoder.decode();
    if instruction.mnemonic() == Mnemonic::Endbr64 {
        instruction = decoder.decode();
    }
    let is_rip_lea = instruction.mnemonic() == Mnemonic::Lea
        && instruction.op0_register() == Register::RAX
        && instruction.op1_kind() == OpKind::Memory
        && instruction.is_ip_rel_memory_operand();
    if !is_rip_lea {
        return None;
    }
    let address = instruction.ip_rel_memory_address();
    (decoder.decode().mnemonic() == Mnemonic::Ret).then_some(address)
}

/// Exported and local data objects by name: `(address, size)`.
fn data_objects(elf: &ElfData) -> HashMap<String, (u64, u64)> {
    let mut objects = HashMap::new();
    let Ok(file) = elf.object() else {
        return objects;
    };
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if symbol.kind() != SymbolKind::Data || symbol.address() == 0 {
            continue;
        }
        if let Ok(name) = symbol.name() {
            let name = name.split('@').next().unwrap_or(name);
            objects
                .entry(name.to_string())
                .or_insert((symbol.address(), symbol.size()));
        }
    }
    objects
}

/// What the loader writes into pointer-sized slots of the file's data.
struct SlotValues {
    /// `R_X86_64_RELATIVE` relocations: where, and the stated address written there.
    relative: HashMap<u64, u64>,
    /// A fixed-address executable: its data holds addresses as they are.
    fixed_address: bool,
}

impl SlotValues {
    fn read(elf: &ElfData) -> SlotValues {
        let mut relative = HashMap::new();
        let mut fixed_address = false;
        if let Ok(file) = elf.object() {
            fixed_address = file.elf_header().e_type(file.endian()) == ET_EXEC;
            for (offset, relocation) in file.dynamic_relocations().into_iter().flatten() {
                let is_relative = matches!(
                    relocation.flags(),
                    RelocationFlags::Elf { r_type } if r_type == R_X86_64_RELATIVE
                );
                if is_relative && relocation.target() == RelocationTarget::Absolute {
                    if let Ok(addend) = u64::try_from(relocation.addend()) {
                        relative.insert(offset, addend);
                    }
                }
            }
        }
        SlotValues {
            relative,
            fixed_address,
        }
    }

    /// The function address the slot at `svma` holds once loaded; None for a null slot or one
    /// filled from another module.
    fn pointer_at(&self, elf: &ElfData, svma: u64) -> Option<u64> {
        if let Some(&target) = self.relative.get(&svma) {
            return Some(target);
        }
        if !self.fixed_address {
            return None;
        }
        let bytes = data_bytes(elf, svma, 8)?;
        let value = u64::from_le_bytes(bytes.try_into().ok()?);
        (value != 0).then_some(value)
    }

    fn u32_at(&self, elf: &ElfData, svma: u64) -> Option<u32> {
        let bytes = data_bytes(elf, svma, 4)?;
        Some(u32::from_le_bytes(bytes.try_into().ok()?))
    }
}

/// `len` file bytes at stated address `svma`, from the load segment holding them.
fn data_bytes(elf: &ElfData, svma: u64, len: u64) -> Option<&[u8]> {
    let end = svma.checked_add(len)?;
    let segment = elf
        .segments
        .iter()
        .find(|s| svma >= s.vaddr && end <= s.vaddr.saturating_add(s.filesz))?;
    let start = usize::try_from(svma - segment.vaddr + segment.offset).ok()?;
    elf.data()
        .get(start..start.checked_add(usize::try_from(len).ok()?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// The distro's PostgreSQL 15 (stripped): `make deps` installs it.
    const DISTRO_POSTGRES: &str = "/usr/lib/postgresql/15/bin/postgres";

    fn distro() -> (ElfData, SymbolTable, FunctionRanges) {
        let elf = ElfData::open(&PathBuf::from(DISTRO_POSTGRES))
            .expect("the distro PostgreSQL 15 (`make deps`) is needed");
        let mut symbols = SymbolTable::default();
        symbols.add(&elf.object().expect("parses"), crate::symbols::Origin::DynSym);
        symbols.finish();
        let functions = FunctionRanges::from_elf(&elf);
        (elf, symbols, functions)
    }

    const GETSOMEATTRS: &[Slot] = &[Slot {
        offset: 0x20,
        field: "getsomeattrs",
        function: "tts_buffer_heap_getsomeattrs",
    }];

    fn buffer_heap(size: u64) -> PointerTable {
        PointerTable {
            at: TableAt::Symbol("TTSOpsBufferHeapTuple"),
            struct_name: "TupleTableSlotOps",
            size,
            tag: None,
            slots: GETSOMEATTRS,
        }
    }

    #[test]
    fn a_relocated_slot_names_the_static_function_it_holds() {
        let (elf, symbols, functions) = distro();
        let (named, errors) = name_functions(&elf, &symbols, &functions, &[buffer_heap(96)]);
        assert!(errors.is_empty(), "{errors:?}");
        let (start, name) = named.iter().next().expect("one function named");
        assert_eq!(*name, "tts_buffer_heap_getsomeattrs");
        assert_eq!(functions.lookup(*start).map(|f| f.start), Some(*start));
        assert!(symbols.at(*start).is_none(), "named only where no symbol does");
    }

    #[test]
    fn a_table_of_another_size_names_nothing() {
        let (elf, symbols, functions) = distro();
        // 17's layout (is_current_xact_tuple added) on a 15 build.
        let (named, errors) = name_functions(&elf, &symbols, &functions, &[buffer_heap(104)]);
        assert!(named.is_empty());
        assert!(
            matches!(errors[..], [TableError::WrongSize { found: 96, .. }]),
            "{errors:?}"
        );
    }

    #[test]
    fn one_function_under_two_names_stays_unnamed() {
        let (elf, symbols, functions) = distro();
        const TWICE: &[Slot] = &[
            Slot {
                offset: 0x20,
                field: "getsomeattrs",
                function: "tts_buffer_heap_getsomeattrs",
            },
            Slot {
                offset: 0x20,
                field: "getsomeattrs",
                function: "something_else",
            },
        ];
        let table = PointerTable {
            slots: TWICE,
            ..buffer_heap(96)
        };
        let (named, _) = name_functions(&elf, &symbols, &functions, &[table]);
        assert!(named.is_empty(), "{named:?}");
    }

    #[test]
    fn a_table_returned_by_a_function_is_found_and_its_tag_checked() {
        let (elf, symbols, functions) = distro();
        const FETCH: &[Slot] = &[Slot {
            offset: 0x70,
            field: "index_fetch_tuple",
            function: "heapam_index_fetch_tuple",
        }];
        // T_TableAmRoutine in 15 (nodes/nodetags.h).
        let heapam = |tag| PointerTable {
            at: TableAt::ReturnedBy("GetHeapamTableAmRoutine"),
            struct_name: "TableAmRoutine",
            size: 0,
            tag: Some(tag),
            slots: FETCH,
        };
        let (named, errors) = name_functions(&elf, &symbols, &functions, &[heapam(TAG_15)]);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            named.values().copied().collect::<Vec<_>>(),
            ["heapam_index_fetch_tuple"]
        );
        let (named, errors) = name_functions(&elf, &symbols, &functions, &[heapam(TAG_15 + 1)]);
        assert!(named.is_empty());
        assert!(matches!(errors[..], [TableError::WrongTag { .. }]), "{errors:?}");
    }

    /// `T_TableAmRoutine` of PostgreSQL 15.
    const TAG_15: u32 = 428;

    #[test]
    fn returned_address_needs_exactly_lea_then_ret() {
        let (elf, symbols, _) = distro();
        let getter = symbols.address_of("GetHeapamTableAmRoutine").expect("exported");
        assert!(returned_address(&elf, getter).is_some());
        let other = symbols.address_of("ExecInitSeqScan").expect("exported");
        assert_eq!(returned_address(&elf, other), None);
    }
}
