//! Each statement's on-CPU time by plan node type: a plan-shaped profile without EXPLAIN
//! ANALYZE. A sample belongs to the innermost executor node on its stack (the node whose
//! per-node function, `ExecHashJoin`, `ExecSort`, `MultiExecHash`, … is nearest the leaf), so
//! a node's share is the time spent in that node itself and in what it calls outside other
//! nodes (its expressions, its tuple reads), not in its child nodes. A node of a statement
//! nested in it (a trigger's or a function's query) is named with what nests it
//! ([`node_of_stack`]).
//!
//! Which functions are per-node functions comes from the symbolizer, which derives them from
//! the exported `ExecInit<Node>` functions that install them (named there even on a stripped
//! build); helpers such as `ExecScan` or `ExecProcNode` are no node type.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use exporters::{FrameKind, Profile, StackSample};

use super::labels::{self, SampleLabels};
use super::QueryId;

/// Per-node function name (`ExecHashJoin`) → its plan node type (`HashJoin`).
pub type NodeFunctions = BTreeMap<Arc<str>, Arc<str>>;

/// The executor's entry points. The first call of them on a stack is the statement's own
/// execution; one reached again from below other code (a trigger, a function, SPI) is a nested
/// statement's.
const EXECUTOR_ENTRIES: &[&str] = &[
    "ExecutorStart",
    "standard_ExecutorStart",
    "ExecutorRun",
    "standard_ExecutorRun",
    "ExecutorFinish",
    "standard_ExecutorFinish",
    "ExecutorEnd",
    "standard_ExecutorEnd",
];

/// Functions through which Postgres fires triggers, by the kind they fire.
const AFTER_TRIGGER_FIRING: &[&str] = &["AfterTriggerEndQuery", "AfterTriggerFireDeferred"];
const BEFORE_TRIGGER_FIRING: &[&str] = &[
    "ExecBRInsertTriggers",
    "ExecBRUpdateTriggers",
    "ExecBRDeleteTriggers",
    "ExecIRInsertTriggers",
    "ExecIRUpdateTriggers",
    "ExecIRDeleteTriggers",
    "ExecBSInsertTriggers",
    "ExecBSUpdateTriggers",
    "ExecBSDeleteTriggers",
];

/// The plan node a stack (user frames, root first) is in, named as the statement sees it:
/// the innermost node of its own plan (`SeqScan`), or, for a node of a statement nested in it,
/// that node with what nests it (`SeqScan (in an AFTER trigger)`, `… (in a BEFORE trigger)`,
/// `… (in a function)`), and the trigger by name when the sample's `trigger` label has it
/// (`SeqScan (in the AFTER trigger for constraint fk_child_parent_id_fkey)`). A DELETE whose
/// foreign key's trigger scans the referencing table is then not shown as that scan, which its
/// own plan does not have.
fn node_of_stack(
    user_root_first: &[&str],
    nodes: &[Option<Arc<str>>],
    trigger: Option<&str>,
) -> Option<Arc<str>> {
    let mut seen_own_call = false;
    let mut in_entry_call = false;
    let mut nested_at = None;
    for (index, name) in user_root_first.iter().enumerate() {
        if EXECUTOR_ENTRIES.contains(name) {
            if !seen_own_call {
                seen_own_call = true;
                in_entry_call = true;
            } else if !in_entry_call {
                nested_at = Some(index);
                break;
            }
        } else if !super::is_unnamed_frame(name) {
            in_entry_call = false;
        }
    }
    let innermost = |frames: &[Option<Arc<str>>]| frames.iter().rev().find_map(Clone::clone);
    let Some(nested_at) = nested_at else {
        return innermost(nodes);
    };
    let Some(node) = innermost(&nodes[nested_at..]) else {
        return innermost(&nodes[..nested_at]);
    };
    let nesting = &user_root_first[..nested_at];
    let kind = if nesting.iter().any(|f| AFTER_TRIGGER_FIRING.contains(f)) {
        Some("AFTER")
    } else if nesting.iter().any(|f| BEFORE_TRIGGER_FIRING.contains(f)) {
        Some("BEFORE")
    } else {
        None
    };
    let nester = match (kind, trigger) {
        (Some(kind), Some(trigger)) => match trigger.strip_prefix("trigger ") {
            Some(name) => format!("the {kind} trigger {name}"),
            None => format!("the {kind} trigger for {trigger}"),
        },
        (Some(kind), None) => format!("{} {kind} trigger", if kind == "AFTER" { "an" } else { "a" }),
        (None, _) => "a function".to_string(),
    };
    Some(Arc::from(format!("{node} (in {nester})")))
}

