//! Sampled off-CPU time (`--off-cpu`, the default: each tick samples every backend off CPU,
//! weighing one tick) checked against two references that measure the same waits another way:
//! the exact context-switch tracer run in the same trace (`--off-cpu=both`), and
//! pg_stat_activity polled from a connection of its own. And what idle connections cost: time
//! counted as idle, never a stack.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::activity_sampler::{sample_activity, ActivitySamples};
use pgscope_tests::bpf_objects;
use pgscope_tests::freeze::FrozenThread;
use pgscope_tests::process::{children_of, wait_for};
use pgscope_tests::summary::OffCpuWait;
use pgscope_tests::{
    pgscope_bin, require_root_and_bpf, workload, PgCluster, PgInstall, Profile, Trace, TraceSummary,
};

/// Largest difference allowed between a wait event's share in the sampled profile and in the
/// reference, in percentage points.
const SHARE_PP: f64 = 5.0;
/// Largest relative difference allowed between the sampled and the exact time in the wait
/// events Postgres reports (every compared row but [`NO_WAIT_EVENT`]).
const TOTAL_TOLERANCE: f64 = 0.10;

/// Largest relative difference allowed between the sampled time and the exact tracer's state
/// at the sampler's runs ([`check_sampled_against_exact_at_runs`]), in reported wait events and
/// outside them. Measured on the storm: 0.990 and 1.004 (kfunc passes), 0.998 and 1.000 (task
/// iterators); a wait the sampler guesses or misreads shows here.
const AT_RUNS_TOLERANCE: f64 = 0.05;

/// On the eviction storm, the exact tracer's state at the sampler's runs over its time
/// average, at least and at most, for the time in reported wait events and the time outside
/// them. What stands between the two is not how a run reads a thread (judged within
/// [`AT_RUNS_TOLERANCE`]) but where the runs fall and what they do to the storm
/// (docs/architecture.md, "The run's own cost"): a run takes a CPU at real-time priority for
/// 90-140 µs, the backend there (often the one holding the extension's lock, the 15 others
/// queued behind it) waits meanwhile, and the exact tracer counts those waits while the
/// instants cannot; the threads a run visits late have queued behind the run itself. Both grow
/// with the runs' length, which is the machine's: over 40-200 s runs the lock's time came out
/// 0.76-1.08 of the average (0.83-0.90 on CI's machine), the time outside wait events
/// 0.65-1.18 (1.18 on CI's, with runs of 140 µs). A sampler whose runs halved or doubled what
/// they measure still fails; how close a given machine comes is `bench/offcpu-agreement.sh`'s.
const INSTANTS_OVER_AVERAGE: (f64, f64) = (0.5, 1.5);

/// The logical replication launcher, asleep for the whole storm, sampled off CPU for this share
/// of the trace at least and at most: every run reached every thread, and the ticks it
/// deferred were all counted (40091 ms of a 40093 ms trace). The sampler starts a moment after
/// the trace's clock does, 0.3-0.6 s on a busy machine.
const LAUNCHER_COVERAGE: (f64, f64) = (0.97, 1.01);

/// The row of off-CPU time outside any reported wait event: preemptions, and blocking syscalls
/// Postgres does not report. It is left out of the shares and of the total's bound, and judged
/// by its own ratio ([`NO_WAIT_EVENT_RATIO`]). How much of it there is depends on what else the machine runs (two busy CPUs
/// of other work preempt every backend), and it is where the sampler is least exact: a backend
/// waiting for a CPU at the sampler's instant often runs, and blocks in its next client read,
/// before the run visits it (docs/architecture.md, "What is left": preempted time 0.63-0.90 of
/// perf's ground truth). On the eviction storm the client backends' preempted time came out
/// 1.036, 0.877, 1.058 and 0.976 of the exact in four runs of 200 s on one quiet day, while
/// `LWLock:pg_stat_statements` held at 0.985, 0.963, 1.008 and 0.992.
const NO_WAIT_EVENT: &str = "(no wait event)";

/// The sampled time of [`NO_WAIT_EVENT`] over the exact, at least and at most, on TPC-B (the
/// storm judges it at the sampler's runs instead): the sampler's
/// known error on preemption (0.63-0.90 of perf's ground truth in
/// `bench/offcpu-groundtruth.sh`'s runs, docs/architecture.md), which two CPU hogs beside the
/// storm make most of its off-CPU time: there it came out 0.75 while the lock's time held at
/// 1.015, and the shares, had this row been among them, were 7.6 pp apart. A sampler that
/// lost or doubled preemptions still fails.
const NO_WAIT_EVENT_RATIO: (f64, f64) = (0.6, 1.15);

/// The settings of a cluster whose commits wait for their WAL flush: the test clusters run with
/// fsync off, for speed.
const SYNCHRONOUS_COMMITS: &[(&str, &str)] = &[
    ("fsync", "on"),
    ("synchronous_commit", "on"),
    ("wal_sync_method", "fdatasync"),
];

/// One wait event's amount in the reference and in the sampled profile.
struct ShareRow {
    wait_event: String,
    reference: f64,
    sampled: f64,
}

/// Per wait event, the reference's and the sampled profile's amounts, compared as shares of
/// their own totals over the rows given.
struct ShareComparison {
    reference_name: &'static str,
    /// What the other side is: "sampled" unless [`ShareComparison::compared_as`] says.
    compared_name: &'static str,
    /// Units of the reference's and the sampled amounts.
    units: (&'static str, &'static str),
    rows: Vec<ShareRow>,
}

impl ShareComparison {
    fn new(
        reference_name: &'static str,
        units: (&'static str, &'static str),
        reference: &BTreeMap<String, f64>,
        sampled: &BTreeMap<String, f64>,
    ) -> Self {
        let events: BTreeSet<&String> = reference.keys().chain(sampled.keys()).collect();
        let mut rows: Vec<ShareRow> = events
            .into_iter()
            .map(|event| ShareRow {
                wait_event: event.clone(),
                reference: reference.get(event).copied().unwrap_or(0.0),
                sampled: sampled.get(event).copied().unwrap_or(0.0),
            })
            .collect();
        rows.sort_by(|a, b| b.reference.total_cmp(&a.reference));
        Self {
            reference_name,
            compared_name: "sampled",
            units,
            rows,
        }
    }

