//! The pathology suite's cases beside those of `findings.rs`: each a real cluster set up the way
//! real ones are, a few seconds of load, the finding that names the mechanism with its figure
//! checked against a measurement pgscope takes no part in (Postgres' own views, perf's own
//! uprobe), and a control of the same shape that raises no warning or critical finding. Assertions read the `--json` findings (rule,
//! severity, statements, figures), not the console's wording.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::app_database::{distinct_selects_in, pgbench_in, psql_in};
use pgscope_tests::findings_json::{describe_findings, findings_while, JsonFinding};
use pgscope_tests::uprobe_count::UprobeEvent;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace};

/// The largest ratio between pgscope's figure and the independent one, either way.
const AGREEMENT_FACTOR: f64 = 2.0;

fn within_factor(pgscope: f64, independent: f64) -> bool {
    pgscope > 0.0
        && independent > 0.0
        && pgscope / independent <= AGREEMENT_FACTOR
        && independent / pgscope <= AGREEMENT_FACTOR
}

/// The warning and critical findings: what a DBA is asked to act on.
fn alarms(findings: &[JsonFinding]) -> Vec<&JsonFinding> {
    findings.iter().filter(|f| f.is_alarm()).collect()
}

/// What a trace of the eviction workload found, and pg_stat_statements_info.dealloc's increase
/// over it as read from database `app`.
struct EvictionRun {
    findings: Vec<JsonFinding>,
    dealloc_increase: f64,
}

