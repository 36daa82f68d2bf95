//! What a file without usable section headers still tells through its program headers. The
//! kernel and the dynamic loader read only program headers, so a binary whose section headers
//! were removed (`sstrip`, some packers) or corrupted still runs; its unwind info is then found
//! through `PT_GNU_EH_FRAME` and its exported functions through `PT_DYNAMIC`, as the loader
//! finds them.

use gimli::{BaseAddresses, EhFrameHdr, Pointer};
use object::elf::{
    FileHeader64, ProgramHeader64, Sym64, DT_GNU_HASH, DT_HASH, DT_NULL, DT_STRSZ, DT_STRTAB, DT_SYMENT,
    DT_SYMTAB, ELF_NOTE_GNU, NT_GNU_BUILD_ID, PT_GNU_EH_FRAME, SHN_UNDEF,
};
use object::read::elf::{Dyn as _, HashTable, ProgramHeader as _, Sym as _};
use object::{LittleEndian, ReadRef};

use crate::elf::{Section, Segment};

const LE: LittleEndian = LittleEndian;

pub(crate) type Phdr = ProgramHeader64<LittleEndian>;
type Header = FileHeader64<LittleEndian>;

/// Size of one `Elf64_Sym`.
const SYM_SIZE: usize = std::mem::size_of::<Sym64<LittleEndian>>();

/// Where the file bytes at stated address `vaddr` are: their offset in `data`, and how many
/// bytes of the same load segment follow in the file (a table's length bound when the dynamic
/// section or `.eh_frame_hdr` gives only its start).
fn file_bytes(data: &[u8], segments: &[Segment], vaddr: u64) -> Option<(usize, usize)> {
    segments.iter().find_map(|s| {
        let rel = vaddr.checked_sub(s.vaddr)?;
        if rel >= s.filesz {
            return None;
        }
        let offset = usize::try_from(s.offset.checked_add(rel)?).ok()?;
        let in_segment = usize::try_from(s.filesz - rel).unwrap_or(usize::MAX);
        let in_file = data.len().checked_sub(offset)?;
        Some((offset, in_segment.min(in_file))).filter(|&(_, len)| len > 0)
    })
}

/// `.eh_frame_hdr` and `.eh_frame` found through `PT_GNU_EH_FRAME`. The header states where
/// `.eh_frame` starts but not its length: it is bounded by the end of the load segment holding
/// it (a terminating zero entry, or the header's search table, ends every reader first).
pub(crate) fn eh_frame(data: &[u8], phdrs: &[Phdr], segments: &[Segment]) -> Option<(Section, Section)> {
    let ph = phdrs.iter().find(|p| p.p_type(LE) == PT_GNU_EH_FRAME)?;
    let hdr_svma = ph.p_vaddr(LE);
    let (hdr_offset, hdr_len) = file_bytes(data, segments, hdr_svma)?;
    let hdr_len = usize::try_from(ph.p_filesz(LE)).ok()?.min(hdr_len);
    let hdr_range = hdr_offset..hdr_offset.checked_add(hdr_len)?;
    let hdr_bytes = data.get(hdr_range.clone())?;
    let bases = BaseAddresses::default().set_eh_frame_hdr(hdr_svma);
    let parsed = EhFrameHdr::new(hdr_bytes, gimli::LittleEndian)
        .parse(&bases, 8)
        .map_err(|err| tracing::debug!(%err, "unreadable PT_GNU_EH_FRAME"))
        .ok()?;
    // An indirect pointer would need relocated memory; no linker emits one here.
    let Pointer::Direct(eh_frame_svma) = parsed.eh_frame_ptr() else {
        return None;
    };
    let (offset, len) = file_bytes(data, segments, eh_frame_svma)?;
    let hdr = Section {
        svma: hdr_svma..hdr_svma.saturating_add(hdr_len as u64),
        file_range: Some(hdr_range),
    };
    let eh_frame = Section {
        svma: eh_frame_svma..eh_frame_svma.saturating_add(len as u64),
        file_range: Some(offset..offset.checked_add(len)?),
    };
    Some((hdr, eh_frame))
}

/// The first executable load segment, standing in for `.text` (the base of text-relative
/// pointers, and the range direct callees are looked for in).
pub(crate) fn text(segments: &[Segment]) -> Option<Section> {
    let s = segments.iter().find(|s| s.exec)?;
    let start = usize::try_from(s.offset).ok()?;
    let end = start.checked_add(usize::try_from(s.filesz).ok()?)?;
    Some(Section {
        svma: s.vaddr..s.vaddr.saturating_add(s.filesz),
        file_range: Some(start..end),
    })
}

