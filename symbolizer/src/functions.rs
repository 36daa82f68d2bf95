//! Function boundaries from `.eh_frame`: one FDE per function (or per hot/cold part), present
//! even in stripped binaries. This is what keeps a static function in a stripped binary from
//! being named after the exported function before it.

use std::ops::Range;

use gimli::{BaseAddresses, CieOrFde, EhFrame, LittleEndian, UnwindSection};

use crate::elf::ElfData;

/// How many preceding FDEs to check when FDEs overlap (they should not, but hand-written
/// assembly sometimes nests them).
const OVERLAP_LOOKBACK: usize = 4;

/// Sorted, non-empty `[start, end)` ranges of all FDEs, in stated addresses (svma).
#[derive(Debug, Default)]
pub(crate) struct FunctionRanges {
    ranges: Vec<Range<u64>>,
}

impl FunctionRanges {
    /// Read every FDE of the file's `.eh_frame`. A malformed entry ends the walk; the FDEs
    /// read so far are kept.
    pub fn from_elf(elf: &ElfData) -> FunctionRanges {
        let (Some(section), Some(data)) = (&elf.eh_frame, elf.section_bytes(&elf.eh_frame)) else {
            return FunctionRanges::default();
        };
        let start_of = |s: &Option<crate::elf::Section>| s.as_ref().map_or(0, |s| s.svma.start);
        let bases = BaseAddresses::default()
            .set_eh_frame(section.svma.start)
            .set_eh_frame_hdr(start_of(&elf.eh_frame_hdr))
            .set_text(start_of(&elf.text))
            .set_got(start_of(&elf.got));
        let mut eh_frame = EhFrame::new(&data, LittleEndian);
        eh_frame.set_address_size(8);

        let mut ranges = Vec::new();
        let mut last_cie = None;
        let mut entries = eh_frame.entries(&bases);
        loop {
            let partial = match entries.next() {
                Ok(Some(CieOrFde::Fde(partial))) => partial,
                Ok(Some(CieOrFde::Cie(cie))) => {
                    last_cie = Some(cie);
                    continue;
                }
                Ok(None) => break,
                Err(err) => {
                    tracing::debug!(path = %elf.path.display(), %err, "stopped reading .eh_frame");
                    break;
                }
            };
            let fde = partial.parse(|section, bases, offset| {
                if let Some(cie) = &last_cie {
                    if gimli::UnwindOffset::into(offset) == cie.offset() {
                        return Ok(cie.clone());
                    }
                }
                let cie = section.cie_from_offset(bases, offset)?;
                last_cie = Some(cie.clone());
                Ok(cie)
            });
            match fde {
                Ok(fde) if fde.len() > 0 => {
                    let start = fde.initial_address();
                    ranges.push(start..start.saturating_add(fde.len()));
                }
                // Zero-length FDEs are left behind by discarded sections.
                Ok(_) => {}
                Err(err) => {
                    tracing::debug!(path = %elf.path.display(), %err, "skipping malformed FDE");
                }
            }
        }
        Self::from_ranges(ranges)
    }

    pub fn from_ranges(mut ranges: Vec<Range<u64>>) -> FunctionRanges {
        ranges.sort_by_key(|r| (r.start, r.end));
        ranges.dedup();
        FunctionRanges { ranges }
    }

    /// The FDE range containing `svma`.
    pub fn lookup(&self, svma: u64) -> Option<Range<u64>> {
        let after = self.ranges.partition_point(|r| r.start <= svma);
        self.ranges[..after]
            .iter()
            .rev()
            .take(OVERLAP_LOOKBACK)
            .find(|r| svma < r.end)
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_finds_containing_range_only() {
        let f = FunctionRanges::from_ranges(vec![0x2000..0x2100, 0x1000..0x1040, 0x1040..0x1100]);
        assert_eq!(f.lookup(0x1000), Some(0x1000..0x1040));
        assert_eq!(f.lookup(0x103f), Some(0x1000..0x1040));
        assert_eq!(f.lookup(0x1040), Some(0x1040..0x1100));
        assert_eq!(f.lookup(0x1100), None, "gap between functions");
        assert_eq!(f.lookup(0xfff), None);
        assert_eq!(f.lookup(0x20ff), Some(0x2000..0x2100));
        assert_eq!(f.lookup(0x2100), None);
    }

    #[test]
    fn lookup_handles_nested_ranges() {
        let f = FunctionRanges::from_ranges(vec![0x1000..0x2000, 0x1100..0x1200]);
        assert_eq!(f.lookup(0x1150), Some(0x1100..0x1200));
        assert_eq!(f.lookup(0x1300), Some(0x1000..0x2000));
    }
}
