//! The collection core shared by `trace` and `agent`: samples from the ring buffer are decoded,
//! attributed to their instance, unwound and counted per instance, on CPU and off CPU. Off-CPU
//! waits that arrive in parts are put together by `wait_reassembly`.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};

use tracing::debug;

use super::instance::InstanceContext;
use super::live::LiveCounts;
use super::off_cpu::{class_of, syscall_frame, OffCpuMode, WaitWithoutStack, PREEMPTED_FRAME};
use super::settings_seen::SettingsSeen;
use super::statement_link::{Held, StatementLink};
use super::statement_read::StatementReader;
use super::wait_reassembly::{OpenPart, PendingWait, WaitReassembly};
use crate::aggregate::StackAggregator;
use crate::bpf::abi::{
    LongWaitEnd, OffCpuClass, SampleHeader, SampleRecord, WaitEnd, WaitRepeat, OFF_CPU_PENDING,
    OFF_CPU_SAMPLED,
};
use crate::bpf::OpenWait;
use crate::bpf::WaitSamplerTally;
use crate::postgres::attribution::{Attribution, LabelNames};
use exporters::{Profile, ProfileMeta};
use symbolizer::{KernelSymbols, Symbolizer, UnwoundStack, UserRegs};

/// The stacks of one instance, counted since they were last taken.
#[derive(Default)]
pub struct InstanceStacks {
    /// On-CPU samples, weight 1 each.
    pub on_cpu: StackAggregator,
    /// Off-CPU waits, weighted by nanoseconds: sampled, or traced when only the tracer runs.
    pub off_cpu: StackAggregator,
    /// The tracer's waits when the sampler runs too (`--off-cpu=both`), kept apart.
    pub off_cpu_exact: StackAggregator,
    /// With both: where the tracer had each thread at the sampler's runs, weighted like its
    /// samples (no stacks).
    pub off_cpu_exact_at_runs: StackAggregator,
}

impl InstanceStacks {
    /// Distinct stacks held, on and off CPU: what memory grows with.
    pub fn distinct(&self) -> usize {
        self.on_cpu.distinct()
            + self.off_cpu.distinct()
            + self.off_cpu_exact.distinct()
            + self.off_cpu_exact_at_runs.distinct()
    }
}

/// Where off-CPU time measured without a stack comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitSource {
    /// The wait sampler's totals (idle and client waits).
    Sampled,
    /// The context-switch tracer's totals and open waits.
    Traced,
}

/// Which stacks waits measured without a stack go to.
#[derive(Clone, Copy)]
enum WaitTarget {
    Source(WaitSource),
    /// The context-switch tracer's state at the wait sampler's runs (`--off-cpu=both`).
    ExactAtRuns,
}

/// The last wait sample sent with stacks for a thread: repeats add to it.
struct LastWait {
    root: u32,
    tgid: u32,
    attribution: Attribution,
    class: OffCpuClass,
    leaf: &'static str,
    user: UnwoundStack,
}

/// An attached instance and the stacks counted for it.
pub struct Instance {
    pub context: InstanceContext,
    pub stacks: InstanceStacks,
    /// On-CPU samples of the instance since it was added (never reset): its CPU use.
    pub on_cpu_samples: u64,
}

