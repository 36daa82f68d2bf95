//! Proof that a file offset given by a user is a safe place for a uprobe. A uprobe replaces the
//! first byte of an instruction with a breakpoint in every process mapping the file: placed in
//! the middle of an instruction it corrupts that instruction, and the process (a Postgres
//! backend) crashes. Only offsets inside a function known from `.eh_frame` that are reached by
//! decoding the function's instructions from its start are accepted.

use std::path::{Path, PathBuf};

use iced_x86::{Decoder, DecoderOptions, Instruction};

use crate::elf::ElfData;
use crate::functions::FunctionRanges;

/// Where a checked offset lies in its function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbePoint {
    /// File offset of the function's first instruction.
    pub function_offset: u64,
    /// Whether the offset is that first instruction (an entry probe, whose arguments are in
    /// their registers).
    pub is_entry: bool,
}

/// Why a file offset is not a safe probe point.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbePointError {
    #[error("`{path}` could not be read as an ELF file")]
    Unreadable { path: PathBuf },
    #[error(
        "offset {offset:#x} of `{path}` is not in an executable segment (it is data, or beyond the code)"
    )]
    NotCode { path: PathBuf, offset: u64 },
    #[error("offset {offset:#x} of `{path}` is in no function that `.eh_frame` describes, so its instruction boundaries cannot be proven")]
    NoFunction { path: PathBuf, offset: u64 },
    #[error("`{path}` has undecodable code at offset {at:#x}, before offset {offset:#x}")]
    Undecodable { path: PathBuf, offset: u64, at: u64 },
    #[error(
        "offset {offset:#x} of `{path}` is inside an instruction ({before:#x}..{after:#x}); a probe there would corrupt it: \
         use the function's start {function:#x} or an instruction boundary such as {before:#x} or {after:#x}"
    )]
    MidInstruction {
        path: PathBuf,
        offset: u64,
        function: u64,
        before: u64,
        after: u64,
    },
}

/// Checks that `offset` of the file at `path` starts an instruction of a function.
pub fn check_probe_point(path: &Path, offset: u64) -> Result<ProbePoint, ProbePointError> {
    let elf = ElfData::open(path).map_err(|_| ProbePointError::Unreadable {
        path: path.to_path_buf(),
    })?;
    check_in_elf(&elf, offset)
}

pub(crate) fn check_in_elf(elf: &ElfData, offset: u64) -> Result<ProbePoint, ProbePointError> {
    let path = || elf.path.clone();
    let svma = elf
        .code_svma(offset)
        .ok_or_else(|| ProbePointError::NotCode { path: path(), offset })?;
    let function = FunctionRanges::from_elf(elf)
        .lookup(svma)
        .ok_or_else(|| ProbePointError::NoFunction { path: path(), offset })?;
    // Addresses in the function are within one segment of `svma`: the difference fits.
    let to_offset = |address: u64| offset.wrapping_add(address.wrapping_sub(svma));
    let code = elf
        .code_bytes(&function)
        .ok_or_else(|| ProbePointError::NotCode { path: path(), offset })?;
    let mut decoder = Decoder::with_ip(64, code, function.start, DecoderOptions::NONE);
    let mut instruction = Instruction::default();
    let mut start = function.start;
    while start < svma && decoder.can_decode() {
        decoder.decode_out(&mut instruction);
        if instruction.is_invalid() {
            return Err(ProbePointError::Undecodable {
                path: path(),
                offset,
                at: to_offset(start),
            });
        }
        let next = instruction.next_ip();
        if next > svma {
            return Err(mid_instruction(elf, offset, &function, start, next, &to_offset));
        }
        start = next;
    }
    if start != svma {
        // The function's bytes ended before `svma` was reached: the FDE and the code disagree.
        return Err(ProbePointError::Undecodable {
            path: path(),
            offset,
            at: to_offset(start),
        });
    }
    Ok(ProbePoint {
        function_offset: to_offset(function.start),
        is_entry: svma == function.start,
    })
}

