//! The per-statement table of on-CPU time: for each queryid, its samples, how they split over
//! statement phases, its hottest function, and the samples under the Postgres functions whose
//! cost has a known mechanism (spinning, locking for a cached plan, planning, index descents,
//! work deferred to commit). Computed once from the on-CPU profile's labels and frames.

use std::collections::{BTreeMap, HashMap};

use exporters::{Frame, FrameKind, HotPath, Profile, StackSample};

use super::labels::{self, SampleLabels};
use super::QueryId;
use crate::postgres::phase::Phase;
use crate::postgres::subsystems::{self, Subsystem};

/// One queryid's on-CPU samples.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatementCpu {
    pub query_id: QueryId,
    pub samples: u64,
    /// Samples per phase, in [`Phase::ALL`] order.
    pub by_phase: [u64; Phase::ALL.len()],
    /// The function most samples of this query were in (self time).
    pub hottest_function: Option<String>,
    /// The samples in [`Self::hottest_function`] itself.
    pub hottest_self: u64,
    /// The named callers it was most often reached through, nearest last (up to
    /// [`CALLERS_SHOWN`]; static functions of a stripped build skipped).
    pub hottest_callers: Vec<String>,
    /// Samples in s_lock, per caller (the frame above it).
    pub spinning: BTreeMap<String, u64>,
    /// Samples locking a relation (LockRelationOid) under GetCachedPlan.
    pub plan_locking: u64,
    /// Samples in the planner itself (`planner`, `standard_planner`): the plan phase also
    /// covers a cached plan's revalidation and locking, which is not planning.
    pub planner: u64,
    /// Samples in the planner under `GetCachedPlan`: a prepared (cached) statement planned
    /// again, at every execution when custom plans are used.
    pub replanning: u64,
    /// Samples starting B-tree index scans: `_bt_first` (descending from the root to the first
    /// leaf and reading it) and the rescan that precedes it when a scan is restarted
    /// (`btrescan`).
    pub index_descents: u64,
    /// Samples of work deferred to commit: deferred triggers and constraints, ON COMMIT
    /// actions, NOTIFY, dropped relations' files (the commit's own WAL flush is not here).
    pub deferred_to_commit: u64,
    /// Samples in foreign keys' queries of the other table (`RI_FKey_noaction_del`,
    /// `SPI_execute_snapshot`, …): above all the checks and changes a DELETE or an UPDATE of
    /// referenced rows makes in the referencing table.
    pub fk_actions: ForeignKeyActions,
    /// Samples in each trigger of the statement, by its `trigger` label (`constraint <name>`,
    /// `trigger <name>`): the triggers the samples were taken in, not a list of the table's.
    pub triggers: BTreeMap<String, u64>,
    /// Samples taken while the CPU handled one of pgscope's own probes in this statement (the
    /// breakpoint's exception, the return trampoline, the BPF program): pgscope's cost, not
    /// the statement's, so left out of every other figure here, [`Self::samples`] included.
    pub probe_traps: u64,
    /// Its hot paths: the call paths holding at least [`HOT_PATH_SHARE`] of its samples, each
    /// down to where they spread out (`exporters::hot_paths`), most samples first.
    pub hot_paths: Vec<HotPath>,
    /// Samples under each of Postgres' subsystems (`postgres::subsystems`), by its name: a
    /// sample counts once for each subsystem any of its frames belongs to.
    pub subsystems: BTreeMap<&'static str, u64>,
}

impl StatementCpu {
    /// Samples in `phase`.
    pub fn phase(&self, phase: Phase) -> u64 {
        Phase::ALL
            .iter()
            .position(|p| *p == phase)
            .map_or(0, |i| self.by_phase[i])
    }

    /// Samples outside every phase function (e.g. protocol handling around the statement).
    pub fn other(&self) -> u64 {
        self.samples - self.by_phase.iter().sum::<u64>()
    }

    /// The phase with most samples, and its share of the query's samples.
    pub fn dominant_phase(&self) -> Option<(Phase, f64)> {
        let (index, &samples) = self.by_phase.iter().enumerate().max_by_key(|(_, &n)| n)?;
        (samples > 0).then(|| (Phase::ALL[index], samples as f64 / self.samples as f64))
    }