/// Everything that is built up while samples arrive.
pub struct Session {
    pub symbolizer: Symbolizer,
    /// Attached instances by root PID (the postmaster, or the one traced backend).
    instances: BTreeMap<u32, Instance>,
    /// Which instance a process belongs to, learnt from its parent at its first sample.
    owners: HashMap<u32, u32>,
    pub malformed: u64,
    /// Samples of processes no attached instance owns (e.g. an instance detached meanwhile).
    pub unowned: u64,
    /// Processes the symbolizer holds state for.
    live_pids: HashSet<u32>,
    /// How off-CPU time is measured (the programs that did attach).
    pub off_cpu: OffCpuMode,
    /// Per thread, its process and the last wait sample with stacks (None: it was filtered
    /// out), for the repeats that follow it; forgotten with the process.
    last_waits: HashMap<u32, (u32, Option<LastWait>)>,
    /// Repeats of wait samples that did not arrive (counted as lost).
    pub orphan_repeats: u64,
    /// What the wait sampler's thread did: its runs, their time, and the off-CPU time it could
    /// not stand for (held up between two runs longer than a sample may weigh); kept current
    /// by the collection loop.
    pub wait_sampler: WaitSamplerTally,
    /// `--queryid`: keep only samples of this query.
    query_filter: Option<i64>,
    /// On-CPU samples of other queries left out (`--queryid`).
    pub filtered_out: u64,
    /// Off-CPU records (wait samples, waits) of other queries left out (`--queryid`).
    pub filtered_out_waits: u64,
    /// Per-query and per-wait counts so far, for `trace`'s live view; the agent keeps none
    /// (they would grow with every queryid it ever sees).
    pub live: Option<LiveCounts>,
    /// Off-CPU waits whose parts come in several records.
    waits: WaitReassembly,
    /// Settings as the sampled backends ran them, per statement, for `trace`'s findings; the
    /// agent keeps none (it would grow with every queryid it ever sees).
    pub settings_seen: Option<SettingsSeen>,
    /// On-CPU samples taken before their statement reported its queryid, until it does.
    statements: StatementLink,
    /// Reads the statement a backend shows now, for the samples still held.
    statement_reader: StatementReader,
}

impl Session {
    pub fn new(
        symbolizer: Symbolizer,
        off_cpu: OffCpuMode,
        query_filter: Option<i64>,
        live: Option<LiveCounts>,
    ) -> Self {
        Self {
            symbolizer,
            instances: BTreeMap::new(),
            owners: HashMap::new(),
            malformed: 0,
            unowned: 0,
            live_pids: HashSet::new(),
            off_cpu,
            last_waits: HashMap::new(),
            orphan_repeats: 0,
            wait_sampler: WaitSamplerTally::default(),
            query_filter,
            filtered_out: 0,
            filtered_out_waits: 0,
            live,
            waits: WaitReassembly::default(),
            settings_seen: None,
            statements: StatementLink::default(),
            statement_reader: StatementReader::default(),
        }
    }

    pub fn add_instance(&mut self, context: InstanceContext) {
        let root = context.root;
        self.owners.insert(root, root);
        self.instances.insert(
            root,
            Instance {
                context,
                stacks: InstanceStacks::default(),
                on_cpu_samples: 0,
            },
        );
    }

    /// Exact off-CPU waits whose end arrived without the record of their stacks (lost in the
    /// ring buffer, or of a process no instance owns): their time is not in the profile.
    pub fn unmatched_wait_ends(&self) -> u64 {
        self.waits.unmatched_ends
    }

    /// Removes an instance (its postmaster exited) with the stacks not taken yet.
    pub fn remove_instance(&mut self, root: u32) -> Option<Instance> {
        self.owners.retain(|_, owner| *owner != root);
        self.instances.remove(&root)
    }

    pub fn instances(&self) -> impl Iterator<Item = &Instance> {
        self.instances.values()
    }

    /// Each instance's root PID first, then every process placed in it so far.
    pub fn pids_by_root(&self) -> BTreeMap<u32, Vec<u32>> {
        let mut out: BTreeMap<u32, Vec<u32>> =
            self.instances.keys().map(|&root| (root, vec![root])).collect();
        for (&pid, &root) in &self.owners {
            if pid != root {
                if let Some(pids) = out.get_mut(&root) {
                    pids.push(pid);
                }
            }
        }
        out
    }

    /// The instance a process was placed in, if it was.
    pub fn placed_in(&self, pid: u32) -> Option<u32> {
        self.owners.get(&pid).copied()
    }

    /// The one instance of a trace.
    pub fn only(&self) -> Option<&Instance> {
        self.instances.values().next()
    }

    /// The stacks of every instance, leaving empty ones in their place (the agent's upload
    /// interval), with the symbolizer that names their frames.
    pub fn take_stacks(&mut self) -> (Vec<(u32, InstanceStacks)>, &mut Symbolizer) {
        self.release_held_samples();
        let taken = self
            .instances
            .iter_mut()
            .map(|(&root, instance)| (root, std::mem::take(&mut instance.stacks)))
            .collect();
        (taken, &mut self.symbolizer)
    }

    /// The on-CPU (or off-CPU) profile of every instance together, frames named.
    pub fn profile(
        &mut self,
        off_cpu: bool,
        kernel: Option<&KernelSymbols>,
        meta: ProfileMeta,
        names: LabelNames<'_>,
    ) -> Profile {
        self.profile_of(
            |stacks| if off_cpu { &stacks.off_cpu } else { &stacks.on_cpu },
            kernel,
            meta,
            names,
        )
    }

