//! The agent's function probes: one uprobe per (file, offset) whatever the number of instances
//! running that file, a duty cycle per file shared by its instances (the uprobe fires for all
//! of them), and per upload interval the calls and time per (instance, function, queryid),
//! scaled up when the duty cycle left the probe detached part of the interval.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::config::AgentConfig;
use super::probe_estimates::{delta, estimate_interval, Estimate, EstimateKey};
use super::trigger_probes::AgentTriggerProbes;
use crate::bpf::abi::{CallKey, Function, ProbedCall, FUNCTION_IDS};
use crate::bpf::OnCpuProbes;
use crate::collect::probes::nested::corrected_total_ns;
use crate::collect::probes::statement_clock::CounterLayout;
use crate::collect::probes::{
    calibrate, executable_file, parse_probe_list, IntervalShares, PidsByRoot, ProbeSet, ProbeState,
};
use crate::collect::Session;
use crate::model::QueryId;
use crate::postgres;
use exporters::{Frame, FrameKind, Profile, ProfileMeta, StackSample};

/// The instances running one executable, and the probes in it (and its libraries).
struct Group {
    /// Device and inode of the executable: the same file seen through different paths (a
    /// container's root) is one group.
    file: (u64, u64),
    executable: String,
    set: ProbeSet,
    roots: HashSet<u32>,
}

/// How often /proc is scanned for the backends of instances whose statement clock has not
/// found its array (every duty tick would scan it 20 times a second, for ever if an instance's
/// clock never finds it).
const CHILDREN_SCAN_EVERY: Duration = Duration::from_secs(1);

/// One probed function's calls in one instance for one queryid, over an interval (estimated
/// when the duty cycle detached the probe part of the time).
#[derive(Clone, Debug, PartialEq)]
pub struct CallRow {
    pub call: ProbedCall,
    pub query_id: i64,
    pub calls: u64,
    pub total_ns: u64,
}

