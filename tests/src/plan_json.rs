//! What the tests read of plans: the node types of an `EXPLAIN (FORMAT JSON)`, in pgscope's
//! names, and the samples per plan node `pgscope trace --json` gives a statement.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// The plan node types of an `EXPLAIN (FORMAT JSON)` output, spelt as the executor's
/// `ExecInit<Node>` functions do (`Hash Join` → `HashJoin`, `Aggregate` → `Agg`).
pub fn explain_node_types(plan: &str) -> Result<BTreeSet<String>> {
    fn walk(node: &Value, types: &mut BTreeSet<String>) -> Result<()> {
        let name = node
            .get("Node Type")
            .and_then(Value::as_str)
            .context("a plan node without `Node Type`")?;
        types.insert(match name {
            "Aggregate" => "Agg".to_string(),
            "Nested Loop" => "NestLoop".to_string(),
            "Materialize" => "Material".to_string(),
            other => other.replace(' ', ""),
        });
        for child in node.get("Plans").and_then(Value::as_array).into_iter().flatten() {
            walk(child, types)?;
        }
        Ok(())
    }
    let json: Value = serde_json::from_str(plan).with_context(|| format!("EXPLAIN output:\n{plan}"))?;
    let root = json
        .get(0)
        .and_then(|p| p.get("Plan"))
        .context("EXPLAIN (FORMAT JSON) has no Plan")?;
    let mut types = BTreeSet::new();
    walk(root, &mut types)?;
    Ok(types)
}

/// `plan_nodes` of the `--json` summary for `queryid`: samples per node type.
pub fn plan_node_samples(path: &Path, queryid: &str) -> Result<BTreeMap<String, u64>> {
    let text = std::fs::read_to_string(path)?;
    let json: Value = serde_json::from_str(&text)?;
    let statements = json
        .get("plan_nodes")
        .and_then(Value::as_array)
        .context("the summary has no `plan_nodes`")?;
    let Some(statement) = statements
        .iter()
        .find(|s| s.get("queryid").and_then(Value::as_str) == Some(queryid))
    else {
        bail!("no plan_nodes entry for queryid {queryid}: {statements:?}");
    };
    let nodes = statement
        .get("nodes")
        .and_then(Value::as_array)
        .context("an entry without `nodes`")?;
    nodes
        .iter()
        .map(|n| {
            let node = n.get("node").and_then(Value::as_str).context("`node`")?;
            let samples = n.get("samples").and_then(Value::as_u64).context("`samples`")?;
            Ok((node.to_string(), samples))
        })
        .collect()
}
