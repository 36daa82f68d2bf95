//! Off-CPU time as the collection core records it: the class of each wait, the syscall it
//! blocked in, and the waits the kernel measured without a stack (short waits, preemptions,
//! idle waits, waits still open), each shown as one placeholder frame so that every
//! nanosecond is in the profile.

use exporters::Profile;
use serde::Deserialize;

use crate::bpf::abi::{OffCpuClass, OffCpuKey, OffCpuTotal, RawAttribution, ATTR_STACK_NOT_SAMPLED};
use crate::bpf::OpenWait;

/// How off-CPU time is measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OffCpuMode {
    /// Not at all.
    None,
    /// Sampled: at each tick every profiled thread that is off CPU is sampled with its stack
    /// and wait event, weighing one tick. Costs threads × ticks, never context switches.
    #[default]
    Sampled,
    /// Traced: every context switch of the host runs a program that times each wait exactly
    /// (3-10% of a busy pgbench's throughput: bench/offcpu.sh).
    Exact,
    /// Both at once, each in its own profile: for checking one against the other (`trace`
    /// only).
    Both,
}

impl OffCpuMode {
    /// Whether the wait sampler runs.
    pub fn samples(self) -> bool {
        matches!(self, Self::Sampled | Self::Both)
    }

    /// Whether the context-switch tracer runs.
    pub fn traces(self) -> bool {
        matches!(self, Self::Exact | Self::Both)
    }

    pub fn any(self) -> bool {
        self != Self::None
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Sampled => "sampled",
            Self::Exact => "exact",
            Self::Both => "both",
        }
    }
}

