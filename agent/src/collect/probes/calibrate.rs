//! What one probe hit costs on this machine: a uprobe and uretprobe on a function of pgscope
//! itself, with pgscope temporarily a target so that the programs run in full, timed against
//! the same calls without probes. The duty cycle turns hit rates into CPU time with it.

use std::hint::black_box;
use std::time::Instant;

use anyhow::{Context, Result};
use symbolizer::Symbolizer;

use crate::bpf::abi::TARGET_PROFILE;
use crate::bpf::OnCpuProbes;

/// Used when calibration cannot run (e.g. a stripped pgscope binary): the upper end of what a
/// uprobe + uretprobe pair costs on current x86 kernels.
pub const FALLBACK_NS_PER_HIT: f64 = 3000.0;

const CALLS: u32 = 20_000;

/// The function probed during calibration; exported so that the symbol table names it.
#[no_mangle]
#[inline(never)]
pub extern "C" fn pgscope_calibration_target(x: u64) -> u64 {
    black_box(x).wrapping_mul(31).wrapping_add(7)
}

fn time_calls() -> f64 {
    // The fastest of a few runs: scheduling noise only ever adds.
    (0..3)
        .map(|_| {
            let start = Instant::now();
            let mut acc = 0u64;
            for i in 0..CALLS {
                acc = acc.wrapping_add(pgscope_calibration_target(u64::from(i)));
            }
            black_box(acc);
            start.elapsed().as_nanos() as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn calibration_target(symbolizer: &mut Symbolizer) -> Result<symbolizer::FunctionLocation> {
    let pid = std::process::id();
    let exe = std::env::current_exe().context("locating pgscope's own executable")?;
    let name = exe
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    symbolizer
        .find_function(pid, &name, "pgscope_calibration_target")
        .context("finding the calibration function in pgscope's own binary")
}

/// Nanoseconds a call costs with a uprobe and a uretprobe whose programs do nothing: the traps
/// alone, the floor under any function probe.
pub fn measure_floor_ns_per_hit(probes: &mut OnCpuProbes, symbolizer: &mut Symbolizer) -> Result<f64> {
    let location = calibration_target(symbolizer)?;
    let bare = time_calls();
    let link = probes.attach_empty(&location.path, location.file_offset)?;
    let probed = time_calls();
    probes.detach_empty(link)?;
    symbolizer.forget_process(std::process::id());
    Ok(((probed - bare) / f64::from(CALLS)).max(0.0))
}

/// Nanoseconds one probed call costs (entry + return, full programs), measured.
pub fn measure_ns_per_hit(probes: &mut OnCpuProbes, symbolizer: &mut Symbolizer) -> Result<f64> {
    let pid = std::process::id();
    let location = calibration_target(symbolizer)?;
    let bare = time_calls();
    probes.add_target(pid, TARGET_PROFILE)?;
    let links = probes.attach_calibration(&location.path, location.file_offset);
    let outcome = links.and_then(|links| {
        let probed = time_calls();
        probes.detach_function(links).map(|()| probed)
    });
    probes.remove_target(pid)?;
    let probed = outcome?;
    symbolizer.forget_process(pid);
    Ok(((probed - bare) / f64::from(CALLS)).max(0.0))
}