    /// Adds one sample's weight to each subsystem its user frames belong to, once each, unless
    /// the sample is outside the work that subsystem counts (`Subsystem::except_under`).
    fn count_subsystems(&mut self, frames: &[Frame], names: &[&str], count: u64) {
        let mut seen: Vec<&'static str> = Vec::new();
        for frame in frames.iter().filter(|f| f.kind == FrameKind::User) {
            if let Some(subsystem) = subsystems::of_frame(&frame.name, frame.module.as_deref()) {
                if !seen.contains(&subsystem.name) && !subsystem.excepted(names) {
                    seen.push(subsystem.name);
                    *self.subsystems.entry(subsystem.name).or_default() += count;
                }
            }
        }
    }

    /// Samples under the subsystem `subsystem`.
    pub fn in_subsystem(&self, subsystem: &Subsystem) -> u64 {
        self.subsystems.get(subsystem.name).copied().unwrap_or(0)
    }

    /// Adds one sample's weight: its phase, its leaf, and the functions on its stack.
    fn add(&mut self, phase: Option<Phase>, names: &[&str], count: u64, leaves: &mut Leaves) {
        self.samples += count;
        if let Some(index) = phase.and_then(|phase| Phase::ALL.iter().position(|p| *p == phase)) {
            self.by_phase[index] += count;
        }
        if let Some((leaf, callers)) = names.split_last() {
            let (samples, paths) = leaves.entry(leaf.to_string()).or_default();
            *samples += count;
            // Named callers: a stripped build's `file+0x…` frames say nothing to a DBA.
            let mut nearest: Vec<String> = callers
                .iter()
                .rev()
                .filter(|c| !super::is_unnamed_frame(c))
                .take(CALLERS_SHOWN)
                .map(|c| c.to_string())
                .collect();
            nearest.reverse();
            *paths.entry(nearest).or_default() += count;
        }
        // Root first: a function's callers come before it.
        if let Some(at) = names.iter().position(|n| *n == "s_lock") {
            let caller = at.checked_sub(1).map_or("?", |c| names[c]);
            *self.spinning.entry(caller.to_string()).or_insert(0) += count;
        }
        if names.iter().any(|n| *n == "planner" || *n == "standard_planner") {
            self.planner += count;
        }
        if names
            .iter()
            .any(|n| matches!(*n, "_bt_first" | "_bt_search" | "_bt_getroot" | "btrescan"))
        {
            self.index_descents += count;
        }
        if names.iter().any(|n| {
            matches!(
                *n,
                "AfterTriggerFireDeferred"
                    | "PreCommit_on_commit_actions"
                    | "PreCommit_Notify"
                    | "smgrDoPendingDeletes"
            )
        }) {
            self.deferred_to_commit += count;
        }
        if let Some(action) = names.iter().position(|n| is_foreign_key_query(n)) {
            let below = &names[action..];
            self.fk_actions.samples += count;
            if below.contains(&"heap_getnextslot") {
                self.fk_actions.sequential += count;
            }
            if below
                .iter()
                .any(|n| matches!(*n, "index_getnext_slot" | "index_getnext_tid" | "btgettuple"))
            {
                self.fk_actions.by_index += count;
            }
        }
        if let Some(plan) = names.iter().position(|n| *n == "GetCachedPlan") {
            if names[plan..].contains(&"LockRelationOid") {
                self.plan_locking += count;
            }
            if names[plan..]
                .iter()
                .any(|n| *n == "planner" || *n == "standard_planner")
            {
                self.replanning += count;
            }
        }
    }
}

/// Samples of a statement in the foreign-key actions of the tables it changes, and how the
/// referencing table was read under them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForeignKeyActions {
    pub samples: u64,
    /// Fetching the referencing table's rows one after the other (`heap_getnextslot`, a
    /// sequential scan's). The scan's qual is evaluated outside it, so this is a part of the
    /// scan's time: it tells how the table was read, not how long.
    pub sequential: u64,
    /// Fetching them through an index (`index_getnext_slot`, `btgettuple`).
    pub by_index: u64,
}

