//! Every sample is labelled with what `pg_stat_activity` shows for its process at that moment
//! (backend type, database, state, queryid, wait event): the labels of the pprof output are
//! checked against `pg_stat_statements` and `pg_stat_activity` of a live cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use pgscope_tests::activity::{has_labels, label_sets, Activity, Labels, CLIENT_BACKEND};
use pgscope_tests::agreement::{
    check_busy_backend, check_queryids, pg_stat_statements, reading_activity, QueryidRun, SCRIPT,
};
use pgscope_tests::cpu_window::stolen_time;
use pgscope_tests::workload::{is_md5_frame, CPU_BOUND, MD5_BOUND};
use pgscope_tests::{
    ensure_samples_cover, expected_samples, require_root_and_bpf, wait_for, CpuWindow, LabeledProfile,
    PgCluster, PgInstall, SchedTime, Trace,
};

const FREQUENCY: u32 = 99;
const AUXILIARY_FREQUENCY: u32 = 499;
/// A trace that lasts until its processes had some CPU time ends with SIGINT; this only bounds
/// it should the test never send one.
const UNTIL_INTERRUPTED_SECS: u64 = 600;
/// Bounds each wait for CPU time: the longest asked is 4 s per process, which a process given
/// a tenth of a core still gets.
const CPU_TIMEOUT: Duration = Duration::from_secs(60);
/// Samples of a busy process per CPU-second × frequency, at least. Its CPU time is read from
/// the scheduler over a window inside the sampling window (opened once pgscope says it
/// profiles, which it says after attaching the perf events, and closed before SIGINT), so a
/// sampler that loses nothing gives 1.0 or a little more (0.79 to 1.24 in this file's runs on a
/// loaded machine). Half is the bar the `--pid` traces held as an absolute count (150 samples
/// for 3 s of CPU); it still fails a sampler or filter that drops half of them.
const MIN_SAMPLES_PER_CPU_PERIOD: f64 = 0.5;

/// CPU time pgbench's two backends get, together, under each protocol's trace: ~400 samples at
/// [`FREQUENCY`], twice the 200 client-backend samples `check_queryids` asks; the cheapest
/// statement of [`SCRIPT`] (the sort) got 63 and 96 of them against the 20 it asks of each.
const QUERYID_CPU: Duration = Duration::from_secs(4);

/// pgbench with the shared script under both protocols; each run is traced on its own, with
/// pg_stat_statements reset before it, so the queryids of one run are the rows read after it.
#[test]
fn queryid_labels_match_pg_stat_statements() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("burn.sql");
    let mut text = String::from("\\set n random(1, 1000)\n");
    for statement in &SCRIPT {
        text.push_str(statement.sql);
        text.push('\n');
    }
    std::fs::write(&script, text).with_context(|| format!("cannot write `{}`", script.display()))?;
    let mut queryids = BTreeMap::new();
    for protocol in ["simple", "prepared"] {
        queryids.insert(protocol, trace_script(&cluster, dir.path(), &script, protocol)?);
    }
    // Const and Param nodes are jumbled differently, so each protocol's statements have their own
    // queryids: the prepared run checked queryids the simple run did not already produce.
    for (i, statement) in SCRIPT.iter().enumerate() {
        let (simple, prepared) = (&queryids["simple"][i], &queryids["prepared"][i]);
        ensure!(
            simple != prepared,
            "the {} statement has queryid {simple} under both protocols",
            statement.name
        );
    }
    Ok(())
}

