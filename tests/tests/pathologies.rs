//! The pathology suite of issue 36: classes of trouble DBAs meet, none of them one of the seven
//! probed functions, each named by a finding written from Postgres' subsystems and its own
//! counters (no rule knows the case), each with a control that differs by the one setting the
//! evidence blames, and a figure from outside pgscope to check the finding's against.
//!
//! Each case prints `case=<name> named=yes|no control_alarms=N` (repeated at the end of
//! `make test`) and fails unless the case is
//! named and its control raises no warning or critical finding: flipping the setting must make
//! the finding go away (the advice does not recommend the value that causes it).
//!
//! The cases share one cluster (the distro build); each keeps its tables in a database of its
//! own and sets the case's setting on that database, so that the control is the same cluster
//! with only that setting changed.

use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::app_database::psql_in;
use pgscope_tests::findings_json::{
    describe_cpu, describe_findings, findings_while, fresh_database, queryid_in, shared_cluster, JsonFinding,
    CPU_TIMEOUT,
};
use pgscope_tests::process::cpu_time_with_reaped_children;
use pgscope_tests::{
    expected_samples, perf_record, require_root_and_bpf, wait_for, CpuWindow, PgCluster, PgInstall,
    SchedTime, Trace,
};

/// The largest ratio between pgscope's figure and the independent one, either way.
const AGREEMENT_FACTOR: f64 = 2.0;
/// CPU time the workload's backends use while traced: 300 samples at 99 Hz, many times the 20
/// a per-statement rule needs, and a dozen executions of each case's statement.
const CASE_CPU: Duration = Duration::from_secs(3);
/// Clients running each case's statement.
const CLIENTS: usize = 2;

/// One case: its database, tables, statement and the plan node it is about.
#[derive(Clone, Copy)]
struct Case {
    database: &'static str,
    setup: &'static str,
    sql: &'static str,
    /// Empty for a statement without a plan.
    plan_node: &'static str,
    /// Run once before the trace (empty: nothing), e.g. to load what a control keeps cached.
    warm_up: &'static str,
    /// Sent as a prepared statement (pgbench `-M prepared`) rather than as text.
    prepared: bool,
    /// Statements run after `sql` in the same transaction (empty: `sql` alone, autocommitted),
    /// then COMMIT, unless they end the transaction themselves (`ROLLBACK`).
    then: &'static str,
}

/// What one traced run of a case gave.
struct CaseRun {
    findings: Vec<JsonFinding>,
    queryid: String,
    /// pg_stat_database.temp_bytes of the case's database, its growth over the workload.
    temp_bytes: f64,
    used: SchedTime,
}

/// Runs `sql` from [`CLIENTS`] pgbench clients in `database` (created afresh with `setup`,
/// `settings` set on it, without parallel workers) until their backends used [`CASE_CPU`],
/// traced with `--instance --json`.
fn run_case(cluster: &PgCluster, case: &Case, settings: &[(&str, &str)]) -> Result<CaseRun> {
    let Case {
        database,
        setup,
        sql,
        plan_node,
        warm_up,
        prepared,
        then,
    } = *case;
    fresh_database(cluster, database)?;
    psql_in(cluster, database, setup)?;
    for (name, value) in settings {
        psql_in(
            cluster,
            database,
            &format!("ALTER DATABASE {database} SET {name} = '{value}'"),
        )?;
    }
    // One process per execution: a parallel plan splits the operator (and its work_mem) over
    // workers, which is another case.
    psql_in(
        cluster,
        database,
        &format!("ALTER DATABASE {database} SET max_parallel_workers_per_gather = 0"),
    )?;
    psql_in(cluster, database, "ANALYZE")?;
    // The case is about one operator: a plan without it is another case. (None for a statement
    // without a plan: DDL.)
    if !plan_node.is_empty() {
        let plan = psql_in(cluster, database, &format!("EXPLAIN (COSTS OFF) {sql}"))?;
        ensure!(
            plan.contains(plan_node),
            "case {database} needs a plan with a {plan_node} node with {settings:?}, the planner \
             chose:\n{plan}"
        );
    }
    if !warm_up.is_empty() {
        psql_in(cluster, database, warm_up)?;
    }
    let script = if then.is_empty() {
        Script::new(sql)?
    } else if then.ends_with("ROLLBACK") {
        Script::new(&format!("BEGIN;\n{sql};\n{then}"))?
    } else {
        Script::new(&format!("BEGIN;\n{sql};\n{then};\nCOMMIT"))?
    };
    let temp_bytes = || -> Result<f64> {
        let bytes = psql_in(
            cluster,
            database,
            "SELECT temp_bytes FROM pg_stat_database WHERE datname = current_database()",
        )?;
        bytes
            .trim()
            .parse()
            .with_context(|| format!("temp_bytes is `{bytes}`"))
    };
    let before = temp_bytes()?;
    let traced = findings_while(Trace::instance(cluster.data_dir()), || {
        let clients = CLIENTS.to_string();
        let args = [
            "-n",
            "-f",
            script.path(),
            "-c",
            &clients,
            "-j",
            &clients,
            "-M",
            if prepared { "prepared" } else { "simple" },
            "-T",
            "600",
        ];
        let mut pgbench = cluster.spawn_pgbench_in(database, &args, CLIENTS)?;
        let used = pgbench.run_for_cpu(CASE_CPU, CPU_TIMEOUT)?;
        pgbench.stop()?;
        Ok(used)
    })?;
    // Backends report their temporary files' sizes as the files close and flush them at exit:
    // pgbench has stopped, so every file of the workload is counted.
    let after = temp_bytes()?;
    // The text as pg_stat_statements normalizes it: up to the first constant.
    let prefix: String = sql.chars().take_while(|c| !c.is_ascii_digit()).take(30).collect();
    let queryid = queryid_in(cluster, database, &prefix)?;
    Ok(CaseRun {
        findings: traced.findings,
        queryid,
        temp_bytes: after - before,
        used: traced.measured,
    })
}

/// A pgbench script in a directory the cluster's OS user can read (pgbench runs as it).
struct Script {
    _dir: tempfile::TempDir,
    path: String,
}

impl Script {
    fn new(sql: &str) -> Result<Self> {
        let (dir, path) = pgscope_tests::workload::readable_script("case.sql", &format!("{sql};\n"))?;
        Ok(Self {
            path: path_string(&path)?,
            _dir: dir,
        })
    }

    fn path(&self) -> &str {
        &self.path
    }
}

fn path_string(path: &Path) -> Result<String> {
    path.to_str()
        .map(str::to_owned)
        .with_context(|| format!("{} is not UTF-8", path.display()))
}

/// The warning and critical findings of a run.
fn alarms(findings: &[JsonFinding]) -> Vec<&JsonFinding> {
    findings.iter().filter(|f| f.is_alarm()).collect()
}

/// Prints the case's line and fails unless it was named and its control raised nothing.
fn judge(case: &str, named: Option<&JsonFinding>, control: &CaseRun) -> Result<()> {
    judge_findings(case, named, &control.findings, &describe_cpu(&control.used))
}

/// [`judge`] of a control's `findings`, its workload described by `control`.
fn judge_findings(
    case: &str,
    named: Option<&JsonFinding>,
    findings: &[JsonFinding],
    control: &str,
) -> Result<()> {
    let control_alarms = alarms(findings);
    // Written past the test harness' capture (which keeps a passing test's print!s), on a line
    // of its own after the harness' `test … ` prefix: the line is the suite's report in `make
    // test`'s log, whose end repeats every case's.
    let line = format!(
        "\ncase={case} named={} control_alarms={}\n",
        if named.is_some() { "yes" } else { "no" },
        control_alarms.len()
    );
    std::io::stdout().lock().write_all(line.as_bytes())?;
    ensure!(named.is_some(), "case {case} was not named");
    ensure!(
        control_alarms.is_empty(),
        "the control of case {case} raised alarms ({control}):\n{}",
        describe_findings(findings)
    );
    Ok(())
}

/// The warning or critical finding of rule `kind` in `run` that covers its statement, if any.
fn named_by<'a>(run: &'a CaseRun, kind: &str) -> Option<&'a JsonFinding> {
    run.findings
        .iter()
        .find(|f| f.kind == kind && f.is_alarm() && f.queryids.contains(&run.queryid))
}

/// Logs what a run of a case found, with the CPU its backends were given.
fn log_run(what: &str, run: &CaseRun) {
    eprintln!(
        "{what}; backends {}; temp_bytes rose by {}:\n{}",
        describe_cpu(&run.used),
        run.temp_bytes,
        describe_findings(&run.findings)
    );
}

