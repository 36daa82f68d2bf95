//! Lifecycle of the on-CPU sampling programs: load the embedded object, attach one CPU-clock
//! perf event per online CPU and the fork/exit tracepoints, fill the target map, read the loss
//! counters. Dropping [`OnCpuProbes`] detaches every program (aya closes the links).

pub mod abi;
mod batch_keys;
mod detaching;
mod iter;
mod map_fd;
mod open_waits;
mod task_storage;
mod wait_sampler;
mod wait_targets;

pub use detaching::Detaching;
pub use open_waits::OpenWait;
pub use wait_sampler::{WaitSamplerTally, WaitSampling};

use anyhow::{anyhow, Context, Result};
use std::os::fd::AsFd;
use std::path::Path;

use aya::maps::{HashMap as BpfHashMap, Map, MapData, PerCpuArray, PerCpuHashMap, RingBuf};
use aya::programs::perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent};
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope};
use aya::programs::{BtfTracePoint, PerfEvent, TracePoint, UProbe};
use aya::util::online_cpus;
use aya::Btf;
use aya::Ebpf;
use tracing::info;

use abi::{
    CallKey, CallStats, Counter, Function, OffCpuKey, OffCpuTotal, PgLayout, ProbeArgs, RelationLockKey,
    SpinSiteKey, SpinSiteStats, TriggerStack, FUNCTION_IDS, PROBE_SLOTS,
};

/// The maps of record buffers, one per possible CPU each (`PGSCOPE_RECORD_BUFFERS`).
const RECORD_BUFFERS: [&str; 3] = ["scratch", "off_cpu_scratch", "wait_sample_scratch"];

static PROFILE_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pgscope.bpf.o"));

/// Set to `iterators`, the wait sampler's passes are task iterators visiting every thread of
/// the host even where the kernel could run the kfunc passes: for comparing the two, and the
/// tests of the way older kernels sample.
const WAIT_PASSES_ENV: &str = "PGSCOPE_WAIT_PASSES";

/// Off-CPU stacks the wait sampler copies per tick at most (a copy is up to 16 KiB of a
/// backend's stack, about what an on-CPU sample costs). Only threads that ran since the last
/// tick and now wait need one; past this, they are counted without a stack, marked so.
const WAIT_STACKS_PER_TICK: u64 = 256;

/// The uprobe and uretprobe programs every probed function shares.
const FUNCTION_PROGRAMS: [&str; 2] = ["on_function_entry", "on_function_return"];

/// Entry and return programs that do nothing, for the floor cost of a probed call.
const EMPTY_PROGRAMS: [&str; 2] = ["empty_entry", "empty_return"];

/// The trigger probes (`bpf/triggers.bpf.c`): on the entries of the calls around a trigger
/// function's call, and of the call that ends it.
const TRIGGER_PROGRAMS: [&str; 2] = ["on_function_usage_start", "on_function_usage_end"];

/// The attachments of the trigger probes.
pub struct TriggerLinks {
    start: UProbeLinkId,
    end: UProbeLinkId,
}

/// A cookie past every function id: the programs run in full, their statistics land under a
/// function user space ignores.
const CALIBRATION_COOKIE: u64 = FUNCTION_IDS as u64;

/// The attachments of one probed function.
pub struct FunctionLinks {
    entry: UProbeLinkId,
    exit: UProbeLinkId,
    /// Its slot in `function_gates` and `probe_args` (0: none, it always counts and reads no
    /// argument).
    gate: u32,
}

/// The loaded on-CPU profiler programs and their maps.
pub struct OnCpuProbes {
    ebpf: Ebpf,
    /// Gate slots freed by detached probes, for the next attach; `next_gate` is the lowest
    /// slot not handed out yet.
    free_gates: Vec<u32>,
    next_gate: u32,
    /// The wait sampler, once attached and until started.
    wait_sampler: Option<wait_sampler::WaitSampler>,
    /// Links detaching on threads of their own, with their gate slots: a slot is handed out
    /// again only once its links are gone.
    detaching: Vec<(Detaching, u32)>,
}

impl OnCpuProbes {
    /// Loads the programs into the kernel (CO-RE relocated against the running kernel's BTF).
    pub fn load() -> Result<Self> {
        // Task storage (off_cpu_tasks) is a map type aya has no wrapper for: it is read
        // through raw bpf(2) calls (`task_storage`).
        // The record buffers are arrays of one entry per possible CPU (`bpf/maps.bpf.h`).
        let cpus = aya::util::nr_cpus()
            .map_err(|(path, error)| anyhow::anyhow!("reading {path}: {error}"))
            .context("counting the possible CPUs")?;
        let cpus = u32::try_from(cpus).context("the number of possible CPUs")?;
        let mut loader = aya::EbpfLoader::new();
        for buffers in RECORD_BUFFERS {
            loader.map_max_entries(buffers, cpus);
        }
        let ebpf = loader
            .allow_unsupported_maps()
            .load(PROFILE_OBJECT)
            .with_context(|| refused(read_kernel_release().as_deref()))?;
        Ok(Self {
            ebpf,
            free_gates: Vec::new(),
            next_gate: 1,
            wait_sampler: None,
            detaching: Vec::new(),
        })
    }

