//! What one probe hit costs on this machine: a uprobe and uretprobe on a function of pgscope
//! itself, with pgscope temporarily a target so that the programs run in full, timed against
//! the same calls without probes. The duty cycle turns hit rates into CPU time with it.

use std::hint::black_box;

use anyhow::{Context, Result};
use symbolizer::Symbolizer;

use crate::bpf::abi::TARGET_PROFILE;
use crate::bpf::OnCpuProbes;

/// Used when calibration cannot run (e.g. a stripped pgscope binary): the upper end of what a
/// uprobe + uretprobe pair costs on current x86 kernels.
pub const FALLBACK_NS_PER_HIT: f64 = 3000.0;

const CALLS: u32 = 20_000;

// The function probed during calibration, global so that the symbol table names it. Written in
// assembly so that it starts the way Postgres' functions do when built with frame pointers (as
// distributions build it): `push %rbp`, an instruction the kernel emulates at the breakpoint.
// A compiled Rust function starts with whatever the compiler picked (`sub $0x48,%rsp` in a
// debug build), which the kernel must single-step out of line instead: on a VM that second
// trap made a probed call cost ~20 µs against ~1 µs for a probed Postgres function, and every
// nested call taken out at that cost erased the function around it.
std::arch::global_asm!(
    ".globl pgscope_calibration_target",
    ".type pgscope_calibration_target, @function",
    "pgscope_calibration_target:",
    "push rbp",
    "mov rbp, rsp",
    "imul rax, rdi, 31",
    "add rax, 7",
    "pop rbp",
    "ret",
    ".size pgscope_calibration_target, . - pgscope_calibration_target",
);

extern "C" {
    /// `x * 31 + 7`, in the assembly above.
    fn pgscope_calibration_target(x: u64) -> u64;
}

fn call_target(x: u64) -> u64 {
    // SAFETY: the function above reads only its argument register and keeps the stack
    // balanced, as the C calling convention asks.
    unsafe { pgscope_calibration_target(x) }
}

/// CPU time of the calling thread in nanoseconds, user and system: a trap is handled in the
/// kernel on the thread's behalf, so it counts, while time the thread waits for a CPU does not.
fn thread_cpu_ns() -> f64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    now.tv_sec as f64 * 1e9 + now.tv_nsec as f64
}

/// CPU time of `CALLS` calls. Wall time would count the time the thread is preempted, which
/// on a busy machine (the workload pgscope is about to trace shares its cores) made a probed
/// call look ten times costlier than it is; the fastest of a few runs: cache misses and
/// interrupts only ever add.
fn time_calls() -> f64 {
    (0..3)
        .map(|_| {
            let start = thread_cpu_ns();
            let mut acc = 0u64;
            for i in 0..CALLS {
                acc = acc.wrapping_add(call_target(black_box(u64::from(i))));
            }
            black_box(acc);
            thread_cpu_ns() - start
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