/// A count of EXPLAIN (ANALYZE, BUFFERS)'s top node for one execution of `case`'s statement:
/// the number after `key` in the first `Buffers:` line's part from `part` on (`temp ` and
/// `written=`: the temporary blocks it wrote).
fn explain_buffers(cluster: &PgCluster, case: &Case, part: &str, key: &str) -> Result<f64> {
    let explain = psql_in(
        cluster,
        case.database,
        &format!("EXPLAIN (ANALYZE, BUFFERS) {}", case.sql),
    )?;
    explain
        .lines()
        .filter(|line| line.contains("Buffers:"))
        .find_map(|line| line.split(part).nth(1)?.split(key).nth(1))
        .and_then(|n| n.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("EXPLAIN shows no `{part}… {key}` in its buffers:\n{explain}"))
}

/// Checks a spill finding's blocks written per call against EXPLAIN (ANALYZE, BUFFERS) of one
/// execution (`temp … written=N` of its top node), and that the database's temp_bytes grew.
/// (Not the bytes themselves: a merge of many runs reuses its files' blocks, so a sort writes
/// more blocks than its files' sizes, which pg_stat_database counts.)
fn check_written(cluster: &PgCluster, case: &Case, finding: &JsonFinding, run: &CaseRun) -> Result<()> {
    let per_call = finding.leading_number("temporary blocks written per call")?;
    let written = explain_buffers(cluster, case, "temp ", "written=")?;
    eprintln!(
        "case={}: {per_call} temporary blocks written per call (pgscope, from pg_stat_statements), \
         EXPLAIN (ANALYZE, BUFFERS) {written}; pg_stat_database.temp_bytes rose by {}",
        case.database, run.temp_bytes
    );
    ensure!(
        run.temp_bytes > 0.0,
        "case {}: pg_stat_database counted no temporary bytes",
        case.database
    );
    ensure!(
        per_call / written <= AGREEMENT_FACTOR && written / per_call <= AGREEMENT_FACTOR,
        "case {}: the finding says {per_call} temporary blocks written per call, EXPLAIN \
         (ANALYZE, BUFFERS) {written}: not within a factor of {AGREEMENT_FACTOR}",
        case.database
    );
    Ok(())
}

/// A sort of 200000 rows by a text key, the classic "why is this report slow": with 1 MB of
/// work_mem it writes its runs to temporary files and merges them; the control has 64 MB and
/// sorts in memory.
const SORT_SPILL: SpillCase = SpillCase {
    case: Case {
        database: "sort_spill",
        setup: "CREATE TABLE events AS SELECT g AS id, md5(g::text) AS tag \
                FROM generate_series(1, 200000) g",
        sql: "SELECT id, tag FROM events ORDER BY tag OFFSET 199999",
        plan_node: "Sort",
        warm_up: "",
        prepared: false,
        then: "",
    },
    work_mem: ("1MB", "64MB"),
    operator: "sorting",
};

/// A hash join whose inner side (300000 rows) outgrows 1 MB of work_mem: the join splits into
/// batches written to temporary files; the control has 256 MB, one batch in memory.
const HASH_SPILL: SpillCase = SpillCase {
    case: Case {
        database: "hash_spill",
        setup: "CREATE TABLE orders AS SELECT g AS id, g % 1000 AS customer, md5(g::text) AS note \
                FROM generate_series(1, 300000) g; \
                CREATE TABLE lines AS SELECT g AS id, (g * 7) % 300000 + 1 AS order_id \
                FROM generate_series(1, 300000) g",
        sql: "SELECT count(*), max(o.note) FROM lines l JOIN orders o ON o.id = l.order_id",
        plan_node: "Hash Join",
        warm_up: "",
        prepared: false,
        then: "",
    },
    work_mem: ("1MB", "256MB"),
    operator: "hash join",
};

/// An operator that outgrows work_mem: the case, work_mem for it and for its control, and the
/// words the finding's title names the operator with.
struct SpillCase {
    case: Case,
    work_mem: (&'static str, &'static str),
    operator: &'static str,
}

/// Runs `spill` and its control on `cluster` and judges them as case `name`.
fn spill_case(cluster: &PgCluster, name: &str, spill: &SpillCase) -> Result<()> {
    let SpillCase {
        case,
        work_mem: (small, large),
        operator,
    } = spill;
    let run = run_case(cluster, case, &[("work_mem", small)])?;
    log_run(&format!("{name}: work_mem = {small}"), &run);
    let named = named_by(&run, "operator_spill");
    if let Some(finding) = named {
        ensure!(
            finding.title.contains(operator),
            "the spill finding does not say it is the {operator}: {finding:#?}"
        );
        check_written(cluster, case, finding, &run)?;
    }
    let control = run_case(cluster, case, &[("work_mem", large)])?;
    log_run(&format!("{name}: work_mem = {large}"), &control);
    ensure!(
        control.temp_bytes == 0.0,
        "the control of {name} wrote {} bytes to temporary files: it is not a control",
        control.temp_bytes
    );
    judge(name, named, &control)
}

#[test]
fn a_sort_outgrowing_work_mem_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    spill_case(&cluster, "sort_spill", &SORT_SPILL)
}

#[test]
fn a_hash_join_outgrowing_work_mem_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    spill_case(&cluster, "hash_spill", &HASH_SPILL)
}

/// The spill, planning, collation, PL/pgSQL, idle-transaction and migration-queue cases on the
/// upstream build of Postgres 17 (no frame pointers, its own
/// pg_stat_statements columns), in a cluster beside the shared one: the rules read the
/// subsystems' functions and the counters as 17 has them.
#[test]
fn cases_are_named_on_postgres_17_too() -> Result<()> {
    require_root_and_bpf();
    let shared = shared_cluster(&[])?;
    let install = PgInstall::upstream(17)?;
    let cluster = PgCluster::start_beside(
        &install,
        &[("shared_preload_libraries", "pg_stat_statements")],
        &shared,
    )?;
    spill_case(&cluster, "sort_spill_pg17", &SORT_SPILL)?;
    spill_case(&cluster, "hash_spill_pg17", &HASH_SPILL)?;
    planning_case(&cluster, "planning_every_execution_pg17")?;
    collation_case(&cluster, "collation_sort_pg17")?;
    plpgsql_case(&cluster, "plpgsql_per_row_pg17")?;
    idle_in_transaction_case(&cluster, "idle_in_transaction_pg17")?;
    ddl_lock_queue_case(&cluster, "ddl_lock_queue_pg17")
}

/// JIT's time per execution as EXPLAIN ANALYZE reports it (`Timing: … Total N ms`), from the
/// third execution in one session: the first ones also load LLVM into the backend.
fn explain_jit_ms(cluster: &PgCluster, database: &str, sql: &str) -> Result<f64> {
    let explain = format!("EXPLAIN (ANALYZE) {sql}");
    let out = psql_in(cluster, database, &[explain.as_str(); 3].join("; "))?;
    let total = out
        .rsplit("Total ")
        .next()
        .filter(|_| out.contains("Total "))
        .and_then(|tail| tail.split_whitespace().next())
        .with_context(|| format!("EXPLAIN ANALYZE shows no JIT timing:\n{out}"))?;
    total
        .parse()
        .with_context(|| format!("JIT's total is `{total}` in:\n{out}"))
}

/// A short aggregate compiled with JIT at every execution, because the database has JIT's cost
/// thresholds at 0 (as set once "to try JIT" and left): compiling, inlining and optimizing take
/// longer than running. Control: the thresholds at their defaults, where this plan's cost is
/// far below them and nothing is compiled.
#[test]
fn jit_compiling_more_than_it_saves_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    let case = Case {
        database: "jit_overhead",
        setup: "CREATE TABLE readings AS SELECT g AS id, g % 100 AS sensor, random() AS v1, \
                random() AS v2 FROM generate_series(1, 20000) g",
        sql: "SELECT sensor, sum(v1 * 2 + v2), avg(v1 - v2), max(v1 + v2 * 3) FROM readings \
              WHERE v1 > 0.1 GROUP BY sensor",
        plan_node: "Aggregate",
        warm_up: "",
        prepared: false,
        then: "",
    };
    let eager = [
        ("jit", "on"),
        ("jit_above_cost", "0"),
        ("jit_inline_above_cost", "0"),
        ("jit_optimize_above_cost", "0"),
    ];
    let compiling = run_case(&cluster, &case, &eager)?;
    log_run("JIT thresholds at 0", &compiling);
    let named = named_by(&compiling, "jit_compilation");
    if let Some(finding) = named {
        let pgscope_ms = finding.leading_number("JIT time per call")?;
        let explain_ms = explain_jit_ms(&cluster, case.database, case.sql)?;
        eprintln!("case=jit_overhead: JIT per call {pgscope_ms} ms (pgscope, from pg_stat_statements), EXPLAIN ANALYZE {explain_ms} ms");
        ensure!(
            pgscope_ms / explain_ms <= AGREEMENT_FACTOR && explain_ms / pgscope_ms <= AGREEMENT_FACTOR,
            "the finding says {pgscope_ms} ms of JIT per call, EXPLAIN ANALYZE {explain_ms} ms: \
             not within a factor of {AGREEMENT_FACTOR}"
        );
    }
    let control = run_case(&cluster, &case, &[("jit", "on")])?;
    log_run("JIT thresholds at their defaults", &control);
    judge("jit_overhead", named, &control)
}