/// The exported helper every scan node's function tail-calls (`return ExecScan(&node->ss,
/// SeqNext, SeqRecheck);`): the scan's own frame is gone, and while `ExecScan` evaluates the
/// scan's qual and projection its access method (`SeqNext`) is not on the stack either.
const EXEC_SCAN: &str = "ExecScan";

/// Which scan node each `ExecScan` call site is, learnt from one statement's samples: the
/// frames above an `ExecScan` (the plan above the scan) → the scan node types its access
/// methods below it named there. A plan has one node at one place, so an `ExecScan` evaluating
/// a qual at a place where only `SeqNext` was ever seen below is that SeqScan's.
#[derive(Default)]
struct ScanSites(HashMap<String, BTreeSet<Arc<str>>>);

impl ScanSites {
    fn learn(&mut self, user_root_first: &[&str], functions: &NodeFunctions) {
        let Some(at) = user_root_first.iter().rposition(|f| *f == EXEC_SCAN) else {
            return;
        };
        if let Some(node) = user_root_first[at + 1..].iter().find_map(|f| functions.get(*f)) {
            self.0
                .entry(user_root_first[..at].join(";"))
                .or_default()
                .insert(node.clone());
        }
    }

    /// The plan node of each frame: a node function's, and for the innermost `ExecScan` with
    /// no node below it, the one scan node type seen at its place (none if several were).
    fn nodes_of(&self, user_root_first: &[&str], functions: &NodeFunctions) -> Vec<Option<Arc<str>>> {
        let mut nodes: Vec<Option<Arc<str>>> = user_root_first
            .iter()
            .map(|f| functions.get(*f).cloned())
            .collect();
        if let Some(at) = user_root_first.iter().rposition(|f| *f == EXEC_SCAN) {
            if nodes[at + 1..].iter().all(Option::is_none) {
                let seen = self.0.get(&user_root_first[..at].join(";"));
                if let Some(only) = seen.filter(|types| types.len() == 1).and_then(|t| t.first()) {
                    nodes[at] = Some(only.clone());
                }
            }
        }
        nodes
    }
}

/// One statement's on-CPU samples split by the innermost plan node on the stack.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatementPlanNodes {
    pub query_id: QueryId,
    /// All of the statement's on-CPU samples.
    pub samples: u64,
    /// Samples per plan node type, most first (ties: by name).
    pub by_node: Vec<(String, u64)>,
}

impl StatementPlanNodes {
    /// Samples with no executor node on the stack (parsing, planning, commit, client I/O).
    pub fn outside_nodes(&self) -> u64 {
        self.samples - self.by_node.iter().map(|(_, n)| n).sum::<u64>()
    }

    /// `samples` as a share of the statement's samples, in percent.
    pub fn pct(&self, samples: u64) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            100.0 * samples as f64 / self.samples as f64
        }
    }
}

/// A sample's user frames, root first.
fn user_frames(sample: &StackSample) -> Vec<&str> {
    sample
        .frames
        .iter()
        .filter(|f| f.kind == FrameKind::User)
        .map(|f| &*f.name)
        .collect()
}