    /// Names the compared side `name` in the table, where it is not the sampled profile.
    fn compared_as(mut self, name: &'static str) -> Self {
        self.compared_name = name;
        self
    }

    fn reference_total(&self) -> f64 {
        self.rows.iter().map(|r| r.reference).sum()
    }

    fn sampled_total(&self) -> f64 {
        self.rows.iter().map(|r| r.sampled).sum()
    }

    /// (reference share, sampled share) of `row`, in percent.
    fn shares(&self, row: &ShareRow) -> (f64, f64) {
        let pct = |n: f64, total: f64| if total > 0.0 { 100.0 * n / total } else { 0.0 };
        (
            pct(row.reference, self.reference_total()),
            pct(row.sampled, self.sampled_total()),
        )
    }

    fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<36} {:>14} {:>8} {:>14} {:>8} {:>8}",
            "wait event",
            format!("{} {}", self.reference_name, self.units.0),
            "share",
            format!("{} {}", self.compared_name, self.units.1),
            "share",
            "diff pp"
        );
        for row in &self.rows {
            let (reference, sampled) = self.shares(row);
            let _ = writeln!(
                out,
                "{:<36} {:>14.1} {:>7.1}% {:>14.1} {:>7.1}% {:>+8.1}",
                row.wait_event,
                row.reference,
                reference,
                row.sampled,
                sampled,
                sampled - reference
            );
        }
        let _ = writeln!(
            out,
            "{:<36} {:>14.1} {:>8} {:>14.1}",
            "total",
            self.reference_total(),
            "",
            self.sampled_total()
        );
        out
    }

    /// The largest difference between a row's two shares, in percentage points.
    fn max_share_difference(&self) -> f64 {
        self.rows
            .iter()
            .map(|row| {
                let (reference, sampled) = self.shares(row);
                (sampled - reference).abs()
            })
            .fold(0.0, f64::max)
    }

    /// The rows whose shares differ by more than [`SHARE_PP`].
    fn disagreements(&self) -> Vec<String> {
        self.rows
            .iter()
            .filter_map(|row| {
                let (reference, sampled) = self.shares(row);
                ((sampled - reference).abs() > SHARE_PP).then(|| {
                    format!(
                        "{}: {sampled:.1}% sampled, {reference:.1}% {}",
                        row.wait_event, self.reference_name
                    )
                })
            })
            .collect()
    }
}

/// Off-CPU milliseconds per wait event (summed over backend types and classes) of the rows the
/// sampler and the exact tracer both measure alike; left out:
/// - class `idle` rows (a client backend waiting for its next statement, a background process
///   in its main loop): neither tracer takes a stack there, and they are the processes' whole
///   lives (seconds per process), which would shrink every real wait to a share of nothing;
/// - `Client:*` waits inside a transaction: the client's think time and round trips, not a wait
///   of the server. Both count them without a stack, but the line between them and idle time is
///   the backend's state, which the tracer reads when the wait begins and the sampler at each
///   tick: time the tracer calls idle the sampler can call a client wait, and the other way.
///
/// Kept: every other wait event, whatever its class (a backend woken from a lock wait but not
/// on a CPU yet is in that wait for both), and `(no wait event)`: preemptions outside any wait
/// and blocking syscalls Postgres does not report, which both measure alike.
fn comparable_waits(rows: &[OffCpuWait]) -> BTreeMap<String, f64> {
    let mut by_event = BTreeMap::new();
    for row in rows
        .iter()
        .filter(|r| r.off_cpu != "idle" && !r.wait_event.starts_with("Client:"))
    {
        *by_event.entry(row.wait_event.clone()).or_insert(0.0) += row.ns as f64 / 1e6;
    }
    by_event
}

/// The exact and the sampled `by_wait` rows side by side, in ms: where a disagreement of the
/// compared table comes from.
fn rows_side_by_side(exact: &[OffCpuWait], sampled: &[OffCpuWait]) -> String {
    let mut rows: BTreeMap<(String, String, String), (f64, f64)> = BTreeMap::new();
    let key = |w: &OffCpuWait| (w.wait_event.clone(), w.off_cpu.clone(), w.backend_type.clone());
    for w in exact {
        rows.entry(key(w)).or_default().0 += w.ns as f64 / 1e6;
    }
    for w in sampled {
        rows.entry(key(w)).or_default().1 += w.ns as f64 / 1e6;
    }
    let mut out = format!(
        "{:<36} {:<10} {:<28} {:>12} {:>12}\n",
        "wait event", "off_cpu", "backend type", "exact ms", "sampled ms"
    );
    for ((wait, class, backend_type), (exact, sampled)) in rows {
        let _ = writeln!(
            out,
            "{wait:<36} {class:<10} {backend_type:<28} {exact:>12.1} {sampled:>12.1}"
        );
    }
    out
}

/// That the trace measured off-CPU time both ways (`--off-cpu=both`).
fn check_both_modes(summary: &TraceSummary) -> Result<()> {
    let (mode, exact_mode) = summary.off_cpu_modes()?;
    ensure!(
        mode == "sampled" && exact_mode.as_deref() == Some("exact"),
        "--off-cpu=both measured off_cpu.mode {mode} and off_cpu_exact.mode {exact_mode:?}"
    );
    Ok(())
}

/// The sampled off-CPU time of the logical replication launcher, asleep for the whole trace,
/// over the trace's duration: how much of the trace the sampler's runs covered.
fn launcher_coverage(summary: &TraceSummary) -> Result<f64> {
    let launcher_ms: f64 = summary
        .off_cpu_by_wait()?
        .iter()
        .filter(|w| w.backend_type == "logical replication launcher")
        .map(|w| w.ns as f64 / 1e6)
        .sum();
    Ok(launcher_ms / (1e3 * summary.duration_seconds()?))
}

/// Says how much of the trace the sampler covered and what it lost: what tells a share gone
/// wrong from time lost.
fn say_coverage(summary: &TraceSummary, workload: &str) -> Result<()> {
    eprintln!(
        "{workload}: the logical replication launcher, asleep throughout, sampled off CPU for \
         {:.4} of the trace's {:.0} ms; samples lost: {:?}",
        launcher_coverage(summary)?,
        1e3 * summary.duration_seconds()?,
        summary.samples_lost_by_reason()?
    );
    Ok(())
}