/// Runs `script` ([`SCRIPT`]) with pgbench under `protocol` (2 clients), traced with `--instance`
/// until its backends had [`QUERYID_CPU`], and checks the queryid labels against the rows
/// pg_stat_statements recorded meanwhile; returns the queryids of the script's statements.
/// (`agreement::QueryidRun::measure`, which the majors matrix shares, traces for a fixed time.)
fn trace_script(cluster: &PgCluster, dir: &Path, script: &Path, protocol: &str) -> Result<Vec<String>> {
    cluster.psql("SELECT pg_stat_statements_reset()")?;
    let pprof = dir.join(format!("{protocol}.pb.gz"));
    let script = script.to_str().context("temp dir path is not UTF-8")?;
    // -n: no vacuum of pgbench's own tables, which do not exist.
    let mut pgbench =
        cluster.spawn_pgbench(&["-n", "-M", protocol, "-f", script, "-c", "2", "-T", "600"], 2)?;
    let backends = pgbench.backend_pids()?;
    let started = Instant::now();
    let running = Trace::instance(cluster.data_dir())
        .duration_secs(UNTIL_INTERRUPTED_SECS)
        .frequency(FREQUENCY)
        .pprof(&pprof)
        .spawn()?;
    let stolen = stolen_time()?;
    let used = CpuWindow::start(&backends)?.await_cpu(QUERYID_CPU, CPU_TIMEOUT)?;
    let stolen = stolen_time()?.saturating_sub(stolen);
    running.interrupt()?;
    let trace_secs = started.elapsed().as_secs();
    ensure!(pgbench.is_running()?, "pgbench ended during the trace");
    pgbench.stop()?;

    let statements = pg_stat_statements(cluster)?;
    let profile = LabeledProfile::read_pprof(&pprof)?;
    let of_backends: u64 = backends
        .iter()
        .map(|&pid| profile.count_where(|s| s.pid() == Some(pid)))
        .sum();
    eprintln!(
        "{protocol}: backends {backends:?}: {:?} on CPU, {:?} waiting for one, {stolen:?} stolen \
         from the VM; {of_backends} samples ({:.0} expected)",
        used.on_cpu,
        used.runnable,
        expected_samples(used.on_cpu, FREQUENCY)
    );
    ensure_samples_cover(
        &format!("{protocol}: pgbench's backends {backends:?} ({stolen:?} stolen from the VM meanwhile)"),
        of_backends,
        used.on_cpu,
        FREQUENCY,
        MIN_SAMPLES_PER_CPU_PERIOD,
    )?;
    let run = QueryidRun {
        trace_secs,
        frequency: FREQUENCY,
    };
    check_queryids(protocol, &run, &profile, &statements)
}

/// CPU time of the busy backend under its `--pid` trace: ~400 samples at [`FREQUENCY`], twice
/// the 200 `check_busy_backend` asks of it, so its 90% agreement bar rests on ~40 samples.
const BUSY_CPU: Duration = Duration::from_secs(4);

/// A CPU-bound session traced with `--pid`: its samples carry what pg_stat_activity shows for
/// it meanwhile. Then the whole instance, with checkpoints and WAL writes going on: auxiliary
/// processes carry their backend type and no queryid.
#[test]
fn labels_agree_with_pg_stat_activity() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with(&PgInstall::distro()?, &[("compute_query_id", "on")])?;
    let session = cluster.spawn_session(CPU_BOUND)?;
    let pid = session.pid();
    let dir = tempfile::tempdir()?;

    let pprof = dir.path().join("backend.pb.gz");
    let trace = Trace::pid(pid)
        .duration_secs(UNTIL_INTERRUPTED_SECS)
        .frequency(FREQUENCY)
        .pprof(&pprof);
    let ((used, stolen), seen) = reading_activity(&cluster, &format!("pid = {pid}"), || {
        let running = trace.spawn()?;
        let stolen = stolen_time()?;
        let used = CpuWindow::start(&[pid])?.await_cpu(BUSY_CPU, CPU_TIMEOUT)?;
        let stolen = stolen_time()?.saturating_sub(stolen);
        running.interrupt()?;
        Ok((used, stolen))
    })?;
    let profile = LabeledProfile::read_pprof(&pprof)?;
    let total = profile.total();
    eprintln!(
        "backend {pid}: {:?} on CPU, {:?} waiting for one, {stolen:?} stolen from the VM; {total} \
         samples ({:.0} expected)",
        used.on_cpu,
        used.runnable,
        expected_samples(used.on_cpu, FREQUENCY)
    );
    ensure_samples_cover(
        &format!("backend {pid} ({stolen:?} stolen from the VM meanwhile)"),
        total,
        used.on_cpu,
        FREQUENCY,
        MIN_SAMPLES_PER_CPU_PERIOD,
    )?;
    check_busy_backend(&profile, pid, &seen)?;
    let phases = profile.label_values("phase", |_| true);
    let running = phases.get(&Some("run".to_owned())).copied().unwrap_or(0);
    ensure!(
        running * 10 >= total * 9,
        "a backend deep in its executor has phase labels {phases:?}"
    );

    check_auxiliary_processes(&cluster, dir.path())?;
    Ok(())
}

