//! The functions a function calls directly, read from its machine code (x86-64). This finds a
//! static function of a stripped file from functions whose addresses are known some other way
//! (a function pointer stored in a global variable): no symbol is needed, only the callers'
//! extents from `.eh_frame`.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::PathBuf;

use iced_x86::{Decoder, DecoderOptions, Instruction, Mnemonic, OpKind};

use crate::elf::ElfData;

/// The direct callees of one function of a process (see [`crate::Symbolizer::direct_callees`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Callees {
    /// The file holding the function, as seen from the process: under `/proc/PID/root`, like
    /// [`crate::FunctionLocation::path`].
    pub path: PathBuf,
    /// Offset in the file of the function's first instruction.
    pub function_offset: u64,
    /// File offsets of the targets of its direct calls, and of its direct jumps out of its own
    /// extent (tail calls; also a jump to its own cold part, which has an FDE of its own), that
    /// lie in the file's `.text`. PLT stubs lie outside `.text`: calls to other files and to
    /// exported (interposable) functions of the same file are not here.
    pub callees: BTreeSet<u64>,
}

/// Why [`crate::Symbolizer::direct_callees`] could not read a function's calls.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CalleesError {
    #[error("process {pid} is gone or its memory maps are unreadable")]
    NoProcess { pid: u32 },
    #[error("address {addr:#x} of process {pid} is in no mapped file")]
    NoFile { pid: u32, addr: u64 },
    #[error("`{path}` could not be read as an ELF file")]
    Unreadable { path: PathBuf },
    #[error("`{path}` has no .eh_frame entry covering {svma:#x}, so the function's extent is unknown")]
    NoExtent { path: PathBuf, svma: u64 },
    #[error("the code at {start:#x}..{end:#x} is not in an executable segment of `{path}`")]
    CodeNotInFile { path: PathBuf, start: u64, end: u64 },
    #[error("`{path}` has no valid x86-64 instruction at {svma:#x}")]
    InvalidInstruction { path: PathBuf, svma: u64 },
}

/// The direct callees (stated addresses) of the function occupying `function` (stated
/// addresses, a whole FDE) in `elf`.
pub(crate) fn in_elf(elf: &ElfData, function: &Range<u64>) -> Result<BTreeSet<u64>, CalleesError> {
    let code = elf
        .code_bytes(function)
        .ok_or_else(|| CalleesError::CodeNotInFile {
            path: elf.path.clone(),
            start: function.start,
            end: function.end,
        })?;
    let text = elf.text.as_ref().map_or(0..0, |text| text.svma.clone());
    direct_targets(code, function, &text).map_err(|svma| CalleesError::InvalidInstruction {
        path: elf.path.clone(),
        svma,
    })
}

/// Decodes `code`, the bytes of `function`, and returns the targets inside `text` of its direct
/// calls and of its direct jumps leaving `function`; the address of the first undecodable
/// instruction on error. An FDE covers exactly one function's instructions, so an undecodable
/// byte means the extent or the bytes are wrong: better no answer than a wrong one.
fn direct_targets(code: &[u8], function: &Range<u64>, text: &Range<u64>) -> Result<BTreeSet<u64>, u64> {
    let mut decoder = Decoder::with_ip(64, code, function.start, DecoderOptions::NONE);
    let mut instruction = Instruction::default();
    let mut targets = BTreeSet::new();
    while decoder.can_decode() {
        decoder.decode_out(&mut instruction);
        if instruction.is_invalid() {
            return Err(instruction.ip());
        }
        // Only `call rel` and `jmp rel` name their target in the code; indirect ones (the
        // previous hook in a chain, a PLT slot) are unknowable here and skipped.
        if instruction.op0_kind() != OpKind::NearBranch64 {
            continue;
        }
        let target = instruction.near_branch64();
        let wanted = match instruction.mnemonic() {
            Mnemonic::Call => true,
            Mnemonic::Jmp => !function.contains(&target),
            _ => false,
        };
        if wanted && text.contains(&target) {
            targets.insert(target);
        }
    }
    Ok(targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rel32` little-endian bytes of `target - next_ip`.
    fn rel32(target: u64, next_ip: u64) -> [u8; 4] {
        let delta = i32::try_from(target as i64 - next_ip as i64).expect("in range");
        delta.to_le_bytes()
    }

    #[test]
    fn keeps_direct_calls_and_jumps_out_only() {
        let start = 0x1000;
        let mut code = Vec::new();
        let mut push = |bytes: &[u8]| code.extend_from_slice(bytes);
        // 0x1000: call 0x2000 (in .text)
        push(&[0xe8]);
        push(&rel32(0x2000, 0x1005));
        // 0x1005: call 0x800 (a PLT stub, before .text)
        push(&[0xe8]);
        push(&rel32(0x800, 0x100a));
        // 0x100a: call *%rax
        push(&[0xff, 0xd0]);
        // 0x100c: je 0x1000 (inside the function)
        push(&[0x0f, 0x84]);
        push(&rel32(0x1000, 0x1012));
        // 0x1012: jmp 0x1000 (a loop, inside)
        push(&[0xe9]);
        push(&rel32(0x1000, 0x1017));
        // 0x1017: je 0x3000 (conditional: not a tail call)
        push(&[0x0f, 0x84]);
        push(&rel32(0x3000, 0x101d));
        // 0x101d: jmp 0x3100 (tail call)
        push(&[0xe9]);
        push(&rel32(0x3100, 0x1022));
        // 0x1022: ret
        push(&[0xc3]);
        let function = start..start + code.len() as u64;
        let targets = direct_targets(&code, &function, &(0x1000..0x4000)).expect("valid code");
        assert_eq!(targets, BTreeSet::from([0x2000, 0x3100]));
    }

    #[test]
    fn undecodable_bytes_are_an_error_at_their_address() {
        // `nop` then a `call rel32` cut short by the function's end.
        let code = [0x90, 0xe8, 0x00, 0x00];
        let function = 0x1000..0x1004;
        assert_eq!(direct_targets(&code, &function, &(0..u64::MAX)), Err(0x1001));
    }
}
