//! `pgscope agent` diagnoses what it ships: each instance's findings over each upload interval
//! appear on /metrics as `pgscope_finding` series and in the log when they change. Under
//! pgbench -S the top CPU consumer is pgbench's select, named by its pg_stat_statements queryid,
//! until the load stops. A workload whose inserts do most of their work in a trigger deferred
//! to commit must raise the commit phase finding for the insert's queryid while it runs, and
//! clear it once it stops. A session idle in its transaction that holds others up is named
//! while it does.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::{
    require_root_and_bpf, wait_for, workload, PgCluster, PgInstall, PyroscopeCapture, RunningAgent,
};

/// One `pgscope_finding` series, by label.
type Labels = BTreeMap<String, String>;

/// The labels of every `pgscope_finding` line valued 1 in a Prometheus text exposition.
fn findings_on(metrics: &str) -> Vec<Labels> {
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix("pgscope_finding{"))
        .filter_map(|rest| rest.strip_suffix("} 1"))
        .map(parse_labels)
        .collect()
}

/// `k="v",k2="v2"` (values as the agent escapes them: `\\`, `\"`, `\n`).
fn parse_labels(text: &str) -> Labels {
    let mut labels = Labels::new();
    let mut rest = text;
    while let Some((name, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((at, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, escaped)) => value.push(escaped),
                    None => {}
                },
                '"' => {
                    end = at + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.insert(name.trim_start_matches(',').to_string(), value);
        rest = &after[end..];
    }
    labels
}

/// The agent's log lines (`--log-json`) about findings: (message, fields).
fn finding_logs(log: &str) -> Vec<(String, serde_json::Value)> {
    log.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|line| {
            let fields = line.get("fields")?.clone();
            let message = fields.get("message")?.as_str()?.to_string();
            message.starts_with("finding ").then_some((message, fields))
        })
        .collect()
}

/// The appearances and clearings logged for one finding (kind and queryid), per severity, in
/// order. Each severity must alternate, starting with its appearance: a finding is logged when
/// it changes, never again while it stays.
fn logged_changes(
    log: &str,
    instance: &str,
    kind: &str,
    queryid: &str,
) -> Result<BTreeMap<String, Vec<String>>> {
    let mut per_severity: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (message, fields) in finding_logs(log) {
        let field = |name: &str| fields.get(name).and_then(|v| v.as_str()).unwrap_or("");
        if field("instance") != instance || field("kind") != kind || field("queryid") != queryid {
            continue;
        }
        ensure!(
            !field("title").is_empty(),
            "a finding logged without its title: {fields}"
        );
        if message == "finding appeared" {
            ensure!(
                !field("action").is_empty(),
                "an appearance without its action: {fields}"
            );
        }
        per_severity
            .entry(field("severity").to_string())
            .or_default()
            .push(message);
    }
    for (severity, messages) in &per_severity {
        for (index, message) in messages.iter().enumerate() {
            let expected = if index % 2 == 0 {
                "finding appeared"
            } else {
                "finding cleared"
            };
            ensure!(
                message == expected,
                "{kind} {queryid} ({severity}) was logged {messages:?}: appearances and clearings must alternate\n{log}"
            );
        }
    }
    Ok(per_severity)
}

/// The labels of `instance`'s finding of `kind` naming `queryid` ("": none) on /metrics.
fn finding_of(metrics: &str, instance: &str, kind: &str, queryid: &str) -> Option<Labels> {
    findings_on(metrics).into_iter().find(|l| {
        l.get("instance").map(String::as_str) == Some(instance)
            && l.get("kind").map(String::as_str) == Some(kind)
            && l.get("queryid").map(String::as_str) == Some(queryid)
    })
}

/// Once the workload behind a finding has stopped: waits for the finding to leave /metrics,
/// then checks that the log said it appeared and that every severity it went through was
/// cleared last. Returns what was logged, per severity.
fn expect_cleared(
    agent: &RunningAgent,
    instance: &str,
    kind: &str,
    queryid: &str,
) -> Result<BTreeMap<String, Vec<String>>> {
    wait_for(
        &format!("the {kind} finding of `{queryid}` to clear from /metrics"),
        Duration::from_secs(30),
        || {
            let (_, metrics) = agent.get("/metrics")?;
            Ok(finding_of(&metrics, instance, kind, queryid)
                .is_none()
                .then_some(()))
        },
    )
    .with_context(|| format!("agent log:\n{}", agent.log()))?;
    let log = agent.log();
    let changes = logged_changes(&log, instance, kind, queryid)?;
    ensure!(
        !changes.is_empty(),
        "the {kind} finding's appearance is not in the log:\n{log}"
    );
    for (severity, messages) in &changes {
        ensure!(
            messages.last().map(String::as_str) == Some("finding cleared"),
            "the {severity} {kind} finding's clearing is not in the log ({messages:?}):\n{log}"
        );
    }
    Ok(changes)
}