    /// Starts sampling every online CPU at `frequency_hz` on the CPU clock. Only processes in
    /// the target map produce samples; the filter runs in the kernel.
    pub fn attach_sampling(&mut self, frequency_hz: u64) -> Result<()> {
        let program: &mut PerfEvent = self
            .ebpf
            .program_mut("on_cpu_sample")
            .ok_or_else(|| anyhow!("BPF object has no program `on_cpu_sample`"))?
            .try_into()?;
        program.load().context("loading the on-CPU sampling program")?;
        let cpus =
            online_cpus().map_err(|(path, error)| anyhow!(error).context(format!("reading `{path}`")))?;
        for cpu in cpus {
            program
                .attach(
                    PerfEventConfig::Software(SoftwareEvent::CpuClock),
                    PerfEventScope::AllProcessesOneCpu { cpu },
                    SamplePolicy::Frequency(frequency_hz),
                    false,
                )
                .with_context(|| format!("attaching the CPU-clock perf event on CPU {cpu}"))?;
        }
        Ok(())
    }

    /// Follows forks of targets flagged [`abi::TARGET_FOLLOW_FORKS`] (children inherit the
    /// attribution layout too) and drops processes that exit or exec another program. Needs tracefs (see `preflight::ensure_tracefs`).
    pub fn attach_process_tracking(&mut self) -> Result<()> {
        for (program_name, event) in [
            ("on_fork", "sched_process_fork"),
            ("on_process_exit", "sched_process_exit"),
            ("on_process_exec", "sched_process_exec"),
        ] {
            let program: &mut TracePoint = self
                .ebpf
                .program_mut(program_name)
                .ok_or_else(|| anyhow!("BPF object has no program `{program_name}`"))?
                .try_into()?;
            program
                .load()
                .with_context(|| format!("loading `{program_name}`"))?;
            program
                .attach("sched", event)
                .with_context(|| format!("attaching to tracepoint sched/{event}"))?;
        }
        Ok(())
    }

    /// Measures the time targets flagged [`abi::TARGET_OFF_CPU`] spend off CPU: one BTF
    /// tracepoint on `sched_switch` (switch out, in the task's context, and switch in). Waits
    /// in a syscall that are not idle have their stacks taken when they begin, at most
    /// `stacks_per_cpu_per_s` a second per CPU, and keep them when they last `min_stack_ns`
    /// or longer; every other wait adds to exact totals.
    pub fn attach_off_cpu(&mut self, min_stack_ns: u64, stacks_per_cpu_per_s: u64) -> Result<()> {
        {
            let map = self.map_mut("off_cpu_config")?;
            let mut config: aya::maps::Array<_, u64> = aya::maps::Array::try_from(map)?;
            config
                .set(0, min_stack_ns, 0)
                .context("setting the off-CPU stack threshold")?;
            config
                .set(1, stacks_per_cpu_per_s, 0)
                .context("setting the off-CPU stack rate")?;
        }
        let btf = Btf::from_sys_fs().context("reading the kernel's BTF (/sys/kernel/btf/vmlinux)")?;
        let program: &mut BtfTracePoint = self
            .ebpf
            .program_mut("on_switch")
            .ok_or_else(|| anyhow!("BPF object has no program `on_switch`"))?
            .try_into()?;
        program
            .load("sched_switch", &btf)
            .context("loading `on_switch` (task storage needs Linux 5.11 or newer)")?;
        program
            .attach()
            .context("attaching to the sched_switch BTF tracepoint")?;
        Ok(())
    }