/// CPU time the auxiliary processes get, together, under the instance trace: ~100 samples at
/// [`AUXILIARY_FREQUENCY`], enough that a process whose samples all carry wrong labels cannot
/// hide among the ones that were never sampled (the shortest trace that says so).
const AUXILIARY_CPU: Duration = Duration::from_millis(200);

/// Traces the instance while another connection writes WAL and checkpoints, then compares the
/// labels of every non-client process that was sampled with its pg_stat_activity row.
fn check_auxiliary_processes(cluster: &PgCluster, dir: &Path) -> Result<()> {
    let pprof = dir.join("instance.pb.gz");
    // Auxiliary processes are mostly asleep: sample more often to catch them on CPU.
    let trace = Trace::instance(cluster.data_dir())
        .duration_secs(UNTIL_INTERRUPTED_SECS)
        .frequency(AUXILIARY_FREQUENCY)
        .pprof(&pprof);
    cluster.psql("CREATE TABLE burn (g int, h text)")?;
    let auxiliary: Vec<u32> = Activity::read(cluster, &format!("backend_type <> '{CLIENT_BACKEND}'"))?
        .iter()
        .map(|row| row.pid)
        .collect();
    let running = trace.spawn()?;
    let window = CpuWindow::start(&auxiliary)?;
    let stolen = stolen_time()?;
    let mut used = SchedTime::default();
    // Dirty buffers for the checkpointer and background writer, WAL for the walwriter, until
    // they have had the CPU time asked. INSERT, unlike CREATE TABLE AS, writes through shared
    // buffers without a ring, so the checkpoint has ~15 MB to write.
    wait_for(
        &format!("auxiliary processes {auxiliary:?} to use {AUXILIARY_CPU:?} of CPU"),
        CPU_TIMEOUT,
        || {
            cluster.psql(
                "TRUNCATE burn; \
                 INSERT INTO burn SELECT g, md5(g::text) FROM generate_series(1, 200000) g; \
                 CHECKPOINT",
            )?;
            used = window.used()?;
            Ok((used.on_cpu >= AUXILIARY_CPU).then_some(()))
        },
    )
    .with_context(|| format!("they used {:?} on CPU", used.on_cpu))?;
    let stolen = stolen_time()?.saturating_sub(stolen);
    running.interrupt()?;
    let activity = Activity::read(cluster, "true")?;
    let profile = LabeledProfile::read_pprof(&pprof)?;
    let by_pid = profile.samples_by_pid();

    eprintln!(
        "{:>7} {:<26} {:>7}  labels seen",
        "pid", "pg_stat_activity", "samples"
    );
    let mut checked = 0;
    for row in activity.iter().filter(|row| row.backend_type != CLIENT_BACKEND) {
        let n = by_pid.get(&row.pid).copied().unwrap_or(0);
        eprintln!(
            "{:>7} {:<26} {n:>7}  {}",
            row.pid,
            row.backend_type,
            label_sets(
                &profile,
                row.pid,
                &["backend_type", "database", "state", "queryid"]
            )
        );
        if n == 0 {
            continue;
        }
        let expected = row.expected_labels();
        let wrong = profile.count_where(|s| s.pid() == Some(row.pid) && !has_labels(s, &expected));
        ensure!(
            wrong == 0,
            "{wrong} of {n} samples of the {} (pid {}) do not carry {expected:?}:\n{}",
            row.backend_type,
            row.pid,
            profile.examples_where(|s| s.pid() == Some(row.pid) && !has_labels(s, &expected), 5)
        );
        checked += n;
    }
    let postmaster = cluster.postmaster_pid()?;
    eprintln!(
        "{postmaster:>7} {:<26} {:>7}  {}",
        "(postmaster)",
        by_pid.get(&postmaster).copied().unwrap_or(0),
        label_sets(
            &profile,
            postmaster,
            &["backend_type", "database", "state", "queryid"]
        )
    );
    let of_auxiliary: u64 = auxiliary.iter().filter_map(|pid| by_pid.get(pid)).sum();
    eprintln!(
        "auxiliary processes {auxiliary:?}: {:?} on CPU, {:?} waiting for one, {stolen:?} stolen \
         from the VM; {of_auxiliary} samples ({:.0} expected), {checked} of them checked",
        used.on_cpu,
        used.runnable,
        expected_samples(used.on_cpu, AUXILIARY_FREQUENCY)
    );
    ensure_samples_cover(
        &format!("auxiliary processes {auxiliary:?} (per pid {by_pid:?}; {stolen:?} stolen from the VM)"),
        of_auxiliary,
        used.on_cpu,
        AUXILIARY_FREQUENCY,
        MIN_SAMPLES_PER_CPU_PERIOD,
    )?;
    ensure!(
        checked > 0,
        "no samples of any auxiliary process although checkpoints ran; per pid: {by_pid:?}"
    );
    Ok(())
}