/// The sampled profile against the exact one of the same `--off-cpu=both` trace: each
/// reported wait event's share of the reported waits within [`SHARE_PP`], their time within
/// [`TOTAL_TOLERANCE`], and the time outside them within [`NO_WAIT_EVENT_RATIO`].
fn check_sampled_against_exact(summary: &TraceSummary, workload: &str) -> Result<()> {
    check_both_modes(summary)?;
    say_coverage(summary, workload)?;
    let (exact_rows, sampled_rows) = (
        comparable_waits(&summary.off_cpu_exact_by_wait()?),
        comparable_waits(&summary.off_cpu_by_wait()?),
    );
    let comparison = ShareComparison::new("exact", ("ms", "ms"), &exact_rows, &sampled_rows);
    check_sampled_against_exact_at_runs(summary, workload, &sampled_rows)?;
    let reported_only = |rows: &BTreeMap<String, f64>| {
        let mut rows = rows.clone();
        rows.remove(NO_WAIT_EVENT);
        rows
    };
    let reported = ShareComparison::new(
        "exact",
        ("ms", "ms"),
        &reported_only(&exact_rows),
        &reported_only(&sampled_rows),
    );
    let no_wait = |rows: &BTreeMap<String, f64>| rows.get(NO_WAIT_EVENT).copied().unwrap_or(0.0);
    let (exact_no_wait, sampled_no_wait) = (no_wait(&exact_rows), no_wait(&sampled_rows));
    eprintln!(
        "{workload}: off-CPU time by wait event, idle and Client:* rows left out\n{}\n\
         {workload}: every row by backend type, wait event and class, in ms (not compared)\n{}",
        comparison.table(),
        rows_side_by_side(&summary.off_cpu_exact_by_wait()?, &summary.off_cpu_by_wait()?)
    );
    let (exact_total, sampled_total) = (comparison.reference_total(), comparison.sampled_total());
    let (exact, sampled) = (reported.reference_total(), reported.sampled_total());
    ensure!(
        exact > 0.0,
        "{workload}: the exact tracer measured no time in a reported wait event outside idle and \
         client waits"
    );
    // One line for bench/offcpu-agreement.sh, which runs the eviction storm's comparison.
    eprintln!(
        "agreement: workload={} total_ratio={:.3} waits_ratio={:.3} no_wait_event_ratio={:.3} \
         max_share_pp={:.1}",
        workload.replace(' ', "-"),
        sampled_total / exact_total,
        sampled / exact,
        sampled_no_wait / exact_no_wait,
        reported.max_share_difference()
    );
    // A sample lost to a full ring buffer takes its tick out of the sampled side only (the
    // exact tracer adds the time of a lost record to its totals): a failure says so.
    let lost = summary.samples_lost_by_reason()?;
    let lost_note = match lost.is_empty() {
        true => String::new(),
        false => format!(
            "\npgscope lost samples {lost:?}: its reader did not drain the ring buffer in time \
             (too little CPU for it), and each off-CPU sample lost is a tick missing from the \
             sampled side"
        ),
    };
    // A run's time is taken from the backend on its CPU; the exact tracer counts the waits
    // that makes, the run's samples cannot (docs/architecture.md): said on failure.
    let cost = summary
        .wait_sampler_cost()?
        .context("the summary has no `wait_sampler`, though the off-CPU sampler ran")?;
    let lost_note = format!("{lost_note}\nthe off-CPU sampler's runs: {cost}");
    let disagreements = reported.disagreements();
    ensure!(
        disagreements.is_empty(),
        "{workload}: reported wait events' shares differ by more than {SHARE_PP} pp between the \
         sampled and the exact profile:\n{}\n{}{lost_note}",
        disagreements.join("\n"),
        reported.table()
    );
    if exact_no_wait > 0.0 {
        let ratio = sampled_no_wait / exact_no_wait;
        let (least, most) = NO_WAIT_EVENT_RATIO;
        ensure!(
            (least..=most).contains(&ratio),
            "{workload}: {NO_WAIT_EVENT} sampled {sampled_no_wait:.1} ms against the exact \
             {exact_no_wait:.1} ms, {ratio:.3} of it (between {least} and {most} allowed: the \
             sampler's known error on preemption)\n{}{lost_note}",
            comparison.table()
        );
    }
    let off = (sampled - exact).abs() / exact;
    ensure!(
        off <= TOTAL_TOLERANCE,
        "{workload}: sampled time in reported wait events ({NO_WAIT_EVENT} left out), \
         {sampled:.1} ms, is {:.1}% away from the exact {exact:.1} ms (at most {:.0}% allowed)\n\
         {}{lost_note}",
        100.0 * off,
        100.0 * TOTAL_TOLERANCE,
        comparison.table()
    );
    Ok(())
}

/// The milliseconds of `rows` in reported wait events, and outside any ([`NO_WAIT_EVENT`]).
fn split_outside(rows: &BTreeMap<String, f64>) -> (f64, f64) {
    let outside = rows.get(NO_WAIT_EVENT).copied().unwrap_or(0.0);
    (rows.values().sum::<f64>() - outside, outside)
}

/// The sampled profile against where the exact tracer had each thread as the sampler's runs
/// reached it (`off_cpu_exact_at_runs`): the time in reported wait events and the time outside
/// them each within [`AT_RUNS_TOLERANCE`]. Both are read at the same instants, so neither
/// sampling noise nor where the runs fall and what they do to the database (which the exact
/// time average holds and the samples cannot) stands between them: only how well a run reads
/// each thread's wait.
fn check_sampled_against_exact_at_runs(
    summary: &TraceSummary,
    workload: &str,
    sampled_rows: &BTreeMap<String, f64>,
) -> Result<()> {
    let at_runs_rows = comparable_waits(&summary.off_cpu_exact_at_runs_by_wait()?);
    let at_runs = ShareComparison::new("exact at runs", ("ms", "ms"), &at_runs_rows, sampled_rows);
    let ((exact_waits, exact_outside), (sampled_waits, sampled_outside)) =
        (split_outside(&at_runs_rows), split_outside(sampled_rows));
    eprintln!(
        "{workload}: against the exact state at the sampler's runs\n{}\nagreement_at_runs: \
         workload={} waits_ratio={:.3} no_wait_event_ratio={:.3}",
        at_runs.table(),
        workload.replace(' ', "-"),
        sampled_waits / exact_waits,
        sampled_outside / exact_outside,
    );
    for (what, exact, sampled) in [
        ("time in reported wait events", exact_waits, sampled_waits),
        (NO_WAIT_EVENT, exact_outside, sampled_outside),
    ] {
        ensure!(
            exact > 0.0,
            "{workload}: the exact tracer had no thread in {what} at the sampler's runs"
        );
        let off = (sampled - exact).abs() / exact;
        ensure!(
            off <= AT_RUNS_TOLERANCE,
            "{workload}: sampled {what}, {sampled:.1} ms, is {:.1}% away from the exact state \
             at the sampler's runs, {exact:.1} ms (at most {:.0}% allowed)\n{}",
            100.0 * off,
            100.0 * AT_RUNS_TOLERANCE,
            at_runs.table()
        );
    }
    Ok(())
}