/// What /metrics shows of the probes.
#[derive(Clone, Debug, Default)]
pub struct ProbeMetrics {
    /// Entries per function since the agent started (probe hits while attached).
    pub hits: Vec<(&'static str, u64)>,
    /// Entries per function by processes that are not profiled, since the agent started.
    pub foreign_hits: Vec<(&'static str, u64)>,
    /// Per executable: the shared duty cycle and each probe's state.
    pub groups: Vec<(String, f64, Vec<ProbeState>)>,
    /// Measured calls not attributed to an instance (their process exited unplaced).
    pub calls_dropped: u64,
}

pub struct AgentProbes {
    functions: Vec<Function>,
    /// None: every call measured.
    budget: Option<f64>,
    /// Measured once, when the first group is attached.
    ns_per_hit: Option<f64>,
    groups: Vec<Group>,
    /// Per (process, function, queryid): the kernel's cumulative counts at the last read.
    last: HashMap<CallKey, (u64, u64)>,
    /// Calls of processes that exited before a sample placed them in an instance, since the
    /// start: counted, not attributed.
    calls_dropped: u64,
    /// Per (instance, function, queryid): the rates of the recent intervals.
    estimates: BTreeMap<EstimateKey, Estimate>,
    /// Per instance: on-CPU samples at the last second and the CPU it used (ns per second).
    cpu: HashMap<u32, (u64, f64)>,
    frequency_hz: u64,
    /// When /proc was last scanned for children (see [`CHILDREN_SCAN_EVERY`]).
    children_scanned: Option<Instant>,
    placed: Placements,
    /// The trigger probes, attached whether or not functions are probed.
    triggers: AgentTriggerProbes,
}

/// The instance of every process the session placed, as of the last duty tick. The session
/// forgets a process within a second of its exit, while its calls since the last read are
/// still to be sent at the next upload: placed from here, they are not lost (a backend's last
/// interval, up to a whole upload interval of its calls).
#[derive(Debug, Default)]
struct Placements(HashMap<u32, u32>);

impl Placements {
    fn remember(&mut self, pids: &PidsByRoot) {
        for (&root, list) in pids {
            self.0.extend(list.iter().map(|&pid| (pid, root)));
        }
    }

    /// The instance of `pid`: the session's placement `by_session` if it still has one.
    fn root_of(&self, pid: u32, by_session: Option<u32>) -> Option<u32> {
        by_session.or_else(|| self.0.get(&pid).copied())
    }

    /// After a read: processes the session no longer knows have nothing left to send.
    fn forget_unless(&mut self, known: impl Fn(u32) -> bool) {
        self.0.retain(|&pid, _| known(pid));
    }
}

impl AgentProbes {
    pub fn new(config: &AgentConfig) -> Self {
        // Validated with the configuration: an unknown name never gets here.
        let functions = parse_probe_list(&config.probes.functions).unwrap_or_default();
        let budget = Some(config.probes.budget).filter(|&b| b > 0.0);
        Self {
            functions,
            budget,
            ns_per_hit: None,
            groups: Vec::new(),
            last: HashMap::new(),
            calls_dropped: 0,
            estimates: BTreeMap::new(),
            cpu: HashMap::new(),
            frequency_hz: config.collection.frequency,
            children_scanned: None,
            placed: Placements::default(),
            triggers: AgentTriggerProbes::new(budget),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.functions.is_empty()
    }

    /// Probes a new instance: joins the group of its executable, or attaches the probes in it.
    /// An instance whose functions cannot be probed (unsupported major, stripped library) is
    /// still profiled; the reason is logged.
    pub fn add_instance(
        &mut self,
        probes: &mut OnCpuProbes,
        session: &mut Session,
        root: u32,
        layout: Option<CounterLayout>,
    ) {
        let ns_per_hit = self.calibrated(probes);
        self.triggers.add_instance(probes, session, root, ns_per_hit);
        if !self.enabled() {
            return;
        }
        // The table of the instance's major places the arguments the probes read.
        let table = match postgres::detect_major(root).and_then(postgres::table_for) {
            Ok(table) => table,
            Err(error) => {
                warn!(
                    postmaster = root,
                    "function probes not attached to this instance: {error:#}; probes are tested on PostgreSQL {:?}",
                    postgres::SUPPORTED_MAJORS
                );
                return;
            }
        };
        let exe = format!("/proc/{root}/exe");
        let file = match executable_file(root) {
            Ok(file) => file,
            Err(error) => {
                warn!(
                    postmaster = root,
                    "function probes not attached: cannot stat {exe}: {error}"
                );
                return;
            }
        };
        // The statement clock finds the instance's status array through any process that has
        // a slot (the checkpointer always does): with its children listed now, it counts from
        // the first duty-cycle window on, whose calls then get a per-statement rate.
        let mut pids = session.pids_by_root();
        pids.entry(root)
            .or_default()
            .extend(crate::target::children_of(root).into_iter().map(|c| c.pid));
        if let Some(group) = self.groups.iter_mut().find(|g| g.file == file) {
            group.roots.insert(root);
            if let Some(layout) = layout {
                group.set.count_statements(root, layout, &pids);
            }
            info!(postmaster = root, executable = %group.executable, "function probes shared with the instances of the same executable");
            return;
        }
        let set = match ProbeSet::attach(
            probes,
            &mut session.symbolizer,
            &self.functions,
            &[],
            root,
            table,
            self.budget,
            ns_per_hit,
        ) {
            Ok(set) => set,
            Err(error) => {
                warn!(postmaster = root, "function probes not attached: {error:#}");
                return;
            }
        };
        let executable = std::fs::read_link(&exe)
            .map(|p| p.display().to_string())
            .unwrap_or(exe);
        info!(
            postmaster = root,
            executable,
            attached = ?set.functions().iter().map(|f| f.name()).collect::<Vec<_>>(),
            "function probes attached"
        );
        let mut group = Group {
            file,
            executable,
            set,
            roots: HashSet::from([root]),
        };
        if let Some(layout) = layout {
            group.set.count_statements(root, layout, &pids);
        }
        self.groups.push(group);
    }

    /// What one probed call costs, measured once for the function and the trigger probes.
    fn calibrated(&mut self, probes: &mut OnCpuProbes) -> f64 {
        *self.ns_per_hit.get_or_insert_with(|| {
            calibrate::measure_ns_per_hit(probes).unwrap_or_else(|error| {
                warn!(
                    "cannot measure the cost of a probe hit, assuming {} ns: {error:#}",
                    calibrate::FALLBACK_NS_PER_HIT
                );
                calibrate::FALLBACK_NS_PER_HIT
            })
        })
    }

    /// The instance is gone: its statements stop counting; the last instance of an
    /// executable takes its probes with it.
    pub fn remove_instance(&mut self, probes: &mut OnCpuProbes, session: &Session, root: u32) {
        self.triggers.remove_instance(probes, root);
        self.cpu.remove(&root);
        let Some(index) = self.groups.iter().position(|g| g.roots.contains(&root)) else {
            return;
        };
        let group = &mut self.groups[index];
        group.roots.remove(&root);
        group.set.forget_instance(root);
        if group.roots.is_empty() {
            let mut group = self.groups.remove(index);
            if let Err(error) = group.set.detach_all(probes, &session.pids_by_root()) {
                warn!(executable = %group.executable, "cannot detach the function probes: {error:#}");
            }
        }
    }

    /// Once a second: each instance's CPU use, from its on-CPU samples (the budget's base).
    pub fn measure_cpu(&mut self, session: &Session, elapsed: Duration) {
        for instance in session.instances() {
            let root = instance.context.root;
            // A new instance is taken to use one CPU until a whole second is measured: its
            // first call would measure no time at all, and budget nothing.
            let Some(entry) = self.cpu.get_mut(&root) else {
                self.cpu.insert(root, (instance.on_cpu_samples, 1e9));
                continue;
            };
            let samples = instance.on_cpu_samples.saturating_sub(entry.0);
            entry.0 = instance.on_cpu_samples;
            let seconds = elapsed.as_secs_f64().max(1e-3);
            entry.1 = samples as f64 / seconds / self.frequency_hz.max(1) as f64 * 1e9;
        }
    }

    /// The session's processes per instance, plus, at most once a second, for instances whose
    /// statement clock still needs a backend to find its array, their children as /proc lists
    /// them (no sample may have placed a backend yet).
    fn pids_for_clocks(&mut self, session: &Session) -> PidsByRoot {
        let mut pids = session.pids_by_root();
        if self
            .children_scanned
            .is_some_and(|at| at.elapsed() < CHILDREN_SCAN_EVERY)
        {
            return pids;
        }
        self.children_scanned = Some(Instant::now());
        for root in self.groups.iter().flat_map(|g| g.set.clocks_not_counting()) {
            if let Some(list) = pids.get_mut(&root) {
                list.extend(crate::target::children_of(root).into_iter().map(|c| c.pid));
            }
        }
        pids
    }

    /// Advances every group's duty cycle, and judges the trigger probes' cost.
    pub fn tick(&mut self, probes: &mut OnCpuProbes, session: &Session, elapsed: Duration) {
        let cpu = &self.cpu;
        self.triggers
            .tick(probes, elapsed, |root| cpu.get(&root).map_or(1e9, |c| c.1));
        if self.groups.is_empty() {
            return;
        }
        let pids = self.pids_for_clocks(session);
        self.placed.remember(&pids);
        for group in &mut self.groups {
            let cpu: f64 = group
                .roots
                .iter()
                .map(|root| self.cpu.get(root).map_or(1e9, |c| c.1))
                .sum();
            if let Err(error) = group.set.tick(probes, elapsed, cpu, &pids) {
                warn!(executable = %group.executable, "duty-cycling the function probes: {error:#}");
            }
        }
    }

    /// The calls of the interval per instance (root PID), estimated (see [`Estimate`]);
    /// entries of processes that exited are dropped from the kernel's maps.
    pub fn take_interval(
        &mut self,
        probes: &mut OnCpuProbes,
        session: &Session,
    ) -> BTreeMap<u32, Vec<CallRow>> {
        if self.groups.is_empty() {
            return BTreeMap::new();
        }
        let pids = self.pids_for_clocks(session);
        let shares: Vec<(HashSet<u32>, IntervalShares)> = self
            .groups
            .iter_mut()
            .map(|g| (g.roots.clone(), g.set.take_interval(&pids)))
            .collect();
        let calls = match probes.call_stats() {
            Ok(calls) => calls,
            Err(error) => {
                warn!("cannot read the function probes' counts: {error:#}");
                return BTreeMap::new();
            }
        };
        let now = Instant::now();
        let ns_per_hit = self.ns_per_hit.unwrap_or(calibrate::FALLBACK_NS_PER_HIT);
        let mut exited = HashSet::new();
        // Each backend's calls since the last read, summed per (instance, call, queryid).
        let mut measured: BTreeMap<EstimateKey, (u64, u64)> = BTreeMap::new();
        for (key, mut stats) in calls {
            // The function's own time: the traps of the probed calls it made are not its cost.
            // Both counts are cumulative, so the interval's delta is corrected too.
            stats.total_ns = corrected_total_ns(&stats, ns_per_hit);
            if !crate::liveness::exists(key.tgid) {
                exited.insert(key.tgid);
            }
            let root = self.placed.root_of(key.tgid, session.placed_in(key.tgid));
            let (Some(root), Some(call)) = (root, ProbedCall::from_key(&key)) else {
                // Kept in the kernel's map while the process lives (it may be placed later:
                // the counts are cumulative), lost once it has exited.
                if exited.contains(&key.tgid) {
                    let (calls, _) = delta(self.last.entry(key).or_default(), &stats);
                    self.calls_dropped += calls;
                }
                continue;
            };
            let (calls, ns) = delta(self.last.entry(key).or_default(), &stats);
            let slot = measured
                .entry((root, call, key.query_id as i64))
                .or_insert((0, 0));
            slot.0 += calls;
            slot.1 += ns;
        }
        let share_of = |root: u32, function: Function| {
            shares
                .iter()
                .find(|(roots, _)| roots.contains(&root))
                .and_then(|(_, s)| s.get(function, root))
        };
        let out = estimate_interval(&mut self.estimates, &measured, share_of, now);
        if !exited.is_empty() {
            if let Err(error) = probes.remove_probe_entries_of(&exited) {
                warn!("cannot drop the probe counts of exited processes: {error:#}");
            }
            self.last.retain(|key, _| !exited.contains(&key.tgid));
        }
        self.placed.forget_unless(|pid| session.placed_in(pid).is_some());
        out.into_iter()
            .map(|(root, rows)| {
                let rows = rows
                    .into_iter()
                    .map(|((call, query_id), (calls, total_ns))| CallRow {
                        call,
                        query_id,
                        calls,
                        total_ns,
                    })
                    .collect();
                (root, rows)
            })
            .collect()
    }

    pub fn metrics(&self, probes: &OnCpuProbes) -> ProbeMetrics {
        if !self.enabled() {
            return ProbeMetrics::default();
        }
        // The seven and the functions probed by name, by id.
        let per_function = |hits: anyhow::Result<[u64; FUNCTION_IDS]>| {
            hits.map(|hits| {
                (0u32..)
                    .zip(hits)
                    .filter_map(|(id, hits)| Some((Function::from_cookie(id)?.name(), hits)))
                    .collect()
            })
            .unwrap_or_default()
        };
        ProbeMetrics {
            hits: per_function(probes.function_hits()),
            foreign_hits: per_function(probes.foreign_function_hits()),
            groups: self
                .groups
                .iter()
                .map(|g| (g.executable.clone(), g.set.duty(), g.set.states()))
                .collect(),
            calls_dropped: self.calls_dropped,
        }
    }

    /// Detaches everything (the agent stops).
    pub fn detach_all(&mut self, probes: &mut OnCpuProbes, session: &Session) {
        self.triggers.detach_all(probes);
        let pids = session.pids_by_root();
        for mut group in self.groups.drain(..) {
            if let Err(error) = group.set.detach_all(probes, &pids) {
                warn!(executable = %group.executable, "cannot detach the function probes: {error:#}");
            }
        }
    }
}

/// The interval's probe counts as two profiles: `pg_function_calls` (calls) and
/// `pg_function_time` (nanoseconds in the function), one frame per function, labelled with
/// the queryid.
pub fn profiles(rows: &[CallRow], start: u64, end: u64) -> Vec<(&'static str, Profile)> {
    if rows.is_empty() {
        return Vec::new();
    }
    let duration = end.saturating_sub(start);
    let meta = |sample_type: &str, unit: &str| ProfileMeta {
        sample_type: sample_type.to_string(),
        unit: unit.to_string(),
        period_type: sample_type.to_string(),
        period_unit: unit.to_string(),
        period: 1,
        start_unix_nanos: start,
        duration_nanos: duration,
    };
    let sample = |row: &CallRow, count: u64| StackSample {
        frames: vec![Frame {
            name: Arc::from(row.call.label()),
            kind: FrameKind::User,
            module: None,
        }],
        labels: match row.query_id {
            0 => Vec::new(),
            id => vec![(QueryId::LABEL.to_string(), id.to_string())],
        },
        count,
    };
    vec![
        (
            "pg_function_calls",
            Profile {
                meta: meta("calls", "count"),
                samples: rows.iter().map(|r| sample(r, r.calls)).collect(),
            },
        ),
        (
            "pg_function_time",
            Profile {
                meta: meta("time", "nanoseconds"),
                samples: rows.iter().map(|r| sample(r, r.total_ns)).collect(),
            },
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_rows_become_calls_and_time_profiles_labelled_by_queryid() {
        let rows = vec![
            CallRow {
                call: ProbedCall {
                    function: Function::PgssStore,
                    detail: 3,
                },
                query_id: -42,
                calls: 10,
                total_ns: 5000,
            },
            CallRow {
                call: ProbedCall {
                    function: Function::PortalStart,
                    detail: 0,
                },
                query_id: 0,
                calls: 3,
                total_ns: 900,
            },
        ];
        let profiles = profiles(&rows, 100, 200);
        let (name, calls) = &profiles[0];
        assert_eq!(*name, "pg_function_calls");
        assert_eq!(calls.meta.sample_type, "calls");
        assert_eq!(calls.total_count(), 13);
        assert_eq!(&*calls.samples[0].frames[0].name, "pgss_store(exec)");
        assert_eq!(
            calls.samples[0].labels,
            vec![("queryid".to_string(), "-42".to_string())]
        );
        assert!(calls.samples[1].labels.is_empty(), "no queryid: no label");
        let (name, time) = &profiles[1];
        assert_eq!(*name, "pg_function_time");
        assert_eq!(
            (time.meta.unit.as_str(), time.total_count()),
            ("nanoseconds", 5900)
        );
        assert!(profiles_is_empty_without_rows());
    }

    #[test]
    fn a_backend_stays_placed_until_its_counts_are_read_after_the_session_forgot_it() {
        let mut placed = Placements::default();
        placed.remember(&PidsByRoot::from([(7, vec![7, 100]), (8, vec![8, 200])]));
        // Exited and forgotten by the session: still in its instance for the next read.
        assert_eq!(placed.root_of(100, None), Some(7));
        // The session's placement wins (a PID reused meanwhile).
        assert_eq!(placed.root_of(200, Some(9)), Some(9));
        assert_eq!(placed.root_of(300, None), None);
        // Read: the session knows only 7, 8 and 200 now.
        placed.forget_unless(|pid| [7, 8, 200].contains(&pid));
        assert_eq!(placed.root_of(100, None), None);
        assert_eq!(placed.root_of(200, None), Some(8));
    }

    fn profiles_is_empty_without_rows() -> bool {
        profiles(&[], 0, 1).is_empty()
    }
}
