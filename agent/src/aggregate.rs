//! Counts identical stacks as they arrive, keyed by module-relative locations so that the
//! expensive part (naming frames) runs once per distinct frame at the end, and still works after
//! a backend has exited.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use crate::bpf::abi::OffCpuClass;
use crate::model::labels as label;
use crate::postgres::attribution::{Attribution, LabelNames};
use crate::postgres::phase::Phase;
use exporters::{Frame, FrameKind, Profile, ProfileMeta, StackSample};
use symbolizer::{KernelSymbols, Location, ModuleId, Symbolizer, UnwindEnd, UnwoundStack};

/// Root frame of stacks whose unwinding stopped before the process root, so that partial stacks
/// do not pose as roots of their own in a flamegraph.
pub const INCOMPLETE_STACK_FRAME: &str = "[incomplete stack]";

#[derive(Debug, Hash, PartialEq, Eq)]
struct StackKey {
    pid: u32,
    attribution: Attribution,
    /// Off-CPU stacks: why the process was off CPU.
    off_cpu: Option<OffCpuClass>,
    /// A frame standing for time measured without a stack (e.g. waits too short to get one).
    placeholder: Option<&'static str>,
    /// A kernel frame below the leaf: the syscall an off-CPU wait blocked in.
    kernel_leaf: Option<&'static str>,
    /// Leaf first.
    kernel: Box<[u64]>,
    /// Leaf first.
    user: Box<[Location]>,
    complete: bool,
}

/// How user stacks ended, over all samples.
#[derive(Clone, Copy, Debug, Default)]
pub struct UnwindStats {
    pub samples: u64,
    pub reached_root: u64,
    pub truncated: u64,
    pub no_unwind_info: u64,
    pub errors: u64,
    pub depth_limit: u64,
    pub empty: u64,
}

impl UnwindStats {
    /// Share of samples whose user stack reached the process root, in percent.
    pub fn complete_pct(&self) -> f64 {
        if self.samples == 0 {
            return 0.0;
        }
        100.0 * self.reached_root as f64 / self.samples as f64
    }

    fn record(&mut self, stack: &UnwoundStack) {
        self.samples += 1;
        if stack.frames.is_empty() {
            self.empty += 1;
            return;
        }
        match stack.end {
            UnwindEnd::ReachedRoot => self.reached_root += 1,
            UnwindEnd::StackTruncated => self.truncated += 1,
            UnwindEnd::NoUnwindInfo => self.no_unwind_info += 1,
            UnwindEnd::Error => self.errors += 1,
            UnwindEnd::DepthLimit => self.depth_limit += 1,
        }
    }
}

/// The largest weight a stack is counted with: pprof and Pyroscope hold int64. Only a corrupt
/// record reaches it (2^63 ns of off-CPU time is 292 years); it stays there rather than
/// wrapping or making the whole profile unencodable.
const WEIGHT_MAX: u64 = i64::MAX as u64;

fn add_weight(total: &mut u64, weight: u64) {
    *total = total.saturating_add(weight).min(WEIGHT_MAX);
}

/// Aggregated samples of one trace session: on-CPU samples (weight 1 each), or off-CPU waits
/// (weight: nanoseconds off CPU).
#[derive(Default)]
pub struct StackAggregator {
    stacks: HashMap<StackKey, u64>,
    stats: UnwindStats,
}

impl StackAggregator {
    pub fn add(&mut self, pid: u32, attribution: Attribution, kernel_stack: &[u64], user: UnwoundStack) {
        self.add_stack(pid, attribution, None, kernel_stack.into(), None, user, 1);
    }

    /// Adds an off-CPU wait of `weight` nanoseconds, blocked in `syscall` (shown as the leaf).
    pub fn add_off_cpu(
        &mut self,
        pid: u32,
        attribution: Attribution,
        class: OffCpuClass,
        syscall: &'static str,
        user: UnwoundStack,
        weight: u64,
    ) {
        self.add_stack(
            pid,
            attribution,
            Some(class),
            Box::new([]),
            Some(syscall),
            user,
            weight,
        );
    }

    #[allow(clippy::too_many_arguments)] // the parts of one key, each from the caller
    fn add_stack(
        &mut self,
        pid: u32,
        attribution: Attribution,
        off_cpu: Option<OffCpuClass>,
        kernel: Box<[u64]>,
        kernel_leaf: Option<&'static str>,
        user: UnwoundStack,
        weight: u64,
    ) {
        self.stats.record(&user);
        let complete = user.end == UnwindEnd::ReachedRoot && !user.frames.is_empty();
        let key = StackKey {
            pid,
            attribution,
            off_cpu,
            placeholder: None,
            kernel_leaf,
            kernel,
            user: user.frames.into_boxed_slice(),
            complete,
        };
        add_weight(self.stacks.entry(key).or_insert(0), weight);
    }

    /// Adds time measured without a stack, shown as the single frame `placeholder`.
    pub fn add_without_stack(
        &mut self,
        pid: u32,
        attribution: Attribution,
        off_cpu: Option<OffCpuClass>,
        placeholder: &'static str,
        weight: u64,
    ) {
        let key = StackKey {
            pid,
            attribution,
            off_cpu,
            placeholder: Some(placeholder),
            kernel_leaf: None,
            kernel: Box::new([]),
            user: Box::new([]),
            complete: true,
        };
        add_weight(self.stacks.entry(key).or_insert(0), weight);
    }

