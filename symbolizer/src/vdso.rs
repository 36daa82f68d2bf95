//! The vDSO (`clock_gettime`, `gettimeofday`): it has no file, but it is the same image in
//! every 64-bit process on this kernel, so we read our own copy once.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::elf::ElfData;
use crate::maps::{read_maps, MapEntry, MapPath};

/// Size of the vDSO mapping in this process, to reject a process whose vDSO differs.
static OWN_VDSO_SIZE: OnceLock<u64> = OnceLock::new();

/// Read this process's vDSO image through `/proc/self/mem`.
pub(crate) fn read_own_vdso() -> Option<ElfData> {
    let maps = read_maps(std::process::id()).ok()?;
    let vdso = maps
        .iter()
        .find(|m| matches!(&m.path, MapPath::Pseudo(name) if name == "[vdso]"))?;
    let size = usize::try_from(vdso.end - vdso.start).ok()?;
    let mut bytes = vec![0; size];
    let mem = File::open("/proc/self/mem").ok()?;
    if let Err(err) = mem.read_exact_at(&mut bytes, vdso.start) {
        tracing::debug!(%err, "cannot read own vDSO");
        return None;
    }
    let _ = OWN_VDSO_SIZE.set(vdso.end - vdso.start);
    match ElfData::from_bytes(PathBuf::from("[vdso]"), bytes) {
        Ok(elf) => Some(elf),
        Err(err) => {
            tracing::debug!(error = %err, "cannot parse own vDSO");
            None
        }
    }
}

/// Whether a process's `[vdso]` mapping has the size of ours.
pub(crate) fn same_size(entry: &MapEntry) -> bool {
    OWN_VDSO_SIZE
        .get()
        .is_some_and(|&size| size == entry.end - entry.start)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use object::{Object, ObjectSymbol};

    use super::*;
    use crate::{Location, Symbolizer, SymbolizerOptions, UserRegs};

    #[test]
    fn vdso_frames_are_named_from_our_own_copy() {
        let maps = read_maps(std::process::id()).expect("own maps");
        let mapping = maps
            .iter()
            .find(|m| m.path == MapPath::Pseudo("[vdso]".into()))
            .expect("x86_64 Linux processes have a vDSO");
        let elf = read_own_vdso().expect("own vDSO readable");
        let object = elf.object().expect("vDSO parses");
        let svma = object
            .dynamic_symbols()
            .find(|s| s.name() == Ok("__vdso_clock_gettime"))
            .expect("__vdso_clock_gettime exported")
            .address();
        let bias = elf
            .bias_for_mapping(mapping.start, mapping.offset, true)
            .expect("vDSO placed");

        let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
        let regs = UserRegs {
            ip: bias + svma + 1,
            sp: 0x1000,
            bp: 0,
        };
        let stack = symbolizer.unwind_with_maps(&maps, Path::new("/"), &regs, &[]);
        let frame = symbolizer.symbolize(&stack.frames[0]);
        // `clock_gettime` is a weak alias at the same address; the global name wins.
        assert_eq!(&*frame.name, "__vdso_clock_gettime");
        assert_eq!(&*frame.module, "[vdso]");
        assert_eq!(stack.end, crate::UnwindEnd::StackTruncated);

        let unknown = symbolizer.symbolize(&Location::Unmapped { addr: 1 });
        assert_eq!((&*unknown.name, &*unknown.module), ("[unknown]", "[unknown]"));
    }
}