/// The pg_stat_statements eviction storm: 16 clients running 128 distinct statements into 100
/// entries queue on the extension's LWLock (futex waits of microseconds, in convoys), for
/// [`storm_seconds`] (120 by default). Judged three ways ([`check_storm_against_exact`]):
/// - how each run reads each thread: the sampled time against the exact tracer's state at the
///   sampler's own runs, within [`AT_RUNS_TOLERANCE`], in reported waits and outside them;
/// - that the runs covered the trace ([`LAUNCHER_COVERAGE`]);
/// - where the runs fall and what they do: the exact state at the runs against the exact time
///   average ([`INSTANTS_OVER_AVERAGE`]).
///
/// Not the sampled time against the exact average within 10-20%, as this test did until
/// 2026-11-29: that ratio is the product of the first and the third, and the third is the
/// machine's (the runs' length), not the sampler's reading. It failed CI at 0.83-0.90 on the
/// lock's time and at 1.18 on the time outside wait events, each time with the first within 1%.
///
/// Why 120 s: the lock waits come in convoys (one backend evicting, the others queued behind
/// it), so few ticks see one and each sees many backends at once. Over 20 s at 99 Hz even a
/// perfect sampler (perf's record of every switch read at as many random instants,
/// `bench/offcpu-groundtruth.sh`) lands within 10% of the true lock-wait time in only 45-60%
/// of draws; runs of 100 s spread 0.905-1.096 (standard deviation 0.052), runs of 200 s with a
/// standard deviation of 0.019-0.045.
/// At 120 s the third check's bounds are over 3 standard deviations from the farthest ratio
/// measured (0.65).
///
/// `bench/offcpu-agreement.sh` runs it repeatedly and prints the ratios.
#[test]
fn sampled_waits_agree_with_the_exact_tracer_in_an_eviction_storm() -> Result<()> {
    require_root_and_bpf();
    let (cluster, _scripts, args) = eviction_storm(storm_seconds()?)?;
    let trace = Trace::instance(cluster.data_dir())
        .off_cpu_mode("both")
        .spawn_summarized()?;
    favour_pgscope()?;
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    cluster.pgbench(&arg_refs)?;
    let (_, summary) = trace.finish()?;
    let dealloc = cluster.psql("SELECT dealloc FROM pg_stat_statements_info")?;
    eprintln!("pg_stat_statements evictions: {dealloc}");
    check_storm_against_exact(&summary, "eviction storm")
}

/// The storm's three checks (see the test): the sampler's reading at its runs, the runs'
/// coverage of the trace, and the exact state at the runs against the exact time average.
fn check_storm_against_exact(summary: &TraceSummary, workload: &str) -> Result<()> {
    check_both_modes(summary)?;
    say_coverage(summary, workload)?;
    let exact_rows = comparable_waits(&summary.off_cpu_exact_by_wait()?);
    let at_runs_rows = comparable_waits(&summary.off_cpu_exact_at_runs_by_wait()?);
    let sampled_rows = comparable_waits(&summary.off_cpu_by_wait()?);
    let cost = summary
        .wait_sampler_cost()?
        .context("the summary has no `wait_sampler`, though the off-CPU sampler ran")?;
    let lost = summary.samples_lost_by_reason()?;
    let average = ShareComparison::new("exact", ("ms", "ms"), &exact_rows, &sampled_rows);
    let instants =
        ShareComparison::new("exact", ("ms", "ms"), &exact_rows, &at_runs_rows).compared_as("at runs");
    eprintln!(
        "{workload}: off-CPU time by wait event, idle and Client:* rows left out\n{}\n\
         {workload}: the exact state at the runs against the exact average\n{}\n\
         {workload}: every row by backend type, wait event and class, in ms (not compared)\n{}",
        average.table(),
        instants.table(),
        rows_side_by_side(&summary.off_cpu_exact_by_wait()?, &summary.off_cpu_by_wait()?)
    );
    let ((exact_waits, exact_outside), (at_runs_waits, at_runs_outside)) =
        (split_outside(&exact_rows), split_outside(&at_runs_rows));
    let (sampled_waits, sampled_outside) = split_outside(&sampled_rows);
    // One line for bench/offcpu-agreement.sh.
    eprintln!(
        "agreement: workload={} total_ratio={:.3} waits_ratio={:.3} no_wait_event_ratio={:.3} \
         max_share_pp={:.1} instants_waits_ratio={:.3} instants_no_wait_event_ratio={:.3}",
        workload.replace(' ', "-"),
        average.sampled_total() / average.reference_total(),
        sampled_waits / exact_waits,
        sampled_outside / exact_outside,
        average.max_share_difference(),
        at_runs_waits / exact_waits,
        at_runs_outside / exact_outside,
    );
    check_sampled_against_exact_at_runs(summary, workload, &sampled_rows)?;

    let coverage = launcher_coverage(summary)?;
    let (least, most) = LAUNCHER_COVERAGE;
    ensure!(
        (least..=most).contains(&coverage),
        "{workload}: the logical replication launcher, asleep throughout, was sampled off CPU for \
         {coverage:.4} of the trace (between {least} and {most} expected): the sampler's runs \
         missed threads or ticks, or counted them twice\nsamples lost: {lost:?}\nthe off-CPU \
         sampler's runs: {cost}"
    );

    let (least, most) = INSTANTS_OVER_AVERAGE;
    for (what, exact, at_runs) in [
        ("time in reported wait events", exact_waits, at_runs_waits),
        (NO_WAIT_EVENT, exact_outside, at_runs_outside),
    ] {
        ensure!(
            exact > 0.0,
            "{workload}: the exact tracer measured no {what} outside idle and client waits"
        );
        let ratio = at_runs / exact;
        ensure!(
            (least..=most).contains(&ratio),
            "{workload}: at the sampler's runs the exact tracer had {at_runs:.1} ms of {what}, \
             {ratio:.3} of its time average, {exact:.1} ms (between {least} and {most} allowed): \
             the runs disturb what they measure (a run takes a CPU at real-time priority from \
             the backend there, and the others queue behind it)\n{}\nthe off-CPU sampler's \
             runs: {cost}",
            instants.table()
        );
    }
    Ok(())
}