/// Settings under which a scan of [`PARALLEL_TABLE`] gets two parallel workers (the harness
/// turns parallel query off by default).
const PARALLEL_SETTINGS: &[(&str, &str)] = &[
    ("compute_query_id", "on"),
    ("max_parallel_workers_per_gather", "2"),
    ("parallel_setup_cost", "0"),
    ("parallel_tuple_cost", "0"),
    ("min_parallel_table_scan_size", "0"),
];
const PARALLEL_TABLE: &str = "CREATE TABLE parallel_burn AS SELECT g FROM generate_series(1, 1000000) g";
/// Hashes ~50 KB per row: ~90 µs a row, ~90 s of CPU for the table, so leader and workers stay
/// on CPU for the whole trace (the session is cancelled at the end).
const PARALLEL_MD5: &str = "SELECT count(*) FROM parallel_burn WHERE md5(repeat(g::text, 8000)) LIKE 'fff%'";
const PARALLEL_WORKER: &str = "parallel worker";
/// CPU time each of the three processes gets under the trace: ~200 samples each at
/// [`FREQUENCY`], so that the share of them hashing rows and their labels are judged on ~100
/// samples at the least.
const PARALLEL_CPU: Duration = Duration::from_secs(2);

/// Parallel workers are background workers; pg_stat_activity names them by their `bgw_type`
/// ("parallel worker") and shows their leader's queryid. Two of them scan a table with the
/// leader, all three on CPU for the whole trace: every sample of each carries what
/// pg_stat_activity shows for it, and the workers' queryid is the leader's.
#[test]
fn parallel_workers_carry_their_type_and_the_leaders_queryid() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with(&PgInstall::distro()?, PARALLEL_SETTINGS)?;
    cluster.psql(PARALLEL_TABLE)?;
    let leader = cluster.spawn_session(PARALLEL_MD5)?;
    let of_the_query = format!("pid = {0} OR leader_pid = {0}", leader.pid());
    let workers: Vec<u32> = wait_for("two parallel workers", Duration::from_secs(30), || {
        let rows = Activity::read(&cluster, &format!("leader_pid = {}", leader.pid()))?;
        Ok((rows.len() == 2).then(|| rows.iter().map(|row| row.pid).collect()))
    })
    .with_context(|| {
        format!(
            "pg_stat_activity: {:#?}\nplan: {}\nserver log: {}",
            Activity::read(&cluster, "true").unwrap_or_default(),
            cluster
                .psql(&format!("EXPLAIN {PARALLEL_MD5}"))
                .unwrap_or_else(|e| e.to_string()),
            cluster.server_log()
        )
    })?;
    let dir = tempfile::tempdir()?;
    let pprof = dir.path().join("parallel.pb.gz");
    let trace = Trace::instance(cluster.data_dir())
        .duration_secs(UNTIL_INTERRUPTED_SECS)
        .frequency(FREQUENCY)
        .pprof(&pprof);
    let traced: Vec<u32> = workers.iter().copied().chain([leader.pid()]).collect();
    let ((used, stolen), seen) = reading_activity(&cluster, &of_the_query, || {
        let running = trace.spawn()?;
        let stolen = stolen_time()?;
        let used = CpuWindow::start(&traced)?.await_cpu_each(PARALLEL_CPU, CPU_TIMEOUT)?;
        let stolen = stolen_time()?.saturating_sub(stolen);
        running.interrupt()?;
        Ok((used, stolen))
    })?;
    let still_running = Activity::read(&cluster, &format!("leader_pid = {}", leader.pid()))?;
    ensure!(
        leader.is_active()?
            && still_running
                .iter()
                .map(|row| row.pid)
                .eq(workers.iter().copied()),
        "the parallel query or its workers {workers:?} ended during the trace: {still_running:#?}"
    );
    let profile = LabeledProfile::read_pprof(&pprof)?;

    // One label set per process: what pg_stat_activity showed for it (its wait event aside).
    let mut expected: BTreeMap<u32, BTreeSet<Labels>> = BTreeMap::new();
    for row in &seen {
        expected.entry(row.pid).or_default().insert(row.expected_labels());
    }
    let leader_labels = single_label_set(&expected, leader.pid())?;
    let leader_queryid = leader_labels["queryid"].clone();
    ensure!(
        leader_queryid.as_deref().is_some_and(|q| q != "0"),
        "the leader has no queryid: {leader_labels:?}"
    );
    for &pid in &traced {
        let labels = single_label_set(&expected, pid)?;
        let n = profile.count_where(|s| s.pid() == Some(pid));
        let hashing = profile.count_where(|s| s.pid() == Some(pid) && s.any_frame(is_md5_frame));
        let cpu = used.get(&pid).copied().unwrap_or_default();
        eprintln!(
            "pid {pid}: {:?} on CPU, {:?} waiting for one; {n} samples ({:.0} expected, {hashing} \
             hashing); pg_stat_activity {labels:?}; label sets: {}",
            cpu.on_cpu,
            cpu.runnable,
            expected_samples(cpu.on_cpu, FREQUENCY),
            label_sets(&profile, pid, &["backend_type", "database", "state", "queryid"])
        );
        if pid != leader.pid() {
            // What Postgres itself says of its workers, before pgscope is asked the same.
            ensure!(
                labels["backend_type"].as_deref() == Some(PARALLEL_WORKER)
                    && labels["queryid"] == leader_queryid,
                "pg_stat_activity does not show worker {pid} as a parallel worker with the leader's \
                 queryid {leader_queryid:?}: {labels:?}"
            );
        }
        ensure_samples_cover(
            &format!(
                "pid {pid} (per pid {:?}; {stolen:?} stolen from the VM)",
                profile.samples_by_pid()
            ),
            n,
            cpu.on_cpu,
            FREQUENCY,
            MIN_SAMPLES_PER_CPU_PERIOD,
        )?;
        ensure!(
            hashing * 2 >= n,
            "pid {pid} has {n} samples, only {hashing} of them hashing rows: {:?}",
            profile.samples_by_pid()
        );
        let wrong = profile.count_where(|s| s.pid() == Some(pid) && !has_labels(s, labels));
        ensure!(
            wrong == 0,
            "{wrong} of {n} samples of pid {pid} do not carry {labels:?}:\n{}",
            profile.examples_where(|s| s.pid() == Some(pid) && !has_labels(s, labels), 5)
        );
    }
    Ok(())
}