/// Scans of a 50 MB table (4 rows a page) with 16 MB of shared_buffers: a table over a quarter of
/// shared_buffers is scanned through a small ring of buffers, so every scan reads every page in
/// again (from the kernel's page cache here, from disk on a server whose memory is busy).
/// Control: 256 MB, with the table loaded before the trace, all hits.
#[test]
fn a_working_set_larger_than_shared_buffers_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let case = Case {
        database: "buffer_misses",
        setup: "CREATE TABLE items AS SELECT g AS id, repeat('x', 1800) AS payload \
                FROM generate_series(1, 25000) g",
        sql: "SELECT count(*) FROM items WHERE id < 0",
        plan_node: "Seq Scan on items",
        warm_up: "SELECT count(*) FROM items",
        prepared: false,
        then: "",
    };
    let mut cluster = shared_cluster(&[("shared_buffers", "16MB")])?;
    let misses = run_case(&cluster, &case, &[])?;
    log_run("shared_buffers = 16MB", &misses);
    let named = named_by(&misses, "shared_buffer_misses");
    if let Some(finding) = named {
        let per_call = finding.leading_number("blocks read into shared buffers per call")?;
        let read = explain_buffers(&cluster, &case, "shared ", "read=")?;
        eprintln!(
            "case=buffer_misses: {per_call} blocks read per call (pgscope, from pg_stat_statements), \
             EXPLAIN (ANALYZE, BUFFERS) {read}"
        );
        ensure!(
            per_call / read <= AGREEMENT_FACTOR && read / per_call <= AGREEMENT_FACTOR,
            "the finding says {per_call} blocks read per call, EXPLAIN (ANALYZE, BUFFERS) \
             {read}: not within a factor of {AGREEMENT_FACTOR}"
        );
    }
    cluster.configure(&[("shared_buffers", "256MB")])?;
    let control = run_case(&cluster, &case, &[])?;
    log_run("shared_buffers = 256MB", &control);
    judge("buffer_misses", named, &control)
}

/// The ten tables of [`TEN_WAY_JOIN`], 100 rows each, joined by primary key.
const TEN_TABLES: &str = "DO $$ BEGIN FOR i IN 1..10 LOOP EXECUTE format('CREATE TABLE t%s \
     (id int PRIMARY KEY, ref int, v int); INSERT INTO t%s SELECT g, g, g \
     FROM generate_series(1, 100) g', i, i); END LOOP; END $$";

/// A lookup through ten tables, the shape an ORM gives a page that loads an object with its
/// relations: every join order the planner weighs (join_collapse_limit is 8) for one row each.
const TEN_WAY_JOIN: &str = "SELECT count(*) FROM t1 JOIN t2 ON t2.id = t1.ref \
     JOIN t3 ON t3.id = t2.ref JOIN t4 ON t4.id = t3.ref JOIN t5 ON t5.id = t4.ref \
     JOIN t6 ON t6.id = t5.ref JOIN t7 ON t7.id = t6.ref JOIN t8 ON t8.id = t7.ref \
     JOIN t9 ON t9.id = t8.ref JOIN t10 ON t10.id = t9.ref WHERE t1.id = 5";

/// EXPLAIN (ANALYZE, SUMMARY)'s planning and execution times of one execution of `case`'s
/// statement, in ms, from the third in one session (the first ones also fill the catalog
/// caches).
fn explain_summary(cluster: &PgCluster, case: &Case) -> Result<(f64, f64)> {
    let explain = format!("EXPLAIN (ANALYZE, SUMMARY) {}", case.sql);
    let out = psql_in(cluster, case.database, &[explain.as_str(); 3].join("; "))?;
    let last = |label: &str| -> Result<f64> {
        out.rsplit(label)
            .next()
            .filter(|_| out.contains(label))
            .and_then(|tail| tail.split_whitespace().next())
            .and_then(|ms| ms.parse().ok())
            .with_context(|| format!("EXPLAIN shows no `{label}`:\n{out}"))
    };
    Ok((last("Planning Time:")?, last("Execution Time:")?))
}

/// A statement sent as text is parsed and planned at every execution: here 1.5 ms of planning
/// against 0.2 ms of execution by EXPLAIN, the "fast in EXPLAIN ANALYZE, slow in the
/// application" of a many-join query. pg_stat_statements times its execution only
/// (track_planning is off by default, parsing is never timed). Control: the same statement
/// prepared (`-M prepared`), planned once per session.
fn planning_case(cluster: &PgCluster, name: &str) -> Result<()> {
    let case = Case {
        database: "planning",
        setup: TEN_TABLES,
        sql: TEN_WAY_JOIN,
        plan_node: "Nested Loop",
        warm_up: "",
        prepared: false,
        then: "",
    };
    let planned = run_case(cluster, &case, &[])?;
    log_run("sent as text", &planned);
    let named = named_by(&planned, "planning_dominated");
    if let Some(finding) = named {
        let share = finding.leading_number("planning")? / 100.0;
        let (plan_ms, exec_ms) = explain_summary(cluster, &case)?;
        let explain_share = plan_ms / (plan_ms + exec_ms);
        eprintln!(
            "case={name}: planning {:.1}% of the statement's CPU (pgscope), {:.1}% of planning \
             and execution by EXPLAIN (ANALYZE, SUMMARY) ({plan_ms} ms and {exec_ms} ms)",
            100.0 * share,
            100.0 * explain_share
        );
        ensure!(
            share / explain_share <= AGREEMENT_FACTOR && explain_share / share <= AGREEMENT_FACTOR,
            "the finding says planning is {:.1}% of the statement's CPU, EXPLAIN {:.1}% of its \
             planning and execution: not within a factor of {AGREEMENT_FACTOR}",
            100.0 * share,
            100.0 * explain_share
        );
    }
    let control = run_case(
        cluster,
        &Case {
            prepared: true,
            ..case
        },
        &[],
    )?;
    log_run("prepared", &control);
    judge(name, named, &control)
}

#[test]
fn planning_at_every_execution_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    planning_case(&cluster, "planning_every_execution")
}