    /// The tracer's off-CPU profile when the sampler ran too (`--off-cpu=both`).
    pub fn exact_off_cpu_profile(
        &mut self,
        kernel: Option<&KernelSymbols>,
        meta: ProfileMeta,
        names: LabelNames<'_>,
    ) -> Profile {
        self.profile_of(|stacks| &stacks.off_cpu_exact, kernel, meta, names)
    }

    /// The tracer's state at the sampler's runs when both ran (`--off-cpu=both`).
    pub fn exact_at_runs_off_cpu_profile(
        &mut self,
        kernel: Option<&KernelSymbols>,
        meta: ProfileMeta,
        names: LabelNames<'_>,
    ) -> Profile {
        self.profile_of(|stacks| &stacks.off_cpu_exact_at_runs, kernel, meta, names)
    }

    fn profile_of(
        &mut self,
        which: impl Fn(&InstanceStacks) -> &StackAggregator,
        kernel: Option<&KernelSymbols>,
        meta: ProfileMeta,
        names: LabelNames<'_>,
    ) -> Profile {
        let mut profile = Profile {
            meta: meta.clone(),
            samples: Vec::new(),
        };
        for instance in self.instances.values() {
            let stacks = which(&instance.stacks);
            let part = stacks.to_profile(&mut self.symbolizer, kernel, meta.clone(), names);
            profile.samples.extend(part.samples);
        }
        profile
    }

    /// The on-CPU stacks of the one instance of a trace (empty before one is added).
    pub fn on_cpu(&self) -> Option<&StackAggregator> {
        self.only().map(|instance| &instance.stacks.on_cpu)
    }

    /// The off-CPU stacks of the one instance of a trace (empty before one is added).
    pub fn off_cpu(&self) -> Option<&StackAggregator> {
        self.only().map(|instance| &instance.stacks.off_cpu)
    }

    /// Whether off-CPU time is measured at all.
    pub fn off_cpu_measured(&self) -> bool {
        self.off_cpu.any()
    }

    /// The stacks the tracer's waits go to: their own with the sampler running too.
    fn traced_waits(off_cpu: OffCpuMode, stacks: &mut InstanceStacks) -> &mut StackAggregator {
        match off_cpu {
            OffCpuMode::Both => &mut stacks.off_cpu_exact,
            _ => &mut stacks.off_cpu,
        }
    }

    /// The instance `tgid` belongs to: known, itself a root, or a child of a root. A process
    /// that exited before its first sample was read can only be placed when one instance is
    /// attached.
    fn owner_of(&mut self, tgid: u32) -> Option<u32> {
        if let Some(&owner) = self.owners.get(&tgid) {
            return Some(owner);
        }
        let owner = match crate::target::ProcessInfo::read(tgid) {
            Some(process) if self.instances.contains_key(&process.ppid) => Some(process.ppid),
            _ if self.instances.len() == 1 => self.instances.keys().next().copied(),
            _ => None,
        }?;
        self.owners.insert(tgid, owner);
        // Tracked like a sampled process, so that its entry goes when it exits (off-CPU totals
        // place processes that may never be sampled).
        self.live_pids.insert(tgid);
        Some(owner)
    }

    /// What the process showed at the sample, decoded; the postmaster, which Postgres calls
    /// "not initialized", is named.
    fn attribution(instance: &mut Instance, header: &SampleHeader) -> Attribution {
        let context = &mut instance.context;
        let mut attribution = match context.version {
            Some(table) => Attribution::decode(header, table, &mut context.names),
            None => Attribution::default(),
        };
        if context.postmaster() == Some(header.tgid) {
            attribution.backend_type = Some(Cow::Borrowed("postmaster"));
        }
        attribution
    }