    /// Loads the wait sampler, which [`Self::start_wait_sampling`] runs once per tick, sampling
    /// every thread of the profiled processes that is off CPU; nothing runs between ticks. Its
    /// passes visit the targets' threads alone where the kernel has the kfuncs for it (Linux
    /// 6.7), and every thread of the host through task iterators otherwise (Linux 5.18,
    /// bpf_copy_from_user_task).
    pub fn attach_wait_sampler(&mut self) -> Result<()> {
        let forced = std::env::var_os(WAIT_PASSES_ENV).is_some_and(|value| value == "iterators");
        let targets = if forced {
            Err(anyhow!("{WAIT_PASSES_ENV}=iterators"))
        } else {
            wait_targets::TargetPasses::load(&self.ebpf)
        };
        let passes = match targets {
            Ok(passes) => {
                info!("the off-CPU sampler visits the profiled processes' threads at each tick");
                wait_sampler::Passes::Targets(passes)
            }
            Err(error) => {
                info!("the off-CPU sampler visits every thread of the host at each tick: {error:#}");
                let btf = Btf::from_sys_fs().context("reading the kernel's BTF (/sys/kernel/btf/vmlinux)")?;
                wait_sampler::Passes::Iterators {
                    first: self.attach_task_iterator("sample_waits", &btf)?,
                    second: self.attach_task_iterator("sample_wait_stacks", &btf)?,
                }
            }
        };
        let map = self
            .ebpf
            .take_map("wait_sample_config")
            .ok_or_else(|| missing_map("wait_sample_config"))?;
        let mut config: aya::maps::Array<MapData, u64> = aya::maps::Array::try_from(map)?;
        config
            .set(1, WAIT_STACKS_PER_TICK, 0)
            .context("setting the wait samples' stack budget")?;
        self.wait_sampler = Some(wait_sampler::WaitSampler {
            passes,
            config,
            exact_beside: false,
        });
        Ok(())
    }

    /// With the exact tracer attached too (`--off-cpu=both`): each run of the wait sampler also
    /// adds where the tracer has every target thread as the run reaches it, read with
    /// [`Self::exact_at_runs_totals`].
    pub fn measure_exact_at_wait_runs(&mut self) {
        if let Some(sampler) = self.wait_sampler.as_mut() {
            sampler.exact_beside = true;
        }
    }