/// Column `column` of pg_stat_statements' row of `queryid` in `database`.
fn pgss_column(cluster: &PgCluster, database: &str, queryid: &str, column: &str) -> Result<f64> {
    number_in(
        cluster,
        database,
        &format!(
            "SELECT {column} FROM pg_stat_statements WHERE queryid = {queryid} AND \
             dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ),
    )
}

/// A counter every session increments, kept in one row, updated first in a transaction that
/// then does its other work (here 2 ms of it): each UPDATE waits for the transaction before it
/// to commit (`Lock:transactionid`), the queue behind an order counter, a stock level or a
/// rate limit. Commits are asynchronous here, so that the queue is the row's, not the WAL
/// flush's. Control: the same statement with the counter spread over 100000 rows (the slot
/// is the backend's pid modulo the slots), the constant the advice names; the two clients
/// then never meet.
///
/// Independent figure: pg_stat_statements' mean execution time against the control's, whose
/// executions do the same work without the queue: 1 - control/case is the share of the case's
/// executions spent waiting.
fn hot_row_case(cluster: &PgCluster, name: &str) -> Result<()> {
    let case = Case {
        database: "hot_row",
        setup: "CREATE TABLE counters (slot int PRIMARY KEY, n bigint NOT NULL); \
                INSERT INTO counters SELECT g, 0 FROM generate_series(0, 99999) g",
        sql: "UPDATE counters SET n = n + 1 WHERE slot = pg_backend_pid() % 1",
        plan_node: "Update on counters",
        warm_up: "",
        prepared: false,
        then: "SELECT count(*) FROM generate_series(1, 20000)",
    };
    let asynchronous = [("synchronous_commit", "off")];
    let queued = run_case(cluster, &case, &asynchronous)?;
    log_run("one row", &queued);
    let named = named_by(&queued, "row_lock_contention");
    let queued_ms = pgss_column(cluster, case.database, &queued.queryid, "mean_exec_time")?;
    let spread = Case {
        sql: "UPDATE counters SET n = n + 1 WHERE slot = pg_backend_pid() % 100000",
        ..case
    };
    let control = run_case(cluster, &spread, &asynchronous)?;
    log_run("100000 rows", &control);
    let spread_ms = pgss_column(cluster, case.database, &control.queryid, "mean_exec_time")?;
    if let Some(finding) = named {
        let share = finding.leading_number("waiting for row locks, of its time")? / 100.0;
        let waiting = 1.0 - spread_ms / queued_ms;
        eprintln!(
            "case={name}: waiting for row locks {:.1}% of its time (pgscope); pg_stat_statements' \
             mean execution {queued_ms:.3} ms on one row, {spread_ms:.3} ms spread: {:.1}% of it \
             waiting",
            100.0 * share,
            100.0 * waiting
        );
        ensure!(
            waiting > 0.0 && share / waiting <= AGREEMENT_FACTOR && waiting / share <= AGREEMENT_FACTOR,
            "the finding says {:.1}% of its time waiting for row locks, pg_stat_statements' mean \
             execution times {:.1}%: not within a factor of {AGREEMENT_FACTOR}",
            100.0 * share,
            100.0 * waiting
        );
    }
    judge(name, named, &control)
}

#[test]
fn sessions_queueing_on_one_hot_row_are_named_and_their_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    hot_row_case(&cluster, "hot_row")
}

/// Functions of the collation providers and of Postgres' calls into them, as `perf` names
/// them: ICU's (`ucol_…`, and its C++ internals in the `icu_NN` namespace), the C library's
/// locale comparisons, and Postgres' comparator and collation entry points.
fn in_collation(frame: &str) -> bool {
    frame.starts_with("ucol_")
        || frame.starts_with("icu_")
        || [
            "varstr_cmp",
            "varstrfastcmp_locale",
            "pg_strcoll",
            "pg_strncoll",
            "pg_strxfrm",
            "pg_strnxfrm",
            "pg_strxfrm_prefix",
            "pg_strnxfrm_prefix",
            "strcoll_l",
            "__strcoll_l",
            "strxfrm_l",
            "__strxfrm_l",
        ]
        .contains(&frame)
}

/// The share of perf's samples of one backend with a frame `in_family` on the stack, while one
/// client ran `case`'s statement (in its database as [`run_case`] left it, with the case's
/// settings).
fn perf_share(cluster: &PgCluster, case: &Case, in_family: fn(&str) -> bool) -> Result<f64> {
    let script = Script::new(case.sql)?;
    let pgbench = cluster.spawn_pgbench_in(
        case.database,
        &["-n", "-f", script.path(), "-c", "1", "-T", "600"],
        1,
    )?;
    let backend = match pgbench.backend_pids()?.as_slice() {
        [pid] => *pid,
        pids => anyhow::bail!("pgbench's one client has backends {pids:?}"),
    };
    let dir = tempfile::tempdir()?;
    let window = CpuWindow::start(&[backend])?;
    let profile = perf_record(backend, PERF_SECONDS, PERF_HZ, dir.path())?;
    let used = window.used()?;
    pgbench.stop()?;
    let total = profile.total();
    // Judged against the backend's own CPU time over the recording, not the machine's speed.
    let expected = expected_samples(used.on_cpu, PERF_HZ);
    ensure!(
        total as f64 >= 0.5 * expected && total >= MIN_PERF_SAMPLES,
        "perf recorded {total} samples of backend {backend}, which was {:?} on CPU ({expected:.0} \
         samples at {PERF_HZ} Hz) and {:?} waiting for one",
        used.on_cpu,
        used.runnable
    );
    Ok(profile.count_where(|stack| stack.frames.iter().any(|f| in_family(f))) as f64 / total as f64)
}

/// Checks a family finding's share of its statement's CPU (the number after `label`) against
/// perf's share of one backend's samples under the same functions, within
/// [`AGREEMENT_FACTOR`].
fn check_family_share(
    cluster: &PgCluster,
    name: &str,
    case: &Case,
    finding: &JsonFinding,
    label: &str,
    in_family: fn(&str) -> bool,
) -> Result<()> {
    let share = finding.leading_number(label)? / 100.0;
    let perf = perf_share(cluster, case, in_family)?;
    eprintln!(
        "case={name}: {label} {:.1}% of its CPU (pgscope), {:.1}% of one backend's samples by perf",
        100.0 * share,
        100.0 * perf
    );
    ensure!(
        perf > 0.0 && share / perf <= AGREEMENT_FACTOR && perf / share <= AGREEMENT_FACTOR,
        "the finding says {:.1}% of its CPU {label}, perf {:.1}%: not within a factor of \
         {AGREEMENT_FACTOR}",
        100.0 * share,
        100.0 * perf
    );
    Ok(())
}

/// perf's recording of one backend for the collation's share: ~600 samples on a quiet machine,
/// a share known within ±4 points.
const PERF_SECONDS: Duration = Duration::from_secs(3);
const PERF_HZ: u32 = 199;
/// The fewest samples the comparison within a factor of 2 rests on (an error of ~14%, 1/√50):
/// a backend given a twelfth of a CPU over the recording still has them.
const MIN_PERF_SAMPLES: u64 = 50;

/// Text sorted under ICU's English collation: every comparison of the sort goes through ICU,
/// which weighs letters, accents and case in passes, where byte order would do for these
/// values (hashes used as keys). Control: the same column in the "C" collation, compared with
/// memcmp. Both sort in memory (64 MB of work_mem), so that the only difference is the
/// collation.
///
/// Independent figure: `perf record --call-graph dwarf` of one backend running the case, the
/// share of its samples under the providers' and Postgres' collation functions. (Not the
/// control's time against the case's: under "C" the sort still makes its keys and compares
/// them, so the difference is what the collation costs beyond that, not its share.)
fn collation_case(cluster: &PgCluster, name: &str) -> Result<()> {
    let case = Case {
        database: "icu_sort",
        setup: "CREATE TABLE customers AS SELECT g AS id, \
                md5(g::text) COLLATE \"en-x-icu\" AS name \
                FROM generate_series(1, 100000) g",
        sql: "SELECT name FROM customers ORDER BY name OFFSET 99999",
        plan_node: "Sort",
        warm_up: "",
        prepared: false,
        then: "",
    };
    let in_memory = [("work_mem", "64MB")];
    let icu = run_case(cluster, &case, &in_memory)?;
    log_run("ICU collation", &icu);
    let named = named_by(&icu, "collation_comparisons");
    if let Some(finding) = named {
        check_family_share(cluster, name, &case, finding, "CPU comparing text", in_collation)?;
    }
    let bytes = Case {
        setup: "CREATE TABLE customers AS SELECT g AS id, \
                md5(g::text) COLLATE \"C\" AS name \
                FROM generate_series(1, 100000) g",
        ..case
    };
    let control = run_case(cluster, &bytes, &in_memory)?;
    log_run("C collation", &control);
    judge(name, named, &control)
}

#[test]
fn text_sorted_under_a_linguistic_collation_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    collation_case(&cluster, "collation_sort")
}

/// A number from one row of `sql` in `database`.
fn number_in(cluster: &PgCluster, database: &str, sql: &str) -> Result<f64> {
    let value = psql_in(cluster, database, sql)?;
    value
        .trim()
        .parse()
        .with_context(|| format!("`{sql}` gave `{value}`, not a number"))
}