/// Attaches the off-CPU programs `wanted` asks for; returns the mode measured. A part the
/// kernel refuses is handed to `refused` (what is missing, and the error) and left out: the
/// front end says so its own way, and on-CPU profiling goes on.
pub fn attach(
    probes: &mut crate::bpf::OnCpuProbes,
    wanted: OffCpuMode,
    min_stack: std::time::Duration,
    stacks_per_cpu_per_s: u64,
    refused: impl Fn(&'static str, anyhow::Error),
) -> OffCpuMode {
    let sampled = load_sampler(probes, wanted, &refused);
    attach_tracer(probes, wanted, sampled, min_stack, stacks_per_cpu_per_s, refused)
}

/// Loads the off-CPU sampler's programs, if `wanted`: the verifier's work, a few tenths of a
/// second, while nothing measures yet (the sampler runs once sampling starts). Returns whether
/// it is ready.
pub fn load_sampler(
    probes: &mut crate::bpf::OnCpuProbes,
    wanted: OffCpuMode,
    refused: impl Fn(&'static str, anyhow::Error),
) -> bool {
    wanted.samples()
        && probes
            .attach_wait_sampler()
            .map_err(|error| refused("no off-CPU profile", error))
            .is_ok()
}

/// Attaches the exact off-CPU tracer, if `wanted` (it measures from now on), beside a sampler
/// that [`load_sampler`] readied or not (`sampled`), and says which profiles the trace has.
pub fn attach_tracer(
    probes: &mut crate::bpf::OnCpuProbes,
    wanted: OffCpuMode,
    sampled: bool,
    min_stack: std::time::Duration,
    stacks_per_cpu_per_s: u64,
    refused: impl Fn(&'static str, anyhow::Error),
) -> OffCpuMode {
    let traced = wanted.traces()
        && probes
            .attach_off_cpu(min_stack.as_nanos() as u64, stacks_per_cpu_per_s)
            .map_err(|error| refused("no exact off-CPU profile", error))
            .is_ok();
    match (sampled, traced) {
        (true, true) => OffCpuMode::Both,
        (true, false) => OffCpuMode::Sampled,
        (false, true) => OffCpuMode::Exact,
        (false, false) => OffCpuMode::None,
    }
}

/// Off-CPU stacks taken per second per CPU at most, by default. A stack is taken when a wait
/// begins (its length is not known yet), so waits that turn out short cost one too; a busy
/// Postgres that waits on locks thousands of times a second keeps a sample of them.
pub const DEFAULT_STACK_RATE: u64 = 500;

/// The frame of waits for the client inside a transaction (the idle ones between statements
/// are [`IDLE_FRAME`]): never given a stack, which would always be the same socket read.
pub const CLIENT_FRAME: &str = "[waiting for the client inside a transaction]";

/// `PG_WAIT_CLIENT >> 24` (utils/wait_event.h, stable since PG 10).
const PG_WAIT_CLASS_CLIENT: u32 = 0x06;

/// The frame of waits left without a stack by the exact tracer's stack rate, the sampler's
/// per-tick stack budget, or a thread that left its wait before the sampler's second pass
/// copied its stack.
pub const NOT_SAMPLED_FRAME: &str =
    "[off-CPU waits without a stack: over the stack rate or budget, or left before the copy]";

/// The frame of waits measured without a stack because they were short.
pub const SHORT_WAITS_FRAME: &str = "[off-CPU waits without a stack: below the threshold]";
/// The frame of run-queue delay: runnable, waiting for a CPU (no stack: it was not blocked
/// anywhere in particular).
pub const PREEMPTED_FRAME: &str = "[preempted: runnable, waiting for a CPU]";
/// The frame of idle waits, never given a stack: a backend waiting for its client's next
/// statement, a background process waiting in its main loop for work.
pub const IDLE_FRAME: &str = "[idle: waiting for the next statement or for work]";

/// The kernel frame of a wait: the syscall it blocked in (x86-64 numbers, the ones
/// `class_of_syscall` in the BPF program tells apart, and a few more Postgres makes).
pub fn syscall_frame(nr: u32) -> &'static str {
    match nr {
        0 => "read (syscall)",
        1 => "write (syscall)",
        7 => "poll (syscall)",
        17 => "pread64 (syscall)",
        18 => "pwrite64 (syscall)",
        19 => "readv (syscall)",
        20 => "writev (syscall)",
        23 => "select (syscall)",
        35 => "nanosleep (syscall)",
        44 => "sendto (syscall)",
        45 => "recvfrom (syscall)",
        61 => "wait4 (syscall)",
        74 => "fsync (syscall)",
        75 => "fdatasync (syscall)",
        202 => "futex (syscall)",
        230 => "clock_nanosleep (syscall)",
        232 => "epoll_wait (syscall)",
        270 => "pselect6 (syscall)",
        271 => "ppoll (syscall)",
        277 => "sync_file_range (syscall)",
        281 => "epoll_pwait (syscall)",
        295 => "preadv (syscall)",
        296 => "pwritev (syscall)",
        327 => "preadv2 (syscall)",
        328 => "pwritev2 (syscall)",
        441 => "epoll_pwait2 (syscall)",
        449 => "futex_waitv (syscall)",
        _ => "other syscall",
    }
}

/// The class of an off-CPU wait, `None` for an on-CPU sample. The postmaster has no wait
/// events; it only waits for connections and children, which is idle time.
///
/// The kernel's side (the syscall, the task state) decides the class, except where Postgres
/// reports a lock wait (`wait_event_type`): a heavyweight lock is waited for on the backend's
/// latch and an LWLock on its semaphore, whatever the kernel saw. A backend in such a wait
/// found blocked in a page fault or a file read of the wait's own doing is in that lock wait,
/// not doing the statement's I/O (a `Lock:transactionid` wait was classed `io` for 111 ms).
pub fn class_of(raw: u32, postmaster: bool, wait_event_type: Option<&str>) -> Option<OffCpuClass> {
    let class = OffCpuClass::from_raw(raw)?;
    Some(match (class, wait_event_type) {
        (OffCpuClass::Latch, _) if postmaster => OffCpuClass::Idle,
        (OffCpuClass::Io, Some("Lock")) => OffCpuClass::Latch,
        (OffCpuClass::Io, Some("LWLock")) => OffCpuClass::Futex,
        (class, _) => class,
    })
}

/// The frame of waits still going on when the trace ended (counted up to that moment).
pub const OPEN_FRAME: &str = "[still off CPU when the trace ended]";

/// Off-CPU time the kernel measured without a stack: short waits, preemptions and idle waits
/// (totals per label set), and waits still open when the trace ended, counted up to that
/// moment — a backend blocked on a lock for the whole trace is the finding, not a blind spot.
pub struct WaitWithoutStack {
    pub tgid: u32,
    pub attr: RawAttribution,
    pub ns: u64,
    pub still_open: bool,
}

impl WaitWithoutStack {
    pub fn from_totals(totals: &[(OffCpuKey, OffCpuTotal)]) -> impl Iterator<Item = Self> + '_ {
        totals.iter().map(|(key, total)| Self {
            tgid: key.tgid,
            attr: key.attr,
            ns: total.ns,
            still_open: false,
        })
    }

    pub fn from_open(open: &[OpenWait]) -> impl Iterator<Item = Self> + '_ {
        open.iter().map(|wait| Self {
            tgid: wait.tgid,
            attr: wait.attr,
            ns: wait.so_far_ns,
            still_open: true,
        })
    }

    /// The one frame that stands for it in the profile.
    pub fn frame(&self, class: OffCpuClass) -> &'static str {
        match class {
            OffCpuClass::Idle => IDLE_FRAME,
            OffCpuClass::Preempted if !self.still_open => PREEMPTED_FRAME,
            _ if self.still_open => OPEN_FRAME,
            _ if self.attr.wait_event_info >> 24 == PG_WAIT_CLASS_CLIENT => CLIENT_FRAME,
            _ if self.attr.flags & ATTR_STACK_NOT_SAMPLED != 0 => NOT_SAMPLED_FRAME,
            _ => SHORT_WAITS_FRAME,
        }
    }
}

/// The profile without idle client waits: they are the client's think time, which would
/// dwarf every real wait in a flamegraph.
pub fn without_idle(profile: &Profile) -> Profile {
    let mut kept = profile.clone();
    kept.samples.retain(|s| {
        !s.labels
            .iter()
            .any(|(k, v)| k == crate::model::labels::OFF_CPU && v == OffCpuClass::Idle.name())
    });
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reported_lock_wait_keeps_its_lock_class_whatever_the_kernel_saw() {
        let io = OffCpuClass::Io as u32;
        assert_eq!(class_of(io, false, Some("Lock")), Some(OffCpuClass::Latch));
        assert_eq!(class_of(io, false, Some("LWLock")), Some(OffCpuClass::Futex));
        // I/O Postgres reports, or no report: the kernel's class.
        assert_eq!(class_of(io, false, Some("IO")), Some(OffCpuClass::Io));
        assert_eq!(class_of(io, false, None), Some(OffCpuClass::Io));
        // Preempted stays preempted.
        let preempted = OffCpuClass::Preempted as u32;
        assert_eq!(
            class_of(preempted, false, Some("Lock")),
            Some(OffCpuClass::Preempted)
        );
        // The postmaster's latch waits are idle; an on-CPU sample has no class.
        let latch = OffCpuClass::Latch as u32;
        assert_eq!(class_of(latch, true, None), Some(OffCpuClass::Idle));
        assert_eq!(class_of(0, false, Some("Lock")), None);
    }
}