fn mid_instruction(
    elf: &ElfData,
    offset: u64,
    function: &std::ops::Range<u64>,
    before: u64,
    after: u64,
    to_offset: &dyn Fn(u64) -> u64,
) -> ProbePointError {
    ProbePointError::MidInstruction {
        path: elf.path.clone(),
        offset,
        function: to_offset(function.start),
        before: to_offset(before),
        after: to_offset(after),
    }
}

#[cfg(test)]
mod tests {
    use object::{Object, ObjectSymbol};
    use proptest::prelude::*;

    use super::*;

    const POSTGRES: &str = "/usr/lib/postgresql/15/bin/postgres";

    /// Cases per property: `PGSCOPE_FUZZ_CASES`, else `default`.
    fn fuzz_cases(default: u32) -> u32 {
        std::env::var("PGSCOPE_FUZZ_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(default)
    }

    /// File offset of an exported function of the distro postgres, and its first bytes'
    /// instruction boundaries as iced-x86 decodes them linearly (the model of the check).
    fn function_of_postgres(name: &str) -> (ElfData, u64, Vec<u64>, u64) {
        let elf = ElfData::open(Path::new(POSTGRES)).expect("the distro postgres is installed");
        let object = object::File::parse(elf.data()).expect("postgres parses");
        let symbol = object
            .dynamic_symbols()
            .find(|s| s.name() == Ok(name))
            .expect("exported function");
        let start = elf.code_file_offset(symbol.address()).expect("in code");
        let range = FunctionRanges::from_elf(&elf)
            .lookup(symbol.address())
            .expect("an FDE");
        let code = elf.code_bytes(&range).expect("code bytes").to_vec();
        let mut decoder = Decoder::with_ip(64, &code, start, DecoderOptions::NONE);
        let boundaries = decoder.iter().map(|i| i.ip()).collect();
        let end = start + (range.end - range.start);
        (elf, start, boundaries, end)
    }

    #[test]
    fn function_start_and_boundaries_are_accepted_inside_instructions_refused() {
        let (elf, start, boundaries, _) = function_of_postgres("LockRelationOid");
        assert_eq!(
            check_in_elf(&elf, start),
            Ok(ProbePoint {
                function_offset: start,
                is_entry: true
            })
        );
        let second = boundaries[1];
        assert_eq!(check_in_elf(&elf, second).map(|p| p.is_entry), Ok(false));
        // endbr64 or push %rbp first; inside the first instruction longer than one byte.
        let long = boundaries
            .windows(2)
            .find(|w| w[1] - w[0] > 1)
            .expect("an instruction longer than a byte");
        match check_in_elf(&elf, long[0] + 1) {
            Err(ProbePointError::MidInstruction { before, after, .. }) => {
                assert_eq!((before, after), (long[0], long[1]));
            }
            other => panic!("mid-instruction offset accepted: {other:?}"),
        }
    }

    #[test]
    fn data_and_headers_are_refused() {
        let elf = ElfData::open(Path::new(POSTGRES)).expect("the distro postgres is installed");
        assert!(matches!(
            check_in_elf(&elf, 0),
            Err(ProbePointError::NotCode { .. })
        ));
        assert!(matches!(
            check_in_elf(&elf, u64::MAX),
            Err(ProbePointError::NotCode { .. })
        ));
        let error = check_probe_point(Path::new("/nonexistent/pg"), 0).expect_err("no file");
        assert!(error.to_string().contains("/nonexistent/pg"), "{error}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(fuzz_cases(24)))]
        /// Exactly the boundaries of a linear decode from the function's start are accepted.
        #[test]
        fn accepts_exactly_the_decoded_boundaries(delta in 0u64..4096) {
            let (elf, start, boundaries, end) = function_of_postgres("PortalStart");
            let offset = start + delta % (end - start);
            let accepted = check_in_elf(&elf, offset).is_ok();
            prop_assert_eq!(accepted, boundaries.contains(&offset), "offset {:#x}", offset);
        }

        /// Any offset of the file gets an answer, never a panic.
        #[test]
        fn any_offset_is_answered(offset in any::<u64>()) {
            let elf = ElfData::open(Path::new(POSTGRES)).expect("postgres");
            let size = elf.data().len() as u64;
            let _ = check_in_elf(&elf, offset % (size + 16));
        }
    }
}