/// A WHERE clause calling a PL/pgSQL function for each of 20000 rows, the helper that "keeps
/// the rule in one place": its interpreter runs at every call. Control: the same function in
/// LANGUAGE sql, which the planner inlines into the filter.
///
/// Independent figure: the function's time in pg_stat_user_functions (track_functions = 'pl',
/// timed by Postgres around each call) against the statement's execution time in
/// pg_stat_statements.
fn plpgsql_case(cluster: &PgCluster, name: &str) -> Result<()> {
    let case = Case {
        database: "plpgsql_filter",
        setup: "CREATE TABLE accounts AS SELECT g AS id, \
                (ARRAY['active', 'trial', 'closed', 'frozen'])[g % 4 + 1] AS status \
                FROM generate_series(1, 20000) g; \
                CREATE FUNCTION is_open(s text) RETURNS boolean LANGUAGE plpgsql IMMUTABLE \
                AS $$ BEGIN RETURN s IN ('active', 'trial'); END $$",
        sql: "SELECT count(*) FROM accounts WHERE is_open(status)",
        plan_node: "Seq Scan on accounts",
        warm_up: "",
        prepared: false,
        then: "",
    };
    let timed = [("track_functions", "pl")];
    let interpreted = run_case(cluster, &case, &timed)?;
    log_run("PL/pgSQL", &interpreted);
    let named = named_by(&interpreted, "plpgsql_calls");
    if let Some(finding) = named {
        let share = finding.leading_number("CPU running PL/pgSQL")? / 100.0;
        let function_ms = number_in(
            cluster,
            case.database,
            "SELECT total_time FROM pg_stat_user_functions WHERE funcname = 'is_open'",
        )?;
        let statement_ms = pgss_column(cluster, case.database, &interpreted.queryid, "total_exec_time")?;
        let counted = function_ms / statement_ms;
        eprintln!(
            "case={name}: in PL/pgSQL {:.1}% of its CPU (pgscope); is_open {function_ms:.0} ms \
             in pg_stat_user_functions of the statement's {statement_ms:.0} ms in \
             pg_stat_statements: {:.1}%",
            100.0 * share,
            100.0 * counted
        );
        ensure!(
            counted > 0.0 && share / counted <= AGREEMENT_FACTOR && counted / share <= AGREEMENT_FACTOR,
            "the finding says {:.1}% of its CPU in PL/pgSQL, pg_stat_user_functions {:.1}% of its \
             execution: not within a factor of {AGREEMENT_FACTOR}",
            100.0 * share,
            100.0 * counted
        );
    }
    let inlined = Case {
        setup: "CREATE TABLE accounts AS SELECT g AS id, \
                (ARRAY['active', 'trial', 'closed', 'frozen'])[g % 4 + 1] AS status \
                FROM generate_series(1, 20000) g; \
                CREATE FUNCTION is_open(s text) RETURNS boolean LANGUAGE sql IMMUTABLE \
                AS $$ SELECT s IN ('active', 'trial') $$",
        ..case
    };
    let control = run_case(cluster, &inlined, &timed)?;
    log_run("LANGUAGE sql", &control);
    judge(name, named, &control)
}

#[test]
fn a_plpgsql_function_called_per_row_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    plpgsql_case(&cluster, "plpgsql_per_row")
}

/// A session in a transaction the test holds open: `psql` in `database` fed the statements
/// through its stdin, which stays open (idle in the transaction once they are done, or still
/// running the last). Dropping it terminates its backend (a statement still running would
/// hold psql and the locks), then ends psql: the transaction rolls back.
struct IdleInTransaction<'a> {
    cluster: &'a PgCluster,
    child: std::process::Child,
    /// Its backend's pid, as it printed it.
    pid: u32,
}

impl<'a> IdleInTransaction<'a> {
    fn start(cluster: &'a PgCluster, database: &str, statements: &str) -> Result<Self> {
        let mut child = cluster
            .psql_command()
            .args(["-d", database, "-At"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("cannot start psql for the idle transaction")?;
        child
            .stdin
            .as_mut()
            .context("psql has no stdin")?
            .write_all(format!("SELECT pg_backend_pid();\nBEGIN;\n{statements};\n").as_bytes())?;
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().context("psql has no stdout")?),
            &mut line,
        )?;
        let pid = line
            .trim()
            .parse()
            .with_context(|| format!("psql printed `{line}` for its backend's pid"))?;
        Ok(Self { cluster, child, pid })
    }
}