/// A cluster set up for the eviction storm, the directory of its pgbench scripts, and pgbench's
/// arguments for 16 clients running them for `seconds`.
fn eviction_storm(seconds: u64) -> Result<(PgCluster, tempfile::TempDir, Vec<String>)> {
    let cluster = PgCluster::start_with_pg_stat_statements(
        &PgInstall::distro()?,
        &[("pg_stat_statements.max", "100")],
    )?;
    let (scripts, mut args) = workload::pgss_eviction_scripts(&cluster)?;
    args.extend(["-n", "-c", "16", "-j", "2", "-T"].map(String::from));
    args.push(seconds.to_string());
    Ok((cluster, scripts, args))
}

/// Nice value of the pgscope traces whose two off-CPU profiles are compared.
const PGSCOPE_NICE: libc::c_int = -10;

/// Runs every thread of the `pgscope` processes this test started at [`PGSCOPE_NICE`], so that
/// its ring buffer's reader keeps up on a busy machine.
///
/// A storm of 16 backends sends ~10 MB/s of off-CPU samples through the 8 MiB ring buffer; at
/// nice 0 beside CPU hogs (load 17-24 here) the reader fell behind for seconds at a time and
/// the buffer dropped 46000-73000 samples in 200 s, each a tick missing from the sampled side
/// only (sampled/exact 0.75-0.85); reniced, a run at load 17 lost none (0.99). (A dropped
/// off-CPU sample keeps its time now, counted without its stack:
/// [`sampled_waits_keep_their_time_when_the_ring_buffer_overflows`]; the renice keeps the
/// stacks.) What these tests
/// judge is where the sampler puts the time, not how fast a reader starved of CPU drains; a
/// loss is still named in their failure message. The reniced threads only take the CPU they
/// need (15-25% of one here), and both profiles are of the same run.
fn favour_pgscope() -> Result<()> {
    let mut reniced = 0;
    for pid in pgscope_children()? {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .with_context(|| format!("cannot list the threads of pgscope ({pid})"))?;
        for task in tasks {
            let name = task?.file_name();
            let tid: libc::id_t = name
                .to_str()
                .and_then(|tid| tid.parse().ok())
                .with_context(|| format!("`/proc/{pid}/task/{name:?}` is not a thread id"))?;
            // SAFETY: setpriority only reads its arguments; `tid` is a thread of our own child.
            if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, PGSCOPE_NICE) } == 0 {
                reniced += 1;
                continue;
            }
            let error = std::io::Error::last_os_error();
            // A thread that ended since it was listed has nothing left to favour.
            if error.raw_os_error() != Some(libc::ESRCH) {
                return Err(error)
                    .with_context(|| format!("cannot renice pgscope's thread {tid} (needs root)"));
            }
        }
    }
    ensure!(
        reniced > 0,
        "no running pgscope among this test's children to renice"
    );
    Ok(())
}

/// The `pgscope` processes this test started.
fn pgscope_children() -> Result<Vec<u32>> {
    let binary = pgscope_bin()?.canonicalize()?;
    Ok(children_of(std::process::id())
        .into_iter()
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe")).ok().as_deref() == Some(binary.as_path())
        })
        .collect())
}

/// The backends' CPU time the storm runs for once pgscope's reader is back.
const STORM_AFTER_OVERFLOW_CPU: Duration = Duration::from_secs(40);

/// Records the ring buffer had no room for, at least, while the reader is stopped: a few
/// seconds of the storm's samples past the buffer's 8 MiB.
const MIN_RING_OVERFLOW: u64 = 2000;

/// Samples the ring buffer has no room for (its reader behind: a pgscope starved of its CPU,
/// or held up in its own work) lose their stacks, never their time: counted without a stack,
/// as the exact tracer keeps its own. A storm traced beside a build once lost 5328 records and
/// 19% of its sampled wait time with them (0.69 of the exact state at the sampler's runs when
/// the reader was stopped on purpose). Here pgscope's reader thread (its main thread; the
/// sampler's runs go on in their own) is stopped during an eviction storm until the buffer has
/// overflowed, and the sampled time is judged against the exact state at the sampler's runs.
#[test]
fn sampled_waits_keep_their_time_when_the_ring_buffer_overflows() -> Result<()> {
    require_root_and_bpf();
    let (cluster, _scripts, args) = eviction_storm(600)?;
    let trace = Trace::instance(cluster.data_dir())
        .off_cpu_mode("both")
        .spawn_summarized()?;
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut pgbench = cluster.spawn_pgbench(&arg_refs, 16)?;
    let reader = match pgscope_children()?.as_slice() {
        [pid] => *pid,
        pids => anyhow::bail!("expected one pgscope among this test's children, found {pids:?}"),
    };
    let counters = counters_map_of(reader)?;
    let overflowed = {
        let _frozen = FrozenThread::freeze(reader)?;
        wait_for(
            &format!(
                "{MIN_RING_OVERFLOW} records lost to the full ring buffer while pgscope's reader is stopped"
            ),
            Duration::from_secs(120),
            || Ok(Some(ring_buffer_full(counters)?).filter(|&lost| lost >= MIN_RING_OVERFLOW)),
        )
    };
    let overflowed = overflowed.context("the storm did not fill the ring buffer")?;
    // And some of the storm with the reader back: enough of it that the time outside wait
    // events, judged within 5% at the runs, is more than a few hundred ticks (10 s of the
    // backends' CPU made ~120, and one CI run 5.2% off: 6 ticks).
    pgbench.run_for_cpu(STORM_AFTER_OVERFLOW_CPU, Duration::from_secs(240))?;
    pgbench.stop()?;
    let (_, summary) = trace.finish()?;
    eprintln!("records lost while the reader was stopped: {overflowed}");
    let lost = summary.samples_lost_by_reason()?;
    ensure!(
        lost.get("lost_ringbuf_full").copied().unwrap_or(0) >= MIN_RING_OVERFLOW,
        "the summary does not count the records the full ring buffer lost: {lost:?}"
    );
    let sampled_rows = comparable_waits(&summary.off_cpu_by_wait()?);
    check_sampled_against_exact_at_runs(&summary, "storm with its reader stopped", &sampled_rows)
}

