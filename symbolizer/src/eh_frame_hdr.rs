//! Checking a file's `.eh_frame_hdr` before the unwinder trusts it. framehop binary-searches its
//! table and gimli turns the FDE pointer found into an offset in `.eh_frame` by subtraction: an
//! entry pointing before `.eh_frame` overflows (a panic in debug builds, a wild offset in
//! release ones), and an unsorted table finds the wrong FDE. A header that fails the check is
//! dropped; framehop then indexes `.eh_frame` itself, as for a file that has no header.

use std::ops::Range;

use gimli::{BaseAddresses, EhFrameHdr, Pointer};

/// Whether the header at `hdr_svma` (bytes `hdr`) describes a sorted table whose every entry
/// points inside `.eh_frame` at `eh_frame`.
pub(crate) fn is_valid(hdr: &[u8], hdr_svma: u64, eh_frame: &Range<u64>) -> bool {
    let bases = BaseAddresses::default()
        .set_eh_frame_hdr(hdr_svma)
        .set_eh_frame(eh_frame.start);
    let Ok(parsed) = EhFrameHdr::new(hdr, gimli::LittleEndian).parse(&bases, 8) else {
        return false;
    };
    if parsed.eh_frame_ptr() != Pointer::Direct(eh_frame.start) {
        return false;
    }
    // Without a table framehop does not use the header.
    let Some(table) = parsed.table() else {
        return true;
    };
    let mut rows = table.iter(&bases);
    let mut previous = 0;
    loop {
        match rows.next() {
            Ok(Some((Pointer::Direct(start), Pointer::Direct(fde)))) => {
                if start < previous || !eh_frame.contains(&fde) {
                    return false;
                }
                previous = start;
            }
            Ok(None) => return true,
            Ok(Some(_)) | Err(_) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header with `eh_frame_ptr` and a table, all absolute udata8 values.
    fn header(eh_frame_ptr: u64, rows: &[(u64, u64)]) -> Vec<u8> {
        const UDATA8: u8 = 0x04;
        let mut bytes = vec![1, UDATA8, UDATA8, UDATA8];
        bytes.extend(eh_frame_ptr.to_le_bytes());
        bytes.extend((rows.len() as u64).to_le_bytes());
        for (start, fde) in rows {
            bytes.extend(start.to_le_bytes());
            bytes.extend(fde.to_le_bytes());
        }
        bytes
    }

    #[test]
    fn accepts_sorted_rows_inside_eh_frame() {
        let hdr = header(0x2000, &[(0x1000, 0x2010), (0x1100, 0x2040)]);
        assert!(is_valid(&hdr, 0x1f00, &(0x2000..0x2100)));
    }

    #[test]
    fn rejects_rows_outside_eh_frame_unsorted_or_cut() {
        let eh_frame = 0x2000..0x2100;
        // An FDE pointer below .eh_frame is what made gimli's subtraction overflow.
        assert!(!is_valid(&header(0x2000, &[(0x1000, 0x10)]), 0x1f00, &eh_frame));
        assert!(!is_valid(&header(0x2000, &[(0x1000, 0x2100)]), 0x1f00, &eh_frame));
        assert!(!is_valid(
            &header(0x2000, &[(0x1100, 0x2010), (0x1000, 0x2040)]),
            0x1f00,
            &eh_frame
        ));
        assert!(!is_valid(&header(0x3000, &[]), 0x1f00, &eh_frame));
        let hdr = header(0x2000, &[(0x1000, 0x2010), (0x1100, 0x2040)]);
        assert!(!is_valid(&hdr[..hdr.len() - 4], 0x1f00, &eh_frame));
    }
}
