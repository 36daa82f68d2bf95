//! The fault drill (issue 16): `pgscope agent` profiles a Postgres under pgbench while, in
//! order, Postgres is restarted (`-m fast`, then `-m immediate`), Pyroscope is killed and
//! restarted, answers 500 and then 429 slowly (the agent keeps no disk spool: its queue is in
//! memory, capped by `pyroscope.queue_max_bytes`, so the queue is what fills, and the drill
//! fills it until it overflows), 1000 connections churn, the agent gets SIGHUP and finally
//! SIGTERM.
//!
//! It asserts that Postgres never restarted but when the test restarted it, that the agent left
//! no BPF object and no uprobe behind, that its memory stayed within the bounds of docs/benchmarks.md, that
//! every push that failed and every batch that was never delivered is counted on `/metrics`,
//! and that profiles of the instance arrive again after each fault.
//!
//! Pyroscope is played by [`FaultyPyroscope`], a stand-in whose faults the test switches on
//! cue; the real server is covered by `agent_pyroscope.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use pgscope_tests::agent::metric_value;
use pgscope_tests::bpf_objects::{self, BpfIds};
use pgscope_tests::fault_pyroscope::{FaultyPyroscope, Mode};
use pgscope_tests::pyroscope_capture::decode_push;
use pgscope_tests::rss_watch::RssWatch;
use pgscope_tests::{require_root_and_bpf, wait_for, PgCluster, PgInstall, RunningAgent, SchedTime};

const CLUSTER_NAME: &str = "pgscope_drill";
/// A function pgbench never calls (autovacuum is off): its uprobe costs the drill nothing,
/// stays attached all the time (no duty cycle), and leaves a breakpoint to look for.
const PROBED: &str = "vac_update_datfrozenxid";
/// How long an overloaded Pyroscope takes to answer 429: well under the agent's 10 s timeout,
/// so the agent gets the answer.
const SLOW_ANSWER: Duration = Duration::from_secs(3);
/// How long profiles may take to arrive again after a fault ends: the sender's backoff after a
/// long outage reaches 30 s.
const RESUME: Duration = Duration::from_secs(45);
/// SIGTERM must end the agent within this even while Pyroscope takes seconds to answer: the
/// agent gives its last push until 1.2 s after the signal and exits, probes already detached.
/// Judged on the time the agent had: less what its threads spent waiting for a CPU, which a
/// busy machine adds and no deadline of the agent's can hold back (measured, not assumed).
const STOP_BOUND: Duration = Duration::from_secs(2);
/// The agent's own memory (`RssAnon`: heap, stacks, copies of BPF data) must stay under this.
/// docs/benchmarks.md records 47-63 MiB of peak RSS over a minute of `pgbench -S -C` (connection
/// churn) across builds and VMs, with the release binary, and that figure includes the pages
/// of the executable. The tests run the debug binary, whose file pages alone are ~56 MiB (a
/// 340 MB executable with debug info), so the drill holds the anonymous part to the
/// highest peak plus the 1 MiB queue: the margin is the executable pages those figures count.
const ANON_BOUND: u64 = 64 << 20;
/// The upload queue's cap (the smallest the agent allows), so that the outage fills it.
const QUEUE_BYTES: u64 = 1 << 20;
/// What fills the queue while Pyroscope refuses: backends that run [`FILL_STATEMENTS`]
/// distinct statements, each sleeping 50 ms. With `labels.pid` every backend and statement is
/// a series of its own in every interval's batch, so the bytes queued per interval grow with
/// their number and the wall time they sleep, not with the CPU a busy machine gives them.
/// Measured on the 2-core VM at a load of 14: the drill's two pgbench clients alone queued
/// 6 KB/s (the 1 MiB cap in three minutes), with 32 fillers 30 KB/s. 96 fillers made 2000
/// statements a second and over a thousand series an interval: the agent's debug build then
/// took over 10 s to answer `/metrics`.
const FILLERS: usize = 32;
const FILL_STATEMENTS: usize = 20;
/// The queue grows by a batch per profile type every upload interval (2 s): one that has not
/// grown for this long is not being filled, and will not overflow.
const QUEUE_STALL: Duration = Duration::from_secs(30);
/// Bounds the wait for the overflow however steadily the queue grows.
const FILL_BOUND: Duration = Duration::from_secs(600);
/// pgbench's `-T`: the drill stops its workloads itself; this only bounds them.
const WORKLOAD_BOUND: &str = "3600";
/// Bounds each step that needs only the agent's own loop (a reload, its metrics, probes
/// attached or freed): it ends as soon as it holds.
const STEP: Duration = Duration::from_secs(45);

