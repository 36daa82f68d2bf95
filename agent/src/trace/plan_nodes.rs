//! The per-plan-node part of the trace summary: for each of the top statements, its samples
//! split by the innermost plan node on the stack (the model's plan-node table, rendered).

use std::fmt::Write as _;

use crate::model::StatementPlanNodes;

/// Node types shown per statement; the rest are summed as `other nodes`.
const NODES_SHOWN: usize = 6;

/// One line per statement: queryid, samples, then `Node share%` by share, then the samples
/// outside every node (`no node`).
pub fn render(statements: &[StatementPlanNodes], limit: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:>21} {:>8}  nodes", "queryid", "samples");
    for statement in statements.iter().take(limit) {
        let _ = write!(out, "{:>21} {:>8} ", statement.query_id, statement.samples);
        for (node, samples) in statement.by_node.iter().take(NODES_SHOWN) {
            let _ = write!(out, " {node} {:.1}%", statement.pct(*samples));
        }
        let rest: u64 = statement.by_node.iter().skip(NODES_SHOWN).map(|(_, n)| n).sum();
        if rest > 0 {
            let _ = write!(out, " (other nodes {:.1}%)", statement.pct(rest));
        }
        let _ = writeln!(out, " (no node {:.1}%)", statement.pct(statement.outside_nodes()));
    }
    if statements.len() > limit {
        let _ = writeln!(out, "… {} more queries", statements.len() - limit);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::QueryId;

    #[test]
    fn shows_each_node_share_and_the_rest() {
        let statement = StatementPlanNodes {
            query_id: QueryId(42),
            samples: 200,
            by_node: vec![
                ("HashJoin".into(), 100),
                ("Sort".into(), 50),
                ("SeqScan".into(), 30),
            ],
        };
        let text = render(&[statement.clone(), statement], 1);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[1].ends_with("HashJoin 50.0% Sort 25.0% SeqScan 15.0% (no node 10.0%)"),
            "{text}"
        );
        assert_eq!(lines[2], "… 1 more queries");
    }
}
