//! The one model of a measurement. The front ends (`trace`, the agent) gather
//! [`Measurements`] — the on-CPU and off-CPU profiles, probe counts, spin sites, the
//! pg_stat_statements counter, the instance's settings — and [`Analysis::new`] computes the
//! tables every view reads, once: per statement (its CPU by phase and by costly function), per
//! wait and per statement's waits, and each statement's time on and off CPU. The console
//! summary, `--json`, the HTML report, the findings and the agent's exports are views of it;
//! none recomputes an analysis and none imports another view.

pub mod counts;
#[cfg(test)]
pub mod fixtures;
pub mod hot_paths;
pub mod labels;
pub mod plan_nodes;
mod query_id;
pub mod statements;
pub mod waits;
pub mod wall_clock;

use std::collections::HashMap;

use exporters::Profile;

#[cfg(test)]
pub use counts::PGSS_TEXT_ONLY;
pub use counts::{PgssEvidence, ProbeRow, SpinSiteRow};
pub use plan_nodes::{NodeFunctions, StatementPlanNodes};
pub use query_id::{shorten, QueryId};
pub use statements::StatementCpu;
pub use waits::WaitTables;
pub use wall_clock::StatementWall;

use crate::postgres::blockers::BlockerEvidence;
use crate::postgres::sql::InstanceFacts;
use labels::SampleLabels;

/// What one trace (or one agent interval) measured.
#[derive(Clone, Copy)]
pub struct Measurements<'a> {
    /// On-CPU samples with `queryid` and `phase` labels.
    pub on_cpu: &'a Profile,
    /// Off-CPU time with `wait_event` and `off_cpu` labels, when measured.
    pub off_cpu: Option<&'a Profile>,
    /// Function-probe counts per (queryid, function), estimates where duty-cycled.
    pub probes: &'a [ProbeRow],
    /// Spinlock acquisitions that spun, per call site and queryid (`--probes s_lock`).
    pub spin_sites: &'a [SpinSiteRow],
    /// pg_stat_statements' eviction counter over the measurement, when it could be read.
    pub pgss: Option<PgssEvidence>,
    /// Settings and sizes read over SQL, when pgscope could connect.
    pub instance: Option<&'a InstanceFacts>,
    /// The sessions that held others' heavyweight locks, when they were polled.
    pub blockers: Option<&'a BlockerEvidence>,
    /// The traced server's major, where known: its own descriptions of its wait events.
    pub postgres_major: Option<u32>,
}

/// Each statement's time, on CPU (samples × period) and blocked (off CPU without the client's
/// time and the sleeps it asked for), in nanoseconds.
pub type StatementTime = HashMap<QueryId, u64>;

/// The tables of one measurement, computed once.
pub struct Analysis<'a> {
    pub measured: Measurements<'a>,
    /// Per queryid, most on-CPU samples first.
    pub statements: Vec<StatementCpu>,
    /// The off-CPU tables, when off-CPU time was measured.
    pub waits: Option<WaitTables>,
    /// Per queryid, its time on and off CPU.
    pub statement_time: StatementTime,
    /// Per queryid, its wall-clock time split into CPU and each wait, largest first; empty
    /// without off-CPU time.
    pub walls: Vec<StatementWall>,
    /// Per queryid, its on-CPU samples by innermost plan node; empty unless
    /// [`Analysis::with_plan_nodes`] was given the executor's per-node functions.
    pub plan_nodes: Vec<StatementPlanNodes>,
}

impl<'a> Analysis<'a> {
    pub fn new(measured: Measurements<'a>) -> Self {
        let statements = statements::statements(measured.on_cpu);
        let waits = measured.off_cpu.map(WaitTables::from_profile);
        let period = measured.on_cpu.meta.period;
        let statement_time = statement_time(&statements, period, measured.off_cpu);
        let walls = measured
            .off_cpu
            .map(|off_cpu| wall_clock::statement_walls(&statements, period, off_cpu))
            .unwrap_or_default();
        Self {
            measured,
            statements,
            waits,
            statement_time,
            walls,
            plan_nodes: Vec::new(),
        }
    }