impl ForeignKeyActions {
    /// The share of the checks' samples fetching rows one after the other from which reading
    /// the other table whole is their work: about half of them in a scan of 200000 rows
    /// (measured), few where the table has a handful of rows and the checks' time is the
    /// executor's setup, which an index would not spare.
    const SCANNING: f64 = 0.20;

    /// Whether the checks read the other table whole, as their work: sequential fetches more
    /// than indexed ones, and at least [`Self::SCANNING`] of their samples.
    pub fn scan_the_table(&self) -> bool {
        self.sequential > self.by_index && self.sequential as f64 >= Self::SCANNING * self.samples as f64
    }
}

/// The functions of a foreign key's queries of the other table. On its referenced table the
/// trigger functions (`RI_FKey_noaction_del`, …) run for each row deleted or whose key is
/// updated and query the referencing table for the rows pointing to it; but they tail-call
/// their static helpers (`ri_restrict`), so an optimized build's stacks show only the helper
/// (named from a symbol table) and the SPI call the checks make, `SPI_execute_snapshot`, which
/// only they call. The referencing side's checks (`RI_FKey_check_ins`) make it too: they query
/// the referenced key, whose unique index the constraint requires, so they read by index.
fn is_foreign_key_query(function: &str) -> bool {
    matches!(
        function,
        "SPI_execute_snapshot" | "ri_PerformCheck" | "ri_restrict" | "ri_set"
    ) || function.strip_prefix("RI_FKey_").is_some_and(|action| {
        ["noaction_", "restrict_", "cascade_", "setnull_", "setdefault_"]
            .iter()
            .any(|kind| action.starts_with(kind))
    })
}

/// Callers of a statement's hottest function shown with it.
pub const CALLERS_SHOWN: usize = 3;

/// The share of a statement's samples a call path must hold to be one of its hot paths. A
/// twentieth: the paths are few enough to read, and a path that holds a twentieth of a
/// statement's time is worth reading.
pub const HOT_PATH_SHARE: f64 = 0.05;
/// And the samples, whatever the share: fewer say nothing of where a statement spends.
pub const HOT_PATH_MIN_SAMPLES: u64 = 3;
/// Hot paths kept per statement.
pub const HOT_PATHS_KEPT: usize = 8;

/// Per leaf function: its samples, and per path of its nearest callers, theirs.
type Leaves = HashMap<String, (u64, HashMap<Vec<String>, u64>)>;

/// Whether a sample was taken while the CPU handled one of pgscope's probes: in the kernel's
/// breakpoint exception or uprobe handling (`asm_exc_int3`, `handle_swbp`,
/// `uprobe_notify_resume`, `uprobe_dispatcher`), a BPF program (`bpf_prog_…`), or the
/// single-stepped instruction's slot (`[uprobes]`). With probes on hot functions such samples are
/// a large part of a statement's (half of all, with `GetCachedPlan` and `LockRelationOid` both
/// probed); counting them as Postgres' time made shares and findings depend on the probes.
pub fn in_probe_trap(frames: &[Frame]) -> bool {
    frames.iter().any(|frame| match frame.kind {
        FrameKind::Kernel => ["uprobe", "uretprobe", "int3", "swbp", "bpf_prog"]
            .iter()
            .any(|part| frame.name.contains(part)),
        _ => &*frame.name == "[uprobes]",
    })
}

/// User frames' names, root first.
fn user_names(frames: &[Frame]) -> Vec<&str> {
    frames
        .iter()
        .filter(|f| f.kind == FrameKind::User)
        .map(|f| &*f.name)
        .collect()
}

