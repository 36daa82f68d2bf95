//! The unwinder given random stack bytes and registers against real fixtures (a process's
//! recorded layout and its files, unmodified). Properties: no panic, a bounded walk, the same
//! answer twice, and a snapshot cut anywhere unwinds to a prefix of the full walk.

mod fuzz_support;
mod support;

use std::path::Path;

use fuzz_support::{config, watch, XorShift};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use support::Fixtures;
use symbolizer::{Symbolizer, SymbolizerOptions, UnwindEnd, UserRegs, MAX_DEPTH};

#[test]
fn random_stacks_and_registers_walk_boundedly_and_deterministically() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let snapshot = fixtures.run(&exe, "via-lib");
    let code: Vec<(u64, u64)> = snapshot
        .maps
        .iter()
        .filter(|m| m.perms.exec)
        .map(|m| (m.start, m.end))
        .collect();
    // One symbolizer across cases, as in the agent (parsed files and rule cache reused).
    let symbolizer = std::cell::RefCell::new(Symbolizer::new(SymbolizerOptions::default()));

    // Words of the stack: 0 code address, 1 stack address, 2 zero, 3 noise; registers alike.
    let strategy = (
        prop::collection::vec((0u8..4, any::<u64>()), 0..600),
        any::<[u64; 3]>(),
        0u8..3,
    );
    let mut runner = TestRunner::new(config(400));
    let result = runner.run(&strategy, |(words, [ip, sp, bp], mode)| {
        let mut rng = XorShift(ip | 1);
        let mut pick_code = |seed: u64| {
            let (start, end) = code[(seed as usize) % code.len()];
            start + rng.next() % (end - start)
        };
        let stack: Vec<u8> = words
            .iter()
            .flat_map(|&(kind, word)| {
                let value = match kind {
                    0 => pick_code(word),
                    1 => snapshot.regs.sp.wrapping_add(word % 0x4000),
                    2 => 0,
                    _ => word,
                };
                value.to_le_bytes()
            })
            .collect();
        let regs = match mode {
            0 => UserRegs {
                ip: pick_code(ip),
                sp: snapshot.regs.sp,
                bp: snapshot.regs.sp.wrapping_add(bp % 0x1000),
            },
            1 => UserRegs {
                ip: pick_code(ip),
                sp,
                bp,
            },
            _ => UserRegs { ip, sp, bp },
        };
        let _guard = watch("unwind", &stack);
        let mut symbolizer = symbolizer.borrow_mut();
        let first = symbolizer.unwind_with_maps(&snapshot.maps, Path::new("/"), &regs, &stack);
        prop_assert!(!first.frames.is_empty() && first.frames.len() <= MAX_DEPTH);
        prop_assert!(first.end != UnwindEnd::DepthLimit || first.frames.len() == MAX_DEPTH);
        let again = symbolizer.unwind_with_maps(&snapshot.maps, Path::new("/"), &regs, &stack);
        prop_assert_eq!(&again.frames, &first.frames);
        prop_assert_eq!(again.end, first.end);
        for loc in &first.frames {
            prop_assert!(!symbolizer.symbolize(loc).name.is_empty());
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

#[test]
fn a_cut_snapshot_unwinds_to_a_prefix_of_the_full_walk() {
    let fixtures = Fixtures::new();
    let exe = fixtures.build_exe("fixture", &[]);
    let snapshot = fixtures.run(&exe, "via-lib");
    let symbolizer = std::cell::RefCell::new(Symbolizer::new(SymbolizerOptions::default()));
    let full = symbolizer.borrow_mut().unwind_with_maps(
        &snapshot.maps,
        Path::new("/"),
        &snapshot.regs,
        &snapshot.stack,
    );
    assert_eq!(full.end, UnwindEnd::ReachedRoot);

    let mut runner = TestRunner::new(config(300));
    let result = runner.run(&(0..=snapshot.stack.len()), |len| {
        let walk = symbolizer.borrow_mut().unwind_with_maps(
            &snapshot.maps,
            Path::new("/"),
            &snapshot.regs,
            &snapshot.stack[..len],
        );
        prop_assert!(walk.frames.len() <= full.frames.len());
        prop_assert_eq!(&walk.frames[..], &full.frames[..walk.frames.len()]);
        if walk.frames.len() < full.frames.len() {
            prop_assert_eq!(walk.end, UnwindEnd::StackTruncated);
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