    /// Loads and attaches the sleepable task iterator `name` of the wait sampler.
    fn attach_task_iterator(&mut self, name: &str, btf: &Btf) -> Result<iter::IterLink> {
        let program: &mut aya::programs::Iter = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("BPF object has no program `{name}`"))?
            .try_into()?;
        program.load("task", btf).with_context(|| {
            format!(
                "loading the wait sampler `{name}` on {} (sleepable task iterators and \
                 bpf_copy_from_user_task need Linux 5.18 or newer)",
                running_kernel(read_kernel_release().as_deref())
            )
        })?;
        let fd = program
            .fd()
            .with_context(|| format!("the wait sampler's program descriptor `{name}`"))?;
        iter::IterLink::attach(fd.as_fd())
            .with_context(|| format!("attaching the wait sampler's task iterator `{name}`"))
    }

    /// Starts the wait sampler, when it is attached, on its own thread at `frequency_hz` (the
    /// on-CPU sampling frequency, so that on- and off-CPU samples weigh alike); it stops when
    /// the returned handle is dropped.
    pub fn start_wait_sampling(&mut self, frequency_hz: u64) -> Result<Option<WaitSampling>> {
        self.wait_sampler
            .take()
            .map(|sampler| sampler.start(frequency_hz))
            .transpose()
    }

    /// Sampled off-CPU time counted without a stack (idle and client waits), per (process,
    /// class, wait event, queryid, state): ticks × their weight.
    pub fn wait_sample_totals(&self) -> Result<Vec<(OffCpuKey, OffCpuTotal)>> {
        self.totals_of("wait_sample_totals")
    }

    /// Under `--off-cpu=both`: the exact tracer's state at the wait sampler's runs, per
    /// (process, class, wait event, queryid, state), weighted like the samples.
    pub fn exact_at_runs_totals(&self) -> Result<Vec<(OffCpuKey, OffCpuTotal)>> {
        self.totals_of("exact_at_runs")
    }

    /// Drops sampled totals of processes that exited (read for the last time).
    pub fn remove_wait_sample_totals(&mut self, keys: &[OffCpuKey]) -> Result<()> {
        self.remove_totals_of("wait_sample_totals", keys)
    }

    /// Off-CPU time of waits without a stack, per (process, class, wait event, queryid, state).
    pub fn off_cpu_totals(&self) -> Result<Vec<(OffCpuKey, OffCpuTotal)>> {
        self.totals_of("off_cpu_totals")
    }

    fn totals_of(&self, map: &str) -> Result<Vec<(OffCpuKey, OffCpuTotal)>> {
        self.sum_per_cpu_hash(map, |per_cpu: &[OffCpuTotal]| {
            per_cpu
                .iter()
                .fold(OffCpuTotal::default(), |sum, cpu| OffCpuTotal {
                    ns: sum.ns + cpu.ns,
                    waits: sum.waits + cpu.waits,
                })
        })
    }

    /// Drops the totals of processes that exited (read for the last time): the map is bounded
    /// and backends come and go.
    pub fn remove_off_cpu_totals(&mut self, keys: &[OffCpuKey]) -> Result<()> {
        self.remove_totals_of("off_cpu_totals", keys)
    }

    fn remove_totals_of(&mut self, map: &str, keys: &[OffCpuKey]) -> Result<()> {
        let mut map: PerCpuHashMap<_, OffCpuKey, OffCpuTotal> = PerCpuHashMap::try_from(self.map_mut(map)?)?;
        for key in keys {
            // Gone already is fine: the goal is that it is gone.
            let _ = map.remove(key);
        }
        Ok(())
    }

    /// Adds a process to the in-kernel filter.
    pub fn add_target(&mut self, tgid: u32, flags: u8) -> Result<()> {
        let map = self.map_mut("targets")?;
        let mut targets: BpfHashMap<_, u32, u8> = BpfHashMap::try_from(map)?;
        targets
            .insert(tgid, flags, 0)
            .with_context(|| format!("adding PID {tgid} to the target map"))?;
        self.bump_targets_generation()
    }

    /// Removes a process from the in-kernel filter.
    pub fn remove_target(&mut self, tgid: u32) -> Result<()> {
        let map = self.map_mut("targets")?;
        let mut targets: BpfHashMap<_, u32, u8> = BpfHashMap::try_from(map)?;
        targets
            .remove(&tgid)
            .with_context(|| format!("removing PID {tgid} from the target map"))?;
        // Its layout too: the exit of a process that is no longer a target removes nothing.
        let mut layouts: BpfHashMap<_, u32, PgLayout> = BpfHashMap::try_from(self.map_mut("pg_layouts")?)?;
        let _ = layouts.remove(&tgid);
        self.bump_targets_generation()
    }

    /// Makes every thread's cached "measured off CPU or not" be decided again at its next
    /// switch. User space is the only writer (a read-modify-write is safe).
    fn bump_targets_generation(&mut self) -> Result<()> {
        let mut generation: aya::maps::Array<_, u32> =
            aya::maps::Array::try_from(self.map_mut("targets_generation")?)?;
        let current = generation.get(&0, 0).context("reading the targets' generation")?;
        generation
            .set(0, current.wrapping_add(1), 0)
            .context("bumping the targets' generation")
    }

    /// Every process in the in-kernel filter: the traced backend, or an instance's postmaster
    /// and every child followed so far.
    pub fn target_pids(&self) -> Result<Vec<u32>> {
        let map = self.map("targets")?;
        if let Some(pids) = batch_keys::hash_keys::<u32>(map_fd::map_fd(map), size_of::<u8>())
            .context("listing the target map")?
        {
            return Ok(pids);
        }
        let targets: BpfHashMap<_, u32, u8> = BpfHashMap::try_from(map)?;
        targets
            .keys()
            .collect::<Result<Vec<u32>, _>>()
            .context("listing the target map")
    }

    /// Tells the sampler where process `tgid` keeps its pg_stat_activity state.
    pub fn set_layout(&mut self, tgid: u32, layout: PgLayout) -> Result<()> {
        let map = self.map_mut("pg_layouts")?;
        let mut layouts: BpfHashMap<_, u32, PgLayout> = BpfHashMap::try_from(map)?;
        layouts
            .insert(tgid, layout, 0)
            .with_context(|| format!("setting the layout of PID {tgid}"))
    }

    /// Attaches the entry and return probes of `function`, whose first instruction is at
    /// `file_offset` in the ELF file `target`, for every process that maps the file: the target
    /// map keeps the others out. `args` says where its values are among its arguments, in the
    /// major of the Postgres that file belongs to (`VersionTable::probe_args`). The links can be
    /// detached and the probe attached again (the duty cycle does).
    pub fn attach_function(
        &mut self,
        function: Function,
        args: ProbeArgs,
        target: &Path,
        file_offset: u64,
    ) -> Result<FunctionLinks> {
        self.wait_for_detached();
        // A gate counts calls only from the moment both programs are attached until detaching
        // starts: detaching takes a grace period during which returns would still be counted
        // while the duty cycle already credits the time as detached.
        let gate = match self.free_gates.pop() {
            Some(gate) => gate,
            None if self.next_gate < PROBE_SLOTS => {
                self.next_gate += 1;
                self.next_gate - 1
            }
            None => 0,
        };
        // Slot 0 reads no argument: a function that needs some is not attached without a slot.
        if gate == 0 && !function.argument_fields().is_empty() {
            anyhow::bail!(
                "all {} probe slots are taken (probes attached and not detached), and `{}` needs \
                 one for where its arguments are",
                PROBE_SLOTS - 1,
                function.name()
            );
        }
        let attached = self.set_probe_args(gate, args).and_then(|()| {
            self.attach_with_cookie(
                u64::from(function.id()) | (u64::from(gate) << 32),
                function.name(),
                target,
                file_offset,
            )
        });
        let mut links = match attached {
            Ok(links) => links,
            Err(error) => {
                if gate != 0 {
                    self.free_gates.push(gate);
                }
                return Err(error);
            }
        };
        links.gate = gate;
        self.set_gate(gate, true)?;
        Ok(links)
    }

    /// Where the entry program of the attachment in `slot` reads its values; written before it
    /// is attached, so that its first call reads them where this major has them.
    fn set_probe_args(&mut self, slot: u32, args: ProbeArgs) -> Result<()> {
        if slot == 0 {
            return Ok(());
        }
        let mut positions: aya::maps::Array<_, ProbeArgs> =
            aya::maps::Array::try_from(self.map_mut("probe_args")?)?;
        positions
            .set(slot, args, 0)
            .context("setting where a function probe reads its arguments")
    }

    fn set_gate(&mut self, gate: u32, open: bool) -> Result<()> {
        if gate == 0 {
            return Ok(());
        }
        let mut gates: aya::maps::Array<_, u32> =
            aya::maps::Array::try_from(self.map_mut("function_gates")?)?;
        gates
            .set(gate, u32::from(open), 0)
            .context("switching a function probe's gate")
    }

    /// Attaches the function-probe programs to a function of no [`Function`] (its statistics
    /// are ignored): for measuring what one probe hit costs.
    pub fn attach_calibration(&mut self, target: &Path, file_offset: u64) -> Result<FunctionLinks> {
        self.attach_with_cookie(
            CALIBRATION_COOKIE,
            "the calibration function",
            target,
            file_offset,
        )
    }

    /// Attaches do-nothing entry and return programs to a function: the floor cost of a probed
    /// call.
    pub fn attach_empty(&mut self, target: &Path, file_offset: u64) -> Result<FunctionLinks> {
        let mut attach = |name: &str| -> Result<UProbeLinkId> {
            let program = self.function_program(name)?;
            Ok(program.attach(
                UProbeAttachLocation::AbsoluteOffset(file_offset),
                target,
                UProbeScope::AllProcesses,
            )?)
        };
        let entry = attach(EMPTY_PROGRAMS[0])?;
        let exit = attach(EMPTY_PROGRAMS[1])?;
        Ok(FunctionLinks { entry, exit, gate: 0 })
    }

    /// Detaches what [`OnCpuProbes::attach_empty`] attached.
    pub fn detach_empty(&mut self, links: FunctionLinks) -> Result<()> {
        self.function_program(EMPTY_PROGRAMS[1])?.detach(links.exit)?;
        self.function_program(EMPTY_PROGRAMS[0])?.detach(links.entry)?;
        Ok(())
    }

    /// Loads the trigger probes' programs (the verifier's work, a tenth of a second), so that
    /// attaching them later is quick; [`OnCpuProbes::attach_trigger_probes`] loads them too.
    pub fn load_trigger_programs(&mut self) -> Result<()> {
        for name in TRIGGER_PROGRAMS {
            self.function_program(name)?;
        }
        Ok(())
    }

    /// Attaches the trigger probes to the functions at `start` and `end` (file offsets of their
    /// first instructions) in `target`.
    pub fn attach_trigger_probes(&mut self, target: &Path, start: u64, end: u64) -> Result<TriggerLinks> {
        self.wait_for_detached();
        let mut attach = |name: &str, offset: u64| -> Result<UProbeLinkId> {
            let program = self.function_program(name)?;
            program
                .attach(
                    UProbeAttachLocation::AbsoluteOffset(offset),
                    target,
                    UProbeScope::AllProcesses,
                )
                .with_context(|| format!("attaching `{name}` in `{}`", target.display()))
        };
        let start = attach(TRIGGER_PROGRAMS[0], start)?;
        match attach(TRIGGER_PROGRAMS[1], end) {
            Ok(end) => Ok(TriggerLinks { start, end }),
            Err(error) => {
                // Leave nothing half attached.
                let _ = self
                    .function_program(TRIGGER_PROGRAMS[0])
                    .and_then(|p| Ok(p.detach(start)?));
                Err(error)
            }
        }
    }

    /// Detaches the trigger probes on a thread of their own, at the end of a trace: the threads'
    /// triggers are not forgotten, as nothing reads them again.
    pub fn detach_trigger_probes_in_background(&mut self, links: TriggerLinks) -> Result<()> {
        self.detach_pair_in_background(TRIGGER_PROGRAMS, (links.end, links.start), 0)
    }

    /// Detaches the trigger probes, then forgets every thread's triggers: calls that end
    /// while they are detached are not seen ending, and a frame kept would name later samples.
    pub fn detach_trigger_probes(&mut self, links: TriggerLinks) -> Result<()> {
        self.function_program(TRIGGER_PROGRAMS[1])?.detach(links.end)?;
        self.function_program(TRIGGER_PROGRAMS[0])?.detach(links.start)?;
        let mut stacks: BpfHashMap<_, u32, TriggerStack> =
            BpfHashMap::try_from(self.map_mut("trigger_stacks")?)?;
        let threads: Vec<u32> = stacks.keys().filter_map(Result::ok).collect();
        for tid in threads {
            let _ = stacks.remove(&tid);
        }
        Ok(())
    }

    fn attach_with_cookie(
        &mut self,
        cookie: u64,
        name: &str,
        target: &Path,
        file_offset: u64,
    ) -> Result<FunctionLinks> {
        let mut links = Vec::with_capacity(2);
        for program_name in FUNCTION_PROGRAMS {
            let program = self.function_program(program_name)?;
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(file_offset),
                cookie: Some(cookie),
            };
            match program.attach(point, target, UProbeScope::AllProcesses) {
                Ok(link) => links.push(link),
                Err(error) => {
                    // Leave nothing half attached.
                    for (name, link) in FUNCTION_PROGRAMS.into_iter().zip(links) {
                        let _ = self.function_program(name).and_then(|p| Ok(p.detach(link)?));
                    }
                    return Err(anyhow!(error)
                        .context(format!("attaching a probe to `{name}` in `{}`", target.display())));
                }
            }
        }
        let mut links = links.into_iter();
        match (links.next(), links.next()) {
            (Some(entry), Some(exit)) => Ok(FunctionLinks { entry, exit, gate: 0 }),
            _ => Err(anyhow!("attaching `{name}` produced no links")),
        }
    }

    /// Detaches a function's probes (calls in flight are simply not counted). The return probe
    /// goes first: detaching takes a grace period, and a return probe left alone would fire for
    /// calls whose entry was no longer recorded.
    pub fn detach_function(&mut self, links: FunctionLinks) -> Result<()> {
        self.set_gate(links.gate, false)?;
        self.function_program(FUNCTION_PROGRAMS[1])?.detach(links.exit)?;
        self.function_program(FUNCTION_PROGRAMS[0])?.detach(links.entry)?;
        if links.gate != 0 {
            self.free_gates.push(links.gate);
        }
        Ok(())
    }

    /// Like [`OnCpuProbes::detach_function`], returning as soon as the function's calls stop
    /// counting: the links detach on a thread of their own while the caller goes on, and are
    /// waited for when these probes are dropped.
    pub fn detach_function_in_background(&mut self, links: FunctionLinks) -> Result<()> {
        self.set_gate(links.gate, false)?;
        self.detach_pair_in_background(FUNCTION_PROGRAMS, (links.exit, links.entry), links.gate)
    }

    /// Takes the links of `programs` (entry, return) out of them, return link first, and drops
    /// them in that order on one thread: the kernel unregisters uprobes one at a time anyway.
    /// `gate` is handed out again once they are gone.
    fn detach_pair_in_background(
        &mut self,
        programs: [&str; 2],
        (exit, entry): (UProbeLinkId, UProbeLinkId),
        gate: u32,
    ) -> Result<()> {
        let exit = self.function_program(programs[1])?.take_link(exit)?;
        let entry = self.function_program(programs[0])?.take_link(entry)?;
        // A tuple drops its fields in order: the return probe first, as detach_function does.
        self.detaching.push((Detaching::start((exit, entry)), gate));
        Ok(())
    }

    /// Waits for the links detaching in the background to be gone. Registering a uprobe waits
    /// while another is being unregistered: a probe's return half attached a tenth of a second
    /// after its entry half, and the three probes of a trace a tenth of a second apart, put
    /// their counts 3% apart (tests/tests/function_probes.rs).
    fn wait_for_detached(&mut self) {
        for (detaching, gate) in std::mem::take(&mut self.detaching) {
            drop(detaching);
            if gate != 0 {
                self.free_gates.push(gate);
            }
        }
    }

    fn function_program(&mut self, name: &str) -> Result<&mut UProbe> {
        let program: &mut UProbe = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("BPF object has no program `{name}`"))?
            .try_into()?;
        if program.fd().is_err() {
            program.load().with_context(|| format!("loading `{name}`"))?;
        }
        Ok(program)
    }

    /// Entries per function by target processes since load, summed over CPUs, indexed by
    /// [`Function::id`].
    pub fn function_hits(&self) -> Result<[u64; FUNCTION_IDS]> {
        self.hits_per_function("function_hits")
    }

    /// Entries per function by processes that are not targets (other instances of the same
    /// executable): they trap as well, since a uprobe is set on the file, not on a process.
    pub fn foreign_function_hits(&self) -> Result<[u64; FUNCTION_IDS]> {
        self.hits_per_function("foreign_function_hits")
    }

    fn hits_per_function(&self, name: &str) -> Result<[u64; FUNCTION_IDS]> {
        let map = self.map(name)?;
        let array: PerCpuArray<_, u64> = PerCpuArray::try_from(map)?;
        let mut hits = [0u64; FUNCTION_IDS];
        for (id, slot) in (0u32..).zip(hits.iter_mut()) {
            *slot = array.get(&id, 0)?.iter().sum();
        }
        Ok(hits)
    }

    /// Per (backend, queryid, function) call statistics so far, summed over CPUs.
    pub fn call_stats(&self) -> Result<Vec<(CallKey, CallStats)>> {
        self.sum_per_cpu_hash("call_stats", |per_cpu: &[CallStats]| {
            let mut total = CallStats::default();
            per_cpu.iter().for_each(|cpu| total.merge(cpu));
            total
        })
    }

    /// LockRelationOid calls per (backend, queryid, relation, lock mode), summed over CPUs.
    pub fn relation_locks(&self) -> Result<Vec<(RelationLockKey, u64)>> {
        self.sum_per_cpu_hash("relation_locks", |per_cpu: &[u64]| per_cpu.iter().sum())
    }

    /// s_lock calls per (backend, queryid, call site), summed over CPUs.
    pub fn spin_sites(&self) -> Result<Vec<(SpinSiteKey, SpinSiteStats)>> {
        self.sum_per_cpu_hash("spin_sites", |per_cpu: &[SpinSiteStats]| {
            let mut total = SpinSiteStats::default();
            per_cpu.iter().for_each(|cpu| total.merge(cpu));
            total
        })
    }

    /// Drops the function-probe entries of processes that exited (read for the last time):
    /// the maps are bounded and backends come and go.
    pub fn remove_probe_entries_of(&mut self, exited: &std::collections::HashSet<u32>) -> Result<()> {
        remove_where::<CallKey, CallStats>(self.map_mut("call_stats")?, |k| exited.contains(&k.tgid))?;
        remove_where::<RelationLockKey, u64>(self.map_mut("relation_locks")?, |k| exited.contains(&k.tgid))?;
        remove_where::<SpinSiteKey, SpinSiteStats>(self.map_mut("spin_sites")?, |k| exited.contains(&k.tgid))
    }

    /// Every entry of a per-CPU hash map, its per-CPU values folded into one.
    fn sum_per_cpu_hash<K: aya::Pod, V: aya::Pod, T>(
        &self,
        name: &str,
        fold: impl Fn(&[V]) -> T,
    ) -> Result<Vec<(K, T)>> {
        let map: PerCpuHashMap<_, K, V> = PerCpuHashMap::try_from(self.map(name)?)?;
        let mut out = Vec::new();
        for entry in map.iter() {
            let (key, per_cpu) = entry.with_context(|| format!("reading `{name}`"))?;
            out.push((key, fold(&per_cpu)));
        }
        Ok(out)
    }

    fn map(&self, name: &str) -> Result<&Map> {
        self.ebpf.map(name).ok_or_else(|| missing_map(name))
    }

    fn map_mut(&mut self, name: &str) -> Result<&mut Map> {
        self.ebpf.map_mut(name).ok_or_else(|| missing_map(name))
    }

    /// Takes the sample ring buffer out of the object, for the event loop to own.
    pub fn take_samples(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map("samples")
            .ok_or_else(|| missing_map("samples"))?;
        Ok(RingBuf::try_from(map)?)
    }

    /// Counters summed over CPUs, in [`Counter::ALL`] order.
    pub fn counters(&self) -> Result<Counters> {
        let map = self.map("counters")?;
        let array: PerCpuArray<_, u64> = PerCpuArray::try_from(map)?;
        let mut totals = [0u64; Counter::ALL.len()];
        for (slot, counter) in totals.iter_mut().zip(Counter::ALL) {
            let per_cpu = array
                .get(&(counter as u32), 0)
                .with_context(|| format!("reading counter `{}`", counter.name()))?;
            *slot = per_cpu.iter().sum();
        }
        Ok(Counters(totals))
    }
}

