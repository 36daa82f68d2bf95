//! The report's plan-node section: each statement's on-CPU samples by the innermost executor
//! node on the stack, as the model's plan-node table holds them (the same figures `pgscope
//! trace` prints and `--json` writes under `plan_nodes`).

use std::fmt::Write as _;

use super::html::escape;
use crate::model::{shorten, QueryId, StatementPlanNodes};

/// Statements the table shows at most, busiest first, as the queries table does.
const MAX_ROWS: usize = 100;

/// The section, with one row per statement of `statements` and its text from `text`.
pub fn section<'a>(
    page: &mut String,
    statements: &[StatementPlanNodes],
    text: impl Fn(QueryId) -> Option<&'a str>,
) {
    let _ = writeln!(
        page,
        "<section id=\"plan-nodes\">\n<h2>CPU by plan node ({})</h2>\n\
         <p class=\"caption\">Each on-CPU sample belongs to the innermost executor node on its \
         stack: a node's share is its own work and what it calls outside its child nodes, in % \
         of the query's on-CPU samples; \"no node\" is parsing, planning, commit and client I/O.</p>",
        statements.len()
    );
    if statements.is_empty() {
        // Either no executor node function was named in the traced binaries, or no sample of
        // a statement ran inside one: say both, since the page cannot tell which.
        page.push_str(
            "<p>No sample of a statement ran in a plan node pgscope could name (node functions \
             are named from the exported <code>ExecInit*</code> functions of <code>postgres</code>; \
             reports from recordings of older versions have none).</p>\n</section>\n",
        );
        return;
    }
    page.push_str(
        "<div class=\"wide\"><table class=\"queries plan-nodes\">\n<tr><th>queryid</th><th>query</th>\
         <th>on-CPU samples</th><th>by plan node</th><th>no node</th></tr>\n",
    );
    for statement in statements.iter().take(MAX_ROWS) {
        row(page, statement, text(statement.query_id).unwrap_or(""));
    }
    page.push_str("</table></div>\n");
    if statements.len() > MAX_ROWS {
        let _ = writeln!(
            page,
            "<p class=\"caption\">… {} more queries, in the flamegraphs.</p>",
            statements.len() - MAX_ROWS
        );
    }
    page.push_str("</section>\n");
}

fn row(page: &mut String, statement: &StatementPlanNodes, text: &str) {
    let _ = write!(
        page,
        "<tr id=\"n{id}\"><td><a href=\"#q{id}\"><code>{id}</code></a></td><td class=\"text\">{}</td>\
         <td>{}</td><td class=\"left\">",
        escape(&shorten(text, 240)),
        statement.samples,
        id = statement.query_id,
    );
    // Every node type is listed: a plan has a handful, and the one left out would be the one
    // asked about.
    for (node, samples) in &statement.by_node {
        let _ = write!(
            page,
            "<span class=\"node\"><code>{}</code> {:.1}% <span class=\"caption\">({samples})</span></span><br>",
            escape(node),
            statement.pct(*samples)
        );
    }
    let _ = writeln!(
        page,
        "</td><td>{:.1}%</td></tr>",
        statement.pct(statement.outside_nodes())
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn statement(node: &str) -> StatementPlanNodes {
        StatementPlanNodes {
            query_id: QueryId(-7),
            samples: 200,
            by_node: vec![(node.into(), 100), ("SeqScan".into(), 60)],
        }
    }

    #[test]
    fn each_statement_shows_its_nodes_shares_and_the_rest() {
        let mut page = String::new();
        section(&mut page, &[statement("HashJoin")], |_| Some("SELECT 1"));
        assert!(page.contains("<h2>CPU by plan node (1)</h2>"), "{page}");
        let row = page.split("<tr id=\"n-7\">").nth(1).expect("the statement's row");
        assert!(row.contains("<a href=\"#q-7\"><code>-7</code></a>"), "{row}");
        assert!(
            row.contains("<code>HashJoin</code> 50.0% <span class=\"caption\">(100)</span>"),
            "{row}"
        );
        assert!(row.contains("<code>SeqScan</code> 30.0%"), "{row}");
        assert!(row.contains("<td>20.0%</td></tr>"), "no node: {row}");
    }

    #[test]
    fn node_names_and_query_texts_are_escaped() {
        let mut page = String::new();
        section(&mut page, &[statement("<b>Hash")], |_| Some("SELECT '<script>'"));
        assert!(!page.contains("<b>") && !page.contains("<script>"), "{page}");
        assert!(
            page.contains("&lt;b&gt;Hash") && page.contains("&lt;script&gt;"),
            "{page}"
        );
    }

    #[test]
    fn no_statement_in_a_node_says_why() {
        let mut page = String::new();
        section(&mut page, &[], |_| None);
        assert!(
            page.contains("<h2>CPU by plan node (0)</h2>") && !page.contains("<table"),
            "{page}"
        );
    }
}
