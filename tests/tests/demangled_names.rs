//! Frames of C++ libraries are named as people read them. Postgres' JIT (`llvmjit.so`) runs
//! LLVM, a C++ library whose exported names are mangled (`_ZN4llvm…`): a backend compiling its
//! expressions at every query must show `llvm::…` frames in the profile, and no mangled C++
//! name at all.

use std::path::Path;

use anyhow::{ensure, Result};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Profile, Trace};

/// JIT for every query, with inlining and optimization: most of each query's CPU is LLVM's.
const JIT_ALWAYS: &[(&str, &str)] = &[
    ("jit", "on"),
    ("jit_above_cost", "0"),
    ("jit_inline_above_cost", "0"),
    ("jit_optimize_above_cost", "0"),
];

/// Queries compiled while traced: each spends milliseconds in LLVM.
const QUERIES: usize = 60;

#[test]
fn llvm_frames_of_the_jit_are_demangled() -> Result<()> {
    require_root_and_bpf();
    ensure!(
        Path::new("/usr/lib/postgresql/15/lib/llvmjit.so").exists(),
        "the distro build's JIT (llvmjit.so, package postgresql-15) is not installed"
    );
    let cluster = PgCluster::start_with(&PgInstall::distro()?, JIT_ALWAYS)?;
    let mut backend = cluster.connect()?;
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("jit.folded");
    let trace = Trace::pid(backend.pid())
        .duration_secs(600)
        .frequency(499)
        .folded(&folded)
        .spawn()?;
    for i in 0..QUERIES {
        // A new constant each time: the plan, and its compiled code, are made anew.
        backend.query(&format!(
            "SELECT sum(g * {i} + length(g::text)) FROM generate_series(1, 1000) g WHERE g % 7 <> {i}"
        ))?;
    }
    trace.interrupt()?;
    let profile = Profile::read_folded(&folded)?;
    let llvm = profile.count_where(|s| s.any_frame(|f| f.starts_with("llvm::")));
    let mangled = profile.count_where(|s| s.any_frame(|f| f.starts_with("_Z")));
    eprintln!(
        "{} samples: {llvm} with an llvm:: frame, {mangled} with a mangled one",
        profile.total()
    );
    ensure!(
        llvm > 0,
        "no sample shows an llvm:: frame, though every query was compiled:\n{}",
        profile.examples_where(|_| true, 5)
    );
    ensure!(
        mangled == 0,
        "{mangled} samples show mangled C++ names:\n{}",
        profile.examples_where(|s| s.any_frame(|f| f.starts_with("_Z")), 5)
    );
    Ok(())
}
