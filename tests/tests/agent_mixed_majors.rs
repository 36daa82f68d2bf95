//! One host, two PostgreSQL majors at once: `pgscope agent` profiles a distro 15 and an
//! upstream 17 cluster side by side and ships to a real Grafana Pyroscope. The `process_cpu`
//! series of each instance carry that instance's pg_stat_statements queryids: both majors run the
//! same pgbench statement, for which they compute different queryids, so each instance's labels
//! also show it was decoded with its own major's table, not the other's.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::pyroscope_server::{now_ms, PyroscopeServer};
use pgscope_tests::{require_root_and_bpf, wait_for, BackgroundPgbench, PgCluster, PgInstall, RunningAgent};

/// One cluster of the pair and what the test learns of it.
struct Instance<'a> {
    /// Its `cluster_name`, which the agent uses as the `instance` label.
    name: String,
    cluster: &'a PgCluster,
}

impl Instance<'_> {
    /// Every queryid pg_stat_statements holds for this instance.
    fn pg_stat_statements_queryids(&self) -> Result<BTreeSet<String>> {
        let out = self.cluster.psql("SELECT queryid FROM pg_stat_statements")?;
        Ok(out.lines().map(str::to_owned).collect())
    }
}

/// `cluster_name` and pg_stat_statements for a cluster named `name`.
fn settings(name: &str) -> [(&str, &str); 2] {
    [
        ("shared_preload_libraries", "pg_stat_statements"),
        ("cluster_name", name),
    ]
}

/// pgbench's select-only script, one client: two instances share 2 cores.
fn select_only(cluster: &PgCluster) -> Result<BackgroundPgbench<'_>> {
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    cluster.spawn_pgbench(&["-n", "-S", "-c", "1", "-T", "300"], 1)
}

#[test]
fn agent_labels_each_major_with_its_own_queryids() -> Result<()> {
    require_root_and_bpf();
    let pyroscope = PyroscopeServer::get()?;
    let pg15 = PgCluster::start_with(&PgInstall::distro()?, &settings("pg15-distro"))?;
    let pg17 = PgCluster::start_beside(&PgInstall::upstream(17)?, &settings("pg17-upstream"), &pg15)?;
    let instances = [
        Instance {
            name: "pg15-distro".into(),
            cluster: &pg15,
        },
        Instance {
            name: "pg17-upstream".into(),
            cluster: &pg17,
        },
    ];
    for instance in &instances {
        instance.cluster.psql("CREATE EXTENSION pg_stat_statements")?;
    }

    // A service name of this run only: a shared server may hold earlier runs' data.
    let service = format!("pgscope-mixed-{}-{}", std::process::id(), now_ms());
    let mut config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"3s\"\nfrequency = 49\n\
         [labels]\nservice_name = \"{service}\"\n",
        pyroscope.url()
    );
    for instance in &instances {
        config.push_str(&format!(
            "[[discovery.include]]\ndata_dir = \"{}\"\n",
            instance.cluster.data_dir().display()
        ));
    }
    let start = now_ms();
    let workloads = instances
        .iter()
        .map(|i| select_only(i.cluster))
        .collect::<Result<Vec<_>>>()?;
    let agent = RunningAgent::start(&config, &[])?;
    agent.wait_for_instances(2)?;
    agent.wait_metric(
        "pgscope_export_pushes_total{result=\"ok\"}",
        "four pushes accepted by Pyroscope",
        Duration::from_secs(90),
        |pushes| pushes >= 4.0,
    )?;
    for workload in workloads {
        workload.stop()?;
    }
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");
    let end = now_ms() + 1000;

    let select_ids: Vec<String> = instances
        .iter()
        .map(|i| i.cluster.pgbench_select_queryid())
        .collect::<Result<_>>()?;
    // Otherwise a 17 decoded with 15's table and the reverse could not be told apart here.
    ensure!(
        select_ids[0] != select_ids[1],
        "PostgreSQL 15 and 17 computed the same queryid {} for pgbench's select",
        select_ids[0]
    );
    // Pyroscope makes pushed series queryable within seconds, not at once.
    let cpu_series = format!("{{__name__=\"process_cpu\",service_name=\"{service}\"}}");
    let names: BTreeSet<String> = instances.iter().map(|i| i.name.clone()).collect();
    wait_for(
        &format!("process_cpu series of {names:?} in Pyroscope"),
        Duration::from_secs(60),
        || {
            let seen = pyroscope.label_values("instance", &cpu_series, start, end)?;
            Ok(names.is_subset(&seen).then_some(()))
        },
    )
    .with_context(|| {
        format!(
            "instance labels: {:?}",
            pyroscope.label_values("instance", &cpu_series, start, end)
        )
    })?;
    for (i, instance) in instances.iter().enumerate() {
        let name = &instance.name;
        let selector = format!("{{__name__=\"process_cpu\",service_name=\"{service}\",instance=\"{name}\"}}");
        let own = &select_ids[i];
        let other = &select_ids[1 - i];
        let labels = pyroscope.label_values("queryid", &selector, start, end)?;
        eprintln!("{name}: pgbench's select has queryid {own}; process_cpu queryid labels {labels:?}");
        ensure!(
            labels.contains(own),
            "{name}: no process_cpu series carries queryid {own}, its pg_stat_statements queryid of \
             pgbench's select; queryid labels: {labels:?}"
        );
        let known = instance.pg_stat_statements_queryids()?;
        ensure!(
            !labels.contains(other),
            "{name} carries queryid {other}, the other major's for pgbench's select: {labels:?}"
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
    }
    Ok(())
}