    pub fn handle(&mut self, bytes: &[u8]) {
        if let Some(end) = WaitEnd::parse(bytes) {
            self.end_wait(end);
            return;
        }
        if let Some(end) = LongWaitEnd::parse(bytes) {
            self.end_long_wait(end);
            return;
        }
        if let Some(repeat) = WaitRepeat::parse(bytes) {
            self.repeat_wait(repeat);
            return;
        }
        let record = match SampleRecord::parse(bytes) {
            Ok(record) => record,
            Err(error) => {
                self.malformed += 1;
                debug!("dropping malformed sample: {error}");
                return;
            }
        };
        let header = record.header;
        let sampled_wait = header.off_cpu_class != 0 && header.off_cpu_flags & OFF_CPU_SAMPLED != 0;
        if sampled_wait {
            // Until it is known to be added, the thread's repeats have nothing to repeat.
            self.last_waits.insert(header.tid, (header.tgid, None));
        }
        let Some(root) = self.owner_of(header.tgid) else {
            // Not filtered but lost: its repeats are counted as such.
            self.last_waits.remove(&header.tid);
            self.unowned += 1;
            return;
        };
        let Some(instance) = self.instances.get_mut(&root) else {
            self.last_waits.remove(&header.tid);
            self.unowned += 1;
            return;
        };
        let attribution = Self::attribution(instance, &header);
        // On CPU before its statement's queryid is reported: held until it is (the filter
        // then applies to the queryid it gets).
        let before_query_id =
            header.off_cpu_class == 0 && header.statement_start != 0 && attribution.query_id == Some(0);
        if let Some(wanted) = self.query_filter.filter(|_| !before_query_id) {
            if attribution.query_id != Some(wanted) {
                match header.off_cpu_class {
                    0 => self.filtered_out += 1,
                    _ => self.filtered_out_waits += 1,
                }
                return;
            }
        }
        let regs = UserRegs {
            ip: header.user_ip,
            sp: header.user_sp,
            bp: header.user_bp,
        };
        let postmaster = instance.context.postmaster();
        let user = match postmaster {
            Some(layout_pid) => self
                .symbolizer
                .unwind_as(header.tgid, layout_pid, &regs, record.user_stack),
            None => self.symbolizer.unwind(header.tgid, &regs, record.user_stack),
        };
        self.live_pids.insert(header.tgid);
        let wait_event_type = attribution.wait_event.as_ref().map(|(kind, _)| *kind);
        match class_of(
            header.off_cpu_class,
            postmaster == Some(header.tgid),
            wait_event_type,
        ) {
            Some(class) if header.off_cpu_flags & OFF_CPU_PENDING != 0 => {
                self.waits.begin(
                    header.tid,
                    PendingWait {
                        root,
                        tgid: header.tgid,
                        start_ns: header.time_ns,
                        attribution,
                        class,
                        syscall: syscall_frame(header.off_cpu_syscall),
                        user,
                    },
                );
            }
            Some(class) if sampled_wait => {
                let leaf = match class {
                    OffCpuClass::Preempted => PREEMPTED_FRAME,
                    _ => syscall_frame(header.off_cpu_syscall),
                };
                let last = LastWait {
                    root,
                    tgid: header.tgid,
                    attribution: attribution.clone(),
                    class,
                    leaf,
                    user: user.clone(),
                };
                instance.stacks.off_cpu.add_off_cpu(
                    header.tgid,
                    attribution,
                    class,
                    leaf,
                    user,
                    header.off_cpu_ns,
                );
                self.last_waits.insert(header.tid, (header.tgid, Some(last)));
            }
            Some(class) => Self::traced_waits(self.off_cpu, &mut instance.stacks).add_off_cpu(
                header.tgid,
                attribution,
                class,
                syscall_frame(header.off_cpu_syscall),
                user,
                header.off_cpu_ns,
            ),
            None if before_query_id => {
                let held = Held {
                    root,
                    tgid: header.tgid,
                    attribution,
                    kernel: record.kernel_stack().to_vec(),
                    user,
                };
                let released = self.statements.hold(header.tid, header.statement_start, held);
                self.add_released(released);
            }
            None => {
                if let Some(query_id) = attribution.query_id.filter(|&q| q != 0) {
                    let released = self
                        .statements
                        .resolve(header.tid, header.statement_start, query_id);
                    self.add_released(released);
                }
                self.add_on_cpu(root, header.tgid, attribution, record.kernel_stack(), user);
            }
        }
    }