/// Per queryid, most samples first (ties: lower queryid first). Samples without a queryid label
/// (processes with no status entry, or no attribution) are left out; queryid 0 is kept (what
/// runs before a statement's queryid is known), for the rules to leave out.
pub fn statements(profile: &Profile) -> Vec<StatementCpu> {
    let mut queries: HashMap<QueryId, (StatementCpu, Leaves)> = HashMap::new();
    let mut samples_of: HashMap<QueryId, Vec<&StackSample>> = HashMap::new();
    for sample in &profile.samples {
        let Some(query_id) = sample.query_id() else {
            continue;
        };
        let (statement, leaves) = queries.entry(query_id).or_insert_with(|| {
            (
                StatementCpu {
                    query_id,
                    ..StatementCpu::default()
                },
                HashMap::new(),
            )
        });
        if in_probe_trap(&sample.frames) {
            statement.probe_traps += sample.count;
            continue;
        }
        let names = user_names(&sample.frames);
        statement.add(sample.phase(), &names, sample.count, leaves);
        statement.count_subsystems(&sample.frames, &names, sample.count);
        samples_of.entry(query_id).or_default().push(sample);
        if let Some(trigger) = sample.label(labels::TRIGGER) {
            *statement.triggers.entry(trigger.to_string()).or_insert(0) += sample.count;
        }
    }
    let mut out: Vec<StatementCpu> = queries
        .into_values()
        // Only pgscope's own probe traps: nothing of the statement to show.
        .filter(|(statement, _)| statement.samples > 0)
        .map(|(mut statement, leaves)| {
            let hottest = leaves
                .into_iter()
                .max_by(|a, b| a.1 .0.cmp(&b.1 .0).then_with(|| b.0.cmp(&a.0)));
            if let Some((name, (samples, paths))) = hottest {
                statement.hottest_function = Some(name);
                statement.hottest_self = samples;
                statement.hottest_callers = paths
                    .into_iter()
                    .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
                    .map(|(path, _)| path)
                    .unwrap_or_default();
            }
            let min_count =
                ((statement.samples as f64 * HOT_PATH_SHARE).ceil() as u64).max(HOT_PATH_MIN_SAMPLES);
            let samples = samples_of.remove(&statement.query_id).unwrap_or_default();
            statement.hot_paths = exporters::hot_paths(samples, min_count, HOT_PATHS_KEPT);
            statement
        })
        .collect();
    out.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.query_id.cmp(&b.query_id)));
    out
}

/// Whether `function` is anywhere on the sample's stack.
pub fn has_frame(sample: &StackSample, function: &str) -> bool {
    sample.frames.iter().any(|f| &*f.name == function)
}