const OK: &str = "pgscope_export_pushes_total{result=\"ok\"}";
const RETRYABLE: &str = "pgscope_export_pushes_total{result=\"retryable_error\"}";
const PERMANENT: &str = "pgscope_export_pushes_total{result=\"permanent_error\"}";
const RETRIES: &str = "pgscope_export_retries_total";
const DROPPED_FULL: &str = "pgscope_export_dropped_batches_total{reason=\"queue_full\"}";
const DROPPED_REJECTED: &str = "pgscope_export_dropped_batches_total{reason=\"rejected\"}";
const QUEUED: &str = "pgscope_export_queue_batches";
const QUEUED_BYTES: &str = "pgscope_export_queue_bytes";
const FORKS: &str = "pgscope_bpf_events_total{kind=\"forks_followed\"}";
const TARGETS_FULL: &str = "pgscope_bpf_events_total{kind=\"lost_targets_full\"}";

fn config(cluster: &PgCluster, url: &str, stage: &str) -> String {
    format!(
        "[pyroscope]\nurl = \"{url}\"\nqueue_max_bytes = {QUEUE_BYTES}\n\
         [collection]\nupload_interval = \"2s\"\nfrequency = 99\noff_cpu = true\n\
         [labels]\npid = true\nstatic = {{ stage = \"{stage}\" }}\n\
         [probes]\nfunctions = [\"{PROBED}\"]\n\
         [[discovery.include]]\ndata_dir = \"{}\"\n",
        cluster.data_dir().display()
    )
}

/// One scrape of the export counters.
#[derive(Clone, Copy, Debug, Default)]
struct Export {
    ok: f64,
    retryable: f64,
    permanent: f64,
    retries: f64,
    dropped_full: f64,
    dropped_rejected: f64,
    queued: f64,
    /// Batches handed to the queue: one per profile type per instance and interval.
    enqueued: f64,
}

impl Export {
    fn scrape(agent: &RunningAgent) -> Result<Self> {
        let (status, body) = agent.get("/metrics")?;
        ensure!(status == 200, "/metrics answered {status}");
        let value = |series: &str| {
            metric_value(&body, series).with_context(|| format!("no `{series}` in /metrics:\n{body}"))
        };
        let enqueued = body
            .lines()
            .filter(|line| line.starts_with("pgscope_profiles_enqueued_total{"))
            .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum();
        Ok(Self {
            ok: value(OK)?,
            retryable: value(RETRYABLE)?,
            permanent: value(PERMANENT)?,
            retries: value(RETRIES)?,
            dropped_full: value(DROPPED_FULL)?,
            dropped_rejected: value(DROPPED_REJECTED)?,
            queued: value(QUEUED)?,
            enqueued,
        })
    }

    /// Every batch queued was delivered, dropped (and counted) or is still queued.
    fn conserved(&self) -> bool {
        self.enqueued == self.ok + self.dropped_full + self.dropped_rejected + self.queued
    }
}

/// Waits until the agent is quiet against a healthy server: its queue empty, its successful
/// pushes exactly those the server took, and every batch accounted for. The scrape returned
/// then counts every failure that came before the last success (the sender sends one batch
/// at a time).
fn settle(agent: &RunningAgent, fake: &FaultyPyroscope, what: &str) -> Result<Export> {
    let mut last = Export::default();
    wait_for(&format!("the agent's counters to settle {what}"), RESUME, || {
        last = Export::scrape(agent)?;
        let taken = fake.answered(200) as f64;
        Ok((last.queued == 0.0 && last.ok == taken && last.conserved()).then_some(last))
    })
    .with_context(|| {
        format!(
            "last scrape {last:?}; the server took {} pushes; every batch queued must be delivered, \
             counted as dropped or still queued",
            fake.answered(200)
        )
    })
}