/// Per queryid (most samples first, ties by queryid), its samples by innermost plan node.
/// Statements none of whose samples ran in a plan node are left out; so are samples without a
/// queryid label.
pub fn plan_nodes(profile: &Profile, functions: &NodeFunctions) -> Vec<StatementPlanNodes> {
    if functions.is_empty() {
        return Vec::new();
    }
    let mut scan_sites: HashMap<QueryId, ScanSites> = HashMap::new();
    for sample in &profile.samples {
        if let Some(query_id) = sample.query_id() {
            scan_sites
                .entry(query_id)
                .or_default()
                .learn(&user_frames(sample), functions);
        }
    }
    let mut by_query: HashMap<QueryId, (u64, HashMap<Arc<str>, u64>)> = HashMap::new();
    for sample in &profile.samples {
        let Some(query_id) = sample.query_id() else {
            continue;
        };
        let (samples, nodes) = by_query.entry(query_id).or_default();
        *samples += sample.count;
        let user = user_frames(sample);
        let frame_nodes = scan_sites
            .get(&query_id)
            .map(|sites| sites.nodes_of(&user, functions))
            .unwrap_or_default();
        if let Some(node) = node_of_stack(&user, &frame_nodes, sample.label(labels::TRIGGER)) {
            *nodes.entry(node).or_insert(0) += sample.count;
        }
    }
    let mut out: Vec<StatementPlanNodes> = by_query
        .into_iter()
        .filter(|(_, (_, nodes))| !nodes.is_empty())
        .map(|(query_id, (samples, nodes))| {
            let mut by_node: Vec<(String, u64)> =
                nodes.into_iter().map(|(node, n)| (node.to_string(), n)).collect();
            by_node.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            StatementPlanNodes {
                query_id,
                samples,
                by_node,
            }
        })
        .collect();
    out.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.query_id.cmp(&b.query_id)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{profile, sample};

    fn functions() -> NodeFunctions {
        [
            ("ExecHashJoin", "HashJoin"),
            ("MultiExecHash", "Hash"),
            ("ExecSeqScan", "SeqScan"),
            ("ExecSort", "Sort"),
        ]
        .into_iter()
        .map(|(f, n)| (Arc::from(f), Arc::from(n)))
        .collect()
    }

    #[test]
    fn each_sample_goes_to_its_innermost_node() {
        let p = profile(vec![
            // The scan under the join: the scan's.
            sample(
                7,
                "run",
                &[
                    "PortalRun",
                    "ExecSort",
                    "ExecHashJoin",
                    "ExecSeqScan",
                    "heapgettup",
                ],
                5,
            ),
            // Building the hash table: Hash, not the join above it.
            sample(
                7,
                "run",
                &[
                    "PortalRun",
                    "ExecSort",
                    "ExecHashJoin",
                    "MultiExecHash",
                    "ExecScan",
                ],
                3,
            ),
            // Probing: the join's own work, through a helper that is no node.
            sample(
                7,
                "run",
                &["PortalRun", "ExecSort", "ExecHashJoin", "ExecScanHashBucket"],
                4,
            ),
            sample(7, "run", &["PortalRun", "ExecSort", "tuplesort_gettuple"], 2),
            sample(7, "plan", &["PortalStart", "standard_planner"], 6),
            // A statement that never reached a node is left out.
            sample(8, "parse", &["exec_simple_query", "raw_parser"], 9),
        ]);
        let found = plan_nodes(&p, &functions());
        assert_eq!(found.len(), 1);
        let statement = &found[0];
        assert_eq!(statement.query_id, QueryId(7));
        assert_eq!(statement.samples, 20);
        let by_node: Vec<(&str, u64)> = statement.by_node.iter().map(|(n, s)| (n.as_str(), *s)).collect();
        assert_eq!(
            by_node,
            vec![("SeqScan", 5), ("HashJoin", 4), ("Hash", 3), ("Sort", 2)]
        );
        assert_eq!(statement.outside_nodes(), 6);
        assert!((statement.pct(5) - 25.0).abs() < 1e-9);
    }

    #[test]
    fn a_nested_statements_nodes_are_shown_under_what_nests_them() {
        let functions: NodeFunctions = [
            ("ExecModifyTable", "ModifyTable"),
            ("ExecIndexScan", "IndexScan"),
            ("ExecSeqScan", "SeqScan"),
            ("ExecLockRows", "LockRows"),
            ("ExecResult", "Result"),
        ]
        .into_iter()
        .map(|(f, n)| (Arc::from(f), Arc::from(n)))
        .collect();
        let node = |stack: &[&str]| {
            node_of_stack(stack, &ScanSites::default().nodes_of(stack, &functions), None)
                .map(|n| n.to_string())
        };
        let named = |stack: &[&str], trigger: &str| {
            node_of_stack(
                stack,
                &ScanSites::default().nodes_of(stack, &functions),
                Some(trigger),
            )
            .map(|n| n.to_string())
        };
        // A DELETE's foreign-key check, fired when the statement finishes.
        let trigger = [
            "PortalRun",
            "postgres+0x47c300",
            "ExecutorFinish",
            "pg_stat_statements.so+0x4a10",
            "standard_ExecutorFinish",
            "AfterTriggerEndQuery",
            "postgres+0x2b0000",
            "SPI_execute_snapshot",
            "ExecutorRun",
            "standard_ExecutorRun",
            "ExecLockRows",
            "ExecSeqScan",
            "heapgettup",
        ];
        assert_eq!(node(&trigger).as_deref(), Some("SeqScan (in an AFTER trigger)"));
        assert_eq!(
            named(&trigger, "constraint fk_child_parent_id_fkey").as_deref(),
            Some("SeqScan (in the AFTER trigger for constraint fk_child_parent_id_fkey)")
        );
        assert_eq!(
            named(&trigger, "trigger audit").as_deref(),
            Some("SeqScan (in the AFTER trigger audit)")
        );
        // The DELETE's own plan, with pg_stat_statements' hook between the two entries.
        let own = [
            "PortalRun",
            "ExecutorRun",
            "pg_stat_statements.so+0x4a10",
            "standard_ExecutorRun",
            "ExecModifyTable",
            "ExecIndexScan",
        ];
        assert_eq!(node(&own).as_deref(), Some("IndexScan"));
        // A SQL function in a select list, and a nested statement that has reached no node.
        let function = [
            "PortalRun",
            "standard_ExecutorRun",
            "ExecResult",
            "fmgr_sql",
            "standard_ExecutorRun",
            "ExecSeqScan",
        ];
        assert_eq!(node(&function).as_deref(), Some("SeqScan (in a function)"));
        let starting = [
            "PortalRun",
            "standard_ExecutorRun",
            "ExecResult",
            "fmgr_sql",
            "ExecutorStart",
        ];
        assert_eq!(node(&starting).as_deref(), Some("Result"));
    }

    #[test]
    fn a_scans_qual_is_credited_to_the_scan_seen_at_its_place() {
        let functions: NodeFunctions = [
            ("SeqNext", "SeqScan"),
            ("IndexNext", "IndexScan"),
            ("ExecHashJoin", "HashJoin"),
        ]
        .into_iter()
        .map(|(f, n)| (Arc::from(f), Arc::from(n)))
        .collect();
        let p = profile(vec![
            // A filtered seq scan: reading a tuple, then evaluating the qual.
            sample(
                7,
                "run",
                &["PortalRun", "ExecutePlan", "ExecScan", "SeqNext", "heapgettup"],
                2,
            ),
            sample(
                7,
                "run",
                &["PortalRun", "ExecutePlan", "ExecScan", "postgres+0x2ff300"],
                8,
            ),
            // A join of two scans: its outer side's qual is known, its inner side is an index
            // scan at another place.
            sample(
                8,
                "run",
                &["PortalRun", "ExecutePlan", "ExecHashJoin", "ExecScan", "SeqNext"],
                1,
            ),
            sample(
                8,
                "run",
                &[
                    "PortalRun",
                    "ExecutePlan",
                    "ExecHashJoin",
                    "ExecScan",
                    "postgres+0x2ff300",
                ],
                3,
            ),
            // Where two scan types were seen at one place, the qual stays unattributed.
            sample(9, "run", &["PortalRun", "ExecScan", "SeqNext"], 1),
            sample(9, "run", &["PortalRun", "ExecScan", "IndexNext"], 1),
            sample(9, "run", &["PortalRun", "ExecScan", "postgres+0x2ff300"], 5),
        ]);
        let found = plan_nodes(&p, &functions);
        let of = |query_id: i64| -> Vec<(String, u64)> {
            found
                .iter()
                .find(|s| s.query_id == QueryId(query_id))
                .map(|s| s.by_node.clone())
                .unwrap_or_default()
        };
        assert_eq!(of(7), vec![("SeqScan".to_string(), 10)]);
        assert_eq!(of(8), vec![("SeqScan".to_string(), 4)]);
        assert_eq!(
            of(9),
            vec![("IndexScan".to_string(), 1), ("SeqScan".to_string(), 1)]
        );
    }

    #[test]
    fn nothing_without_node_functions() {
        let p = profile(vec![sample(7, "run", &["PortalRun", "ExecSort"], 5)]);
        assert!(plan_nodes(&p, &NodeFunctions::new()).is_empty());
    }
}