/// Of `query_id`'s on-CPU samples, the share with `function` anywhere on the stack; pgscope's
/// own probe traps (which show the probed function on the stack) are left out of both.
pub fn share_with_frame(profile: &Profile, query_id: QueryId, function: &str) -> f64 {
    let (mut with, mut all) = (0u64, 0u64);
    for sample in profile
        .samples
        .iter()
        .filter(|s| s.query_id() == Some(query_id) && !in_probe_trap(&s.frames))
    {
        all += sample.count;
        if has_frame(sample, function) {
            with += sample.count;
        }
    }
    if all == 0 {
        0.0
    } else {
        with as f64 / all as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{profile, sample};
    use crate::model::labels;
    use std::sync::Arc;

    #[test]
    fn groups_by_query_and_phase_with_the_hottest_leaf() {
        let mut client_read = sample(7, "run", &["main", "pq_getbyte"], 1);
        client_read.labels.retain(|(k, _)| k != labels::PHASE);
        let mut kernel = sample(7, "run", &["main", "ExecScan"], 6);
        kernel.frames.push(Frame {
            name: Arc::from("do_syscall_64"),
            kind: FrameKind::Kernel,
            module: None,
        });
        let mut unlabelled = sample(9, "run", &["main"], 50);
        unlabelled.labels.clear();
        let p = profile(vec![
            sample(7, "plan", &["main", "standard_planner"], 3),
            kernel,
            client_read,
            sample(-5, "parse", &["main", "base_yyparse"], 2),
            unlabelled,
        ]);
        let found = statements(&p);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].query_id, QueryId(7));
        assert_eq!(found[0].samples, 10);
        assert_eq!(found[0].phase(Phase::Plan), 3);
        assert_eq!(found[0].phase(Phase::Run), 6);
        assert_eq!(found[0].other(), 1);
        assert_eq!(found[0].planner, 3);
        // The leaf is the innermost user frame, kernel frames aside.
        assert_eq!(found[0].hottest_function.as_deref(), Some("ExecScan"));
        assert_eq!(found[0].dominant_phase().map(|(p, _)| p), Some(Phase::Run));
        assert_eq!(found[1].query_id, QueryId(-5));
    }

    #[test]
    fn a_family_leaves_out_the_remedy_at_work_and_the_values_plain_use() {
        let p = profile(vec![
            // A pattern tested in a sequential scan's filter, and in an index's recheck.
            sample(7, "run", &["ExecScan", "ExecQual", "textlike"], 30),
            sample(
                7,
                "run",
                &["ExecScan", "BitmapHeapNext", "ExecQual", "textlike"],
                20,
            ),
            // A document detoasted for one key, and to be sent whole to the client.
            sample(
                7,
                "run",
                &["ExecInterpExpr", "jsonb_object_field_text", "detoast_attr"],
                40,
            ),
            sample(7, "run", &["OutputFunctionCall", "jsonb_out", "detoast_attr"], 10),
        ]);
        let found = &statements(&p)[0];
        assert_eq!(found.in_subsystem(&subsystems::PATTERN_MATCHING), 30);
        assert_eq!(found.in_subsystem(&subsystems::TOAST), 40);
    }

    #[test]
    fn functions_with_a_known_cost_are_counted_where_they_sit_on_the_stack() {
        let p = profile(vec![
            sample(7, "finish", &["PostgresMain", "pgss_store", "s_lock"], 30),
            sample(
                7,
                "run",
                &[
                    "PortalStart",
                    "GetCachedPlan",
                    "AcquireExecutorLocks",
                    "LockRelationOid",
                ],
                20,
            ),
            // Locks the executor takes itself are not the plan's.
            sample(7, "run", &["PortalRun", "ExecInitNode", "LockRelationOid"], 5),
            sample(7, "run", &["PortalRun", "btrescan"], 4),
            sample(7, "commit", &["CommitTransaction", "AfterTriggerFireDeferred"], 2),
        ]);
        let found = &statements(&p)[0];
        assert_eq!(found.spinning.get("pgss_store"), Some(&30));
        assert_eq!(found.plan_locking, 20);
        assert_eq!(found.index_descents, 4);
        assert_eq!(found.deferred_to_commit, 2);
        // Each subsystem counts the samples with one of its functions on the stack.
        assert_eq!(found.in_subsystem(&subsystems::LOCK_MANAGER), 25);
        assert_eq!(found.in_subsystem(&subsystems::PG_STAT_STATEMENTS), 30);
        assert_eq!(found.in_subsystem(&subsystems::SORT), 0);
        assert!((share_with_frame(&p, QueryId(7), "LockRelationOid") - 25.0 / 61.0).abs() < 1e-9);
        assert_eq!(share_with_frame(&p, QueryId(8), "LockRelationOid"), 0.0);
    }

    #[test]
    fn samples_in_pgscopes_own_probe_traps_are_left_out_and_counted() {
        let trap = |name: &str, count| {
            let mut s = sample(7, "plan", &["main", "GetCachedPlan", "LockRelationOid"], count);
            s.frames.push(Frame {
                name: Arc::from(name),
                kind: FrameKind::Kernel,
                module: None,
            });
            s
        };
        let mut xol = sample(7, "plan", &["main", "GetCachedPlan"], 1);
        xol.frames.push(Frame {
            name: Arc::from("[uprobes]"),
            kind: FrameKind::User,
            module: None,
        });
        let p = profile(vec![
            sample(7, "plan", &["main", "GetCachedPlan", "standard_planner"], 10),
            trap("handle_swbp", 5),
            trap("uprobe_notify_resume", 3),
            trap("bpf_prog_6deef7357e7b4530_on_entry", 2),
            xol,
        ]);
        let mut p = p;
        // Only traps: nothing of the statement itself.
        let mut only_traps = sample(8, "plan", &["main", "LockRelationOid"], 4);
        only_traps.frames.push(Frame {
            name: Arc::from("asm_exc_int3"),
            kind: FrameKind::Kernel,
            module: None,
        });
        p.samples.push(only_traps);
        let found = statements(&p);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].samples, 10);
        assert_eq!(found[0].probe_traps, 11);
        assert_eq!(found[0].planner, 10);
    }
}