/// Waits for a push after request number `since` that the server took, holding a
/// `process_cpu` series of the instance with samples — from one of `pids` when given, with
/// `stage` when given. Returns the number of requests seen by then.
fn wait_resumed(
    fake: &FaultyPyroscope,
    since: usize,
    pids: Option<&BTreeSet<u32>>,
    stage: Option<&str>,
    what: &str,
) -> Result<usize> {
    let service = format!("postgres/{CLUSTER_NAME}");
    wait_for(what, RESUME, || {
        let requests = fake.requests();
        for request in requests.iter().skip(since).filter(|r| r.status == 200) {
            for series in decode_push(request)? {
                let ours = series.label("__name__") == Some("process_cpu")
                    && series.label("service_name") == Some(service.as_str())
                    && stage.is_none_or(|s| series.label("stage") == Some(s))
                    && pids.is_none_or(|pids| {
                        series
                            .label("pid")
                            .and_then(|p| p.parse().ok())
                            .is_some_and(|p| pids.contains(&p))
                    });
                let sampled = series
                    .profiles
                    .iter()
                    .any(|p| p.sample.iter().any(|s| s.value.iter().any(|v| *v > 0)));
                if ours && sampled {
                    return Ok(Some(requests.len()));
                }
            }
        }
        Ok(None)
    })
}