/// The GNU build-id note, from `PT_NOTE` segments.
pub(crate) fn build_id<'d>(data: &'d [u8], phdrs: &[Phdr]) -> Option<&'d [u8]> {
    for ph in phdrs {
        let Ok(Some(mut notes)) = ph.notes(LE, data) else {
            continue;
        };
        while let Ok(Some(note)) = notes.next() {
            if note.name() == ELF_NOTE_GNU && note.n_type(LE) == NT_GNU_BUILD_ID {
                return Some(note.desc());
            }
        }
    }
    None
}

/// A defined symbol of the dynamic symbol table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DynamicSymbol<'d> {
    pub name: &'d [u8],
    pub addr: u64,
    pub size: u64,
    pub st_type: u8,
    pub st_bind: u8,
}

/// The defined symbols of the dynamic symbol table, found as the loader finds it: `DT_SYMTAB`
/// and `DT_STRTAB` of the `PT_DYNAMIC` segment, the count from `DT_HASH` or `DT_GNU_HASH`
/// (else the gap between the two tables, where every linker puts them). Anything out of
/// bounds yields fewer symbols, never an error: names are a best effort.
pub(crate) fn dynamic_symbols<'d>(
    data: &'d [u8],
    phdrs: &[Phdr],
    segments: &[Segment],
) -> Vec<DynamicSymbol<'d>> {
    let Some(dynamic) = phdrs.iter().find_map(|p| p.dynamic(LE, data).ok().flatten()) else {
        return Vec::new();
    };
    let (mut symtab, mut strtab, mut strsz, mut hash, mut gnu_hash) = (None, None, None, None, None);
    for entry in dynamic {
        let (tag, value) = (entry.tag(LE), entry.val(LE));
        match tag {
            DT_NULL => break,
            DT_SYMTAB => symtab = Some(value),
            DT_STRTAB => strtab = Some(value),
            DT_STRSZ => strsz = Some(value),
            DT_HASH => hash = Some(value),
            DT_GNU_HASH => gnu_hash = Some(value),
            DT_SYMENT if value != SYM_SIZE as u64 => {
                tracing::debug!(value, "DT_SYMENT is not the size of Elf64_Sym");
                return Vec::new();
            }
            _ => {}
        }
    }
    let (Some(symtab), Some(strtab)) = (symtab, strtab) else {
        return Vec::new();
    };
    let Some((sym_offset, sym_len)) = file_bytes(data, segments, symtab) else {
        return Vec::new();
    };
    let Some((str_offset, str_len)) = file_bytes(data, segments, strtab) else {
        return Vec::new();
    };
    let str_len = strsz.map_or(str_len, |size| {
        str_len.min(usize::try_from(size).unwrap_or(usize::MAX))
    });
    let strings = data.get(str_offset..str_offset + str_len).unwrap_or_default();

    let table_bytes = |vaddr: u64| {
        let (offset, len) = file_bytes(data, segments, vaddr)?;
        data.get(offset..offset + len)
    };
    let count = gnu_hash
        .and_then(table_bytes)
        .and_then(crate::gnu_hash::symbol_count)
        .or_else(|| {
            let bytes = hash.and_then(table_bytes)?;
            Some(HashTable::<Header>::parse(LE, bytes).ok()?.symbol_table_length())
        })
        .map(|n| n as usize)
        .or_else(|| {
            usize::try_from(strtab.checked_sub(symtab)?)
                .ok()
                .map(|gap| gap / SYM_SIZE)
        })
        .unwrap_or(0)
        .min(sym_len / SYM_SIZE);
    let Ok(symbols) = data.read_slice_at::<Sym64<LittleEndian>>(sym_offset as u64, count) else {
        return Vec::new();
    };
    symbols
        .iter()
        .filter(|sym| sym.st_shndx(LE) != SHN_UNDEF)
        .filter_map(|sym| {
            let start = usize::try_from(sym.st_name(LE)).ok()?;
            let tail = strings.get(start..)?;
            let name = &tail[..tail.iter().position(|&b| b == 0)?];
            Some(DynamicSymbol {
                name,
                addr: sym.st_value(LE),
                size: sym.st_size(LE),
                st_type: sym.st_type(),
                st_bind: sym.st_bind(),
            })
        })
        .collect()
}

/// Parse only the file header and program headers: what a file without usable section headers
/// still has.
pub(crate) fn program_headers(data: &[u8]) -> Result<&[Phdr], object::read::Error> {
    use object::read::elf::FileHeader as _;
    let header = Header::parse(data)?;
    header.program_headers(header.endian()?, data)
}