    /// A thread still in the wait of its last sample: the same stacks weigh one more tick.
    fn repeat_wait(&mut self, repeat: WaitRepeat) {
        let Some((_, Some(last))) = self.last_waits.get(&repeat.tid) else {
            // Filtered out (None) is not lost; never seen is.
            if !self.last_waits.contains_key(&repeat.tid) {
                self.orphan_repeats += 1;
            }
            return;
        };
        let Some(instance) = self.instances.get_mut(&last.root) else {
            self.unowned += 1;
            return;
        };
        instance.stacks.off_cpu.add_off_cpu(
            last.tgid,
            last.attribution.clone(),
            last.class,
            last.leaf,
            last.user.clone(),
            repeat.weight_ns,
        );
    }

    /// Adds one on-CPU sample to its instance's stacks, `--queryid` applied (again, for a
    /// sample that was held: it may have got its queryid since).
    fn add_on_cpu(
        &mut self,
        root: u32,
        tgid: u32,
        attribution: Attribution,
        kernel: &[u64],
        user: UnwoundStack,
    ) {
        if let Some(wanted) = self.query_filter {
            if attribution.query_id != Some(wanted) {
                self.filtered_out += 1;
                return;
            }
        }
        let Some(instance) = self.instances.get_mut(&root) else {
            self.unowned += 1;
            return;
        };
        instance.on_cpu_samples += 1;
        if let Some(live) = &mut self.live {
            live.record(&attribution);
        }
        if let (Some(seen), Some(table), Some(query_id)) = (
            &mut self.settings_seen,
            instance.context.version,
            attribution.query_id.filter(|&q| q != 0),
        ) {
            seen.record(root, tgid, query_id, table);
        }
        instance.stacks.on_cpu.add(tgid, attribution, kernel, user);
    }

    /// Adds samples that were held for their statement's queryid.
    fn add_released(&mut self, released: Vec<Held>) {
        for held in released {
            self.add_on_cpu(held.root, held.tgid, held.attribution, &held.kernel, held.user);
        }
    }

    /// Gives the samples still waiting for their statement's queryid the one their backend's
    /// status shows now, where it shows the same statement with its queryid (a backend waiting
    /// for its client after a statement too short to be sampled again); a few small reads of
    /// each waiting backend's memory. The loop calls it after each batch of samples.
    pub fn resolve_held_from_memory(&mut self) {
        if !self.holds_samples() {
            return;
        }
        let (instances, reader) = (&self.instances, &mut self.statement_reader);
        let released = self.statements.resolve_from(|tid, held| {
            // Backends are single-threaded: the thread's status is its process's.
            let table = instances.get(&held.root)?.context.version?;
            (tid == held.tgid)
                .then(|| reader.current_statement(held.root, tid, table))
                .flatten()
        });
        self.add_released(released);
    }

    /// Whether samples wait for their statement's queryid.
    pub fn holds_samples(&self) -> bool {
        !self.statements.is_empty()
    }

    /// Adds the samples still waiting for their statement's queryid as they are (queryid 0),
    /// those whose backend shows their statement's queryid now with it: before the stacks are
    /// read (the end of a trace, an agent interval).
    pub fn release_held_samples(&mut self) {
        self.resolve_held_from_memory();
        let held = self.statements.release_all();
        self.add_released(held);
    }

    /// A wait whose stacks came when it began has ended: they get its blocked time, or are
    /// dropped when it was short (the kernel counted it in the totals).
    fn end_wait(&mut self, end: WaitEnd) {
        if let Some((pending, ns)) = self.waits.end(&end) {
            self.add_pending_wait(pending, ns);
        }
    }

    /// A wait without stacks that lasted a second or more has ended: what was not shipped of
    /// it while it was open is counted like the totals' waits.
    fn end_long_wait(&mut self, end: LongWaitEnd) {
        let rest = self.waits.end_long(&end);
        if rest > 0 {
            self.add_waits_without_stack(
                std::iter::once(WaitWithoutStack {
                    tgid: end.tgid,
                    attr: end.attr,
                    ns: rest,
                    still_open: false,
                }),
                WaitSource::Traced,
            );
        }
    }