/// Waits until the queue overflows (a batch dropped as `queue_full`) for as long as it keeps
/// growing; returns the batches dropped and the most bytes seen queued. Fails, saying how full
/// the queue got, when it stopped growing for [`QUEUE_STALL`] or after [`FILL_BOUND`].
fn await_overflow(agent: &RunningAgent) -> Result<(f64, f64)> {
    let begun = Instant::now();
    let (mut peak, mut grew) = (0.0_f64, Instant::now());
    loop {
        let dropped = agent.metric(DROPPED_FULL)?;
        let bytes = agent.metric(QUEUED_BYTES)?;
        if dropped >= 1.0 {
            return Ok((dropped, peak.max(bytes)));
        }
        if bytes > peak {
            (peak, grew) = (bytes, Instant::now());
        }
        let how_far = || {
            format!(
                "{:.0} KiB queued of the {} KiB cap after {:.1?}",
                peak / 1024.0,
                QUEUE_BYTES >> 10,
                begun.elapsed()
            )
        };
        ensure!(
            grew.elapsed() < QUEUE_STALL,
            "the queue never overflowed: it stopped growing for {QUEUE_STALL:?} at {}",
            how_far()
        );
        ensure!(
            begun.elapsed() < FILL_BOUND,
            "the queue never overflowed, still growing: {}",
            how_far()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn fill_table(i: usize) -> String {
    format!("drill_fill_{i}")
}

/// pgbench arguments for [`FILLERS`] clients over the [`FILL_STATEMENTS`] statements, their
/// scripts written to `dir`. The test stops them once the queue overflowed.
fn fill_args(dir: &std::path::Path) -> Result<Vec<String>> {
    let clients = FILLERS.to_string();
    let mut args: Vec<String> = ["-n", "-c", &clients, "-j", "2", "-T", WORKLOAD_BOUND]
        .iter()
        .map(|a| a.to_string())
        .collect();
    for i in 0..FILL_STATEMENTS {
        let path = dir.join(format!("fill{i}.sql"));
        std::fs::write(&path, format!("SELECT pg_sleep(0.05) FROM {};\n", fill_table(i)))?;
        args.extend(["-f".to_string(), path.display().to_string()]);
    }
    Ok(args)
}

/// How long a process's threads wait for a CPU (runnable, not running) from [`RunQueueWatch::start`]
/// until it is gone, polled from `/proc/<tid>/schedstat`: what a busy machine adds to the
/// time it takes to do something. Summed over threads, which counts twice a wait two threads
/// share; the agent's work runs on one thread (a current-thread runtime), so that is rare.
struct RunQueueWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Duration>,
}

impl RunQueueWatch {
    fn start(pid: u32) -> Self {
        let threads = move || -> Vec<u32> {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|dir| {
                    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                        .collect()
                })
                .unwrap_or_default()
        };
        let start: BTreeMap<u32, SchedTime> = threads()
            .into_iter()
            .filter_map(|tid| Some((tid, SchedTime::of(tid).ok()?)))
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut last = start.clone();
            while !stopped.load(Ordering::Relaxed) {
                for tid in threads() {
                    if let Ok(now) = SchedTime::of(tid) {
                        last.insert(tid, now);
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            last.iter()
                .map(|(tid, now)| {
                    let before = start.get(tid).map_or(Duration::ZERO, |t| t.runnable);
                    now.runnable.saturating_sub(before)
                })
                .sum()
        });
        Self { stop, thread }
    }

    /// The run-queue time since the start, as last seen.
    fn finish(self) -> Duration {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The postmaster of one run of the server (between two of the test's restarts).
struct Epoch {
    postmaster: u32,
    started: String,
}

impl Epoch {
    fn begin(cluster: &PgCluster) -> Result<Self> {
        Ok(Self {
            postmaster: cluster.postmaster_pid()?,
            started: cluster.psql("SELECT pg_postmaster_start_time()")?,
        })
    }

    /// The same postmaster still runs, never restarted since [`Epoch::begin`].
    fn check(&self, cluster: &PgCluster, when: &str) -> Result<()> {
        let now = Self::begin(cluster)?;
        ensure!(
            now.postmaster == self.postmaster && now.started == self.started,
            "Postgres restarted {when} without the test restarting it: postmaster {} started {} \
             is now {} started {}",
            self.postmaster,
            self.started,
            now.postmaster,
            now.started
        );
        Ok(())
    }
}

/// Lines a Postgres server logs when a child crashes and it reinitialises. An immediate
/// shutdown (SIGQUIT) ends the children without any of these: it logs "received immediate
/// shutdown request", and the next start "automatic recovery in progress". A fast shutdown
/// logs one child exit, [`FAST_SHUTDOWN_EXIT`].
const CRASH_LINES: &[&str] = &[
    "terminated by signal",
    "terminating any other active server processes",
    "all server processes terminated; reinitializing",
    "PANIC:",
];
/// The only child exit a fast shutdown logs (PG15): the launcher ends with 1 on SIGTERM. Any
/// other "exited with exit code" is a crash.
const FAST_SHUTDOWN_EXIT: &str = "background worker \"logical replication launcher\"";

fn canonical_postgres(install: &PgInstall) -> Result<PathBuf> {
    let binary = install.bin("postgres");
    std::fs::canonicalize(&binary).with_context(|| format!("cannot resolve `{}`", binary.display()))
}

#[test]
fn the_agent_survives_the_fault_drill() -> Result<()> {
    require_root_and_bpf();
    let drill = Instant::now();
    let mark = |what: &str, rss: Option<&RssWatch>| {
        let memory = rss.and_then(|r| r.now().ok()).map(|(anon, file)| {
            format!(
                " (agent RssAnon {:.1} MiB, RssFile {:.1} MiB)",
                anon as f64 / 1048576.0,
                file as f64 / 1048576.0
            )
        });
        eprintln!(
            "drill: {what} after {:.1?}{}",
            drill.elapsed(),
            memory.unwrap_or_default()
        )
    };
    let install = PgInstall::distro()?;
    // Room for the fillers beside pgbench, the churn and the agent.
    let cluster = PgCluster::start_with_pg_stat_statements(
        &install,
        &[("cluster_name", CLUSTER_NAME), ("max_connections", "100")],
    )?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let tables: String = (0..FILL_STATEMENTS)
        .map(|i| format!("CREATE TABLE {} AS SELECT 1 AS x;", fill_table(i)))
        .collect();
    cluster.psql(&tables)?;
    let fill_scripts = tempfile::tempdir()?;
    let fill_args = fill_args(fill_scripts.path())?;
    let binary = canonical_postgres(&install)?;
    let entry = bpf_objects::function_entry(&binary, PROBED)?;
    ensure!(
        entry.byte != 0xcc,
        "`{PROBED}` starts with int3 in the file itself"
    );
    let mut fake = FaultyPyroscope::start()?;
    let loaded_before = bpf_objects::loaded()?;
    let agent = RunningAgent::start(&config(&cluster, &fake.url(), "before"), &[])?;
    let agent_pid = agent.pid();
    let rss = RssWatch::start(agent_pid);
    agent.wait_for_instances(1)?;
    let mut epoch = Epoch::begin(&cluster)?;
    let mut pgbench = Some(cluster.spawn_pgbench(&["-S", "-c", "2", "-j", "2", "-T", WORKLOAD_BOUND], 2)?);
    let mut seen = wait_resumed(&fake, 0, None, None, "the first profiles of the instance")?;

    // What the agent holds in the kernel, to look for after it exited: its BPF objects (new
    // ones, not another test's) and the breakpoint of its uprobe in the postmaster.
    let held = bpf_objects::held_by(agent_pid)?;
    ensure!(!held.progs.is_empty(), "the agent holds no BPF program: {held:?}");
    ensure!(
        held.intersection(&loaded_before).is_empty(),
        "IDs held by the agent existed before it started: {held:?}"
    );
    // The agent opens and closes objects as it goes (probes of new processes, duty cycles), and
    // listing with bpftool takes seconds on a busy machine: an object it held both before and
    // after the listing must be in it.
    let listed = bpf_objects::loaded()?;
    let throughout = held.intersection(&bpf_objects::held_by(agent_pid)?);
    let unlisted = BpfIds {
        progs: &throughout.progs - &listed.progs,
        maps: &throughout.maps - &listed.maps,
        links: &throughout.links - &listed.links,
    };
    ensure!(
        !throughout.progs.is_empty() && unlisted.is_empty(),
        "bpftool does not list every BPF object the agent held throughout: {unlisted:?} missing of \
         {throughout:?}"
    );
    wait_for(
        &format!("the uprobe on `{PROBED}` in the postmaster"),
        STEP,
        || {
            Ok(
                (bpf_objects::byte_in_process(epoch.postmaster, &binary, entry.file_offset)? == 0xcc)
                    .then_some(()),
            )
        },
    )
    .with_context(|| agent.log())?;

    mark("agent profiling", Some(&rss));

    // 1. Postgres restarts: fast, then immediate (crash recovery). pgbench loses its
    // connections and is started again.
    for mode in ["fast", "immediate"] {
        epoch.check(&cluster, &format!("before the -m {mode} restart"))?;
        cluster.restart_with(mode)?;
        drop(pgbench.take());
        let old = epoch.postmaster;
        epoch = Epoch::begin(&cluster)?;
        ensure!(
            epoch.postmaster != old,
            "-m {mode}: the postmaster did not change"
        );
        pgbench = Some(cluster.spawn_pgbench(&["-S", "-c", "2", "-j", "2", "-T", WORKLOAD_BOUND], 2)?);
        let processes = cluster.process_pids()?;
        seen = wait_resumed(
            &fake,
            seen,
            Some(&processes),
            None,
            &format!("profiles of the new postmaster's processes after `pg_ctl restart -m {mode}`"),
        )
        .with_context(|| agent.log())?;
    }
    let healthy = settle(&agent, &fake, "after the Postgres restarts")?;
    ensure!(
        healthy.retryable == 0.0,
        "pushes failed against a healthy server: {healthy:?}"
    );

    mark("Postgres restarts done", Some(&rss));

    // 2. Pyroscope killed: connections refused, counted as retryable failures, the batches
    // stay queued; restarted on the same port, it gets them.
    fake.kill()?;
    agent.wait_metric(RETRYABLE, "refused pushes to be counted", RESUME, |n| n >= 2.0)?;
    wait_for("batches to wait in the queue", RESUME, || {
        Ok((Export::scrape(&agent)?.queued >= 2.0).then_some(()))
    })?;
    fake.restart()?;
    seen = wait_resumed(&fake, seen, None, None, "profiles after Pyroscope restarted")?;
    let after_kill = settle(&agent, &fake, "after Pyroscope restarted")?;
    // Nothing reached the server while it was down: those failures were refusals.
    let refused = after_kill.retryable;
    ensure!(
        fake.answered(500) + fake.answered(429) == 0,
        "error answers before the error phase"
    );

    mark("Pyroscope kill done", Some(&rss));

    // 3. Pyroscope answers 500, then 429 after 3 s, until the 1 MiB queue overflows: the
    // fillers' series fill it while it refuses.
    fake.set_mode(Mode::Fail);
    wait_for("three pushes answered 500", RESUME, || {
        Ok((fake.answered(500) >= 3).then_some(()))
    })?;
    fake.set_mode(Mode::SlowTooMany(SLOW_ANSWER));
    let fill_args: Vec<&str> = fill_args.iter().map(String::as_str).collect();
    // Returns once one filler is connected; the others connect while the queue fills.
    let fillers = cluster.spawn_pgbench(&fill_args, 1)?;
    wait_for("two pushes answered 429", RESUME * 2, || {
        Ok((fake.answered(429) >= 2).then_some(()))
    })?;
    let (full, peak) = await_overflow(&agent)?;
    eprintln!(
        "drill: queue full ({:.0} KiB) after {} answers 429, {full} batches dropped",
        peak / 1024.0,
        fake.answered(429)
    );
    fillers.stop()?;
    fake.set_mode(Mode::Accept);
    let gaps = |status: u16| -> Vec<String> {
        fake.arrivals(status)
            .windows(2)
            .map(|pair| format!("{:.1?}", pair[1] - pair[0]))
            .collect()
    };
    eprintln!(
        "drill: gaps between attempts answered 500: {:?}; 429: {:?}",
        gaps(500),
        gaps(429)
    );
    seen = wait_resumed(&fake, seen, None, None, "profiles after the 500/429 phase")?;
    let after_errors = settle(&agent, &fake, "after the 500/429 phase")?;
    // Each attempt that failed is one `retryable_error` and one retry; refused ones never
    // reached the server, every other one got a 500 or a 429 from it.
    let answered_errors = (fake.answered(500) + fake.answered(429)) as f64;
    ensure!(
        after_errors.retryable - refused == answered_errors,
        "{} retryable failures counted after the kill phase, the server answered {answered_errors} \
         errors: {after_errors:?}",
        after_errors.retryable - refused
    );
    ensure!(
        after_errors.retries == after_errors.retryable,
        "every retryable failure is retried: {after_errors:?}"
    );
    ensure!(
        after_errors.permanent == 0.0 && after_errors.dropped_rejected == 0.0,
        "500 and 429 are retryable, nothing may be dropped as rejected: {after_errors:?}"
    );
    ensure!(after_errors.dropped_full >= 1.0, "{after_errors:?}");

    mark("500/429 done", Some(&rss));

    // 4. 1000 connections, one per transaction, beside the running pgbench.
    let forks = agent.metric(FORKS)?;
    let churn = cluster.pgbench(&["-S", "-C", "-c", "2", "-j", "2", "-t", "500"])?;
    ensure!(
        churn.contains("1000/1000"),
        "the churn did not run its 1000 transactions:\n{churn}"
    );
    // The metrics are published once a second: wait for the last forks to show.
    agent
        .wait_metric(FORKS, "1000 forks followed", STEP, |n| n - forks >= 1000.0)
        .context("the agent did not follow every backend of the churn")?;
    ensure!(agent.metric(TARGETS_FULL)? == 0.0, "the target map filled up");
    let processes = cluster.process_pids()?;
    seen = wait_resumed(&fake, seen, Some(&processes), None, "profiles after the churn")?;

    mark("churn done", Some(&rss));

    // 5. SIGHUP: a new static label, the rest unchanged.
    std::fs::write(agent.config_path(), config(&cluster, &fake.url(), "after"))?;
    agent.signal(libc::SIGHUP);
    agent.wait_metric(
        "pgscope_config_reloads_total{result=\"ok\"}",
        "the reload",
        STEP,
        |n| n == 1.0,
    )?;
    wait_resumed(
        &fake,
        seen,
        None,
        Some("after"),
        "profiles labelled after the reload",
    )?;
    let before_stop = settle(&agent, &fake, "before SIGTERM")?;
    ensure!(
        before_stop.retryable == after_errors.retryable,
        "pushes failed against a healthy server: {before_stop:?}"
    );

    mark("reload done", Some(&rss));

    // Memory, while the agent still runs: its peak over the whole drill.
    let peak = rss.high_water_mark()?;
    let (sampled, samples) = rss.peak_sampled();
    eprintln!(
        "drill: agent peak RSS {:.1} MiB (VmHWM), highest of {samples} samples {:.1} MiB, of it \
         RssAnon {:.1} MiB",
        peak as f64 / 1048576.0,
        sampled as f64 / 1048576.0,
        rss.peak_anon_sampled() as f64 / 1048576.0
    );
    let anon = rss.peak_anon_sampled();
    ensure!(
        samples > 100 && anon > 0,
        "the agent's memory was not sampled ({samples} samples)"
    );
    ensure!(
        anon <= ANON_BOUND,
        "the agent's own memory (RssAnon) peaked at {anon} bytes, over {ANON_BOUND}"
    );
    let held_now = bpf_objects::held_by(agent_pid)?;
    // The uprobe reached the postmaster of the last restart too: its breakpoint must go.
    ensure!(
        bpf_objects::byte_in_process(epoch.postmaster, &binary, entry.file_offset)? == 0xcc,
        "no uprobe breakpoint on `{PROBED}` in the current postmaster before SIGTERM"
    );

    // 6. SIGTERM under load, with Pyroscope slow again: the last push cannot hold the exit up.
    fake.set_mode(Mode::SlowTooMany(SLOW_ANSWER));
    let run_queue = RunQueueWatch::start(agent_pid);
    let stopping = Instant::now();
    let (status, log) = agent.terminate()?;
    let took = stopping.elapsed();
    let waited = run_queue.finish();
    drop(rss);
    ensure!(
        status.success(),
        "the agent exited with {status} on SIGTERM:\n{log}"
    );
    let own = took.saturating_sub(waited);
    ensure!(
        own <= STOP_BOUND,
        "the agent took {took:?} to exit after SIGTERM, its threads {waited:?} of it waiting for a \
         CPU on this machine: {own:?} of its own, over the bound {STOP_BOUND:?}"
    );

    // What the slow Pyroscope did not take in time is said, not silently lost.
    ensure!(
        log.contains("Pyroscope did not take everything before the shutdown deadline"),
        "the agent did not report the last push it gave up on:\n{log}"
    );
    mark(
        &format!("agent stopped (SIGTERM took {took:.2?}, {waited:.2?} of it waiting for a CPU)"),
        None,
    );

    // Nothing left behind: its BPF objects are unloaded, no probe event carries its PID, and
    // the breakpoint is gone from the postmaster's memory.
    let held_all = BpfIds {
        progs: &held.progs | &held_now.progs,
        maps: &held.maps | &held_now.maps,
        links: &held.links | &held_now.links,
    };
    let mut left = BpfIds::default();
    wait_for("the agent's BPF objects to be freed", STEP, || {
        left = held_all.intersection(&bpf_objects::loaded()?);
        Ok(left.is_empty().then_some(()))
    })
    .with_context(|| format!("still loaded after the agent exited: {left:?}"))?;
    let events = bpf_objects::uprobe_events_with(&format!("aya_{agent_pid}_"))?;
    ensure!(events.is_empty(), "probe events left in tracefs: {events:?}");
    let byte = bpf_objects::byte_in_process(epoch.postmaster, &binary, entry.file_offset)?;
    ensure!(
        byte == entry.byte,
        "`{PROBED}` starts with {byte:#04x} in the postmaster's memory, {:#04x} in the file: \
         a uprobe is left",
        entry.byte
    );

    // Postgres restarted only when the test restarted it.
    drop(pgbench.take());
    epoch.check(&cluster, "since the immediate restart")?;
    let server_log = cluster.server_log();
    for line in CRASH_LINES {
        ensure!(
            !server_log.contains(line),
            "the server log shows a crash (`{line}`):\n{server_log}"
        );
    }
    let exits: Vec<&str> = server_log
        .lines()
        .filter(|line| line.contains("exited with exit code"))
        .collect();
    ensure!(
        exits.len() == 1 && exits[0].contains(FAST_SHUTDOWN_EXIT),
        "children exited other than by the one fast shutdown: {exits:#?}\n{server_log}"
    );
    for (line, expected) in [
        ("received fast shutdown request", 1),
        ("received immediate shutdown request", 1),
        ("automatic recovery in progress", 1),
    ] {
        let count = server_log.matches(line).count();
        ensure!(
            count == expected,
            "`{line}` {count} times in the server log, the test caused it {expected} time(s):\n{server_log}"
        );
    }
    Ok(())
}