impl Drop for IdleInTransaction<'_> {
    fn drop(&mut self) {
        let _ = psql_in(
            self.cluster,
            "postgres",
            &format!("SELECT pg_terminate_backend({})", self.pid),
        );
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// The pid of the session of `database` in `state`, once there is one.
fn session_in_state(cluster: &PgCluster, database: &str, state: &str) -> Result<u32> {
    wait_for(&format!("a session of {database} {state}"), LOCK_TIMEOUT, || {
        let pid = psql_in(
            cluster,
            database,
            &format!(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
                     AND state = '{state}' LIMIT 1"
            ),
        )?;
        Ok(pid.trim().parse().ok())
    })
}

/// The update's execution time in pg_stat_statements the control runs to once the idle session
/// is gone: as long as the case's queued, so that the 100 ms it queued before the session was
/// ended is a small part of its time, as it would be of any workload's.
const CONTROL_EXEC_MS: f64 = 2000.0;
/// Waits until the statements of `database` whose text starts with `prefix` have run for
/// [`CONTROL_EXEC_MS`] by pg_stat_statements: a lock case's control, once nothing holds them.
fn await_execution(cluster: &PgCluster, database: &str, prefix: &str) -> Result<()> {
    wait_for(
        &format!("{CONTROL_EXEC_MS} ms of `{prefix}…`"),
        LOCK_TIMEOUT,
        || {
            let ms = number_in(
                cluster,
                database,
                &format!(
                    "SELECT coalesce(sum(total_exec_time), 0) FROM pg_stat_statements \
                     WHERE query LIKE '{prefix}%' AND \
                     dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                ),
            )?;
            Ok((ms >= CONTROL_EXEC_MS).then_some(()))
        },
    )
}

/// Bounds every wait of the lock cases.
const LOCK_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the waiter must have queued: four of pgscope's polls of pg_blocking_pids() (every
/// 0.5 s), twice what its rule needs to call a lock held across polls.
const QUEUED: Duration = Duration::from_secs(2);

/// A client that began a transaction, updated an order and went idle without ending it (an
/// application waiting on something else, a forgotten console): the next update of that order
/// queues on `Lock:transactionid` for as long as it stays open. Control: the same with
/// `idle_in_transaction_session_timeout = 100ms` on the database, which ends such a session
/// before anyone queues long.
///
/// Independent figure: `pg_blocking_pids()` of the waiting update, read by the test while it
/// waits, names the idle session the finding names. The update is prepared (`-M prepared`): sent
/// as text, a one-row update spends over 40% of its CPU parsing and planning, another finding.
fn idle_in_transaction_case(cluster: &PgCluster, name: &str) -> Result<()> {
    const DATABASE: &str = "idle_tx";
    let run = |timeout: Option<&str>| -> Result<(Vec<JsonFinding>, u32, Vec<u32>)> {
        fresh_database(cluster, DATABASE)?;
        psql_in(
            cluster,
            DATABASE,
            "CREATE TABLE orders (id int PRIMARY KEY, status text); \
             INSERT INTO orders SELECT g, 'new' FROM generate_series(1, 100) g",
        )?;
        // Commits that do not wait for their WAL flush: the update's time is its own and its
        // queue's.
        psql_in(
            cluster,
            DATABASE,
            &format!("ALTER DATABASE {DATABASE} SET synchronous_commit = off"),
        )?;
        if let Some(timeout) = timeout {
            psql_in(
                cluster,
                DATABASE,
                &format!("ALTER DATABASE {DATABASE} SET idle_in_transaction_session_timeout = '{timeout}'"),
            )?;
        }
        let script = Script::new("UPDATE orders SET status = 'shipped' WHERE id = 1")?;
        let traced = findings_while(Trace::instance(cluster.data_dir()), || {
            let holder = IdleInTransaction::start(
                cluster,
                DATABASE,
                "UPDATE orders SET status = 'held' WHERE id = 1",
            )?;
            // The control's session is ended 100 ms after it goes idle, often before a poll
            // could see it: only the case's is looked up.
            let idle = match timeout {
                None => session_in_state(cluster, DATABASE, "idle in transaction")?,
                Some(_) => 0,
            };
            let pgbench = cluster.spawn_pgbench_in(
                DATABASE,
                &[
                    "-n",
                    "-M",
                    "prepared",
                    "-f",
                    script.path(),
                    "-c",
                    "1",
                    "-T",
                    "600",
                ],
                1,
            )?;
            let waiter = match pgbench.backend_pids()?.as_slice() {
                [pid] => *pid,
                pids => anyhow::bail!("pgbench's one client has backends {pids:?}"),
            };
            let blockers = match timeout {
                // Until the update has queued for QUEUED.
                None => wait_for(
                    &format!("the update to have queued for {QUEUED:?}"),
                    LOCK_TIMEOUT,
                    || {
                        let row = psql_in(
                            cluster,
                            DATABASE,
                            &format!(
                                "SELECT coalesce(wait_event_type, ''), \
                                 extract(epoch FROM now() - query_start) >= {}, \
                                 array_to_string(pg_blocking_pids({waiter}), ' ') \
                                 FROM pg_stat_activity WHERE pid = {waiter}",
                                QUEUED.as_secs_f64()
                            ),
                        )?;
                        Ok(match row.split('|').collect::<Vec<_>>().as_slice() {
                            ["Lock", "t", blockers] => Some(
                                blockers
                                    .split_whitespace()
                                    .filter_map(|p| p.parse().ok())
                                    .collect::<Vec<u32>>(),
                            ),
                            _ => None,
                        })
                    },
                )?,
                // Until the server has ended the idle session; then the updates run on for as
                // long as the case's queued.
                Some(_) => {
                    wait_for("the idle session to be ended", LOCK_TIMEOUT, || {
                        let left = number_in(
                            cluster,
                            DATABASE,
                            &format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {}", holder.pid),
                        )?;
                        Ok((left == 0.0).then_some(()))
                    })?;
                    await_execution(cluster, DATABASE, "UPDATE orders SET status")?;
                    Vec::new()
                }
            };
            // The transaction first: the queued update ends only once it does.
            drop(holder);
            pgbench.stop()?;
            Ok((idle, blockers))
        })?;
        let (idle, blockers) = traced.measured;
        Ok((traced.findings, idle, blockers))
    };
    let (findings, idle, blockers) = run(None)?;
    eprintln!(
        "{name}: session {idle} idle in transaction; pg_blocking_pids() of the update: {blockers:?}\n{}",
        describe_findings(&findings)
    );
    let named = findings
        .iter()
        .find(|f| f.kind == "lock_blocker" && f.is_alarm() && f.title.contains(&format!("session {idle},")));
    if named.is_some() {
        eprintln!("case={name}: the finding names session {idle}; pg_blocking_pids() of the waiting update: {blockers:?}");
        ensure!(
            blockers.contains(&idle),
            "pg_blocking_pids() of the waiting update named {blockers:?}, not the idle session {idle}"
        );
    }
    let (control, _, _) = run(Some("100ms"))?;
    let setting = "idle_in_transaction_session_timeout = 100ms";
    eprintln!("{name}: {setting}\n{}", describe_findings(&control));
    judge_findings(name, named, &control, setting)
}

#[test]
fn a_session_idle_in_its_transaction_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    idle_in_transaction_case(&cluster, "idle_in_transaction")
}

/// A migration's `ALTER TABLE` behind a long transaction that read the table: the ALTER waits
/// for its ACCESS EXCLUSIVE lock, and every session that touches the table then queues behind
/// the ALTER (`Lock:relation`), though none conflicts with the long transaction itself: the
/// table stops for everyone. Control: the ALTER run with `lock_timeout = 200ms`, as migrations
/// should, which gives up rather than stall the table.
///
/// Independent figure: `pg_blocking_pids()` read by the test while the readers wait: theirs
/// names the ALTER, the ALTER's names the long transaction, which the finding names.
fn ddl_lock_queue_case(cluster: &PgCluster, name: &str) -> Result<()> {
    const DATABASE: &str = "ddl_queue";
    let run = |lock_timeout: Option<&str>| -> Result<(Vec<JsonFinding>, u32, Vec<u32>)> {
        fresh_database(cluster, DATABASE)?;
        psql_in(
            cluster,
            DATABASE,
            "CREATE TABLE products AS SELECT g AS id, md5(g::text) AS name FROM generate_series(1, 100) g",
        )?;
        let script = Script::new("SELECT count(*) FROM products")?;
        let traced = findings_while(Trace::instance(cluster.data_dir()), || {
            // BEGIN is sent first: the long transaction reads the table, then sleeps in it.
            let long = IdleInTransaction::start(
                cluster,
                DATABASE,
                "SELECT count(*) FROM products; SELECT pg_sleep(600)",
            )?;
            let alter = IdleInTransaction::start(
                cluster,
                DATABASE,
                &format!(
                    "SET lock_timeout = '{}'; ALTER TABLE products ADD COLUMN note text",
                    lock_timeout.unwrap_or("0")
                ),
            )?;
            let pgbench = cluster.spawn_pgbench_in(
                DATABASE,
                &[
                    "-n",
                    "-M",
                    "prepared",
                    "-f",
                    script.path(),
                    "-c",
                    "2",
                    "-j",
                    "2",
                    "-T",
                    "600",
                ],
                2,
            )?;
            let readers = pgbench.backend_pids()?;
            let reader = *readers.first().context("pgbench has no backends")?;
            let chain = match lock_timeout {
                None => wait_for(
                    &format!("the readers to have queued for {QUEUED:?}"),
                    LOCK_TIMEOUT,
                    || {
                        let row = psql_in(
                            cluster,
                            DATABASE,
                            &format!(
                                "SELECT coalesce(wait_event, ''), \
                                 extract(epoch FROM now() - query_start) >= {}, \
                                 array_to_string(pg_blocking_pids({reader}), ' '), \
                                 array_to_string(pg_blocking_pids({}), ' ') \
                                 FROM pg_stat_activity WHERE pid = {reader}",
                                QUEUED.as_secs_f64(),
                                alter.pid
                            ),
                        )?;
                        Ok(match row.split('|').collect::<Vec<_>>().as_slice() {
                            ["relation", "t", readers_blockers, alters_blockers] => {
                                let pids = |text: &str| -> Vec<u32> {
                                    text.split_whitespace().filter_map(|p| p.parse().ok()).collect()
                                };
                                Some([pids(readers_blockers), pids(alters_blockers)].concat())
                            }
                            _ => None,
                        })
                    },
                )?,
                Some(_) => {
                    await_execution(cluster, DATABASE, "SELECT count(*) FROM products")?;
                    Vec::new()
                }
            };
            let long_pid = long.pid;
            // The long transaction first: then the ALTER, then the readers go on.
            drop(long);
            drop(alter);
            pgbench.stop()?;
            Ok((long_pid, chain))
        })?;
        let (long_pid, chain) = traced.measured;
        Ok((traced.findings, long_pid, chain))
    };
    let (findings, long_pid, chain) = run(None)?;
    eprintln!(
        "{name}: long transaction {long_pid}; pg_blocking_pids() of a reader, then of the ALTER: \
         {chain:?}\n{}",
        describe_findings(&findings)
    );
    // Named: the long transaction by pid, and the queue behind the ALTER's request with the
    // setting that prevents it.
    let named = findings.iter().find(|f| {
        f.kind == "lock_blocker"
            && f.is_alarm()
            && f.title.contains(&format!("session {long_pid} "))
            && f.action.contains("lock_timeout")
    });
    if named.is_some() {
        eprintln!("case={name}: the finding names session {long_pid}; pg_blocking_pids(): {chain:?}");
        ensure!(
            chain.last() == Some(&long_pid),
            "pg_blocking_pids() of the ALTER named {chain:?}, not the long transaction {long_pid}"
        );
    }
    let (control, _, _) = run(Some("200ms"))?;
    let setting = "the ALTER with lock_timeout = 200ms";
    eprintln!("{name}: {setting}\n{}", describe_findings(&control));
    judge_findings(name, named, &control, setting)
}

#[test]
fn a_migration_queued_behind_a_long_transaction_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    ddl_lock_queue_case(&cluster, "ddl_lock_queue")
}

