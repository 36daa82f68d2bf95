//! A statement's phase is the phase of the statement the client sent, not of the executor
//! calls nested in it. A `DELETE` from a table referenced by an unindexed foreign key spends
//! its time in the constraint's AFTER trigger (`RI_FKey_noaction_del`, whose query scans the
//! whole referencing table), fired from `ExecutorFinish` when the statement ends
//! (`AfterTriggerEndQuery`): pgscope must put that time in the DELETE's `finish` phase, though
//! the trigger's own query runs the executor (`ExecutorRun`) under it.
//!
//! Judged against the same run: the share of the DELETE's samples in `finish` must reach the
//! share whose stacks fire the AFTER triggers (less a point), and at least 90%. Those samples
//! name the constraint whose trigger they ran (the `trigger` label, read from the trigger data
//! Postgres holds), as EXPLAIN ANALYZE does ("Trigger for constraint …"). Its plan-node table
//! shows the nodes of its own plan (those its EXPLAIN shows), and the trigger's query's nodes
//! only as such, under the constraint's name.

use anyhow::{ensure, Result};
use pgscope_tests::plan_json::{explain_node_types, plan_node_samples};
use pgscope_tests::workload::MD5_BOUND;
use pgscope_tests::{require_root_and_bpf, LabeledProfile, PgCluster, PgInstall, Trace};

/// Rows of the referencing table: the trigger's scan of them is the DELETE's work.
const CHILD_ROWS: u64 = 300_000;
/// DELETEs while traced (each rolled back, so each finds its row and fires the trigger).
const EXECUTIONS: u64 = 60;
const FREQUENCY: u32 = 499;
/// Where `ExecutorFinish` fires the statement's AFTER triggers (exported: named on the stripped
/// build; `RI_FKey_noaction_del` tail-calls the static check, and its own frame is gone).
const TRIGGER_FUNCTION: &str = "AfterTriggerEndQuery";
/// The least share of the DELETE's samples in its finish phase (issue 35's bar).
const MIN_FINISH_PCT: f64 = 90.0;
/// The trigger label of the foreign key's checks, and how the plan-node table marks the nodes
/// of its query: `{}` is the constraint's name.
const TRIGGER_LABEL: &str = "constraint {}";
const IN_AFTER_TRIGGER: &str = " (in the AFTER trigger for constraint {})";

