//! End to end with a real Grafana Pyroscope: Postgres (the no-frame-pointer build, with its
//! debug files) under pgbench, `pgscope agent`, and Pyroscope queried back through its own
//! querier API (Connect JSON), as Grafana does. The server is the one
//! `PGSCOPE_TEST_PYROSCOPE_URL` points at, else one built from the Go module proxy by
//! `scripts/pyroscope-server.sh` and started for the test.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::pyroscope_server::{now_ms, push_pgbench_run, PyroscopeServer};
use pgscope_tests::{require_root_and_bpf, wait_for, PgCluster, PgInstall};
use serde_json::{json, Value};

/// The function names of a merged flamegraph.
fn flamegraph_names(answer: &Value) -> BTreeSet<String> {
    answer["flamegraph"]["names"]
        .as_array()
        .map(|names| {
            names
                .iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn pyroscope_answers_per_query_flamegraphs_on_and_off_cpu() -> Result<()> {
    require_root_and_bpf();
    let pyroscope = PyroscopeServer::get()?;
    let install = PgInstall::no_frame_pointers()?;
    let debug_dir = install
        .debug_dir
        .clone()
        .context("the nofp build has debug files")?;
    let cluster = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    // A service name of this run only: a shared server may hold earlier runs' data.
    let service = format!("pgscope-e2e-{}-{}", std::process::id(), now_ms());
    let start = push_pgbench_run(&pyroscope, &cluster, &debug_dir, &service, "off_cpu = true")?;
    let queryid = cluster.pgbench_select_queryid()?;
    let end = now_ms() + 1000;
    let selector = format!("{{service_name=\"{service}\"}}");

    // Both profile types exist.
    let types = wait_for("both profile types in Pyroscope", Duration::from_secs(60), || {
        let answer = pyroscope.call("ProfileTypes", json!({"start": start, "end": end}))?;
        let ids: BTreeSet<String> = answer["profileTypes"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter_map(|t| t["ID"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let cpu = ids
            .iter()
            .find(|id| id.starts_with("process_cpu:cpu:nanoseconds:cpu:nanoseconds"))
            .cloned();
        let off = ids.iter().find(|id| id.starts_with("offcpu:")).cloned();
        Ok(cpu.zip(off))
    })?;
    eprintln!("profile types: {types:?}");

    // The queryid values are pg_stat_statements'.
    let values = pyroscope.call(
        "LabelValues",
        json!({"name": "queryid", "matchers": [selector], "start": start, "end": end}),
    )?;
    let values: BTreeSet<String> = values["names"]
        .as_array()
        .map(|v| v.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    ensure!(
        values.contains(&queryid),
        "queryid {queryid} not among LabelValues {values:?}"
    );

    // A filter on that queryid returns stacks through exec_simple_query.
    let by_query = format!("{{service_name=\"{service}\",queryid=\"{queryid}\"}}");
    let cpu = pyroscope.call(
        "SelectMergeStacktraces",
        json!({"profileTypeID": types.0, "labelSelector": by_query, "start": start, "end": end}),
    )?;
    let names = flamegraph_names(&cpu);
    for expected in ["PostgresMain", "exec_simple_query", "PortalRun"] {
        ensure!(
            names.contains(expected),
            "no {expected} in the queryid's flamegraph: {names:?}"
        );
    }
    let total: u64 = cpu["flamegraph"]["total"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    ensure!(total > 0, "empty flamegraph for queryid {queryid}: {cpu}");
    eprintln!(
        "Pyroscope, process_cpu for queryid {queryid}: {:.2} s of CPU, {} distinct frames",
        total as f64 / 1e9,
        names.len()
    );

    // Off-CPU profiles are queryable too.
    let off = pyroscope.call(
        "SelectMergeStacktraces",
        json!({"profileTypeID": types.1, "labelSelector": selector, "start": start, "end": end}),
    )?;
    let off_total: u64 = off["flamegraph"]["total"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    ensure!(off_total > 0, "empty off-CPU flamegraph: {off}");
    Ok(())
}