    /// Distinct (process, labels, stack) keys held.
    pub fn distinct(&self) -> usize {
        self.stacks.len()
    }

    pub fn stats(&self) -> UnwindStats {
        self.stats
    }

    /// Samples per queryid, most first (for fetching the texts of the busiest queries).
    pub fn query_ids(&self) -> Vec<(i64, u64)> {
        let mut counts: HashMap<i64, u64> = HashMap::new();
        for (key, &count) in &self.stacks {
            if let Some(query_id) = key.attribution.query_id.filter(|&q| q != 0) {
                add_weight(counts.entry(query_id).or_insert(0), count);
            }
        }
        let mut sorted: Vec<_> = counts.into_iter().collect();
        sorted.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        sorted
    }

    /// Per queryid (0 left out), the samples taken in each database (`MyDatabaseId`, 0 left
    /// out).
    pub fn databases_by_query(&self) -> BTreeMap<i64, BTreeMap<u32, u64>> {
        let mut out: BTreeMap<i64, BTreeMap<u32, u64>> = BTreeMap::new();
        for (key, &count) in &self.stacks {
            let attribution = &key.attribution;
            if let (Some(query_id), Some(oid)) = (
                attribution.query_id.filter(|&q| q != 0),
                attribution.database_oid.filter(|&d| d != 0),
            ) {
                add_weight(out.entry(query_id).or_default().entry(oid).or_insert(0), count);
            }
        }
        out
    }

    /// The databases samples were taken in (`MyDatabaseId`), 0 (no database) left out.
    pub fn database_oids(&self) -> HashSet<u32> {
        self.stacks
            .keys()
            .filter_map(|key| key.attribution.database_oid)
            .filter(|&oid| oid != 0)
            .collect()
    }

    /// The triggers samples ran in, by database OID: what the trigger labels need named.
    pub fn triggers_by_database(&self) -> BTreeMap<u32, BTreeSet<u32>> {
        let mut triggers: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for key in self.stacks.keys() {
            if let (Some(trigger), Some(database)) = (key.attribution.trigger, key.attribution.database_oid) {
                triggers.entry(database).or_default().insert(trigger.oid);
            }
        }
        triggers
    }

    /// Every module some sampled frame lies in.
    pub fn modules(&self) -> HashSet<ModuleId> {
        let mut modules = HashSet::new();
        for key in self.stacks.keys() {
            for location in key.user.iter() {
                if let Location::InModule { module, .. } = location {
                    modules.insert(module.clone());
                }
            }
        }
        modules
    }

    /// Names every frame and builds the profile: frames root first (user root … user leaf,
    /// then kernel entry … kernel leaf), labelled with the process id, what the backend's
    /// status showed (backend type, database, state, queryid, wait event) and the statement
    /// phase its stack runs under. Databases and triggers are named from `names` (by OID) where
    /// it has them.
    pub fn to_profile(
        &self,
        symbolizer: &mut Symbolizer,
        kernel: Option<&KernelSymbols>,
        meta: ProfileMeta,
        names: LabelNames<'_>,
    ) -> Profile {
        let incomplete: Arc<str> = Arc::from(INCOMPLETE_STACK_FRAME);
        let unknown_kernel: Arc<str> = Arc::from("[unknown]");
        let mut kernel_names: HashMap<u64, Arc<str>> = HashMap::new();
        let mut samples = Vec::with_capacity(self.stacks.len());
        for (key, &count) in &self.stacks {
            let mut frames = Vec::with_capacity(key.user.len() + key.kernel.len() + 1);
            if let Some(placeholder) = key.placeholder {
                frames.push(Frame {
                    name: Arc::from(placeholder),
                    kind: FrameKind::User,
                    module: None,
                });
            }
            if !key.complete {
                frames.push(Frame {
                    name: incomplete.clone(),
                    kind: FrameKind::User,
                    module: None,
                });
            }
            for location in key.user.iter().rev() {
                let frame = symbolizer.symbolize(location);
                frames.push(Frame {
                    name: frame.name,
                    kind: FrameKind::User,
                    module: Some(frame.module),
                });
            }
            for (depth, &addr) in key.kernel.iter().enumerate().rev() {
                // Callers' entries are return addresses: look up the call instruction.
                let lookup = if depth == 0 { addr } else { addr.saturating_sub(1) };
                let name = kernel_names
                    .entry(lookup)
                    .or_insert_with(|| match kernel.and_then(|k| k.lookup(lookup)) {
                        Some(name) => Arc::from(name),
                        None => unknown_kernel.clone(),
                    })
                    .clone();
                frames.push(Frame {
                    name,
                    kind: FrameKind::Kernel,
                    module: None,
                });
            }
            if let Some(syscall) = key.kernel_leaf {
                frames.push(Frame {
                    name: Arc::from(syscall),
                    kind: FrameKind::Kernel,
                    module: None,
                });
            }
            let mut labels = vec![(label::PID.to_string(), key.pid.to_string())];
            key.attribution.push_labels(&mut labels, names);
            if let Some(class) = key.off_cpu {
                labels.push((label::OFF_CPU.to_string(), class.name().to_string()));
            }
            let user_names = frames
                .iter()
                .filter(|f| f.kind == FrameKind::User)
                .map(|f| &*f.name);
            if let Some(phase) = Phase::of_stack(user_names) {
                labels.push((label::PHASE.to_string(), phase.label().to_string()));
            }
            labels.sort();
            samples.push(StackSample {
                frames,
                labels,
                count,
            });
        }
        Profile { meta, samples }
    }
}