/// Events logged one row per transaction, each INSERT committed on its own with
/// `synchronous_commit = on` and the WAL flushed to disk (`fsync = on` in this case's cluster,
/// whose other cases run without it): every execution waits for the WAL device's flush
/// (`IO:WALSync`), which pg_stat_statements' execution time does not include. Control:
/// `synchronous_commit = off` on the database, the value the advice gives where losing the last
/// transactions on a crash is acceptable.
///
/// Independent figure: Postgres' own timing of its WAL writes and flushes over the run
/// (pg_stat_wal's `wal_write_time + wal_sync_time`, with `track_wal_io_timing` on), against the
/// time the finding counts waiting for them.
fn commit_flush_case(cluster: &PgCluster, name: &str) -> Result<()> {
    let case = Case {
        database: "commit_flush",
        setup: "CREATE TABLE events (id bigserial PRIMARY KEY, at timestamptz DEFAULT now(), kind int)",
        sql: "INSERT INTO events (kind) VALUES (1)",
        plan_node: "Insert on events",
        warm_up: "",
        prepared: true,
        then: "",
    };
    let wal_io_ms = || {
        number_in(
            cluster,
            "postgres",
            "SELECT wal_write_time + wal_sync_time FROM pg_stat_wal",
        )
    };
    let before = wal_io_ms()?;
    let flushed = run_case(
        cluster,
        &case,
        &[("synchronous_commit", "on"), ("track_wal_io_timing", "on")],
    )?;
    let wal_ms = wal_io_ms()? - before;
    log_run("synchronous_commit = on", &flushed);
    let named = named_by(&flushed, "commit_flush_waits");
    if let Some(finding) = named {
        let waited_ms = finding.leading_number("ms waiting for WAL flushes")?;
        eprintln!(
            "case={name}: {waited_ms:.0} ms waiting for WAL flushes (pgscope); pg_stat_wal's \
             write and sync time {wal_ms:.0} ms"
        );
        ensure!(
            wal_ms > 0.0 && waited_ms / wal_ms <= AGREEMENT_FACTOR && wal_ms / waited_ms <= AGREEMENT_FACTOR,
            "the finding says {waited_ms:.0} ms waiting for WAL flushes, pg_stat_wal {wal_ms:.0} ms \
             writing and syncing WAL: not within a factor of {AGREEMENT_FACTOR}"
        );
    }
    let control = run_case(cluster, &case, &[("synchronous_commit", "off")])?;
    log_run("synchronous_commit = off", &control);
    judge(name, named, &control)
}

#[test]
fn commits_waiting_for_their_wal_flush_are_named_and_their_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[("fsync", "on")])?;
    commit_flush_case(&cluster, "commit_flush")
}

/// Functions that read or write TOASTed values, as perf names them on the distro build (the
/// compressors are not exported: their callers are on the stack).
fn in_toast(frame: &str) -> bool {
    [
        "detoast_attr",
        "detoast_attr_slice",
        "detoast_external_attr",
        "heap_fetch_toast_slice",
        "toast_fetch_datum",
        "toast_decompress_datum",
        "pglz_decompress",
        "toast_compress_datum",
        "toast_save_datum",
    ]
    .contains(&frame)
}

/// Documents of ~150 keys (6 kB, kept out of line) filtered on one small key: every row's
/// document is fetched from the TOAST table and reassembled to read `status`. Control: the key
/// in a generated column of its own, the advice's remedy; the documents stay in the table.
///
/// Independent figures: perf's share of one backend's samples under the TOAST functions, and
/// the table's toast_blks_hit in pg_statio_user_tables, which grows only when TOAST is read.
fn toast_case(cluster: &PgCluster, name: &str) -> Result<()> {
    macro_rules! documents {
        () => {
            "CREATE TABLE documents AS SELECT g AS id, \
             (SELECT jsonb_object_agg('field' || k, md5((g * 1000 + k)::text)) \
              FROM generate_series(1, 150) k) || jsonb_build_object('status', \
              (ARRAY['open', 'closed'])[g % 2 + 1]) AS doc \
             FROM generate_series(1, 2000) g"
        };
    }
    let case = Case {
        database: "toast_documents",
        setup: documents!(),
        sql: "SELECT count(*) FROM documents WHERE doc->>'status' = 'open'",
        plan_node: "Seq Scan on documents",
        warm_up: "",
        prepared: false,
        then: "",
    };
    let toast_hits = || {
        number_in(
            cluster,
            case.database,
            "SELECT coalesce(toast_blks_hit, 0) + coalesce(toast_blks_read, 0) \
             FROM pg_statio_user_tables WHERE relname = 'documents'",
        )
    };
    let documents = run_case(cluster, &case, &[])?;
    log_run("one key of each document", &documents);
    let named = named_by(&documents, "toast_values");
    if let Some(finding) = named {
        let before = toast_hits()?;
        check_family_share(
            cluster,
            name,
            &case,
            finding,
            "CPU reading and writing large values",
            in_toast,
        )?;
        let read = toast_hits()? - before;
        eprintln!("case={name}: {read} TOAST blocks read while perf recorded (pg_statio_user_tables)");
        ensure!(
            read > 0.0,
            "pg_statio_user_tables counted no TOAST block read for the documents"
        );
    }
    let column = Case {
        setup: concat!(
            documents!(),
            "; ALTER TABLE documents ADD COLUMN status text \
             GENERATED ALWAYS AS (doc->>'status') STORED"
        ),
        sql: "SELECT count(*) FROM documents WHERE status = 'open'",
        ..case
    };
    let control = run_case(cluster, &column, &[])?;
    log_run("the key in its own column", &control);
    judge(name, named, &control)
}

#[test]
fn a_large_document_read_for_one_key_per_row_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    toast_case(&cluster, "toast_per_row")
}

/// Functions of LIKE and of the regular-expression engine, as perf names them on the distro
/// build (the engine's internals are static and unnamed: its entry points are on the stack).
fn in_pattern_matching(frame: &str) -> bool {
    frame.starts_with("textregex")
        || frame.starts_with("regexp_")
        || [
            "textlike",
            "textnlike",
            "texticlike",
            "RE_compile_and_cache",
            "RE_compile_and_execute",
            "pg_regexec",
        ]
        .contains(&frame)
}

/// A log table searched with a leading wildcard, the "grep in SQL" every application grows:
/// no B-tree serves `LIKE '%…%'`, so each of the 100000 messages is matched. Control: the same
/// query served by a pg_trgm GIN index, the advice's remedy, which rechecks only the rows that
/// hold the pattern's trigrams. (The recheck still matches those rows, under the bitmap heap
/// scan: the family leaves it out, as the remedy at work. With a regular expression that recheck
/// is half of a 0.4 ms statement.)
///
/// Independent figure: perf's share of one backend's samples under the same functions.
fn pattern_case(cluster: &PgCluster, name: &str) -> Result<()> {
    macro_rules! logs {
        () => {
            "CREATE TABLE logs AS SELECT g AS id, 'request ' || md5(g::text) || \
             CASE WHEN g % 1000 = 0 THEN ' timeout on db' || g % 7 ELSE ' ok' END AS message \
             FROM generate_series(1, 100000) g"
        };
    }
    let case = Case {
        database: "pattern_logs",
        setup: logs!(),
        sql: "SELECT count(*) FROM logs WHERE message LIKE '%timeout on db%'",
        plan_node: "Seq Scan on logs",
        warm_up: "",
        prepared: false,
        then: "",
    };
    let scanned = run_case(cluster, &case, &[])?;
    log_run("every message matched", &scanned);
    let named = named_by(&scanned, "pattern_matches");
    if let Some(finding) = named {
        check_family_share(
            cluster,
            name,
            &case,
            finding,
            "CPU matching text",
            in_pattern_matching,
        )?;
    }
    let indexed = Case {
        setup: concat!(
            logs!(),
            "; CREATE EXTENSION pg_trgm; \
             CREATE INDEX logs_message ON logs USING gin (message gin_trgm_ops)"
        ),
        plan_node: "Bitmap Index Scan on logs_message",
        ..case
    };
    let control = run_case(cluster, &indexed, &[])?;
    log_run("a trigram index", &control);
    judge(name, named, &control)
}

#[test]
fn text_matched_against_a_pattern_in_every_row_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    pattern_case(&cluster, "pattern_scan")
}

/// A temporary table created and dropped in every transaction (ON COMMIT DROP), the staging
/// pattern of many applications: each transaction writes rows of pg_class, pg_type and
/// pg_attribute, creates and unlinks files and sends invalidations. Control: the advice's
/// remedy, the same rows in a CTE. (Not a table kept for the session ON COMMIT DELETE ROWS:
/// truncating it rebuilds its files and indexes at every commit, which the commit-phase rule
/// rightly names.)
///
/// Independent figure: pg_class rows inserted (pg_stat_sys_tables) per transaction committed
/// (pg_stat_database) over the run: at least one relation created by each.
fn catalog_churn_case(cluster: &PgCluster, name: &str) -> Result<()> {
    let case = Case {
        database: "temp_churn",
        setup: "SELECT 1",
        sql: "CREATE TEMP TABLE basket (id int, total numeric) ON COMMIT DROP",
        plan_node: "",
        warm_up: "",
        // As text: Postgres 14 and 15 report no queryid for a prepared utility statement's
        // executions after its first (pg_stat_statements zeroes the cached plan's).
        prepared: false,
        // 1000 rows: enough that the control's one statement is not mostly parsed and planned
        // (with 10, 44% of it was: planning_dominated, another case).
        then: "INSERT INTO basket SELECT g, g FROM generate_series(1, 1000) g;\n\
               SELECT sum(total) FROM basket",
    };
    let counters = |database: &str| -> Result<(f64, f64)> {
        let inserted = number_in(
            cluster,
            database,
            "SELECT n_tup_ins FROM pg_stat_sys_tables WHERE relname = 'pg_class'",
        )?;
        let commits = number_in(
            cluster,
            database,
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
        )?;
        Ok((inserted, commits))
    };
    // Counted from the database's creation: run_case makes it afresh.
    let churned = run_case(cluster, &case, &[])?;
    log_run("a temporary table per transaction", &churned);
    let named = named_by(&churned, "catalog_churn");
    if named.is_some() {
        let (inserted, commits) = counters(case.database)?;
        eprintln!(
            "case={name}: {inserted} pg_class rows inserted over {commits} transactions \
             (pg_stat_sys_tables, pg_stat_database)"
        );
        ensure!(
            commits > 0.0 && inserted >= commits,
            "pg_stat_sys_tables counted {inserted} pg_class rows inserted in {commits} \
             transactions: not one relation per transaction"
        );
    }
    let in_query = Case {
        sql: "WITH basket AS (SELECT g AS id, g::numeric AS total FROM generate_series(1, 1000) g) \
              SELECT sum(total) FROM basket",
        plan_node: "Function Scan on generate_series",
        then: "",
        ..case
    };
    let control = run_case(cluster, &in_query, &[])?;
    log_run("the rows in a CTE", &control);
    judge(name, named, &control)
}