/// A capture endpoint and an agent (JSON logs, 2 s uploads) profiling `cluster` alone, once
/// the agent has found it.
fn start_agent(cluster: &PgCluster) -> Result<(PyroscopeCapture, RunningAgent)> {
    let capture = PyroscopeCapture::start()?;
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"2s\"\n\
         [[discovery.include]]\ndata_dir = \"{}\"\n",
        capture.url(),
        cluster.data_dir().display()
    );
    let agent = RunningAgent::start(&config, &["--log-json"])?;
    agent.wait_for_instances(1)?;
    Ok((capture, agent))
}

/// Waits until the agent has evaluated `count` more upload intervals.
fn wait_intervals(agent: &RunningAgent, count: u32) -> Result<()> {
    let evaluated = agent.metric("pgscope_findings_evaluated_total")?;
    agent.wait_metric(
        "pgscope_findings_evaluated_total",
        &format!("{count} more intervals evaluated"),
        Duration::from_secs(30 * u64::from(count)),
        |n| n >= evaluated + f64::from(count),
    )?;
    Ok(())
}

/// SIGTERM: the agent must exit 0.
fn stop(agent: RunningAgent) -> Result<()> {
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "the agent exited with {status}:\n{log}");
    Ok(())
}

#[test]
fn the_top_cpu_consumer_under_pgbench_is_its_select_named_by_its_queryid_until_the_load_stops() -> Result<()>
{
    const INSTANCE: &str = "pgscope_top_cpu";
    require_root_and_bpf();
    let cluster =
        PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[("cluster_name", INSTANCE)])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let (_capture, agent) = start_agent(&cluster)?;

    let pgbench = cluster.spawn_pgbench(&["-n", "-S", "-c", "2", "-j", "2", "-T", "300"], 2)?;
    let select = wait_for(
        "pgbench's select in pg_stat_statements",
        Duration::from_secs(30),
        || Ok(cluster.pgbench_select_queryid().ok()),
    )?;
    let top = wait_for(
        "a top_cpu finding for pgbench's select on /metrics",
        Duration::from_secs(30),
        || {
            let (_, metrics) = agent.get("/metrics")?;
            let top: Vec<Labels> = findings_on(&metrics)
                .into_iter()
                .filter(|l| l.get("kind").map(String::as_str) == Some("top_cpu"))
                .collect();
            let named = top.iter().any(|l| l.get("queryid") == Some(&select));
            Ok(named.then_some(top))
        },
    )
    .with_context(|| format!("agent log:\n{}", agent.log()))?;
    let known: BTreeSet<String> = cluster
        .psql("SELECT queryid FROM pg_stat_statements")?
        .lines()
        .map(|l| l.trim().to_string())
        .collect();
    for labels in &top {
        ensure!(
            labels.get("instance").map(String::as_str) == Some(INSTANCE),
            "{labels:?}"
        );
        ensure!(
            labels.get("severity").map(String::as_str) == Some("info"),
            "{labels:?}"
        );
        let queryid = labels.get("queryid").map(String::as_str).unwrap_or("");
        ensure!(
            !queryid.is_empty() && known.contains(queryid),
            "the top consumer's queryid `{queryid}` is not one of pg_stat_statements' {known:?}"
        );
    }
    ensure!(top.len() <= 3, "at most 3 top consumers per instance: {top:?}");
    // Three more intervals under the same load: the finding stays, and is not logged again.
    wait_intervals(&agent, 3)?;
    let (_, metrics) = agent.get("/metrics")?;
    ensure!(
        findings_on(&metrics).iter().any(
            |l| l.get("kind").map(String::as_str) == Some("top_cpu") && l.get("queryid") == Some(&select)
        ),
        "the select's top_cpu finding left /metrics while pgbench still ran:\n{metrics}"
    );

    // The load stops: the select runs no more, and the interval after it no longer names it.
    pgbench.stop()?;
    let changes = expect_cleared(&agent, INSTANCE, "top_cpu", &select)?;
    let log = agent.log();
    // A steady load is one appearance, not one line per interval, and the stop one clearing.
    ensure!(
        changes.get("info")
            == Some(&vec![
                "finding appeared".to_string(),
                "finding cleared".to_string()
            ]),
        "the select's top_cpu finding was logged {changes:?}:\n{log}"
    );
    // pg_stat_statements has room for every statement here (max 5000): nothing evicted.
    let evictions = logged_changes(&log, INSTANCE, "pgss_evictions", "")?;
    ensure!(
        evictions.is_empty(),
        "evictions named with room for every statement ({evictions:?}):\n{log}"
    );
    let evaluated = agent.metric("pgscope_findings_evaluated_total")?;
    ensure!(evaluated >= 3.0, "{evaluated} intervals evaluated");
    stop(agent)
}

