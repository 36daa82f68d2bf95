//! The trigger probes of a trace (`bpf/triggers.bpf.c`): which trigger each backend runs, so
//! that samples in a trigger name it. They trap on every trigger function's call, and on every
//! call of a set-returning function too (the same functions wrap both), so their cost is held
//! to the probe budget on its own: past it they are detached for the rest of the trace, and
//! samples in triggers then keep only the nesting their stacks show.

use std::time::Duration;

use anyhow::{Context, Result};
use symbolizer::Symbolizer;
use tracing::warn;

use super::set::ProbedFile;
use crate::bpf::abi::Counter;
use crate::bpf::{OnCpuProbes, TriggerLinks};
use crate::postgres::{VersionTable, TRIGGER_CALL_END, TRIGGER_CALL_START};

/// The shortest window whose trap rate is judged: a handful of trigger calls in one 50 ms tick
/// says nothing of the rate.
const JUDGED_AFTER: Duration = Duration::from_millis(250);

/// The two functions, found in the executable and ready to attach.
pub struct LocatedTriggerProbes {
    file: ProbedFile,
    start: u64,
    end: u64,
}

impl LocatedTriggerProbes {
    /// Finds the functions in the executable of `pid`, whose major's `table` must say where
    /// a trigger call holds its trigger.
    pub fn locate(symbolizer: &mut Symbolizer, pid: u32, table: &VersionTable) -> Result<Self> {
        anyhow::ensure!(
            table.triggers.trigger_data_tag != 0,
            "pgscope does not know where PostgreSQL {} keeps a trigger call's trigger",
            table.major
        );
        let executable = super::executable_name(pid)?;
        let mut find = |name: &str| {
            symbolizer
                .find_function(pid, &executable, name)
                .with_context(|| format!("finding `{name}` in `{executable}`"))
        };
        let start = find(TRIGGER_CALL_START)?;
        let end = find(TRIGGER_CALL_END)?;
        anyhow::ensure!(
            start.path == end.path,
            "`{TRIGGER_CALL_START}` and `{TRIGGER_CALL_END}` were found in different files"
        );
        Ok(Self {
            file: ProbedFile::open(&start.path)?,
            start: start.file_offset,
            end: end.file_offset,
        })
    }
}

/// The trigger probes of a trace or of the agent's instances of one executable.
pub struct TriggerProbes {
    /// Where they attach, kept for attaching again (the agent retries after a detach).
    located: Option<LocatedTriggerProbes>,
    links: Option<TriggerLinks>,
    /// Budget as a fraction of the instance's CPU time; None: never detached for cost.
    budget: Option<f64>,
    /// What one trap costs: half a probed call's (entry and return traps) as calibrated.
    ns_per_trap: f64,
    /// The traps counter when the current window began, and the window's length.
    traps_at_window: u64,
    window: Duration,
    /// Why they were detached before the end, once they were.
    detached_because: Option<String>,
}

impl TriggerProbes {
    /// No trigger probes (the major has no layout, or they could not be found).
    pub fn none() -> Self {
        Self {
            located: None,
            links: None,
            budget: None,
            ns_per_trap: 0.0,
            traps_at_window: 0,
            window: Duration::ZERO,
            detached_because: None,
        }
    }

    /// Attaches the located functions' probes. `ns_per_hit` is a probed call's calibrated cost.
    pub fn attach(
        located: LocatedTriggerProbes,
        probes: &mut OnCpuProbes,
        budget: Option<f64>,
        ns_per_hit: f64,
    ) -> Result<Self> {
        let mut attached = Self {
            located: Some(located),
            links: None,
            budget,
            ns_per_trap: ns_per_hit / 2.0,
            traps_at_window: 0,
            window: Duration::ZERO,
            detached_because: None,
        };
        attached.attach_again(probes)?;
        Ok(attached)
    }

    /// Attaches them again where they were located (after a detach over the budget), with a
    /// new window to judge.
    pub fn attach_again(&mut self, probes: &mut OnCpuProbes) -> Result<()> {
        let Some(located) = &self.located else {
            return Ok(());
        };
        if self.links.is_some() {
            return Ok(());
        }
        self.traps_at_window = probes.counters()?.get(Counter::TriggerProbeHits);
        self.window = Duration::ZERO;
        self.links =
            Some(probes.attach_trigger_probes(&located.file.attach_path(), located.start, located.end)?);
        self.detached_because = None;
        Ok(())
    }

    /// Why they were detached before the trace ended, if they were.
    pub fn detached_because(&self) -> Option<&str> {
        self.detached_because.as_deref()
    }

    /// Advances by `elapsed`; once a window is long enough to judge, detaches the probes for
    /// good when their traps (by every process mapping the file) cost more than the budget
    /// of `instance_cpu_ns_per_s`.
    pub fn tick(&mut self, probes: &mut OnCpuProbes, elapsed: Duration, instance_cpu_ns_per_s: f64) {
        let Some(budget) = self.budget.filter(|_| self.links.is_some()) else {
            return;
        };
        self.window += elapsed;
        if self.window < JUDGED_AFTER {
            return;
        }
        let traps = match probes.counters() {
            Ok(counters) => counters.get(Counter::TriggerProbeHits),
            Err(error) => {
                warn!("cannot read the trigger probes' traps: {error:#}");
                return;
            }
        };
        let seconds = self.window.as_secs_f64();
        let cost_ns_per_s = traps.saturating_sub(self.traps_at_window) as f64 / seconds * self.ns_per_trap;
        let budget_ns_per_s = budget * instance_cpu_ns_per_s;
        self.traps_at_window = traps;
        self.window = Duration::ZERO;
        if cost_ns_per_s <= budget_ns_per_s {
            return;
        }
        let because = format!(
            "their traps cost {:.1} ms of CPU a second (trigger and set-returning function calls, \
             in every process of the executable), over the probe budget's {:.1} ms",
            cost_ns_per_s / 1e6,
            budget_ns_per_s / 1e6
        );
        self.detach(probes);
        self.detached_because = Some(because);
    }

    /// Detaches them for good at the end of a trace, on a thread of their own: the trace's
    /// results are read, and the kernel's grace periods pass while its report is written.
    pub fn detach_at_end(&mut self, probes: &mut OnCpuProbes) {
        if let Some(links) = self.links.take() {
            if let Err(error) = probes.detach_trigger_probes_in_background(links) {
                warn!("cannot detach the trigger probes: {error:#}");
            }
        }
    }

    /// Detaches them (over the budget, or an instance gone).
    pub fn detach(&mut self, probes: &mut OnCpuProbes) {
        if let Some(links) = self.links.take() {
            if let Err(error) = probes.detach_trigger_probes(links) {
                warn!("cannot detach the trigger probes: {error:#}");
            }
        }
    }
}