/// 16 clients running 128 distinct selects in database `app`, the only database where
/// pg_stat_statements is created, with `pg_stat_statements.max` = `max`; traced with
/// `--instance --json`.
fn evictions_in_app_database(max: &str) -> Result<EvictionRun> {
    let cluster = PgCluster::start_with(
        &PgInstall::distro()?,
        &[
            ("shared_preload_libraries", "pg_stat_statements"),
            ("pg_stat_statements.max", max),
        ],
    )?;
    cluster.psql("CREATE DATABASE app")?;
    psql_in(&cluster, "app", "CREATE EXTENSION pg_stat_statements")?;
    ensure!(
        cluster.psql("SELECT to_regclass('pg_stat_statements') IS NULL")? == "t",
        "the extension must be absent from database postgres for this case"
    );
    let (_scripts, mut args) = distinct_selects_in(&cluster, "app", 16, 8)?;
    args.extend(["-n", "-c", "16", "-j", "2", "-T", "6"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let dealloc = || -> Result<f64> {
        let n = psql_in(&cluster, "app", "SELECT dealloc FROM pg_stat_statements_info")?;
        n.parse().with_context(|| format!("dealloc is `{n}`"))
    };
    let before = dealloc()?;
    let traced = findings_while(Trace::instance(cluster.data_dir()), || {
        pgbench_in(&cluster, "app", &args).map(drop)
    })?;
    let after = dealloc()?;
    Ok(EvictionRun {
        findings: traced.findings,
        dealloc_increase: after - before,
    })
}

#[test]
fn evictions_with_the_extension_in_an_application_database_are_named_with_their_count() -> Result<()> {
    require_root_and_bpf();
    let storm = evictions_in_app_database("100")?;
    eprintln!(
        "pg_stat_statements.max = 100, extension in `app` only:\n{}",
        describe_findings(&storm.findings)
    );
    let finding = storm
        .findings
        .iter()
        .find(|f| f.kind == "pgss_evictions" && f.is_alarm())
        .with_context(|| {
            format!(
                "128 distinct statements in 100 entries (dealloc rose by {} in database app), \
                 yet no warning or critical pgss_evictions finding:\n{}",
                storm.dealloc_increase,
                describe_findings(&storm.findings)
            )
        })?;
    ensure!(
        finding.number("pg_stat_statements.max") == Some("100"),
        "the eviction finding does not cite the setting that causes it, \
         pg_stat_statements.max = 100: {finding:#?}"
    );
    let evictions = finding.leading_number("evictions")?;
    eprintln!(
        "evictions: pgscope {evictions}, pg_stat_statements_info.dealloc in app rose by {}",
        storm.dealloc_increase
    );
    ensure!(
        within_factor(evictions, storm.dealloc_increase),
        "pgscope counted {evictions} evictions, pg_stat_statements_info.dealloc in database app \
         rose by {}: not within a factor of {AGREEMENT_FACTOR}",
        storm.dealloc_increase
    );

    let calm = evictions_in_app_database("5000")?;
    eprintln!(
        "pg_stat_statements.max = 5000, extension in `app` only:\n{}",
        describe_findings(&calm.findings)
    );
    ensure!(
        calm.dealloc_increase == 0.0,
        "the control evicted {} entries: it is not a control",
        calm.dealloc_increase
    );
    ensure!(
        alarms(&calm.findings).is_empty(),
        "every statement has its entry, yet warnings or criticals were raised:\n{}",
        describe_findings(&calm.findings)
    );
    Ok(())
}

/// What a trace of the hot select found, and what Postgres and perf counted of it meanwhile.
struct HotSelectRun {
    findings: Vec<JsonFinding>,
    queryid: String,
    /// Executions (`calls`) and plannings (`plans`) pg_stat_statements counted: one entry
    /// update each.
    calls: f64,
    plans: f64,
    /// s_lock calls from pg_stat_statements.c in the clients' backends, counted by perf's own
    /// uprobe over [`SPIN_WINDOW`]: entry updates that found the spinlock taken.
    spun: f64,
}

/// How long the clients run (perf counts over all of it).
const SPIN_WINDOW: Duration = Duration::from_secs(5);
const CLIENTS: usize = 8;

/// The pids of the backends serving connections named `application_name`.
fn backends_named(cluster: &PgCluster, application_name: &str) -> Result<Vec<u32>> {
    cluster
        .psql(&format!(
            "SELECT pid FROM pg_stat_activity WHERE application_name = '{application_name}'"
        ))?
        .lines()
        .map(|pid| {
            pid.parse()
                .with_context(|| format!("pg_stat_activity gave pid `{pid}`"))
        })
        .collect()
}

/// The role the hot select's clients connect as: track_planning is given to it alone.
const WORKLOAD_ROLE: &str = "app";

/// [`CLIENTS`] clients running pgbench's select-only statement over the simple protocol
/// (planned at every execution, so that with track_planning = on its entry is updated twice per
/// execution; a prepared statement with a generic plan is planned once and would not show it),
/// traced with pgss_store and s_lock probed at every call. The clients connect as role
/// [`WORKLOAD_ROLE`], which has `track_planning` from `ALTER ROLE … SET`; the server (and so
/// pgscope's own session) has the opposite value, as real servers tuned per application do.
fn hot_select_with_track_planning(track_planning: &str) -> Result<HotSelectRun> {
    let server_value = if track_planning == "on" { "off" } else { "on" };
    let cluster = PgCluster::start_with_pg_stat_statements(
        &PgInstall::distro()?,
        &[("pg_stat_statements.track_planning", server_value)],
    )?;
    cluster.pgbench(&["-i", "-q", "-s", "1"])?;
    cluster.psql(&format!(
        "CREATE ROLE {WORKLOAD_ROLE} LOGIN; \
         GRANT SELECT ON ALL TABLES IN SCHEMA public TO {WORKLOAD_ROLE}; \
         ALTER ROLE {WORKLOAD_ROLE} SET pg_stat_statements.track_planning = {track_planning}"
    ))?;
    cluster.psql("SELECT pg_stat_statements_reset()")?;
    // s_lock(lock, file, line, func): the file, in the second argument's register, tells the
    // entry's spinlock (pg_stat_statements.c) from any other.
    let spins = UprobeEvent::add(
        &cluster.install().bin("postgres"),
        "s_lock",
        Some("file=+0(%si):string"),
    )?
    .filtered("file ~ \"*pg_stat_statements.c\"");
    let trace = Trace::instance(cluster.data_dir())
        .probes("pgss_store,s_lock")
        .probe_budget("none");
    let clients = CLIENTS.to_string();
    let traced = findings_while(trace, || {
        // The last -U wins over the superuser the cluster's clients connect as.
        let pgbench = cluster.spawn_pgbench(
            &[
                "-U",
                WORKLOAD_ROLE,
                "-n",
                "-S",
                "-M",
                "simple",
                "-c",
                &clients,
                "-j",
                "2",
                "-T",
                "600",
            ],
            CLIENTS,
        )?;
        let backends = backends_named(&cluster, pgbench.tag())?;
        let spun = spins.count_in(&backends, SPIN_WINDOW)?;
        pgbench.stop()?;
        Ok(spun)
    })?;
    let queryid = cluster.pgbench_select_queryid()?;
    let counts = cluster.psql(&format!(
        "SELECT calls, plans FROM pg_stat_statements WHERE queryid = {queryid}"
    ))?;
    let (calls, plans) = counts
        .split_once('|')
        .and_then(|(c, p)| Some((c.parse().ok()?, p.parse().ok()?)))
        .with_context(|| format!("pg_stat_statements gave `{counts}` for calls and plans"))?;
    Ok(HotSelectRun {
        findings: traced.findings,
        queryid,
        calls,
        plans,
        spun: traced.measured as f64,
    })
}

/// Whether `finding` is about pg_stat_statements' entry spinlock.
fn names_entry_spinlock(finding: &JsonFinding) -> bool {
    finding.names_function("pgss_store") || finding.names_function("s_lock")
}

#[test]
fn track_planning_on_a_hot_statement_is_named_by_its_entry_spinlock() -> Result<()> {
    require_root_and_bpf();
    let on = hot_select_with_track_planning("on")?;
    eprintln!(
        "track_planning = on for the role, off for the server: queryid {} calls {} plans {}\n{}",
        on.queryid,
        on.calls,
        on.plans,
        describe_findings(&on.findings)
    );
    let finding = on
        .findings
        .iter()
        .find(|f| f.kind == "spin_site" && f.queryids.contains(&on.queryid) && f.names_function("pgss_store"))
        .with_context(|| {
            format!(
                "{CLIENTS} clients updating queryid {}'s entry twice per execution ({} calls, {} \
                 plans, {} spins counted by perf), yet no finding names its spinlock in \
                 pgss_store:\n{}",
                on.queryid,
                on.calls,
                on.plans,
                on.spun,
                describe_findings(&on.findings)
            )
        })?;
    // "12.3% of 45678": the share of the entry's updates that spun, of all its updates.
    let updates: f64 = finding
        .number("entry updates that spun")
        .and_then(|v| v.split(" of ").nth(1))
        .and_then(|n| n.trim().parse().ok())
        .with_context(|| format!("no count of the entry's updates in {finding:#?}"))?;
    // The clients' role has it on, the server and pgscope's own session off: the finding
    // quotes the value the backends ran with, and where it came from.
    let quoted = finding.number("pg_stat_statements.track_planning");
    ensure!(
        quoted == Some("on (ALTER ROLE app SET, as the statement's backends ran)"),
        "the finding does not cite the setting that doubles the entry's updates, \
         pg_stat_statements.track_planning = on from ALTER ROLE {WORKLOAD_ROLE} SET (the server \
         has it off), but {quoted:?}: {finding:#?}"
    );
    let independent = on.calls + on.plans;
    let spun = finding.leading_number("acquisitions that spun")?;
    eprintln!(
        "entry updates: pgscope {updates} pgss_store calls, pg_stat_statements calls + plans \
         {independent}\nspins on the entry: pgscope {spun} s_lock calls, perf's uprobe {}; \
         share of the statement's time {:?}, severity {}",
        on.spun,
        finding.number("share of the statement's time"),
        finding.severity
    );
    ensure!(
        within_factor(updates, independent),
        "pgscope counted {updates} updates of the entry, pg_stat_statements {} calls + {} plans: \
         not within a factor of {AGREEMENT_FACTOR}",
        on.calls,
        on.plans
    );
    ensure!(
        within_factor(spun, on.spun),
        "pgscope counted {spun} acquisitions of the entry's spinlock that spun, perf's uprobe on \
         s_lock {}: not within a factor of {AGREEMENT_FACTOR}",
        on.spun
    );

    let off = hot_select_with_track_planning("off")?;
    eprintln!(
        "track_planning = off for the role, on for the server: queryid {} calls {} plans {}, perf's uprobe counted {} spins\n{}",
        off.queryid,
        off.calls,
        off.plans,
        off.spun,
        describe_findings(&off.findings)
    );
    ensure!(
        off.plans == 0.0,
        "track_planning = off for role {WORKLOAD_ROLE} (on for the server), yet \
         pg_stat_statements counted {} plans",
        off.plans
    );
    // Whatever finding names the entry quotes the role's value, not the server's.
    for finding in off.findings.iter().filter(|f| names_entry_spinlock(f)) {
        let quoted = finding.number("pg_stat_statements.track_planning");
        ensure!(
            quoted.is_none_or(|q| q.starts_with("off (ALTER ROLE app SET")),
            "role {WORKLOAD_ROLE} has track_planning off, yet {quoted:?}: {finding:#?}"
        );
    }
    let named: Vec<&JsonFinding> = alarms(&off.findings)
        .into_iter()
        .filter(|f| names_entry_spinlock(f))
        .collect();
    ensure!(
        named.is_empty(),
        "one entry update per execution, yet a warning or critical names the entry's spinlock:\n{}",
        describe_findings(&off.findings)
    );
    Ok(())
}

/// pgbench's TPC-B-like statements at scale 10 from two clients: nothing an operator should
/// act on.
#[test]
fn a_plain_pgbench_at_defaults_raises_no_warning() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-q", "-s", "10"])?;
    let traced = findings_while(Trace::instance(cluster.data_dir()), || {
        cluster
            .pgbench(&["-n", "-c", "2", "-j", "2", "-T", "8"])
            .map(drop)
    })?;
    let (output, findings) = (traced.output, traced.findings);
    eprintln!("pgbench TPC-B-like:\n{}", describe_findings(&findings));
    ensure!(
        output.stdout.contains("UPDATE pgbench_accounts"),
        "the trace did not see pgbench's statements:\n{}",
        output.stdout
    );
    ensure!(
        alarms(&findings).is_empty(),
        "a healthy pgbench raised warnings or criticals:\n{}",
        describe_findings(&alarms(&findings).into_iter().cloned().collect::<Vec<_>>())
    );
    Ok(())
}