#[test]
fn time_in_an_after_trigger_is_the_statements_finish_phase() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(
        &PgInstall::distro()?,
        &[("max_parallel_workers_per_gather", "0"), ("jit", "off")],
    )?;
    cluster.psql(&format!(
        "CREATE TABLE fk_parent (id int PRIMARY KEY); \
         INSERT INTO fk_parent SELECT generate_series(1, 1000); \
         CREATE TABLE fk_child (parent_id int REFERENCES fk_parent (id), pad int); \
         INSERT INTO fk_child SELECT 1 + g % 500, g FROM generate_series(1, {CHILD_ROWS}) g; \
         ANALYZE fk_parent; ANALYZE fk_child"
    ))?;
    let mut connection = cluster.connect()?;
    let plan = connection.query("EXPLAIN (FORMAT JSON) DELETE FROM fk_parent WHERE id = 501")?;
    let explained = explain_node_types(&plan)?;
    let dir = tempfile::tempdir()?;
    let (json, pprof) = (dir.path().join("summary.json"), dir.path().join("profile.pb.gz"));
    let trace = Trace::pid(connection.pid())
        .duration_secs(600)
        .frequency(FREQUENCY)
        .json(&json)
        .pprof(&pprof)
        .spawn()?;
    // Parents 501-1000 have no children: each DELETE finds its row, the trigger scans every
    // child and finds none, and the rollback keeps the row for the next round.
    for i in 0..EXECUTIONS {
        connection.query(&format!(
            "BEGIN; DELETE FROM fk_parent WHERE id = {}; ROLLBACK",
            501 + i % 500
        ))?;
    }
    let output = trace.interrupt()?;
    let constraint = cluster
        .psql("SELECT conname FROM pg_constraint WHERE conrelid = 'fk_child'::regclass AND contype = 'f'")?;
    let constraint = constraint.trim();
    let trigger_label = TRIGGER_LABEL.replace("{}", constraint);
    let in_after_trigger = IN_AFTER_TRIGGER.replace("{}", constraint);
    let queryid =
        cluster.psql("SELECT queryid FROM pg_stat_statements WHERE query LIKE 'DELETE FROM fk_parent%'")?;
    let queryid = queryid.trim();
    ensure!(!queryid.is_empty(), "the DELETE is not in pg_stat_statements");

    let summary = pgscope_tests::TraceSummary::read(&json)?;
    let phases = summary.phases_of_query(queryid)?;
    let samples: u64 = phases.values().sum();
    ensure!(samples > 0, "no samples of the DELETE ({queryid})");
    let pct = |n: u64| 100.0 * n as f64 / samples as f64;
    let finish = pct(phases.get("finish").copied().unwrap_or(0));
    let profile = LabeledProfile::read_pprof(&pprof)?;
    let in_trigger = pct(profile.count_where(|s| {
        s.label("queryid") == Some(queryid) && s.frames.iter().any(|f| f == TRIGGER_FUNCTION)
    }));
    let named = pct(profile.count_where(|s| {
        s.label("queryid") == Some(queryid)
            && s.frames.iter().any(|f| f == TRIGGER_FUNCTION)
            && s.label("trigger") == Some(trigger_label.as_str())
    }));
    eprintln!(
        "DELETE {queryid}: {samples} samples; phases {phases:?}; finish {finish:.1}%, \
         under {TRIGGER_FUNCTION} {in_trigger:.1}%, labelled `{trigger_label}` {named:.1}%"
    );
    ensure!(
        in_trigger >= MIN_FINISH_PCT,
        "only {in_trigger:.1}% of the DELETE's samples fire its AFTER triggers \
         ({TRIGGER_FUNCTION}): the workload is not the one this test needs"
    );
    ensure!(
        finish + 1.0 >= in_trigger,
        "{finish:.1}% of the DELETE's samples are in its finish phase, but {in_trigger:.1}% run \
         its AFTER triggers ({TRIGGER_FUNCTION}), which ExecutorFinish fires: {phases:?}"
    );
    let by_node = plan_node_samples(&json, queryid)?;
    eprintln!("DELETE's plan nodes: {by_node:?}; EXPLAIN: {explained:?}");
    let foreign: Vec<&String> = by_node
        .keys()
        .filter(|node| !node.ends_with(&in_after_trigger) && !explained.contains(*node))
        .collect();
    ensure!(
        foreign.is_empty(),
        "the DELETE's plan-node table shows {foreign:?}, which its plan ({explained:?}) does not \
         have and which are not marked as the trigger's: {by_node:?}"
    );
    ensure!(
        by_node.keys().any(|node| node.ends_with(&in_after_trigger)),
        "no node of the trigger's query is marked{in_after_trigger}: {by_node:?}"
    );
    // The JSON's per-query entry counts the same samples under the constraint.
    let triggers = summary.triggers_of_query(queryid)?;
    let in_json = pct(triggers.get(&trigger_label).copied().unwrap_or(0));
    ensure!(
        (in_json - named).abs() < 1.0,
        "queries[].triggers {triggers:?} puts {in_json:.1}% of the DELETE under `{trigger_label}`, \
         its pprof labels {named:.1}%"
    );
    // The finding that the DELETE spends its time finishing names the trigger it ran.
    let finding_line = format!("in triggers: {trigger_label} ");
    ensure!(
        output.stdout.contains(&finding_line),
        "no finding names the trigger the DELETE ran (`{finding_line}`):\n{}",
        output.stdout
    );
    // Every sample that fires the trigger runs it: the calls the probes saw end are its own.
    ensure!(
        named + 1.0 >= in_trigger,
        "{named:.1}% of the DELETE's samples are labelled `{trigger_label}`, but {in_trigger:.1}% \
         run its AFTER triggers ({TRIGGER_FUNCTION})"
    );
    ensure!(
        finish >= MIN_FINISH_PCT,
        "only {finish:.1}% of the DELETE's samples are in its finish phase (at least \
         {MIN_FINISH_PCT}%; {in_trigger:.1}% run {TRIGGER_FUNCTION}): {phases:?}"
    );
    Ok(())
}

/// The trigger probes trap on every set-returning function call too (the same calls wrap
/// both): a statement generating rows in its select list traps twice a row, far over any
/// budget, and the trace must detach them and say so rather than slow the statement down.
#[test]
fn trigger_probes_leave_when_set_returning_calls_cost_more_than_the_budget() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let burner = cluster.spawn_session(MD5_BOUND)?;
    let output = Trace::pid(burner.pid()).duration_secs(5).output()?;
    ensure!(
        output
            .stderr
            .contains("triggers were named only until the trigger probes were detached"),
        "the trace kept the trigger probes over the budget, or did not say it detached them:\n{}",
        output.stderr
    );
    Ok(())
}