/// The ID of the BPF `counters` map `pid` (pgscope) holds: its own, not another profiler's of the
/// same name on the machine (a pgscope agent a developer runs, one a killed test left behind).
fn counters_map_of(pid: u32) -> Result<u32> {
    let maps = bpf_objects::held_by(pid)?.maps;
    for id in &maps {
        let out = std::process::Command::new("bpftool")
            .args(["map", "show", "id", &id.to_string(), "-j"])
            .output()
            .context("cannot run bpftool")?;
        // Freed since it was listed: not the counters, which live as long as pgscope.
        if !out.status.success() {
            continue;
        }
        let map: serde_json::Value = serde_json::from_slice(&out.stdout).context("bpftool's JSON")?;
        if map["name"] == "counters" {
            return Ok(*id);
        }
    }
    anyhow::bail!("pgscope ({pid}) holds no BPF map named `counters` among {maps:?}")
}

/// Records lost to a full ring buffer so far (`PGSCOPE_CNT_RINGBUF_FULL`, index 2 of the BPF
/// `counters` map `id`, summed over CPUs), read with bpftool: pgscope's reader, which would say,
/// is the one stopped.
fn ring_buffer_full(id: u32) -> Result<u64> {
    let out = std::process::Command::new("bpftool")
        .args(["map", "dump", "id", &id.to_string(), "-j"])
        .output()
        .context("cannot run bpftool")?;
    ensure!(
        out.status.success(),
        "bpftool map dump id {id}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let entries: serde_json::Value = serde_json::from_slice(&out.stdout).context("bpftool's JSON")?;
    let entry = entries
        .as_array()
        .and_then(|entries| entries.get(2))
        .and_then(|entry| entry.get("formatted"))
        .context("bpftool shows no formatted entry 2 of `counters`")?;
    Ok(entry["values"]
        .as_array()
        .context("entry 2 of `counters` has no per-CPU values")?
        .iter()
        .filter_map(|v| v["value"].as_u64())
        .sum())
}

/// How long the eviction storm runs: `PGSCOPE_STORM_SECONDS`, 120 by default (what its bounds
/// need, measured above); `bench/offcpu-groundtruth.sh` runs it for 20, as perf records every
/// switch of it.
fn storm_seconds() -> Result<u64> {
    match std::env::var("PGSCOPE_STORM_SECONDS") {
        Err(_) => Ok(120),
        Ok(text) => text
            .parse()
            .ok()
            .filter(|&seconds| seconds > 0)
            .with_context(|| format!("PGSCOPE_STORM_SECONDS={text:?} is not a number of seconds")),
    }
}

/// How long TPC-B is traced and pg_stat_activity polled: the window both share comparisons are
/// drawn from. Their samples are ticks and polls, which come at a fixed rate however busy the
/// machine is (the sampler and the poller run at real-time priority), so the window is a time.
/// The waits here last milliseconds and overlap across the 8 backends, so successive ticks are
/// nearly independent but one tick's backends are not: 10 s is ~1000 ticks at 99 Hz and 1000
/// polls at 100 Hz, a standard error of at most 1.6 pp on a share (p = 0.5, one independent
/// observation per tick), which puts the 5 pp bound 3 standard errors away; at 5 s it would be
/// 2.2 (one run in 35 outside by chance alone).
const TPCB_WINDOW: Duration = Duration::from_secs(10);

/// pgbench's TPC-B-like script with synchronous commits: commits wait for their WAL flush
/// (`IO:WALSync`, or `LWLock:WALWrite` behind another backend's flush), and 8 clients updating
/// 4 branch rows wait for each other's row locks (`Lock:transactionid`, `Lock:tuple`). One
/// `--off-cpu=both` trace of it, with pg_stat_activity polled over the same window, is checked
/// three ways:
/// - the sampled profile against the exact one of the same trace ([`check_sampled_against_exact`]);
/// - the sampled profile against pg_stat_activity, polled at 100 Hz from a connection of its
///   own ([`check_sampled_against_activity`]);
/// - the wall-clock split of the branch update: its parts add up to its total, and the row
///   lock waits are among them.
///
/// pgbench runs inside the trace, from its connections to their ends: the exact tracer is
/// attached a moment before the sampler's first tick and detached a moment after its last
/// (0.3-0.6 s apart on a busy machine), which with the workload running across them came out
/// as a sampled total 3-10% short of the exact one. pg_stat_activity is polled while it runs.
#[test]
fn sampled_waits_agree_with_the_exact_tracer_and_pg_stat_activity_under_tpcb() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, SYNCHRONOUS_COMMITS)?;
    cluster.pgbench(&["-i", "-q", "-s", "4"])?;
    cluster.psql("SELECT pg_stat_statements_reset()")?;
    let trace = Trace::instance(cluster.data_dir())
        .off_cpu_mode("both")
        .spawn_summarized()?;
    favour_pgscope()?;
    // Longer than the test: stopped once the poll is done. -n: `-i` has just vacuumed.
    let mut pgbench = cluster.spawn_pgbench(&["-n", "-c", "8", "-j", "2", "-T", "600"], 8)?;
    let polled = sample_activity(&cluster, 100, TPCB_WINDOW)?;
    ensure!(pgbench.is_running()?, "pgbench ended during the poll");
    // Before the trace ends: `stop` returns once the backends are gone.
    pgbench.stop()?;
    let (_, summary) = trace.finish()?;
    let branch_update = cluster.psql(
        "SELECT queryid FROM pg_stat_statements WHERE toplevel AND query LIKE 'UPDATE pgbench_branches%'",
    )?;

    // Every check runs and prints its tables; the first failure fails the test.
    let failures: Vec<anyhow::Error> = [
        check_branch_update_wall_clock(&summary, branch_update.trim()).context("wall-clock split"),
        check_sampled_against_exact(&summary, "TPC-B").context("sampled against exact"),
        check_sampled_against_activity(&summary, &polled).context("sampled against pg_stat_activity"),
    ]
    .into_iter()
    .filter_map(Result::err)
    .collect();
    for failure in &failures {
        eprintln!("TPC-B: {failure:#}");
    }
    failures.into_iter().next().map_or(Ok(()), Err)
}

