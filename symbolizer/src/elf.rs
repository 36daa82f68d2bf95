//! One ELF file: its bytes (shared, usually memory-mapped), load segments, and the sections
//! the unwinder and the symbolizer need.

use std::fs::File;
use std::ops::{Deref, Range};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object::elf::{PF_X, PT_LOAD};
use object::read::elf::{ElfFile64, ProgramHeader};
use object::{LittleEndian, Object, ObjectSection};

use crate::{eh_frame_hdr, segments, Error};

/// x86_64 page size: the kernel maps segments at page granularity.
const PAGE: u64 = 4096;

pub(crate) type Elf<'data> = ElfFile64<'data, LittleEndian, &'data [u8]>;

/// Where the bytes of a file live.
pub(crate) enum Backing {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mapped(map) => map,
            Backing::Owned(bytes) => bytes,
        }
    }
}

/// A cheap-to-clone window into a shared file; framehop's section data type.
#[derive(Clone)]
pub(crate) struct Bytes {
    backing: Arc<Backing>,
    range: Range<usize>,
}

impl Default for Bytes {
    fn default() -> Self {
        Bytes {
            backing: Arc::new(Backing::Owned(Vec::new())),
            range: 0..0,
        }
    }
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // The range was checked against the backing's length when the window was made.
        self.backing.get(self.range.clone()).unwrap_or(&[])
    }
}

/// A section's address as stated in the file, and where its bytes are (None for NOBITS).
#[derive(Clone, Debug)]
pub(crate) struct Section {
    pub svma: Range<u64>,
    pub file_range: Option<Range<usize>>,
}

/// A `PT_LOAD` program header.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Segment {
    pub offset: u64,
    pub vaddr: u64,
    pub filesz: u64,
    pub exec: bool,
}

/// An ELF file with the parts needed for unwinding parsed eagerly; symbol tables are parsed
/// on demand from `data()`.
pub(crate) struct ElfData {
    pub path: PathBuf,
    backing: Arc<Backing>,
    pub build_id: Option<Vec<u8>>,
    /// `.gnu_debuglink`: file name and CRC32 of the debug file.
    pub debuglink: Option<(PathBuf, u32)>,
    pub segments: Vec<Segment>,
    pub text: Option<Section>,
    pub eh_frame: Option<Section>,
    pub eh_frame_hdr: Option<Section>,
    pub got: Option<Section>,
    /// Whether the file has a non-empty `.symtab`.
    pub has_symtab: bool,
    /// False when the section headers are absent or corrupt: the sections above were then
    /// found through program headers (see [`crate::segments`]).
    pub has_section_headers: bool,
}

impl ElfData {
    /// Memory-map and parse the file at `path`.
    pub fn open(path: &Path) -> Result<ElfData, Error> {
        let io_err = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        Self::from_file(&file, path)
    }

    /// Memory-map and parse an already opened file; `path` names it in errors.
    pub fn from_file(file: &File, path: &Path) -> Result<ElfData, Error> {
        // SAFETY: the mapping is read-only and private. Mapped binaries and libraries are
        // replaced by rename on upgrade, not rewritten in place; truncating a file while it
        // is mapped here would fault, as it would for every process running it.
        let map = unsafe { memmap2::Mmap::map(file) }.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(path.to_path_buf(), Backing::Mapped(map))
    }

    /// Parse bytes already in memory (the vDSO).
    pub fn from_bytes(label: PathBuf, bytes: Vec<u8>) -> Result<ElfData, Error> {
        Self::parse(label, Backing::Owned(bytes))
    }

    fn parse(path: PathBuf, backing: Backing) -> Result<ElfData, Error> {
        let mut elf = Self::parse_headers(path, backing)?;
        let hdr_ok = match (
            &elf.eh_frame_hdr,
            &elf.eh_frame,
            elf.section_bytes(&elf.eh_frame_hdr),
        ) {
            (Some(hdr), Some(eh_frame), Some(bytes)) => {
                eh_frame_hdr::is_valid(&bytes, hdr.svma.start, &eh_frame.svma)
            }
            _ => true,
        };
        if !hdr_ok {
            tracing::debug!(path = %elf.path.display(), "ignoring a corrupt .eh_frame_hdr");
            elf.eh_frame_hdr = None;
        }
        Ok(elf)
    }