/// The one label set `pid`'s pg_stat_activity rows gave.
fn single_label_set(expected: &BTreeMap<u32, BTreeSet<Labels>>, pid: u32) -> Result<&Labels> {
    let sets = expected
        .get(&pid)
        .with_context(|| format!("pid {pid} never showed in pg_stat_activity"))?;
    ensure!(
        sets.len() == 1,
        "pg_stat_activity changed for pid {pid} during the trace: {sets:#?}"
    );
    Ok(sets.iter().next().expect("one set"))
}

/// CPU time each traced backend gets under a `--queryid` trace: the trace lasts until every one
/// has had it, however long that takes on a loaded machine. At 99 Hz that is ~300 samples; the
/// fewest seen for it, with two `yes` loops and other tests on 2 cores, were 0.75 of that.
const FILTER_CPU: Duration = Duration::from_secs(3);
/// [`MIN_SAMPLES_PER_CPU_PERIOD`] for `--instance`: a sixth, the 50 of ~300 samples it asked
/// as an absolute count. On a CI host that steals CPU from the VM, a backend credited with
/// 3.01 s of CPU by `/proc/PID/stat` got 88 samples there (46% of them taken as it came back
/// from preemption), while `--pid` traces in the same run, which sample the same per-CPU
/// clocks, got all of theirs; the cause was not found. The CPU time is now the scheduler's
/// (`/proc/PID/schedstat`, which leaves stolen time out on this VM's kernel), but no run has
/// shown that this closes the gap. A sixth still fails a filter that drops the kept query.
const MIN_INSTANCE_SAMPLES_PER_CPU_PERIOD: f64 = 1.0 / 6.0;