/// The wall-clock split of TPC-B's branch update (`queryid`): its parts add up to its total,
/// and waits for the other clients' row locks are among them.
fn check_branch_update_wall_clock(summary: &TraceSummary, queryid: &str) -> Result<()> {
    ensure!(
        !queryid.is_empty(),
        "no pg_stat_statements entry for the branch update"
    );
    let walls = summary.wall_clock()?;
    let wall = walls.iter().find(|w| w.queryid == queryid).with_context(|| {
        format!("no wall_clock row for the branch update (queryid {queryid}): {walls:#?}")
    })?;
    let parts: Vec<String> = wall
        .parts
        .iter()
        .map(|p| format!("{} {:.1} ms ({:.1}%)", p.name, p.ns as f64 / 1e6, p.pct))
        .collect();
    eprintln!(
        "UPDATE pgbench_branches (queryid {queryid}): {:.1} ms = {}",
        wall.total_ns as f64 / 1e6,
        parts.join(" + ")
    );
    let sum: u64 = wall.parts.iter().map(|p| p.ns).sum();
    ensure!(
        sum == wall.total_ns,
        "the branch update's parts add up to {sum} ns, its total is {} ns: {wall:#?}",
        wall.total_ns
    );
    let pct: f64 = wall.parts.iter().map(|p| p.pct).sum();
    ensure!(
        (pct - 100.0).abs() < 0.5,
        "the branch update's parts' shares add up to {pct:.2}%: {wall:#?}"
    );
    ensure!(
        wall.parts
            .iter()
            .any(|p| (p.name == "Lock:transactionid" || p.name == "Lock:tuple") && p.ns > 0),
        "8 clients updating 4 branch rows wait for each other's row locks, yet the branch update's \
         wall-clock time has no Lock:transactionid or Lock:tuple part: {}",
        parts.join(", ")
    );
    Ok(())
}

/// Per wait event, what pg_stat_activity showed of client backends that were not idle and
/// waited on something, in rows seen.
fn activity_waits(samples: &ActivitySamples) -> BTreeMap<String, f64> {
    let mut by_event = BTreeMap::new();
    for ((state, wait), n) in &samples.seen {
        if let Some(wait) = wait.as_ref().filter(|_| state != "idle") {
            *by_event.entry(wait.clone()).or_insert(0.0) += *n as f64;
        }
    }
    by_event
}

/// The wait of the pg_stat_activity poller's own backend between its reads (`sample_activity`).
/// TPC-B never sleeps: the trace's time in it is the poller's, which its reads leave out.
const POLLER_SLEEP: &str = "Timeout:PgSleep";

/// Per wait event, the sampled off-CPU milliseconds of client backends that were not idle and
/// waited on something, the poller's sleep left out.
fn traced_client_waits(rows: &[OffCpuWait]) -> BTreeMap<String, f64> {
    let mut by_event = BTreeMap::new();
    for row in rows.iter().filter(|r| {
        r.backend_type == "client backend"
            && r.off_cpu != "idle"
            && r.wait_event != "(no wait event)"
            && r.wait_event != POLLER_SLEEP
    }) {
        *by_event.entry(row.wait_event.clone()).or_insert(0.0) += row.ns as f64 / 1e6;
    }
    by_event
}

/// The sampled profile of TPC-B with synchronous commits against pg_stat_activity polled at
/// 100 Hz over the same window, per wait event of client backends.
///
/// What is compared: the time client backends spent in each wait event, as a share of their
/// time in any wait event while not idle.
/// - pg_stat_activity side: rows of client backends (the poller's own left out) whose `state`
///   is not `idle` and whose `wait_event` is set, counted per `wait_event_type:wait_event`.
/// - trace side: `off_cpu.by_wait` rows of client backends whose class is not `idle` and that
///   carry a wait event, in ns.
///
/// Left out on both sides: a backend running (pg_stat_activity: active, no wait event; the
/// trace: its on-CPU samples, not in `off_cpu`) and idle time between statements
/// (pg_stat_activity: state `idle`; the trace: class `idle`), which would dwarf every wait.
/// Off CPU without a wait event (preempted outside any wait, a syscall Postgres does not
/// report) is left out of the trace's side: pg_stat_activity shows that time as running. In a
/// transaction between statements (`idle in transaction`, `Client:ClientRead`) both count the
/// wait. Time in a reported wait that the backend spends on CPU (the copy of a `write()` under
/// `IO:WALWrite`, a read served from the page cache under `IO:DataFileRead`) pg_stat_activity
/// counts and the off-CPU profile does not: those events are 0.1-0.2% of the waits here.
///
/// The poller is a backend of its own, reading in a loop of its own while pgscope (a process of
/// its own) traces the same window. Like pgscope's sampler it runs at real-time priority, so
/// that its reads are of the instants its timer picks (see `sample_activity`); its sleeps
/// between reads are left out of the trace's side (`POLLER_SLEEP`). The exact
/// tracer running in the same trace costs every backend alike; both sides see the same run.
fn check_sampled_against_activity(summary: &TraceSummary, polled: &ActivitySamples) -> Result<()> {
    let comparison = ShareComparison::new(
        "activity",
        ("rows", "ms"),
        &activity_waits(polled),
        &traced_client_waits(&summary.off_cpu_by_wait()?),
    );
    eprintln!(
        "{} reads of pg_stat_activity in {:.1} s ({:.0} Hz); every row seen: {:?}\n\
         client backends' waits, not idle:\n{}",
        polled.polls,
        polled.elapsed.as_secs_f64(),
        polled.rate_hz(),
        polled.seen,
        comparison.table()
    );
    // Fewer rows would make a share's sampling error itself a few points.
    ensure!(
        comparison.reference_total() >= 500.0,
        "pg_stat_activity showed only {} rows of waiting client backends in {} reads",
        comparison.reference_total(),
        polled.polls
    );
    let disagreements = comparison.disagreements();
    ensure!(
        disagreements.is_empty(),
        "wait event shares of client backends differ by more than {SHARE_PP} pp between the sampled \
         profile and pg_stat_activity:\n{}\n{}",
        disagreements.join("\n"),
        comparison.table()
    );
    Ok(())
}

