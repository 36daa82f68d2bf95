//! What one probe hit costs on this machine: a uprobe and uretprobe on a function of pgscope
//! itself, with pgscope temporarily a target so that the programs run in full, timed against
//! the same calls without probes. The duty cycle turns hit rates into CPU time with it.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result};
use symbolizer::MapPath;

use crate::bpf::abi::TARGET_PROFILE;
use crate::bpf::{FunctionLinks, OnCpuProbes};

/// Used when calibration cannot run (e.g. no uprobes on pgscope's own file): the upper end of what a
/// uprobe + uretprobe pair costs on current x86 kernels.
pub const FALLBACK_NS_PER_HIT: f64 = 3000.0;

/// Calls per timed block: about 3 ms probed, long against the clock's resolution and short
/// against the spells in which a trap costs more or less.
const CALLS: u32 = 2_000;
/// Pairs of blocks, twin then probed. On a VM the cost of a trap switches between levels ~40%
/// apart (1.1 and 1.6 µs per probed call here) in spells of 10 ms to a second, the same for the
/// calibration and for the target's calls: one long measurement caught one level and was off by
/// a quarter for the trace, so the pairs are spread over [`ROUNDS`] × ([`PAUSE`] + two blocks),
/// ~0.5 s, and averaged.
const ROUNDS: usize = 32;
const PAUSE: Duration = Duration::from_millis(10);
/// The share of pairs left out at either end before averaging: an interrupt during a block
/// only ever adds, a preemption of the twin's block subtracts.
const TRIMMED: f64 = 0.125;

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
    ".globl pgscope_calibration_twin",
    ".type pgscope_calibration_twin, @function",
    "pgscope_calibration_twin:",
    "push rbp",
    "mov rbp, rsp",
    "imul rax, rdi, 31",
    "add rax, 7",
    "pop rbp",
    "ret",
    ".size pgscope_calibration_twin, . - pgscope_calibration_twin",
);

extern "C" {
    /// `x * 31 + 7`, in the assembly above.
    fn pgscope_calibration_target(x: u64) -> u64;
    /// The same instructions, never probed: the bare cost, timed beside the probed one.
    fn pgscope_calibration_twin(x: u64) -> u64;
}

fn call_target(x: u64) -> u64 {
    // SAFETY: the function above reads only its argument register and keeps the stack
    // balanced, as the C calling convention asks.
    unsafe { pgscope_calibration_target(x) }
}