#[test]
fn a_temporary_table_per_transaction_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    catalog_churn_case(&cluster, "temp_table_churn")
}

/// CPU time the cluster's processes have used so far: the postmaster's own and that of the
/// backends it has reaped. A workload of short sessions is measured by it where the backends'
/// own times end with them.
fn cluster_cpu(cluster: &PgCluster) -> Result<Duration> {
    cpu_time_with_reaped_children(cluster.postmaster_pid()?)
}

/// A number pgbench's report prints after `label` (`average connection time = 5.438 ms`).
fn pgbench_figure(report: &str, label: &str) -> Result<f64> {
    report
        .lines()
        .find_map(|line| {
            line.strip_prefix(label)?
                .trim()
                .strip_prefix('=')?
                .split_whitespace()
                .next()
        })
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("pgbench's report has no `{label} = …`:\n{report}"))
}

/// A connection opened for every transaction (`pgbench -C`), the application without a
/// connection pool: each transaction forks a backend that authenticates, fills its caches for
/// one lookup by primary key, and exits. Control: the same transactions over kept connections.
///
/// Independent figure: pgbench's own timing of an untraced run, its average connection time
/// against its average latency (which includes the reconnection): the share of each
/// transaction spent connecting, against the finding's share of the instance's CPU.
fn connection_churn_case(cluster: &PgCluster, name: &str) -> Result<()> {
    let case = Case {
        database: "connection_churn",
        setup: "CREATE TABLE accounts AS SELECT g AS id, 0 AS balance FROM generate_series(1, 10000) g; \
                ALTER TABLE accounts ADD PRIMARY KEY (id)",
        sql: "SELECT balance FROM accounts WHERE id = 42",
        plan_node: "Index Scan using accounts_pkey",
        warm_up: "",
        prepared: true,
        then: "",
    };
    // The control first: it also creates the database and its table, which the case reuses.
    let control = run_case(cluster, &case, &[])?;
    log_run("kept connections", &control);
    let script = Script::new(case.sql)?;
    let clients = CLIENTS.to_string();
    let args = [
        "-n",
        "-C",
        "-M",
        "prepared",
        "-f",
        script.path(),
        "-c",
        &clients,
        "-j",
        &clients,
    ];
    let before = cluster_cpu(cluster)?;
    let traced = findings_while(Trace::instance(cluster.data_dir()), || {
        let mut pgbench =
            cluster.spawn_pgbench_in(case.database, &[&args[..], &["-T", "600"]].concat(), 0)?;
        let used = wait_for(
            &format!("the cluster's processes to use {CASE_CPU:?} of CPU under `pgbench -C`"),
            CPU_TIMEOUT,
            || Ok((cluster_cpu(cluster)? - before >= CASE_CPU).then_some(())),
        );
        pgbench.ensure_running()?;
        pgbench.stop()?;
        used
    })?;
    eprintln!(
        "a connection per transaction:\n{}",
        describe_findings(&traced.findings)
    );
    let named = traced
        .findings
        .iter()
        .find(|f| f.kind == "connection_churn" && f.is_alarm());
    if let Some(finding) = named {
        let share = finding.leading_number("CPU starting and ending sessions")? / 100.0;
        let mut untraced = cluster.client("pgbench");
        // A number of transactions, not a duration: the same work on any machine.
        untraced.args(args).args(["-t", "200", case.database]);
        let output = untraced.output().context("running pgbench -C untraced")?;
        let report = String::from_utf8_lossy(&output.stdout);
        ensure!(
            output.status.success(),
            "pgbench -C failed: {report}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let connecting =
            pgbench_figure(&report, "average connection time")? / pgbench_figure(&report, "latency average")?;
        eprintln!(
            "case={name}: starting and ending sessions {:.1}% of the instance's CPU (pgscope); \
             pgbench spent {:.1}% of each transaction connecting",
            100.0 * share,
            100.0 * connecting
        );
        ensure!(
            connecting > 0.0
                && share / connecting <= AGREEMENT_FACTOR
                && connecting / share <= AGREEMENT_FACTOR,
            "the finding says {:.1}% of the CPU starting and ending sessions, pgbench {:.1}% of \
             each transaction connecting: not within a factor of {AGREEMENT_FACTOR}",
            100.0 * share,
            100.0 * connecting
        );
    }
    judge(name, named, &control)
}

#[test]
fn a_connection_per_transaction_is_named_and_its_control_is_quiet() -> Result<()> {
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    connection_churn_case(&cluster, "connection_churn")
}

/// Parents deleted while 200000 child rows reference the table through a foreign key with no
/// index on the referencing column, the migration that forgot it: each deleted parent makes
/// the key's NO ACTION check scan the child table whole. (Each client deletes a parent no
/// child references, its own by its backend's pid, and rolls back: the check runs every time,
/// and the clients never wait for each other's rows.) Control: the index on child.parent_id,
/// the advice's remedy.
///
/// Independent figure: the child table's seq_scan in pg_stat_user_tables against the DELETE's
/// calls in pg_stat_statements: one scan of the referencing table per deleted row.
fn foreign_key_case(cluster: &PgCluster, name: &str) -> Result<()> {
    macro_rules! tables {
        () => {
            "CREATE TABLE parent (id int PRIMARY KEY); \
             INSERT INTO parent SELECT generate_series(1, 2000); \
             CREATE TABLE child (id bigint, parent_id int REFERENCES parent); \
             INSERT INTO child SELECT g, g % 1000 + 1 FROM generate_series(1, 200000) g"
        };
    }
    let case = Case {
        database: "fk_unindexed",
        setup: tables!(),
        sql: "DELETE FROM parent WHERE id = 1001 + pg_backend_pid() % 1000",
        plan_node: "Delete on parent",
        warm_up: "",
        prepared: false,
        then: "ROLLBACK",
    };
    let scanned = run_case(cluster, &case, &[])?;
    log_run("no index on child.parent_id", &scanned);
    let named = named_by(&scanned, "unindexed_foreign_key");
    if named.is_some() {
        let scans = number_in(
            cluster,
            case.database,
            "SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'child'",
        )?;
        let calls = pgss_column(cluster, case.database, &scanned.queryid, "calls")?;
        eprintln!(
            "case={name}: {scans} sequential scans of child (pg_stat_user_tables) for {calls} \
             DELETEs (pg_stat_statements)"
        );
        ensure!(
            calls > 0.0 && scans / calls <= AGREEMENT_FACTOR && calls / scans <= AGREEMENT_FACTOR,
            "pg_stat_user_tables counted {scans} sequential scans of child for {calls} DELETEs: \
             not one per deleted row within a factor of {AGREEMENT_FACTOR}"
        );
    }
    let indexed = Case {
        setup: concat!(tables!(), "; CREATE INDEX child_parent_id ON child (parent_id)"),
        ..case
    };
    let control = run_case(cluster, &indexed, &[])?;
    log_run("child.parent_id indexed", &control);
    judge(name, named, &control)
}

#[test]
fn a_foreign_key_without_an_index_on_its_referencing_column_is_named_and_its_control_is_quiet() -> Result<()>
{
    require_root_and_bpf();
    let cluster = shared_cluster(&[])?;
    foreign_key_case(&cluster, "unindexed_foreign_key")
}