    fn parse_headers(path: PathBuf, backing: Backing) -> Result<ElfData, Error> {
        let backing = Arc::new(backing);
        let elf_err = |source| Error::Elf {
            path: path.clone(),
            source,
        };
        // Program headers are all the kernel needs to run a file: without them it is no
        // module, but section headers may be absent or corrupt (see `segments`).
        let phdrs = segments::program_headers(&backing[..]).map_err(elf_err)?;
        let segments: Vec<Segment> = phdrs
            .iter()
            .filter(|ph| ph.p_type(LittleEndian) == PT_LOAD)
            .map(|ph| Segment {
                offset: ph.p_offset(LittleEndian),
                vaddr: ph.p_vaddr(LittleEndian),
                filesz: ph.p_filesz(LittleEndian),
                exec: ph.p_flags(LittleEndian) & PF_X != 0,
            })
            .collect();
        let elf = match Elf::parse(&backing[..]) {
            Ok(elf) if !elf.elf_section_table().is_empty() => elf,
            parsed => {
                if let Err(err) = parsed {
                    tracing::debug!(path = %path.display(), %err, "unusable section headers; reading program headers only");
                }
                return Ok(Self::from_program_headers(path, backing.clone(), phdrs, segments));
            }
        };
        let section = |name: &str| {
            let s = elf.section_by_name(name)?;
            let file_range = s.file_range().and_then(|(offset, size)| {
                let start = usize::try_from(offset).ok()?;
                let end = start.checked_add(usize::try_from(size).ok()?)?;
                (end <= backing.len()).then_some(start..end)
            });
            Some(Section {
                svma: s.address()..s.address().saturating_add(s.size()),
                file_range,
            })
        };
        // A malformed note or debuglink only costs us the debug file, not the module.
        let build_id = elf.build_id().ok().flatten().map(<[u8]>::to_vec);
        let debuglink = elf.gnu_debuglink().ok().flatten().map(|(name, crc)| {
            use std::os::unix::ffi::OsStrExt;
            (PathBuf::from(std::ffi::OsStr::from_bytes(name)), crc)
        });
        let has_symtab = elf.symbols().next().is_some();
        Ok(ElfData {
            text: section(".text"),
            eh_frame: section(".eh_frame"),
            eh_frame_hdr: section(".eh_frame_hdr"),
            got: section(".got"),
            path,
            build_id,
            debuglink,
            segments,
            has_symtab,
            has_section_headers: true,
            backing: backing.clone(),
        })
    }

    /// A file whose section headers are missing or corrupt: unwind info through
    /// `PT_GNU_EH_FRAME`, the build-id from `PT_NOTE`, symbols later from `PT_DYNAMIC`.
    fn from_program_headers(
        path: PathBuf,
        backing: Arc<Backing>,
        phdrs: &[segments::Phdr],
        segments: Vec<Segment>,
    ) -> ElfData {
        let data = &backing[..];
        let (eh_frame_hdr, eh_frame) = segments::eh_frame(data, phdrs, &segments).unzip();
        ElfData {
            text: segments::text(&segments),
            eh_frame,
            eh_frame_hdr,
            got: None,
            build_id: segments::build_id(data, phdrs).map(<[u8]>::to_vec),
            debuglink: None,
            has_symtab: false,
            has_section_headers: false,
            segments,
            path,
            backing,
        }
    }