/// Idle connections held open: 200 pgbench clients whose script only sleeps on the client's
/// side, so their backends wait for a first statement that never comes.
const IDLE_CONNECTIONS: usize = 200;

/// How long the idle connections are traced. Idle time is wall-clock time, counted a tick at a
/// time: 5 s at 99 Hz is ~500 ticks of each of the 200 backends, ~100000 visits of an idle
/// backend that must each leave no stack. The summary's duration, which the idle total is
/// judged against, runs past the sampled ticks by pgscope's start and stop: 0.11 s in runs of
/// 3 s on this VM busy with other work (602 s of idle time counted for 200 × 3.11 s), 0.25 s
/// with two CPU hogs added, 0.06 s in one of 10 s. At 5 s that is 2-5% of the 20% the total
/// is allowed; at 3 s it was up to 8%.
const IDLE_TRACE_SECS: u64 = 5;

/// 200 idle connections during a default trace: the default is sampled off-CPU time, their
/// time is counted as idle (`Client:ClientRead`, class `idle`, ~200 × the trace's duration) and
/// none of them has a stack in the off-CPU profile; nothing is lost. A backend sleeping in
/// `pg_sleep` beside them (a real wait: `Timeout:PgSleep`) does have its stack, so the profile
/// is not empty for want of off-CPU sampling.
#[test]
fn idle_connections_are_counted_as_idle_without_stacks() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with(&PgInstall::distro()?, &[("max_connections", "250")])?;
    let scripts = tempfile::tempdir()?;
    let script = scripts.path().join("sleep.sql");
    std::fs::write(&script, "\\sleep 1 s\n")?;
    let script = script.display().to_string();
    let clients = IDLE_CONNECTIONS.to_string();
    let idle = cluster.spawn_pgbench(
        &["-n", "-c", &clients, "-j", "1", "-T", "300", "-f", &script],
        IDLE_CONNECTIONS,
    )?;
    let idle_pids: BTreeSet<u32> = cluster
        .psql(&format!(
            "SELECT pid FROM pg_stat_activity WHERE application_name = '{}'",
            idle.tag()
        ))?
        .lines()
        .map(|pid| pid.trim().parse().with_context(|| format!("bad pid `{pid}`")))
        .collect::<Result<_>>()?;
    ensure!(
        idle_pids.len() == IDLE_CONNECTIONS,
        "{} backends of the idle connections, expected {IDLE_CONNECTIONS}",
        idle_pids.len()
    );
    let sleeper = cluster.spawn_session("SELECT pg_sleep(600)")?;
    let sleeper_pid = sleeper.pid();

    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("stacks.folded");
    let json = dir.path().join("summary.json");
    Trace::instance(cluster.data_dir())
        .duration_secs(IDLE_TRACE_SECS)
        .folded(&folded)
        .json(&json)
        .output()?;
    let summary = TraceSummary::read(&json)?;
    let off_cpu_folded = dir.path().join("stacks.offcpu.folded");
    let off_cpu = Profile::read_folded(&off_cpu_folded)?;
    drop(sleeper);
    idle.stop()?;

    let (mode, _) = summary.off_cpu_modes()?;
    ensure!(
        mode == "sampled",
        "a trace without --off-cpu measured off_cpu.mode {mode}, not sampled"
    );
    let lost = summary.samples_lost_by_reason()?;
    ensure!(lost.is_empty(), "samples were lost: {lost:?}");
    let of_pid = |pid: u32| {
        let root = format!("postgres-{pid}");
        off_cpu.count_where(|s| s.frames.first() == Some(&root))
    };
    let idle_stacks: Vec<String> = off_cpu
        .stacks
        .iter()
        .filter(|s| {
            s.frames
                .first()
                .and_then(|root| root.strip_prefix("postgres-"))
                .and_then(|pid| pid.parse().ok())
                .is_some_and(|pid| idle_pids.contains(&pid))
        })
        .map(|s| format!("{} {}", s.frames.join(";"), s.count))
        .collect();
    let sleeper_ns = of_pid(sleeper_pid);
    let sleeper_in_pg_sleep = off_cpu.count_where(|s| {
        s.frames.first() == Some(&format!("postgres-{sleeper_pid}"))
            && s.frames.iter().any(|f| f == "pg_sleep")
    });
    eprintln!(
        "off-CPU folded file: {} stacks, {:.1} ms; of the idle backends: {}; of the pg_sleep \
         backend: {:.1} ms",
        off_cpu.stacks.len(),
        off_cpu.total() as f64 / 1e6,
        idle_stacks.len(),
        sleeper_ns as f64 / 1e6
    );
    ensure!(
        sleeper_in_pg_sleep > 0,
        "the backend in pg_sleep ({sleeper_pid}) has no stack through pg_sleep in the off-CPU profile"
    );
    ensure!(
        idle_stacks.is_empty(),
        "idle backends have stacks in the off-CPU profile:\n{}",
        idle_stacks.join("\n")
    );

    let waits = summary.off_cpu_by_wait()?;
    let idle_ns: u64 = waits
        .iter()
        .filter(|w| {
            w.backend_type == "client backend" && w.wait_event == "Client:ClientRead" && w.off_cpu == "idle"
        })
        .map(|w| w.ns)
        .sum();
    let duration = summary.duration_seconds()?;
    let expected = IDLE_CONNECTIONS as f64 * duration;
    let measured = idle_ns as f64 / 1e9;
    let rows: Vec<String> = waits
        .iter()
        .map(|w| {
            format!(
                "{} / {} / {}: {:.1} ms",
                w.backend_type,
                w.wait_event,
                w.off_cpu,
                w.ns as f64 / 1e6
            )
        })
        .collect();
    eprintln!(
        "idle Client:ClientRead time of client backends: {measured:.1} s; {IDLE_CONNECTIONS} \
         connections × {duration:.2} s = {expected:.1} s\nby_wait:\n{}",
        rows.join("\n")
    );
    ensure!(
        (measured / expected - 1.0).abs() <= 0.2,
        "{IDLE_CONNECTIONS} idle connections over {duration:.2} s should be ~{expected:.1} s of idle \
         Client:ClientRead time, measured {measured:.1} s"
    );
    Ok(())
}