fn missing_map(name: &str) -> anyhow::Error {
    anyhow!("BPF object has no map `{name}`: the embedded object does not match this agent")
}

/// A snapshot of the BPF-side counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters([u64; Counter::ALL.len()]);

impl Counters {
    pub fn get(&self, counter: Counter) -> u64 {
        self.0[counter as usize]
    }

    /// Counters with the given values, the others 0: for tests of what reads them.
    #[cfg(test)]
    pub fn with(values: &[(Counter, u64)]) -> Self {
        let mut counters = Counters::default();
        for &(counter, n) in values {
            counters.0[counter as usize] = n;
        }
        counters
    }

    /// Samples lost in the kernel, by reason, for the reasons that occurred.
    pub fn losses(&self) -> Vec<(Counter, u64)> {
        [
            Counter::RingbufFull,
            Counter::NoScratch,
            Counter::TargetsFull,
            Counter::WaitThreadsOver,
            Counter::ProbeNoEntry,
            Counter::ProbeMapFull,
            Counter::OffCpuMapFull,
        ]
        .into_iter()
        .map(|c| (c, self.get(c)))
        .filter(|&(_, n)| n > 0)
        .collect()
    }

    /// Samples kept with part of their stack or attribution missing, by reason.
    pub fn degradations(&self) -> Vec<(Counter, u64)> {
        self.nonzero(&[
            Counter::UserStackFault,
            Counter::UserStackLost,
            Counter::KernelStackFault,
            Counter::WaitOverBudget,
            Counter::WaitRanBeforeStack,
            Counter::WaitEventUnknown,
        ])
    }