#[test]
fn a_finding_appears_on_metrics_and_in_the_log_while_its_workload_runs_and_clears_after() -> Result<()> {
    const INSTANCE: &str = "pgscope_findings";
    require_root_and_bpf();
    let cluster =
        PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[("cluster_name", INSTANCE)])?;
    cluster.psql("CREATE TABLE t (x int)")?;
    // CPU in a loop of plain function calls: a set-returning function would trap the trigger
    // probes at every row, over their budget, and leave the trigger unnamed.
    cluster.psql(
        "CREATE FUNCTION heavy() RETURNS trigger LANGUAGE plpgsql AS \
         $$DECLARE h text := ''; BEGIN FOR i IN 1..4000 LOOP h := md5(h); END LOOP; RETURN NULL; END$$",
    )?;
    cluster.psql(
        "CREATE CONSTRAINT TRIGGER heavy AFTER INSERT ON t DEFERRABLE INITIALLY DEFERRED \
         FOR EACH ROW EXECUTE FUNCTION heavy()",
    )?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("insert.sql");
    std::fs::write(&script, "INSERT INTO t VALUES (1);\n")?;

    let (_capture, agent) = start_agent(&cluster)?;

    let script = script.display().to_string();
    let queryid = std::thread::scope(|scope| -> Result<String> {
        let load = scope.spawn(|| cluster.pgbench(&["-n", "-c", "2", "-j", "2", "-T", "8", "-f", &script]));
        // The insert's queryid, once pg_stat_statements has it.
        let queryid = wait_for(
            "the insert in pg_stat_statements",
            Duration::from_secs(20),
            || {
                let id = cluster
                    .psql("SELECT queryid FROM pg_stat_statements WHERE query LIKE 'INSERT INTO t%'")?;
                Ok(Some(id.trim().to_string()).filter(|id| !id.is_empty()))
            },
        )?;
        let labels = wait_for(
            "the commit phase finding on /metrics",
            Duration::from_secs(20),
            || {
                let (_, metrics) = agent.get("/metrics")?;
                Ok(finding_of(&metrics, INSTANCE, "phase_dominance", &queryid))
            },
        );
        load.join()
            .map_err(|_| anyhow::anyhow!("pgbench thread panicked"))??;
        let labels = labels.with_context(|| format!("agent log:\n{}", agent.log()))?;
        // Most of the insert's CPU is the deferred trigger's: a warning or worse (at 19 Hz an
        // interval holds few samples, so which of the two varies).
        let severity = labels.get("severity").map(String::as_str).unwrap_or("");
        ensure!(matches!(severity, "warning" | "critical"), "{labels:?}");
        // Its samples ran in the trigger, which the agent's trigger probes name.
        let log = agent.log();
        ensure!(
            log.contains("these triggers: constraint heavy "),
            "the finding does not name the trigger the insert ran:\n{log}"
        );
        Ok(queryid)
    })?;

    // The load has stopped: the next interval has no such statement, and the finding clears.
    expect_cleared(&agent, INSTANCE, "phase_dominance", &queryid)?;
    let evaluated = agent.metric("pgscope_findings_evaluated_total")?;
    ensure!(evaluated >= 3.0, "{evaluated} intervals evaluated");
    stop(agent)
}