/// `--queryid` keeps only the samples of that query: with `--pid` of the backend running it,
/// all of them; with `--pid` of a backend running another query, none, and says it left them
/// out; with `--instance`, only that backend's. Each trace runs until every traced backend had
/// the same CPU time, so the samples asked of each do not depend on the machine's load; every
/// sample taken must be either kept or counted in `samples.filtered_out`.
#[test]
fn queryid_filter_keeps_only_that_query() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with(&PgInstall::distro()?, &[("compute_query_id", "on")])?;
    let session = cluster.spawn_session(CPU_BOUND)?;
    let other = cluster.spawn_session(MD5_BOUND)?;
    let query_id = |pid: u32| -> Result<i64> {
        let id = cluster.psql(&format!(
            "SELECT query_id FROM pg_stat_activity WHERE pid = {pid}"
        ))?;
        id.parse()
            .with_context(|| format!("backend {pid} has query_id `{id}`"))
    };
    let (wanted, other_id) = (query_id(session.pid())?, query_id(other.pid())?);
    ensure!(
        wanted != 0 && wanted != other_id,
        "queryids {wanted} and {other_id}"
    );
    let dir = tempfile::tempdir()?;
    for (name, trace, kept_backend, left_out_backend, min_ratio) in [
        (
            "own-pid",
            Trace::pid(session.pid()),
            Some(session.pid()),
            None,
            MIN_SAMPLES_PER_CPU_PERIOD,
        ),
        (
            "other-pid",
            Trace::pid(other.pid()),
            None,
            Some(other.pid()),
            MIN_SAMPLES_PER_CPU_PERIOD,
        ),
        (
            "instance",
            Trace::instance(cluster.data_dir()),
            Some(session.pid()),
            Some(other.pid()),
            MIN_INSTANCE_SAMPLES_PER_CPU_PERIOD,
        ),
    ] {
        let pprof = dir.path().join(format!("{name}.pb.gz"));
        let running = trace
            .frequency(FREQUENCY)
            .queryid(wanted)
            .pprof(&pprof)
            .spawn_summarized()?;
        let traced: Vec<u32> = kept_backend.iter().chain(&left_out_backend).copied().collect();
        let stolen = stolen_time()?;
        let used = CpuWindow::start(&traced)?.await_cpu_each(FILTER_CPU, CPU_TIMEOUT)?;
        let stolen = stolen_time()?.saturating_sub(stolen);
        let (output, summary) = running.finish()?;
        let cpu = |pid: u32| used.get(&pid).map_or(Duration::ZERO, |t| t.on_cpu);
        let profile = LabeledProfile::read_pprof(&pprof)?;
        let (kept, left_out) = (profile.total(), summary.samples_filtered_out()?);
        let (taken, lost) = (summary.samples_taken_in_kernel()?, summary.samples_lost()?);
        eprintln!(
            "{name}: CPU time {used:?}, {stolen:?} stolen from the VM; {taken} samples taken, \
             {lost} lost, {kept} kept, {left_out} left out; per pid {:?}",
            profile.samples_by_pid()
        );
        let foreign = profile.count_where(|s| {
            s.pid() != Some(session.pid()) || s.label("queryid") != Some(wanted.to_string().as_str())
        });
        ensure!(
            foreign == 0,
            "{name}: {foreign} samples are not backend {}'s with queryid {wanted}:\n{}",
            session.pid(),
            profile.examples_where(|s| s.pid() != Some(session.pid()), 5)
        );
        ensure!(
            summary.samples_profiled()? == kept,
            "{name}: the summary counts {} samples kept, the pprof profile has {kept}",
            summary.samples_profiled()?
        );
        // Every sample taken is kept, left out or lost; the counters are read after the last
        // drain of the ring buffer, so a few samples taken in between may be in none.
        let accounted = kept + left_out + lost;
        ensure!(
            accounted <= taken && accounted * 50 >= taken * 49,
            "{name}: of {taken} samples taken, {kept} kept, {left_out} left out and {lost} lost"
        );
        match kept_backend {
            Some(pid) => ensure_samples_cover(
                &format!(
                    "{name}: kept with --queryid {wanted}, of backend {pid} running only that query \
                     ({stolen:?} stolen from the VM meanwhile)"
                ),
                kept,
                cpu(pid),
                FREQUENCY,
                min_ratio,
            )?,
            None => {
                ensure!(kept == 0, "{name}: {kept} samples kept");
                ensure!(
                    output.stdout.contains("left out (--queryid)"),
                    "{name}: the summary does not say samples were left out:\n{}",
                    output.stdout
                );
                // A busy backend whose samples were all of other queries was not idle.
                ensure!(
                    output.stdout.contains("no samples of that queryid")
                        && !output.stdout.contains("the target was idle"),
                    "{name}: the summary does not say why no sample was kept:\n{}",
                    output.stdout
                );
            }
        }
        match left_out_backend {
            Some(pid) => ensure_samples_cover(
                &format!(
                    "{name}: counted as left out, of backend {pid} running another query ({stolen:?} \
                     stolen from the VM meanwhile)"
                ),
                left_out,
                cpu(pid),
                FREQUENCY,
                min_ratio,
            )?,
            // The traced backend ran nothing but the wanted query.
            None => ensure!(left_out == 0, "{name}: {left_out} samples left out"),
        }
    }
    ensure!(
        session.is_active()? && other.is_active()?,
        "a workload ended during the traces"
    );
    Ok(())
}
