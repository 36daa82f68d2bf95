//! The agent's trigger probes (`collect::probes::triggers`): one pair per executable, shared by
//! the instances running it (a uprobe fires for all of them), so that samples in triggers carry
//! a `trigger` label in the series. Held to the probe budget like the function probes: past it
//! they are detached, and attached again after [`RETRY_AFTER`] to see whether the workload
//! changed.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::bpf::OnCpuProbes;
use crate::collect::probes::{executable_file, LocatedTriggerProbes, TriggerProbes};
use crate::collect::Session;
use crate::postgres;

/// How long trigger probes detached over the budget stay detached.
const RETRY_AFTER: Duration = Duration::from_secs(600);

/// The instances running one executable, and its trigger probes.
struct Group {
    /// Device and inode of the executable (see the function probes' groups).
    file: (u64, u64),
    executable: String,
    probes: TriggerProbes,
    roots: HashSet<u32>,
    /// When they were detached over the budget, until attached again.
    detached_at: Option<Instant>,
}

pub struct AgentTriggerProbes {
    /// None: never detached for their cost.
    budget: Option<f64>,
    groups: Vec<Group>,
}

impl AgentTriggerProbes {
    pub fn new(budget: Option<f64>) -> Self {
        Self {
            budget,
            groups: Vec::new(),
        }
    }

    /// Attaches the trigger probes to a new instance's executable, or counts it in the group
    /// already attached there. An instance whose triggers cannot be named is still profiled;
    /// the reason is logged.
    /// `ns_per_hit` is a probed call's calibrated cost (the function probes' calibration).
    pub fn add_instance(
        &mut self,
        probes: &mut OnCpuProbes,
        session: &mut Session,
        root: u32,
        ns_per_hit: f64,
    ) {
        let file = match executable_file(root) {
            Ok(file) => file,
            Err(error) => {
                warn!(
                    postmaster = root,
                    "triggers will not be named: cannot stat its executable: {error}"
                );
                return;
            }
        };
        if let Some(group) = self.groups.iter_mut().find(|g| g.file == file) {
            group.roots.insert(root);
            return;
        }
        let located = postgres::detect_major(root)
            .and_then(postgres::table_for)
            .and_then(|table| LocatedTriggerProbes::locate(&mut session.symbolizer, root, table));
        let attached =
            located.and_then(|located| TriggerProbes::attach(located, probes, self.budget, ns_per_hit));
        let trigger_probes = match attached {
            Ok(trigger_probes) => trigger_probes,
            Err(error) => {
                warn!(postmaster = root, "triggers will not be named: {error:#}");
                return;
            }
        };
        let exe = format!("/proc/{root}/exe");
        let executable = std::fs::read_link(&exe)
            .map(|p| p.display().to_string())
            .unwrap_or(exe);
        info!(postmaster = root, executable, "trigger probes attached");
        self.groups.push(Group {
            file,
            executable,
            probes: trigger_probes,
            roots: HashSet::from([root]),
            detached_at: None,
        });
    }

    /// The instance is gone: the last instance of an executable takes its probes with it.
    pub fn remove_instance(&mut self, probes: &mut OnCpuProbes, root: u32) {
        let Some(index) = self.groups.iter().position(|g| g.roots.contains(&root)) else {
            return;
        };
        self.groups[index].roots.remove(&root);
        if self.groups[index].roots.is_empty() {
            let mut group = self.groups.remove(index);
            group.probes.detach(probes);
        }
    }

    /// Judges each group's cost against the budget of its instances' CPU (`cpu_of`, ns per
    /// second), and attaches again the probes detached long enough ago.
    pub fn tick(&mut self, probes: &mut OnCpuProbes, elapsed: Duration, cpu_of: impl Fn(u32) -> f64) {
        for group in &mut self.groups {
            if let Some(at) = group.detached_at {
                if at.elapsed() >= RETRY_AFTER {
                    match group.probes.attach_again(probes) {
                        Ok(()) => group.detached_at = None,
                        Err(error) => {
                            warn!(executable = %group.executable, "cannot attach the trigger probes again: {error:#}");
                            group.detached_at = Some(Instant::now());
                        }
                    }
                }
                continue;
            }
            let cpu: f64 = group.roots.iter().map(|&root| cpu_of(root)).sum();
            group.probes.tick(probes, elapsed, cpu);
            if let Some(because) = group.probes.detached_because() {
                info!(
                    executable = %group.executable,
                    retry_in = ?RETRY_AFTER,
                    "trigger probes detached: {because}"
                );
                group.detached_at = Some(Instant::now());
            }
        }
    }

    /// Detaches everything (the agent stops).
    pub fn detach_all(&mut self, probes: &mut OnCpuProbes) {
        for mut group in self.groups.drain(..) {
            group.probes.detach(probes);
        }
    }
}