    /// The defined symbols of the dynamic segment, for a file without usable section headers
    /// (with them, `.dynsym` is read through [`ElfData::object`]).
    pub fn segment_dynamic_symbols(&self) -> Vec<segments::DynamicSymbol<'_>> {
        match segments::program_headers(self.data()) {
            Ok(phdrs) => segments::dynamic_symbols(self.data(), phdrs, &self.segments),
            Err(_) => Vec::new(),
        }
    }

    /// Whether `svma` lies in the file bytes of an executable load segment.
    pub fn is_code(&self, svma: u64) -> bool {
        self.exec_segment(svma).is_some()
    }

    /// All bytes of the file.
    pub fn data(&self) -> &[u8] {
        &self.backing
    }

    /// Re-parse the headers (cheap) to walk symbol tables or sections.
    pub fn object(&self) -> Result<Elf<'_>, Error> {
        Elf::parse(self.data()).map_err(|source| Error::Elf {
            path: self.path.clone(),
            source,
        })
    }

    /// The bytes of a section, if it has bytes in the file.
    pub fn section_bytes(&self, section: &Option<Section>) -> Option<Bytes> {
        let range = section.as_ref()?.file_range.clone()?;
        Some(Bytes {
            backing: self.backing.clone(),
            range,
        })
    }

    /// The load bias of a mapping: `avma - svma` for every address in it. The mapping has
    /// file offset `map_offset` at address `map_start`; it is matched to the `PT_LOAD`
    /// segment whose file bytes it maps, so this works for executables (bias 0), PIEs and
    /// shared objects alike, and for a segment split in two by `mprotect` (RELRO).
    pub fn bias_for_mapping(&self, map_start: u64, map_offset: u64, exec: bool) -> Option<u64> {
        let covers = |s: &&Segment| {
            let page_start = s.offset & !(PAGE - 1);
            page_start <= map_offset && map_offset < s.offset.saturating_add(s.filesz.max(1))
        };
        let segment = self.segments.iter().filter(covers).min_by_key(|s| {
            let exact = s.offset & !(PAGE - 1) == map_offset;
            (!exact, s.exec != exec)
        })?;
        // The byte at file offset `map_offset` lives at svma p_vaddr + (map_offset - p_offset).
        let svma_at_start = segment
            .vaddr
            .wrapping_add(map_offset)
            .wrapping_sub(segment.offset);
        Some(map_start.wrapping_sub(svma_at_start))
    }

    /// The executable load segment whose file bytes hold `svma`.
    fn exec_segment(&self, svma: u64) -> Option<&Segment> {
        self.segments
            .iter()
            .find(|s| s.exec && svma >= s.vaddr && svma - s.vaddr < s.filesz)
    }

    /// Offset in the file of the code at `svma`: what a uprobe attaches to.
    pub fn code_file_offset(&self, svma: u64) -> Option<u64> {
        let segment = self.exec_segment(svma)?;
        Some(svma - segment.vaddr + segment.offset)
    }

    /// The stated address of the code at file offset `offset`, when an executable load
    /// segment holds it.
    pub fn code_svma(&self, offset: u64) -> Option<u64> {
        let segment = self
            .segments
            .iter()
            .find(|s| s.exec && offset >= s.offset && offset - s.offset < s.filesz)?;
        Some(segment.vaddr + (offset - segment.offset))
    }

    /// The file bytes of the code at `svma`, when all of it lies in one executable segment.
    pub fn code_bytes(&self, svma: &Range<u64>) -> Option<&[u8]> {
        let segment = self.exec_segment(svma.start)?;
        let end_in_segment = svma.end.checked_sub(segment.vaddr)?;
        if svma.end < svma.start || end_in_segment > segment.filesz {
            return None;
        }
        let start = usize::try_from(self.code_file_offset(svma.start)?).ok()?;
        let len = usize::try_from(svma.end - svma.start).ok()?;
        self.data().get(start..start.checked_add(len)?)
    }

    /// Hex build-id, for display.
    pub fn build_id_hex(&self) -> Option<String> {
        self.build_id.as_deref().map(hex)
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_segments(segments: Vec<Segment>) -> ElfData {
        ElfData {
            path: PathBuf::from("test"),
            backing: Arc::new(Backing::Owned(Vec::new())),
            build_id: None,
            debuglink: None,
            segments,
            text: None,
            eh_frame: None,
            eh_frame_hdr: None,
            got: None,
            has_symtab: false,
            has_section_headers: true,
        }
    }

    #[test]
    fn bias_of_pie_segments() {
        // Layout of a typical PIE: r-- at 0, r-x at 0x1000 (offset 0x1000), RELRO+data with
        // a page offset.
        let elf = with_segments(vec![
            Segment {
                offset: 0,
                vaddr: 0,
                filesz: 0x6d0,
                exec: false,
            },
            Segment {
                offset: 0x1000,
                vaddr: 0x1000,
                filesz: 0x2000,
                exec: true,
            },
            Segment {
                offset: 0x3de8,
                vaddr: 0x4de8,
                filesz: 0x258,
                exec: false,
            },
        ]);
        let base = 0x5555_5555_4000;
        assert_eq!(elf.bias_for_mapping(base, 0, false), Some(base));
        assert_eq!(elf.bias_for_mapping(base + 0x1000, 0x1000, true), Some(base));
        // The data segment's first page (offset 0x3000) is mapped at vaddr 0x4000.
        assert_eq!(elf.bias_for_mapping(base + 0x4000, 0x3000, false), Some(base));
        assert_eq!(elf.bias_for_mapping(base, 0x9000, false), None);
    }

    #[test]
    fn bias_of_non_pie_executable_is_zero() {
        let elf = with_segments(vec![
            Segment {
                offset: 0,
                vaddr: 0x400000,
                filesz: 0x500,
                exec: false,
            },
            Segment {
                offset: 0x1000,
                vaddr: 0x401000,
                filesz: 0x3000,
                exec: true,
            },
        ]);
        assert_eq!(elf.bias_for_mapping(0x401000, 0x1000, true), Some(0));
        assert_eq!(elf.bias_for_mapping(0x400000, 0, false), Some(0));
    }
}