    /// Off-CPU samples that sought a stack: sent with one, or left without (the thread ran before
    /// the copy, its wait event guessed, over the run's budget).
    pub fn off_cpu_stack_seekers(&self) -> u64 {
        [
            Counter::WaitSamples,
            Counter::WaitRanBeforeStack,
            Counter::WaitEventUnknown,
            Counter::WaitOverBudget,
        ]
        .into_iter()
        .map(|c| self.get(c))
        .sum()
    }

    /// Off-CPU samples whose whole stack was copied after the thread ran and went back into the
    /// wait the sample is of (same kind of syscall, wait event and statement).
    pub fn late_stacks(&self) -> Vec<(Counter, u64)> {
        self.nonzero(&[Counter::WaitStackAfterRun])
    }

    fn nonzero(&self, counters: &[Counter]) -> Vec<(Counter, u64)> {
        counters
            .iter()
            .map(|&c| (c, self.get(c)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Removes the entries of a per-CPU hash map whose key matches (keys only are read); keys
/// already gone are fine (the goal is that they are gone).
fn remove_where<K: aya::Pod, V: aya::Pod>(map: &mut Map, matches: impl Fn(&K) -> bool) -> Result<()> {
    let mut map: PerCpuHashMap<_, K, V> = PerCpuHashMap::try_from(map)?;
    let doomed: Vec<K> = map
        .keys()
        .filter_map(|key| key.ok())
        .filter(|key| matches(key))
        .collect();
    for key in &doomed {
        let _ = map.remove(key);
    }
    Ok(())
}

/// What pgscope says when the kernel refuses its programs: which kernel this is, and what the
/// oldest it runs on needs (the README's). Debian 11's 5.10 refused the task storage map
/// `off_cpu_tasks` (5.11) with a bare "Invalid argument", under a message that named 5.8.
fn refused(release: Option<&str>) -> String {
    format!(
        "{} refused pgscope's BPF programs; pgscope needs Linux {MIN_KERNEL} or newer (task \
         storage maps, bpf_task_pt_regs) with BTF (/sys/kernel/btf/vmlinux), and root or CAP_BPF \
         + CAP_PERFMON",
        running_kernel(release)
    )
}

/// The running kernel's release (`uname -r`), for messages that depend on it.
fn read_kernel_release() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()
}

/// `Linux <release>`, or "the kernel" when the release is unknown.
fn running_kernel(release: Option<&str>) -> String {
    match release.map(str::trim) {
        Some(release) if !release.is_empty() => format!("Linux {release}"),
        _ => "the kernel".to_owned(),
    }
}

/// The oldest kernel pgscope runs on (README, "Supported versions").
const MIN_KERNEL: &str = "5.15";

/// Every program is unloaded on a thread of its own, so that the kernel's grace periods overlap:
/// each tracepoint took 70 to 80 ms to let go of, one after another.
impl Drop for OnCpuProbes {
    fn drop(&mut self) {
        std::thread::scope(|scope| {
            for (name, program) in self.ebpf.programs_mut() {
                let spawned = std::thread::Builder::new()
                    .name("pgscope-unload".to_owned())
                    .spawn_scoped(scope, move || unload(name, program));
                if let Err(error) = spawned {
                    // Unloaded with the others when the object is dropped, in turn.
                    tracing::debug!("unloading `{name}` in turn: {error}");
                }
            }
        });
    }
}

/// Detaches `program`'s links and unloads it, for the kinds pgscope loads.
fn unload(name: &str, program: &mut aya::programs::Program) {
    use aya::programs::Program;
    let unloaded = match program {
        Program::UProbe(program) => program.unload(),
        Program::PerfEvent(program) => program.unload(),
        Program::TracePoint(program) => program.unload(),
        Program::BtfTracePoint(program) => program.unload(),
        _ => Ok(()),
    };
    if let Err(error) = unloaded {
        tracing::debug!("unloading `{name}`: {error}");
    }
}

#[cfg(test)]
mod tests {
    use super::refused;

    #[test]
    fn a_refusal_names_the_kernel_and_the_oldest_pgscope_runs_on() {
        let said = refused(Some("5.10.0-32-amd64\n"));
        assert!(
            said.starts_with(
                "Linux 5.10.0-32-amd64 refused pgscope's BPF programs; pgscope needs Linux 5.15 or newer"
            ),
            "{said}"
        );
        assert!(refused(None).starts_with("the kernel refused"));
        assert!(refused(Some(" ")).starts_with("the kernel refused"));
    }
}
