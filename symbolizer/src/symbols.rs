//! Function symbols of one module (binary `.symtab`, debug file `.symtab`, `.dynsym`), sorted
//! by address, with a fixed preference among aliases so a name never flips between runs.

use std::sync::Arc;

use object::elf::{SHF_EXECINSTR, STB_GLOBAL, STB_WEAK, STT_FUNC, STT_GNU_IFUNC, STT_NOTYPE};
use object::read::elf::SectionHeader;
use object::{Object, ObjectSymbol, ObjectSymbolTable};

use crate::elf::Elf;
use crate::segments::DynamicSymbol;

/// How far back to look for a sized symbol containing an address; symbols nest or overlap
/// only in hand-written assembly, and then by a handful.
const CONTAINING_LOOKBACK: usize = 32;

/// Which table a symbol came from; `SymTab` (of the binary or its debug file) wins over
/// `DynSym`, which only holds exported names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Origin {
    SymTab,
    DynSym,
}

#[derive(Clone, Debug)]
struct Sym {
    addr: u64,
    size: u64,
    /// Lower is preferred: (origin, binding: global < weak < local).
    rank: (Origin, u8),
    name: Arc<str>,
}

impl Sym {
    fn sort_key(&self) -> (u64, (Origin, u8), usize, &str) {
        (self.addr, self.rank, self.name.len(), &self.name)
    }
}

/// Function symbols sorted by (address, preference).
#[derive(Debug, Default)]
pub(crate) struct SymbolTable {
    all: Vec<Sym>,
    /// The subset with a size, for "which symbol contains this address".
    sized: Vec<Sym>,
}

impl SymbolTable {
    /// Add the function symbols of one table of `elf`.
    pub fn add(&mut self, elf: &Elf<'_>, origin: Origin) {
        let endian = elf.endian();
        let exec_sections: Vec<bool> = elf
            .elf_section_table()
            .iter()
            .map(|s| s.sh_flags(endian) & u64::from(SHF_EXECINSTR) != 0)
            .collect();
        let table = match origin {
            Origin::SymTab => elf.symbol_table(),
            Origin::DynSym => elf.dynamic_symbol_table(),
        };
        let Some(table) = table else { return };
        for symbol in table.symbols() {
            let raw = symbol.elf_symbol();
            let Some(index) = symbol.section_index() else {
                continue;
            };
            let in_exec = exec_sections.get(index.0).copied().unwrap_or(false);
            let Ok(name) = symbol.name_bytes() else { continue };
            self.push(
                name,
                symbol.address(),
                symbol.size(),
                (raw.st_type(), raw.st_bind()),
                in_exec,
                origin,
            );
        }
    }

