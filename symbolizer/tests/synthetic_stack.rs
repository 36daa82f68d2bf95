//! The unwinder on hand-made stacks: frame-pointer chains through anonymous code (as JIT code
//! is), and each way a walk can end.

use std::path::Path;

use symbolizer::{
    parse_maps, Location, MapEntry, Symbolizer, SymbolizerOptions, UnwindEnd, UserRegs, MAX_DEPTH,
};

const CODE: u64 = 0x7f00_0001_0000;
const DATA: u64 = 0x7f00_0002_0000;
const STACK: u64 = 0x7ffd_0000_0000;
const STACK_TOP: u64 = STACK + 0x10_0000;

fn maps() -> Vec<MapEntry> {
    let text = format!(
        "{CODE:x}-{:x} r-xp 00000000 00:00 0 \n\
         {DATA:x}-{:x} rw-p 00000000 00:00 0 \n\
         {STACK:x}-{STACK_TOP:x} rw-p 00000000 00:00 0                          [stack]\n",
        CODE + 0x1_0000,
        DATA + 0x1_0000,
    );
    parse_maps(text.as_bytes(), Path::new("synthetic maps")).expect("valid maps")
}

/// A stack image starting at `sp`, written word by word.
struct StackImage {
    sp: u64,
    words: Vec<u64>,
}

impl StackImage {
    fn new(sp: u64, len_words: usize) -> StackImage {
        StackImage {
            sp,
            words: vec![0xdead_beef; len_words],
        }
    }

    fn set(&mut self, addr: u64, value: u64) {
        let index = ((addr - self.sp) / 8) as usize;
        self.words[index] = value;
    }

    /// A frame record at `bp`: saved caller `rbp`, then the return address.
    fn frame(&mut self, bp: u64, caller_bp: u64, return_address: u64) {
        self.set(bp, caller_bp);
        self.set(bp + 8, return_address);
    }

    fn bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }
}

fn unwind(regs: UserRegs, stack: &[u8]) -> (Vec<Location>, UnwindEnd) {
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let result = symbolizer.unwind_with_maps(&maps(), Path::new("/"), &regs, stack);
    for loc in &result.frames {
        assert_eq!(&*symbolizer.symbolize(loc).name, "[unknown]");
    }
    (result.frames, result.end)
}

fn unmapped(addr: u64) -> Location {
    Location::Unmapped { addr }
}

#[test]
fn frame_pointer_chain_through_anonymous_code_ends_without_unwind_info() {
    let sp = STACK_TOP - 0x400;
    let mut image = StackImage::new(sp, 0x80);
    image.frame(sp + 0x20, sp + 0x60, CODE + 0x100);
    image.frame(sp + 0x60, 0, CODE + 0x200);
    let regs = UserRegs {
        ip: CODE + 0x10,
        sp,
        bp: sp + 0x20,
    };
    let (frames, end) = unwind(regs, &image.bytes());
    // Return addresses are looked up one byte back, inside the call instruction.
    assert_eq!(
        frames,
        [
            unmapped(CODE + 0x10),
            unmapped(CODE + 0xff),
            unmapped(CODE + 0x1ff)
        ]
    );
    // rbp == 0 ends a frame-pointer chain, but without unwind info that is not proof of a root.
    assert_eq!(end, UnwindEnd::NoUnwindInfo);
}

#[test]
fn return_address_outside_code_is_an_error_and_not_a_frame() {
    let sp = STACK_TOP - 0x400;
    let mut image = StackImage::new(sp, 0x80);
    image.frame(sp + 0x20, sp + 0x60, CODE + 0x100);
    image.frame(sp + 0x60, sp + 0x100, DATA + 0x40);
    let regs = UserRegs {
        ip: CODE + 0x10,
        sp,
        bp: sp + 0x20,
    };
    let (frames, end) = unwind(regs, &image.bytes());
    assert_eq!(frames, [unmapped(CODE + 0x10), unmapped(CODE + 0xff)]);
    assert_eq!(end, UnwindEnd::Error);
}

#[test]
fn frame_beyond_the_copy_but_inside_the_stack_is_truncation() {
    let sp = STACK_TOP - 0x4000;
    let mut image = StackImage::new(sp, 0x10);
    // The caller's frame record lies past the 128 copied bytes.
    image.frame(sp + 0x20, sp + 0x800, CODE + 0x100);
    let regs = UserRegs {
        ip: CODE + 0x10,
        sp,
        bp: sp + 0x20,
    };
    let (frames, end) = unwind(regs, &image.bytes());
    assert_eq!(frames, [unmapped(CODE + 0x10), unmapped(CODE + 0xff)]);
    assert_eq!(end, UnwindEnd::StackTruncated);
}

#[test]
fn frame_pointer_outside_the_stack_is_an_error() {
    let sp = STACK_TOP - 0x400;
    let image = StackImage::new(sp, 0x80);
    for bp in [STACK_TOP + 0x1000, DATA + 0x100] {
        let regs = UserRegs {
            ip: CODE + 0x10,
            sp,
            bp,
        };
        let (frames, end) = unwind(regs, &image.bytes());
        assert_eq!(frames, [unmapped(CODE + 0x10)], "bp {bp:#x}");
        assert_eq!(end, UnwindEnd::Error, "bp {bp:#x}");
    }
}

#[test]
fn endless_chain_stops_at_the_depth_limit() {
    let sp = STACK_TOP - 0x8000;
    let mut image = StackImage::new(sp, 0x1000);
    for i in 0..(0x1000 / 2 - 1) as u64 {
        let bp = sp + 16 * i;
        image.frame(bp, bp + 16, CODE + 0x100 + i);
    }
    let regs = UserRegs {
        ip: CODE + 0x10,
        sp,
        bp: sp,
    };
    let (frames, end) = unwind(regs, &image.bytes());
    assert_eq!(frames.len(), MAX_DEPTH);
    assert_eq!(end, UnwindEnd::DepthLimit);
}
