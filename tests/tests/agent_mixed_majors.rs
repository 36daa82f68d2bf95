//! One host, several PostgreSQL majors at once: `pgscope agent` profiles a distro 15, an
//! upstream 17 and an upstream 18 cluster side by side and ships to a real Grafana Pyroscope.
//! The `process_cpu` series of each instance carry that instance's pg_stat_statements queryids:
//! every major runs the same pgbench statement, for which each computes its own queryid, so an
//! instance's labels also show it was decoded with its own major's table, not another's.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::pyroscope_server::{now_ms, PyroscopeServer};
use pgscope_tests::{require_root_and_bpf, wait_for, BackgroundPgbench, PgCluster, PgInstall, RunningAgent};

/// The builds profiled together, each with the `cluster_name` the agent uses as its `instance`
/// label. The first one's cluster holds the lock that keeps other tests' clusters away.
fn builds() -> Result<Vec<(PgInstall, &'static str)>> {
    Ok(vec![
        (PgInstall::distro()?, "pg15-distro"),
        (PgInstall::upstream(17)?, "pg17-upstream"),
        (PgInstall::upstream(18)?, "pg18-upstream"),
    ])
}

/// `cluster_name` and pg_stat_statements for a cluster named `name`.
fn settings(name: &str) -> [(&str, &str); 2] {
    [
        ("shared_preload_libraries", "pg_stat_statements"),
        ("cluster_name", name),
    ]
}

/// pgbench's select-only script, one client: the instances share 2 cores.
fn select_only(cluster: &PgCluster) -> Result<BackgroundPgbench<'_>> {
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    cluster.spawn_pgbench(&["-n", "-S", "-c", "1", "-T", "300"], 1)
}

/// Every queryid pg_stat_statements holds for `cluster`.
fn pg_stat_statements_queryids(cluster: &PgCluster) -> Result<BTreeSet<String>> {
    let out = cluster.psql("SELECT queryid FROM pg_stat_statements")?;
    Ok(out.lines().map(str::to_owned).collect())
}

#[test]
fn agent_labels_each_major_with_its_own_queryids() -> Result<()> {
    require_root_and_bpf();
    let pyroscope = PyroscopeServer::get()?;
    let builds = builds()?;
    let ((first_install, first_name), rest) = builds.split_first().context("no build")?;
    let first = PgCluster::start_with(first_install, &settings(first_name))?;
    let mut others = Vec::new();
    for (install, name) in rest {
        others.push(PgCluster::start_beside(install, &settings(name), &first)?);
    }
    let clusters: Vec<&PgCluster> = [&first].into_iter().chain(&others).collect();
    let names: Vec<&str> = builds.iter().map(|(_, name)| *name).collect();
    for cluster in &clusters {
        cluster.psql("CREATE EXTENSION pg_stat_statements")?;
    }

    // A service name of this run only: a shared server may hold earlier runs' data.
    let service = format!("pgscope-mixed-{}-{}", std::process::id(), now_ms());
    let mut config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"3s\"\nfrequency = 49\n\
         [labels]\nservice_name = \"{service}\"\n",
        pyroscope.url()
    );
    for cluster in &clusters {
        config.push_str(&format!(
            "[[discovery.include]]\ndata_dir = \"{}\"\n",
            cluster.data_dir().display()
        ));
    }
    let start = now_ms();
    let workloads = clusters
        .iter()
        .map(|cluster| select_only(cluster))
        .collect::<Result<Vec<_>>>()?;
    let agent = RunningAgent::start(&config, &[])?;
    agent.wait_for_instances(clusters.len())?;
    // Two upload intervals' worth of pushes from every instance.
    let pushes = 2 * clusters.len();
    agent.wait_metric(
        "pgscope_export_pushes_total{result=\"ok\"}",
        &format!("{pushes} pushes accepted by Pyroscope"),
        Duration::from_secs(90),
        |n| n >= pushes as f64,
    )?;
    for workload in workloads {
        workload.stop()?;
    }
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");
    let end = now_ms() + 1000;

    let select_ids: Vec<String> = clusters
        .iter()
        .map(|cluster| cluster.pgbench_select_queryid())
        .collect::<Result<_>>()?;
    eprintln!(
        "pgbench's select per instance: {:?}",
        names.iter().zip(&select_ids).collect::<Vec<_>>()
    );
    // Otherwise an instance decoded with another major's table could not be told apart here.
    let distinct: BTreeSet<&String> = select_ids.iter().collect();
    ensure!(
        distinct.len() == select_ids.len(),
        "the majors computed the same queryid for pgbench's select: {select_ids:?}"
    );

    // Pyroscope makes pushed series queryable within seconds, not at once.
    let cpu_series = format!("{{__name__=\"process_cpu\",service_name=\"{service}\"}}");
    let wanted: BTreeSet<String> = names.iter().map(|n| n.to_string()).collect();
    wait_for(
        &format!("process_cpu series of {wanted:?} in Pyroscope"),
        Duration::from_secs(60),
        || {
            let seen = pyroscope.label_values("instance", &cpu_series, start, end)?;
            Ok(wanted.is_subset(&seen).then_some(()))
        },
    )
    .with_context(|| {
        format!(
            "instance labels: {:?}",
            pyroscope.label_values("instance", &cpu_series, start, end)
        )
    })?;

    let mut failures = Vec::new();
    for (i, (cluster, name)) in clusters.iter().zip(&names).enumerate() {
        let selector = format!("{{__name__=\"process_cpu\",service_name=\"{service}\",instance=\"{name}\"}}");
        let labels = pyroscope.label_values("queryid", &selector, start, end)?;
        let own = &select_ids[i];
        eprintln!("{name}: pgbench's select has queryid {own}; process_cpu queryid labels {labels:?}");
        if let Err(e) = check_instance(
            name,
            &labels,
            own,
            &select_ids,
            &pg_stat_statements_queryids(cluster)?,
        ) {
            eprintln!("{e:#}");
            failures.push(e);
        }
    }
    // Every instance is reported above; the first failure fails the test.
    match failures.into_iter().next() {
        Some(first) => Err(first),
        None => Ok(()),
    }
}

/// The queryid labels of instance `name`'s process_cpu series hold `own` (its pgbench select's
/// queryid), none of the other instances' queryids for the same statement, and nothing its
/// pg_stat_statements (`known`) does not hold.
fn check_instance(
    name: &str,
    labels: &BTreeSet<String>,
    own: &str,
    select_ids: &[String],
    known: &BTreeSet<String>,
) -> Result<()> {
    ensure!(
        labels.contains(own),
        "{name}: no process_cpu series carries queryid {own}, its pg_stat_statements queryid of \
         pgbench's select; queryid labels: {labels:?}"
    );
    let foreign: Vec<&String> = select_ids
        .iter()
        .filter(|id| *id != own && labels.contains(*id))
        .collect();
    ensure!(
        foreign.is_empty(),
        "{name} carries queryids {foreign:?}, other majors' for pgbench's select: {labels:?}"
    );
    // 0 is what runs before a statement's queryid is computed.
    let unknown: Vec<&String> = labels
        .iter()
        .filter(|id| *id != "0" && !known.contains(*id))
        .collect();
    ensure!(
        unknown.is_empty(),
        "{name}: queryid labels {unknown:?} are not in its pg_stat_statements {known:?}"
    );
    Ok(())
}