    /// Add the function symbols of the dynamic segment of a file without usable section
    /// headers; `is_code` tells whether an address lies in an executable segment.
    pub fn add_dynamic_segment(&mut self, symbols: &[DynamicSymbol<'_>], is_code: impl Fn(u64) -> bool) {
        for symbol in symbols {
            self.push(
                symbol.name,
                symbol.addr,
                symbol.size,
                (symbol.st_type, symbol.st_bind),
                is_code(symbol.addr),
                Origin::DynSym,
            );
        }
    }

    /// Keep one symbol if it names a function.
    fn push(
        &mut self,
        name: &[u8],
        addr: u64,
        size: u64,
        (st_type, st_bind): (u8, u8),
        in_exec: bool,
        origin: Origin,
    ) {
        let wanted = match st_type {
            STT_FUNC | STT_GNU_IFUNC => true,
            // Assembly entry points without `.type`: only global ones, in code.
            STT_NOTYPE => in_exec && st_bind != object::elf::STB_LOCAL,
            _ => false,
        };
        if !wanted || addr == 0 {
            return;
        }
        // `.symtab` of shared objects spells versioned definitions `name@@VERSION`.
        let name = name.split(|&b| b == b'@').next().unwrap_or(name);
        if name.is_empty() {
            return;
        }
        let binding = match st_bind {
            STB_GLOBAL => 0,
            STB_WEAK => 1,
            _ => 2,
        };
        let sym = Sym {
            addr,
            size,
            rank: (origin, binding),
            name: Arc::from(String::from_utf8_lossy(name)),
        };
        if sym.size > 0 {
            self.sized.push(sym.clone());
        }
        self.all.push(sym);
    }

    /// Sort after all tables were added.
    pub fn finish(&mut self) {
        self.all.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
        self.sized.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
    }

    /// Where the function `name` starts (the preferred table when several define it).
    pub fn address_of(&self, name: &str) -> Option<u64> {
        self.all
            .iter()
            .filter(|s| &*s.name == name)
            .min_by_key(|s| s.rank)
            .map(|s| s.addr)
    }

    /// The functions whose name starts with `prefix`, each once (from its preferred table):
    /// name, start and size (0 when unknown).
    pub fn with_prefix(&self, prefix: &str) -> Vec<(Arc<str>, u64, u64)> {
        let mut chosen: std::collections::BTreeMap<&str, &Sym> = std::collections::BTreeMap::new();
        for sym in self.all.iter().filter(|s| s.name.starts_with(prefix)) {
            let entry = chosen.entry(&sym.name).or_insert(sym);
            if sym.rank < entry.rank {
                *entry = sym;
            }
        }
        chosen
            .into_values()
            .map(|s| (s.name.clone(), s.addr, s.size))
            .collect()
    }

    /// The preferred symbol starting exactly at `svma`.
    pub fn at(&self, svma: u64) -> Option<&Arc<str>> {
        let i = self.all.partition_point(|s| s.addr < svma);
        self.all.get(i).filter(|s| s.addr == svma).map(|s| &s.name)
    }

    /// The preferred sized symbol `[addr, addr + size)` containing `svma`, innermost first.
    pub fn containing(&self, svma: u64) -> Option<&Arc<str>> {
        let after = self.sized.partition_point(|s| s.addr <= svma);
        let window = &self.sized[after.saturating_sub(CONTAINING_LOOKBACK)..after];
        let contains = |s: &&Sym| svma - s.addr < s.size;
        let innermost = window.iter().rev().find(contains)?.addr;
        // Among aliases at that address, the first in sort order is preferred.
        window
            .iter()
            .find(|s| s.addr == innermost && contains(s))
            .map(|s| &s.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(syms: &[(u64, u64, Origin, u8, &str)]) -> SymbolTable {
        let mut t = SymbolTable::default();
        for &(addr, size, origin, binding, name) in syms {
            let sym = Sym {
                addr,
                size,
                rank: (origin, binding),
                name: Arc::from(name),
            };
            if size > 0 {
                t.sized.push(sym.clone());
            }
            t.all.push(sym);
        }
        t.finish();
        t
    }

    #[test]
    fn aliases_resolve_deterministically() {
        let t = table(&[
            (0x100, 0x20, Origin::DynSym, 0, "exported"),
            (0x100, 0x20, Origin::SymTab, 2, "local_impl"),
            (0x100, 0x20, Origin::SymTab, 0, "global_long_name"),
            (0x100, 0x20, Origin::SymTab, 0, "global"),
            (0x100, 0x20, Origin::SymTab, 1, "weak"),
        ]);
        assert_eq!(t.at(0x100).map(|s| &**s), Some("global"));
        assert_eq!(t.containing(0x110).map(|s| &**s), Some("global"));
        assert_eq!(t.at(0x101), None);
    }

    #[test]
    fn containing_respects_size_and_nesting() {
        let t = table(&[
            (0x100, 0x10, Origin::DynSym, 0, "first"),
            (0x200, 0, Origin::DynSym, 0, "unsized"),
            (0x300, 0x100, Origin::SymTab, 0, "outer"),
            (0x340, 0x10, Origin::SymTab, 2, "inner"),
        ]);
        assert_eq!(t.containing(0x10f).map(|s| &**s), Some("first"));
        assert_eq!(t.containing(0x110), None, "past the end of `first`");
        assert_eq!(t.containing(0x204), None, "unsized symbols contain nothing");
        assert_eq!(t.at(0x200).map(|s| &**s), Some("unsized"));
        assert_eq!(t.containing(0x345).map(|s| &**s), Some("inner"));
        assert_eq!(t.containing(0x350).map(|s| &**s), Some("outer"));
        assert_eq!(t.containing(0x50), None);
    }
}
