//! Frames of C++ libraries are named as people read them. Postgres' JIT (`llvmjit.so`) runs
//! LLVM, a C++ library whose exported names are mangled (`_ZN4llvm…`): a backend compiling its
//! expressions at every query must show `llvm::…` frames in the profile, and no mangled C++
//! name at all. And LLVM, whose thousands of functions are each small, must show in the
//! inclusive views: the time per module and the statement's hot paths.

use std::path::Path;

use anyhow::{ensure, Context, Result};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Profile, Trace, TraceSummary};

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
    let json = dir.path().join("jit.json");
    let trace = Trace::pid(backend.pid())
        .duration_secs(600)
        .frequency(499)
        .folded(&folded)
        .json(&json)
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
    check_inclusive_views(&TraceSummary::read(&json)?)
}

/// LLVM holds most of the backend's time in thousands of functions, none much on its own (the
/// top one 2.4% here): the views by module and by hot path must show what the top list cannot.
fn check_inclusive_views(summary: &TraceSummary) -> Result<()> {
    let modules = summary.modules()?;
    let listed: Vec<String> = modules
        .iter()
        .map(|m| format!("{} {:.1}%/{:.1}%", m.name, m.self_pct, m.total_pct))
        .collect();
    eprintln!("modules (self/total): {}", listed.join(", "));
    let llvm = modules
        .iter()
        .find(|m| m.name.starts_with("libLLVM"))
        .with_context(|| format!("no LLVM library among the modules: {listed:?}"))?;
    let top_self = summary.top_self_pct()?;
    // Most of each query's CPU is LLVM's; far more than any one function's.
    ensure!(
        llvm.total_pct > 50.0 && llvm.self_pct > 5.0 * top_self,
        "{} holds {:.1}% in all and {:.1}% on its own, against {top_self:.1}% for the top function",
        llvm.name,
        llvm.total_pct,
        llvm.self_pct
    );
    let self_sum: u64 = modules.iter().map(|m| m.self_samples).sum();
    ensure!(
        self_sum <= summary.samples_profiled()?,
        "the modules' self samples ({self_sum}) are more than the samples"
    );

    // The statement with the most samples (queryid 0 here: the queryid of a statement whose
    // expressions are compiled is not known to pgscope yet).
    let queryid = summary
        .query_ids()?
        .into_iter()
        .next()
        .context("no statement in the summary")?;
    let (samples, paths) = summary.hot_paths_of_query(&queryid)?;
    let counted: u64 = paths.iter().map(|p| p.samples).sum();
    ensure!(
        !paths.is_empty() && counted <= samples,
        "queryid {queryid}: its hot paths hold {counted} of its {samples} samples: {paths:?}"
    );
    for path in &paths {
        // Inclusive counts only fall along a path, and the path's own count is under its last.
        let falling = path.frames.windows(2).all(|w| w[0].samples >= w[1].samples);
        let last = path.frames.last().map_or(0, |f| f.samples);
        ensure!(
            falling && path.samples <= last && path.self_samples <= last && path.samples * 20 >= samples,
            "queryid {queryid}: a hot path that is not one: {path:?}"
        );
    }
    let through_llvm: u64 = paths
        .iter()
        .filter(|p| {
            p.frames
                .iter()
                .any(|f| f.module.as_deref() == Some(llvm.name.as_str()))
        })
        .map(|p| p.samples)
        .sum();
    ensure!(
        through_llvm * 2 > samples,
        "queryid {queryid}: hot paths through {} hold {through_llvm} of its {samples} samples",
        llvm.name
    );
    Ok(())
}