/// A session idle in its transaction, holding a row two others queue on, is a `lock_blocker`
/// finding of the agent's (polled with `pg_blocking_pids()` every second) on /metrics and in
/// the log, naming its pid, while it holds them; it clears once the session rolls back.
#[test]
fn a_session_idle_in_its_transaction_holding_others_up_is_named_until_it_ends() -> Result<()> {
    const INSTANCE: &str = "pgscope_blocker";
    require_root_and_bpf();
    let cluster =
        PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[("cluster_name", INSTANCE)])?;
    cluster.psql(
        "CREATE TABLE held_rows (id int PRIMARY KEY, v bigint NOT NULL); \
         INSERT INTO held_rows VALUES (1, 0)",
    )?;
    let (_capture, agent) = start_agent(&cluster)?;
    let mut holder = cluster.connect()?;
    holder.query("BEGIN")?;
    holder.query("UPDATE held_rows SET v = v + 1 WHERE id = 1")?;
    let queryid = cluster
        .psql("SELECT queryid FROM pg_stat_statements WHERE query LIKE 'UPDATE held_rows%'")?
        .trim()
        .to_string();
    ensure!(
        !queryid.is_empty(),
        "the holder's UPDATE is not in pg_stat_statements"
    );
    let waiters = (0..2)
        .map(|_| cluster.spawn_session("UPDATE held_rows SET v = v + 10 WHERE id = 1"))
        .collect::<Result<Vec<_>>>()?;
    let labels = wait_for(
        "the lock_blocker finding on /metrics",
        Duration::from_secs(60),
        || {
            let (_, metrics) = agent.get("/metrics")?;
            Ok(finding_of(&metrics, INSTANCE, "lock_blocker", &queryid))
        },
    )
    .with_context(|| format!("agent log:\n{}", agent.log()))?;
    eprintln!("{labels:?}");
    let named = format!("session {}, idle in transaction", holder.pid());
    let log = agent.log();
    ensure!(
        finding_logs(&log).iter().any(|(message, fields)| {
            message == "finding appeared"
                && fields.get("kind").and_then(|v| v.as_str()) == Some("lock_blocker")
                && fields
                    .get("title")
                    .and_then(|v| v.as_str())
                    .is_some_and(|title| title.starts_with(&named))
        }),
        "no `finding appeared` of kind lock_blocker titled `{named}…`:\n{log}"
    );
    holder.query("ROLLBACK")?;
    for waiter in &waiters {
        waiter.wait_until_finished()?;
    }
    expect_cleared(&agent, INSTANCE, "lock_blocker", &queryid)?;
    stop(agent)
}

#[test]
fn the_agent_names_a_pg_stat_statements_eviction_storm_from_the_counter_it_reads_over_sql() -> Result<()> {
    const INSTANCE: &str = "pgscope_pgss_storm";
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(
        &PgInstall::distro()?,
        &[("cluster_name", INSTANCE), ("pg_stat_statements.max", "100")],
    )?;
    let (_scripts, mut args) = workload::pgss_eviction_scripts(&cluster)?;
    let (_capture, agent) = start_agent(&cluster)?;
    // Two intervals with nothing to evict: the counter is read, and nothing is named.
    wait_intervals(&agent, 2)?;
    // The storm is the instance's, not a statement's: it names no queryid.
    let storm = |metrics: &str| finding_of(metrics, INSTANCE, "pgss_evictions", "");
    let (_, metrics) = agent.get("/metrics")?;
    ensure!(
        storm(&metrics).is_none(),
        "evictions named before any workload ran:\n{metrics}"
    );

    // 16 clients, 128 distinct statements, 100 entries.
    args.extend(["-n", "-c", "16", "-j", "2", "-T", "300"].map(String::from));
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let pgbench = cluster.spawn_pgbench(&arg_refs, 16)?;
    wait_for(
        "the eviction storm's finding (a warning or worse) on /metrics",
        Duration::from_secs(30),
        || {
            let (_, metrics) = agent.get("/metrics")?;
            Ok(storm(&metrics).filter(|l| l.get("severity").map(String::as_str) != Some("info")))
        },
    )
    .with_context(|| format!("agent log:\n{}", agent.log()))?;
    let dealloc: f64 = cluster
        .psql("SELECT dealloc FROM pg_stat_statements_info")?
        .trim()
        .parse()
        .context("pg_stat_statements_info.dealloc")?;
    ensure!(dealloc > 0.0, "the storm evicted nothing ({dealloc})");

    // The load stops: the counter stands still, and the finding clears.
    pgbench.stop()?;
    let changes = expect_cleared(&agent, INSTANCE, "pgss_evictions", "")?;
    ensure!(
        changes.keys().any(|s| s == "warning" || s == "critical"),
        "the storm was not logged as a warning or worse: {changes:?}"
    );
    stop(agent)
}

#[test]
fn an_instance_without_pg_stat_statements_is_not_sent_queries_that_fail() -> Result<()> {
    const INSTANCE: &str = "pgscope_no_pgss";
    require_root_and_bpf();
    let cluster = PgCluster::start_with(&PgInstall::distro()?, &[("cluster_name", INSTANCE)])?;
    let (_capture, agent) = start_agent(&cluster)?;
    wait_intervals(&agent, 2)?;
    // The agent looked for the eviction counter and found no extension: that must not be an
    // error in the DBA's server log at every look.
    let log = cluster.server_log();
    ensure!(
        !log.contains("pg_stat_statements_info"),
        "the agent's look for pg_stat_statements left errors in the server log:\n{log}"
    );
    stop(agent)
}