    /// Ships what grew, since it was last shipped, of every wait open for a second or more:
    /// the agent does at every upload, so that a backend blocked for minutes is in each
    /// interval's profile rather than all at once in the one its wait ends in. The end (a
    /// [`WaitEnd`] or [`LongWaitEnd`], both carrying the wait's whole time, never the totals)
    /// counts only what was not shipped.
    pub fn ship_open_waits(&mut self, open: &[OpenWait]) {
        for part in self.waits.open_parts(open) {
            match part {
                OpenPart::WithStacks(pending, ns) => self.add_pending_wait(pending, ns),
                OpenPart::WithoutStacks(wait, ns) => self.add_waits_without_stack(
                    std::iter::once(WaitWithoutStack {
                        tgid: wait.tgid,
                        attr: wait.attr,
                        ns,
                        still_open: false,
                    }),
                    WaitSource::Traced,
                ),
            }
        }
    }

    fn add_pending_wait(&mut self, pending: PendingWait, ns: u64) {
        if let Some(instance) = self.instances.get_mut(&pending.root) {
            Self::traced_waits(self.off_cpu, &mut instance.stacks).add_off_cpu(
                pending.tgid,
                pending.attribution,
                pending.class,
                pending.syscall,
                pending.user,
                ns,
            );
        }
    }

    /// Adds off-CPU time measured without a stack, labelled like any sample of its process.
    pub fn add_waits_without_stack(
        &mut self,
        waits: impl Iterator<Item = WaitWithoutStack>,
        source: WaitSource,
    ) {
        self.add_waits_to(waits, WaitTarget::Source(source));
    }

    /// Adds where the context-switch tracer had each thread at the wait sampler's runs
    /// (`--off-cpu=both`), apart from both profiles.
    pub fn add_exact_at_runs(&mut self, waits: impl Iterator<Item = WaitWithoutStack>) {
        self.add_waits_to(waits, WaitTarget::ExactAtRuns);
    }

    fn add_waits_to(&mut self, waits: impl Iterator<Item = WaitWithoutStack>, target: WaitTarget) {
        for wait in waits {
            let Some(root) = self.owner_of(wait.tgid) else {
                self.unowned += 1;
                continue;
            };
            let Some(instance) = self.instances.get_mut(&root) else {
                continue;
            };
            let postmaster = instance.context.postmaster() == Some(wait.tgid);
            let attribution =
                Self::attribution(instance, &SampleHeader::with_attribution(wait.tgid, &wait.attr));
            let wait_event_type = attribution.wait_event.as_ref().map(|(kind, _)| *kind);
            let Some(class) = class_of(wait.attr.off_cpu_class, postmaster, wait_event_type) else {
                continue;
            };
            let stacks = match target {
                WaitTarget::Source(WaitSource::Sampled) => &mut instance.stacks.off_cpu,
                WaitTarget::Source(WaitSource::Traced) => {
                    Self::traced_waits(self.off_cpu, &mut instance.stacks)
                }
                WaitTarget::ExactAtRuns => &mut instance.stacks.off_cpu_exact_at_runs,
            };
            stacks.add_without_stack(wait.tgid, attribution, Some(class), wait.frame(class), wait.ns);
        }
    }

    /// The major version attribution is decoded for (of the first instance).
    pub fn postgres_major(&self) -> Option<u32> {
        self.only()
            .and_then(|instance| instance.context.version)
            .map(|table| table.major)
    }

    /// Drops the per-process state of exited processes: PIDs are reused, and a new process must
    /// not be unwound with an old one's mappings nor named by an old one's worker type. Returns
    /// the PIDs dropped.
    pub fn forget_exited(&mut self) -> Vec<u32> {
        let exited: Vec<u32> = self
            .live_pids
            .iter()
            .copied()
            .filter(|pid| !crate::liveness::exists(*pid))
            .collect();
        for &pid in &exited {
            self.symbolizer.forget_process(pid);
            // A root keeps its entry: its late samples still belong to its instance.
            if let Some(&root) = self.owners.get(&pid).filter(|&&root| root != pid) {
                self.owners.remove(&pid);
                if let Some(instance) = self.instances.get_mut(&root) {
                    instance.context.names.forget(pid);
                }
            }
            self.live_pids.remove(&pid);
            if let Some(seen) = &mut self.settings_seen {
                seen.forget(pid);
            }
        }
        if !exited.is_empty() {
            self.waits.forget_processes(&exited);
            let gone: HashSet<u32> = exited.iter().copied().collect();
            self.last_waits.retain(|_, (tgid, _)| !gone.contains(tgid));
            let held = self.statements.release_processes(&exited);
            self.add_released(held);
        }
        exited
    }
}