    /// Adds each statement's CPU by plan node type, given which functions run which node
    /// (from the symbolizer: see [`plan_nodes`]).
    pub fn with_plan_nodes(mut self, functions: &NodeFunctions) -> Self {
        self.plan_nodes = plan_nodes::plan_nodes(self.measured.on_cpu, functions);
        self
    }

    /// On-CPU samples in all.
    pub fn cpu_samples(&self) -> u64 {
        self.measured.on_cpu.total_count()
    }

    /// On-CPU samples taken inside pgscope's own probe traps (see
    /// [`statements::in_probe_trap`]): pgscope's cost, left out of the statements' figures and
    /// of [`Analysis::backend_time_ns`].
    pub fn probe_trap_samples(&self) -> u64 {
        self.measured
            .on_cpu
            .samples
            .iter()
            .filter(|s| statements::in_probe_trap(&s.frames))
            .map(|s| s.count)
            .sum()
    }

    /// The on-CPU sampling period in nanoseconds.
    pub fn period_ns(&self) -> u64 {
        self.measured.on_cpu.meta.period
    }

    /// All the time the traced processes were busy, in nanoseconds: on CPU (samples × period,
    /// without pgscope's own probe traps) and, where off-CPU time was measured, blocked, without
    /// the waits for a client (idle or within a transaction: the client's time, not the
    /// database's) and the sleeps asked for (`pg_sleep`, vacuum's cost delay).
    pub fn backend_time_ns(&self) -> u64 {
        let on_cpu = self.cpu_samples().saturating_sub(self.probe_trap_samples()) * self.period_ns();
        let blocked: u64 = self
            .measured
            .off_cpu
            .iter()
            .flat_map(|p| &p.samples)
            .filter(|s| s.is_blocked())
            .map(|s| s.count)
            .sum();
        on_cpu + blocked
    }

    /// Seconds measured.
    pub fn seconds(&self) -> f64 {
        self.measured.on_cpu.meta.duration_nanos as f64 / 1e9
    }
}

pub(crate) fn statement_time(
    statements: &[StatementCpu],
    period_ns: u64,
    off_cpu: Option<&Profile>,
) -> StatementTime {
    let mut time: StatementTime = statements
        .iter()
        .map(|s| (s.query_id, s.samples * period_ns))
        .collect();
    for sample in off_cpu.iter().flat_map(|p| &p.samples) {
        if !sample.is_blocked() {
            continue;
        }
        if let Some(query_id) = sample.query_id() {
            *time.entry(query_id).or_insert(0) += sample.count;
        }
    }
    time
}

/// Whether a frame is a function symbolization could not name (`postgres+0x5d2c90`, a static
/// function of a stripped binary).
pub fn is_unnamed_frame(name: &str) -> bool {
    name.contains("+0x")
}

#[cfg(test)]
mod tests {
    use super::fixtures::{labelled, off_cpu, profile, sample};
    use super::*;

    #[test]
    fn statement_time_adds_blocked_time_to_cpu_time_without_the_clients() {
        let on_cpu = profile(vec![sample(7, "run", &["PortalRun"], 10)]);
        let wait = |query_id: &str, wait_event: &str, class: &str, ns: u64| {
            let labels = [
                (labels::OFF_CPU, class),
                (labels::QUERY_ID, query_id),
                (labels::WAIT_EVENT, wait_event),
            ];
            labelled(&[], &labels, ns)
        };
        let off_cpu = off_cpu(vec![
            wait("7", "IO:DataFileRead", "io", 1_000),
            wait("7", "Client:ClientRead", "latch", 50_000),
            wait("8", "Lock:transactionid", "latch", 3_000),
        ]);
        let analysis = Analysis::new(Measurements {
            on_cpu: &on_cpu,
            off_cpu: Some(&off_cpu),
            probes: &[],
            spin_sites: &[],
            pgss: None,
            instance: None,
            blockers: None,
            postgres_major: None,
        });
        let period = on_cpu.meta.period;
        assert_eq!(
            analysis.statement_time.get(&QueryId(7)),
            Some(&(10 * period + 1_000))
        );
        assert_eq!(analysis.statement_time.get(&QueryId(8)), Some(&3_000));
        assert_eq!(analysis.statements[0].samples, 10);
        assert!(analysis.waits.is_some());
    }
}
