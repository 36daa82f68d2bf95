//! Walking a user-stack snapshot with framehop, and deciding why the walk ended.

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64};
use framehop::{FrameAddress, Unwinder};

use crate::process::ProcessState;
use crate::{Location, UnwindEnd, UnwoundStack, UserRegs};

/// Frames beyond this are dropped and the stack ends with [`UnwindEnd::DepthLimit`].
pub const MAX_DEPTH: usize = 256;

/// Re-reads the process's mappings when an address is in none of them (a library loaded
/// after the last read). Returns false when it did not (or may not yet) refresh.
pub(crate) type Refresh<'a> = dyn FnMut(&mut ProcessState) -> bool + 'a;

/// The snapshot of the stack: `bytes` were copied from `sp` upward.
struct Snapshot<'a> {
    sp: u64,
    bytes: &'a [u8],
}

impl Snapshot<'_> {
    fn read(&self, addr: u64) -> Result<u64, ()> {
        let offset = usize::try_from(addr.checked_sub(self.sp).ok_or(())?).map_err(|_| ())?;
        let end = offset.checked_add(8).ok_or(())?;
        let word = self.bytes.get(offset..end).ok_or(())?;
        Ok(u64::from_le_bytes(word.try_into().map_err(|_| ())?))
    }

    fn end(&self) -> u64 {
        self.sp.saturating_add(self.bytes.len() as u64)
    }
}

pub(crate) fn unwind(
    state: &mut ProcessState,
    cache: &mut CacheX86_64,
    regs: &UserRegs,
    stack: &[u8],
    mut refresh: Option<&mut Refresh<'_>>,
) -> UnwoundStack {
    let snapshot = Snapshot {
        sp: regs.sp,
        bytes: stack,
    };
    let mut read_stack = |addr| snapshot.read(addr);
    let mut unwind_regs = UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp);
    let mut refreshed = false;
    let mut frames = Vec::new();

    // The sampled ip is certainly code; if no mapping holds it, the maps are stale.
    if state.mapping_for(regs.ip).is_none() {
        if let Some(refresh) = refresh.as_mut() {
            refreshed = refresh(state);
        }
    }
    let mut address = FrameAddress::from_instruction_pointer(regs.ip);
    let end = loop {
        if frames.len() == MAX_DEPTH {
            break UnwindEnd::DepthLimit;
        }
        frames.push(state.location(address.address_for_lookup()));
        let step = state
            .unwinder
            .unwind_frame(address, &mut unwind_regs, cache, &mut read_stack);
        match step {
            Ok(Some(0)) => break UnwindEnd::ReachedRoot,
            Ok(Some(return_address)) => {
                let lookup = return_address - 1;
                if !state.is_code(lookup) && !refreshed {
                    if let Some(refresh) = refresh.as_mut() {
                        refreshed = refresh(state);
                    }
                }
                if !state.is_code(lookup) {
                    // A "return address" outside code: we walked into garbage.
                    break UnwindEnd::Error;
                }
                match FrameAddress::from_return_address(return_address) {
                    Some(next) => address = next,
                    None => break UnwindEnd::ReachedRoot,
                }
            }
            Ok(None) => break end_of_stack(state, frames.last()),
            Err(framehop::Error::CouldNotReadStack(addr)) => {
                break read_failure(state, &snapshot, addr);
            }
            Err(err) => {
                tracing::trace!(%err, "unwinding stopped");
                break UnwindEnd::Error;
            }
        }
    };
    UnwoundStack { frames, end }
}

/// framehop ends a walk without error both at a real root (`.cfi_undefined rip` in `_start`
/// or a thread start, or a zero return address) and when its frame-pointer fallback meets
/// `rbp == 0`. Only the first is a complete stack, unless the module has no unwind info at
/// all and so follows the frame-pointer convention of ending at `rbp == 0`.
fn end_of_stack(state: &ProcessState, last: Option<&Location>) -> UnwindEnd {
    let Some(Location::InModule { module, addr }) = last else {
        return UnwindEnd::NoUnwindInfo;
    };
    let Some(placed) = state.modules.iter().find(|m| &m.module.id == module) else {
        return UnwindEnd::NoUnwindInfo;
    };
    let module = &placed.module;
    if !module.has_unwind_info() || module.functions().lookup(*addr).is_some() {
        UnwindEnd::ReachedRoot
    } else {
        UnwindEnd::NoUnwindInfo
    }
}

/// A read beyond the copied bytes but still inside the stack mapping means the snapshot was
/// too short; any other address came from a garbage frame.
fn read_failure(state: &ProcessState, snapshot: &Snapshot<'_>, addr: u64) -> UnwindEnd {
    let beyond_copy = addr >= snapshot.sp && addr.saturating_add(8) > snapshot.end();
    let in_stack = match state.mapping_for(snapshot.sp) {
        Some(mapping) => addr < mapping.end,
        None => true,
    };
    if beyond_copy && in_stack {
        UnwindEnd::StackTruncated
    } else {
        UnwindEnd::Error
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_reads_only_copied_words() {
        let bytes: Vec<u8> = (0u8..24).collect();
        let s = Snapshot {
            sp: 0x1000,
            bytes: &bytes,
        };
        assert_eq!(s.read(0x1000), Ok(u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7])));
        assert_eq!(
            s.read(0x1010),
            Ok(u64::from_le_bytes([16, 17, 18, 19, 20, 21, 22, 23]))
        );
        assert_eq!(s.read(0x1011), Err(()), "partially beyond the copy");
        assert_eq!(s.read(0xff8), Err(()), "below sp");
        assert_eq!(s.read(u64::MAX), Err(()));
        let top = Snapshot {
            sp: u64::MAX - 3,
            bytes: &bytes,
        };
        assert_eq!(top.end(), u64::MAX, "no overflow at the top of the address space");
    }
}