fn call_twin(x: u64) -> u64 {
    // SAFETY: as `call_target`.
    unsafe { pgscope_calibration_twin(x) }
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

/// CPU time of `CALLS` calls of `function`. Wall time would count the time the thread is
/// preempted, which on a busy machine (the workload pgscope is about to trace shares its
/// cores) made a probed call look ten times costlier than it is.
fn time_calls(function: fn(u64) -> u64) -> f64 {
    let start = thread_cpu_ns();
    let mut acc = 0u64;
    for i in 0..CALLS {
        acc = acc.wrapping_add(function(black_box(u64::from(i))));
    }
    black_box(acc);
    thread_cpu_ns() - start
}

/// Nanoseconds a probe adds to one call: the trimmed mean over [`ROUNDS`] pairs of blocks, the
/// unprobed twin timed right before the probed target, so that both see the same moment.
/// Stops early, with what it has, when `cancelled` is set.
fn extra_ns_per_call(cancelled: &AtomicBool) -> f64 {
    let mut extra: Vec<f64> = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS {
        if round > 0 {
            std::thread::sleep(PAUSE);
        }
        if cancelled.load(Ordering::Relaxed) {
            break;
        }
        let bare = time_calls(call_twin);
        let probed = time_calls(call_target);
        extra.push((probed - bare) / f64::from(CALLS));
    }
    trimmed_mean(&mut extra, TRIMMED).max(0.0)
}

/// The mean of `values` without the `share` lowest and the `share` highest.
fn trimmed_mean(values: &mut [f64], share: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let cut = (values.len() as f64 * share) as usize;
    let kept = &values[cut..values.len() - cut];
    if kept.is_empty() {
        return 0.0;
    }
    kept.iter().sum::<f64>() / kept.len() as f64
}

/// Where the calibration function is, in the file it was loaded from: found from its own
/// address in pgscope's memory map, which needs no symbol table (a stripped pgscope calibrates
/// too) and no parse of pgscope's own binary (a tenth of a second of every trace's start in a
/// debug build). The address is the function's first instruction by construction.
fn calibration_target() -> Result<(PathBuf, u64)> {
    let address = pgscope_calibration_target as *const () as usize as u64;
    let maps = symbolizer::read_maps(std::process::id()).context("reading pgscope's own memory map")?;
    let mapping = maps
        .iter()
        .find(|entry| entry.perms.exec && entry.contains(address))
        .context("the calibration function is in no executable mapping of pgscope")?;
    match &mapping.path {
        MapPath::File { path, deleted: false } => {
            Ok((path.clone(), address - mapping.start + mapping.offset))
        }
        _ => anyhow::bail!(
            "the calibration function is not mapped from a file that still exists (pgscope's \
             binary was replaced while it ran?)"
        ),
    }
}

/// Nanoseconds a call costs with a uprobe and a uretprobe whose programs do nothing: the traps
/// alone, the floor under any function probe.
pub fn measure_floor_ns_per_hit(probes: &mut OnCpuProbes) -> Result<f64> {
    let (path, file_offset) = calibration_target()?;
    let link = probes.attach_empty(&path, file_offset)?;
    let extra = extra_ns_per_call(&AtomicBool::new(false));
    probes.detach_empty(link)?;
    Ok(extra)
}

/// Nanoseconds one probed call costs (entry + return, full programs), measured.
pub fn measure_ns_per_hit(probes: &mut OnCpuProbes) -> Result<f64> {
    Calibration::start(probes)?.finish(probes)
}

/// A calibration under way: the probe is attached to pgscope's own function and a thread of its
/// own times the calls, so that the half second the pairs are spread over can overlap other
/// work (a trace parses its symbol files meanwhile). Its thread's CPU clock is its own, so what
/// the other threads do does not enter the figure.
pub struct Calibration {
    links: FunctionLinks,
    timing: JoinHandle<f64>,
    cancelled: Arc<AtomicBool>,
}

impl Calibration {
    /// Makes pgscope a target, attaches the full function programs to its calibration function
    /// and starts timing. On error nothing stays attached and pgscope is no target.
    pub fn start(probes: &mut OnCpuProbes) -> Result<Self> {
        let pid = std::process::id();
        let (path, file_offset) = calibration_target()?;
        probes.add_target(pid, TARGET_PROFILE)?;
        let links = match probes.attach_calibration(&path, file_offset) {
            Ok(links) => links,
            Err(error) => {
                probes.remove_target(pid)?;
                return Err(error);
            }
        };
        let cancelled = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&cancelled);
        let timing = std::thread::Builder::new()
            .name("pgscope-calibrate".to_owned())
            .spawn(move || extra_ns_per_call(&flag));
        match timing {
            Ok(timing) => Ok(Self {
                links,
                timing,
                cancelled,
            }),
            Err(error) => {
                probes.detach_function(links)?;
                probes.remove_target(pid)?;
                Err(error).context("starting the calibration's thread")
            }
        }
    }

    /// Stops the timing at once (no probe will be attached), detaches and takes pgscope out of
    /// the targets.
    pub fn cancel(self, probes: &mut OnCpuProbes) -> Result<()> {
        self.cancelled.store(true, Ordering::Relaxed);
        self.finish(probes).map(|_| ())
    }

    /// Waits for the timing to end, takes pgscope out of the targets and detaches: on a thread
    /// of its own, as nothing calls the calibration function any more and the kernel's grace
    /// periods took a fifth of a second of every trace's start.
    pub fn finish(self, probes: &mut OnCpuProbes) -> Result<f64> {
        let extra = self.timing.join();
        let detached = probes.detach_function_in_background(self.links);
        probes.remove_target(std::process::id())?;
        detached?;
        extra.map_err(|_| anyhow::anyhow!("the calibration's thread panicked"))
    }
}

#[cfg(test)]
mod tests {
    use super::trimmed_mean;

    #[test]
    fn trimmed_mean_leaves_out_both_ends() {
        let mut values = [9.0, 1.0, 2.0, 2.0, 2.0, 4.0, 4.0, 100.0];
        // An eighth of 8 is one value at either end: 1.0 and 100.0 go.
        assert_eq!(trimmed_mean(&mut values, 0.125), 23.0 / 6.0);
    }

    #[test]
    fn trimmed_mean_of_nothing_is_zero() {
        assert_eq!(trimmed_mean(&mut [], 0.125), 0.0);
    }

    #[test]
    fn trimmed_mean_of_few_values_keeps_them_all() {
        let mut values = [3.0, 5.0];
        assert_eq!(trimmed_mean(&mut values, 0.125), 4.0);
    }
}
