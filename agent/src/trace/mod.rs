//! `pgscope trace`: profile one backend or one instance for a while, then print the top
//! functions and write the flamegraph outputs.

mod hot_paths;
mod json;
pub(crate) mod off_cpu;
mod plan_nodes;
mod probes;
mod progress;
pub(crate) mod queries;
mod report;
mod spin_sites;
mod sql_facts;
mod stat_views;
mod wall_clock;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use std::pin::Pin;

use aya::maps::{MapData, RingBuf};
use tokio::time::Sleep;
use tracing::warn;

use crate::bpf::abi::{Counter, TARGET_OFF_CPU};
use crate::bpf::{Detaching, OnCpuProbes};
use crate::collect::driver::{self, Flow, Policy, DUTY_TICK};
use crate::collect::instance::{self, Scope};
use crate::collect::off_cpu::WaitWithoutStack;
use crate::collect::probes::{
    self as probing, calibrate, statement_clock, LocatedTriggerProbes, PidsByRoot, ProbeSet, TriggerProbes,
};
use crate::collect::session::WaitSource;
use crate::collect::{self, Session};
use crate::output_file::{self, OutputMode, Planned};
use crate::postgres;
use crate::preflight;
use crate::signals::Signals;
use crate::target::{self, Target};
pub use probing::{parse_explicit_probe, ExplicitProbe};
use symbolizer::{KernelSymbols, Symbolizer, SymbolizerOptions};

/// Options of one trace session (parsed from the command line in `main.rs`).
#[derive(Clone, Debug)]
pub struct TraceOptions {
    pub pid: Option<u32>,
    pub instance: Option<String>,
    pub duration: Duration,
    pub frequency_hz: u64,
    pub svg: Option<PathBuf>,
    pub folded: Option<PathBuf>,
    pub pprof: Option<PathBuf>,
    /// Permission bits of the files written.
    pub output_mode: OutputMode,
    pub debug_dirs: Vec<PathBuf>,
    pub top: usize,
    pub query_id: Option<i64>,
    pub json: Option<PathBuf>,
    /// `--record`: save the trace as a recording for `pgscope report`.
    pub record: Option<PathBuf>,
    /// `--report`: write the HTML report.
    pub report: Option<PathBuf>,
    /// `--probes` items as given (function names or `all`).
    pub probes: Vec<String>,
    /// `--probe FUNCTION=PATH:OFFSET`: functions at locations the user gives.
    pub explicit_probes: Vec<ExplicitProbe>,
    /// Budget of the probes as a fraction of the instance's CPU; None: no duty cycling.
    pub probe_budget: Option<f64>,
    /// `--conninfo`: how to reach the instance for query texts.
    pub conninfo: Option<String>,
    /// How time off CPU is measured (`--off-cpu`).
    pub off_cpu: crate::collect::off_cpu::OffCpuMode,
    /// Off-CPU waits at least this long get their stacks; shorter ones only count.
    pub off_cpu_min_stack: Duration,
    /// Off-CPU stacks taken per second per CPU at most.
    pub off_cpu_stack_rate: u64,
    /// Keep idle client waits in the off-CPU flamegraphs and profiles.
    pub off_cpu_idle: bool,
}

impl TraceOptions {
    /// Every file this trace is asked to write, with the option that named it.
    fn planned_outputs(&self) -> Vec<Planned> {
        let mut planned = Vec::new();
        let with_off_cpu = [
            ("--svg", &self.svg),
            ("--folded", &self.folded),
            ("--pprof", &self.pprof),
        ];
        for (option, path) in with_off_cpu {
            if let Some(path) = path {
                planned.push(Planned::new(option, path));
                if self.off_cpu.any() {
                    planned.push(Planned::new(
                        format!("{option} (off-CPU)"),
                        &off_cpu::beside(path),
                    ));
                }
            }
        }
        let single = [
            ("--json", &self.json),
            ("--record", &self.record),
            ("--report", &self.report),
        ];
        for (option, path) in single {
            if let Some(path) = path {
                planned.push(Planned::new(option, path));
            }
        }
        planned
    }
}

pub async fn run(options: TraceOptions) -> Result<()> {
    // Before anything is attached: a bad path must not cost the trace.
    output_file::check_all(&options.planned_outputs()).context("nothing was profiled")?;
    preflight::check_all()?;
    let target = match (&options.pid, &options.instance) {
        (Some(pid), _) => target::backend(*pid)?,
        (None, Some(spec)) => target::instance(spec)?,
        (None, None) => anyhow::bail!("pass --pid <backend pid> or --instance <postmaster pid | data dir>"),
    };

    let mut probes = OnCpuProbes::load()?;
    probes.attach_process_tracking()?;
    // What a probe hit costs, timed on a thread of its own over half a second while the
    // instance is read and the stacks' symbol files are parsed; awaited before the off-CPU
    // programs and the probes are attached, and cut short when no probe will be.
    let calibration = calibrate::Calibration::start(&mut probes);
    // Loaded meanwhile (the verifier's work); it samples only once sampling starts.
    let off_cpu_sampled = collect::off_cpu::load_sampler(&mut probes, options.off_cpu, |what, error| {
        note!("pgscope: {what}: {error:#}; on-CPU profiling goes on")
    });
    let layout_source = target.pid();
    // Targets are flagged for off-CPU now; the exact tracer attaches just before sampling
    // starts (after the calibration), so that both off-CPU profiles measure the same period.
    let off_cpu_flag = if options.off_cpu.traces() {
        TARGET_OFF_CPU
    } else {
        0
    };
    let (root, scope) = match &target {
        Target::Backend(process) => (process, Scope::Backend),
        Target::Instance { postmaster } => (postmaster, Scope::Instance),
    };
    let attached = instance::attach(&mut probes, root, scope, off_cpu_flag)?;
    if let Some(error) = &attached.no_attribution {
        note!("pgscope: no query or wait-event labels: {error:#}");
    }
    if let Some(error) = &attached.no_instance_names {
        note!(
            "pgscope: extension LWLock waits show as `LWLock:extension` and background workers \
             as `background worker`: {error:#}"
        );
    }
    if scope == Scope::Instance {
        note!(
            "pgscope: instance has {} processes besides the postmaster",
            attached.children
        );
    }
    let version_table = attached.layout;
    let mut symbolizer = Symbolizer::new(SymbolizerOptions {
        debug_dirs: options.debug_dirs.clone(),
    });
    let mut functions = probing::parse_probe_list(&options.probes)?;
    functions.extend(options.explicit_probes.iter().map(|p| p.function));
    functions.sort();
    functions.dedup();
    // Probes read arguments where the table of the instance's major places them (e.g.
    // _bt_getroot gained an argument in 16); without a table none is attached.
    let probe_table = if functions.is_empty() {
        None
    } else {
        match postgres::detect_major(layout_source).and_then(postgres::table_for) {
            Ok(table) => Some(table),
            Err(error) => {
                note!(
                    "pgscope: function probes not attached: {error:#}; probes are tested on PostgreSQL {:?}",
                    postgres::SUPPORTED_MAJORS
                );
                None
            }
        }
    };
    // Samples in triggers name them (bpf/triggers.bpf.c), in every major with a table.
    let triggers_located = match &version_table {
        Some((_, table)) => match LocatedTriggerProbes::locate(&mut symbolizer, layout_source, table) {
            Ok(located) => Some(located),
            Err(error) => {
                note!("pgscope: triggers will not be named: {error:#}");
                None
            }
        },
        None => None,
    };
    // The session's symbolizer names the stacks (the one above only locates the probes). Both
    // parse files, which takes seconds in a debug build: done before anything that measures a
    // period (the off-CPU programs, the probes, the sampler) is attached.
    let mut stack_symbolizer = Symbolizer::new(SymbolizerOptions {
        debug_dirs: options.debug_dirs.clone(),
    });
    if let Some(offset) = crate::postgres::pgss_hooks::name_in_stacks(&mut stack_symbolizer, root.pid) {
        tracing::debug!(
            offset,
            "pgss_store named in stacks through pg_stat_statements' hooks"
        );
    }
    if let Some((_, table)) = &version_table {
        let named = crate::postgres::pointer_tables::name_in_stacks(&mut stack_symbolizer, root.pid, table);
        tracing::debug!(
            named,
            "static functions named through tables of function pointers"
        );
    }
    // Their programs are verified while the calibration times its calls, rather than after.
    if triggers_located.is_some() {
        if let Err(error) = probes.load_trigger_programs() {
            tracing::debug!("the trigger probes' programs will be loaded as they attach: {error:#}");
        }
    }
    let probed = probe_table.is_some() || triggers_located.is_some();
    let calibrated = match calibration {
        Ok(calibration) if !probed => calibration.cancel(&mut probes).map(|()| None),
        Ok(calibration) => calibration.finish(&mut probes).map(Some),
        Err(error) => Err(error),
    };
    let ns_per_hit = probed.then(|| {
        let ns_per_hit = match calibrated.and_then(|ns| ns.context("the calibration was cut short")) {
            Ok(ns) => ns,
            Err(error) => {
                warn!(
                    "cannot measure the cost of a probe hit, assuming {} ns: {error:#}",
                    calibrate::FALLBACK_NS_PER_HIT
                );
                calibrate::FALLBACK_NS_PER_HIT
            }
        };
        if probe_table.is_some() {
            note!(
                "pgscope: one probe hit costs {:.0} ns here; probe budget {}",
                ns_per_hit,
                match options.probe_budget {
                    Some(fraction) => format!("{:.1}% of the instance's CPU", fraction * 100.0),
                    None => "none (every call measured)".to_string(),
                }
            );
        }
        ns_per_hit
    });
    let located = match (probe_table, ns_per_hit.filter(|_| probe_table.is_some())) {
        (Some(table), Some(ns_per_hit)) => Some(ProbeSet::locate(
            &mut symbolizer,
            &functions,
            &options.explicit_probes,
            layout_source,
            table,
            options.probe_budget,
            ns_per_hit,
        )?),
        _ => None,
    };
    let off_cpu_measured = collect::off_cpu::attach_tracer(
        &mut probes,
        options.off_cpu,
        off_cpu_sampled,
        options.off_cpu_min_stack,
        options.off_cpu_stack_rate,
        |what, error| note!("pgscope: {what}: {error:#}; on-CPU profiling goes on"),
    );
    // A trace with both off-CPU profiles also sets the exact state at the sampler's instants
    // beside them (`off_cpu_exact_at_runs`); the agent, which would have to bound that map too,
    // does not.
    if off_cpu_measured == collect::off_cpu::OffCpuMode::Both {
        probes.measure_exact_at_wait_runs();
    }
    // Counters now and at the end: pg_stat_statements' (the findings' eviction rate, each
    // statement's growth) and the instance's own (what it did over the trace).
    let start = sql_facts::start_snapshot(&options, layout_source).await;
    // The probes are attached last, just before sampling starts and the duty cycle governs
    // them: attached before the off-CPU programs were loaded and the stacks' symbolizer set up,
    // a probe took every trap of a busy neighbour for those seconds, outside the budget (a
    // third to a half of a 10 s trace).
    let mut probe_set = match located {
        Some(located) => located.attach(&mut probes)?,
        None => ProbeSet::empty(),
    };
    let mut trigger_probes = match (triggers_located, ns_per_hit) {
        (Some(located), Some(ns_per_hit)) => {
            TriggerProbes::attach(located, &mut probes, options.probe_budget, ns_per_hit).unwrap_or_else(
                |error| {
                    note!("pgscope: triggers will not be named: {error:#}");
                    TriggerProbes::none()
                },
            )
        }
        _ => TriggerProbes::none(),
    };
    if let Some((layout, table)) = &version_table {
        match statement_clock::CounterLayout::for_process(layout_source, layout, table) {
            Ok(counter) => {
                probe_set.count_statements(layout_source, counter, &traced_pids(&probes, layout_source))
            }
            Err(error) => warn!("duty-cycled probe counts will be scaled by time: {error:#}"),
        }
    }
    let ring = probes.take_samples()?;
    probes.attach_sampling(options.frequency_hz)?;

    // Who blocks whom, polled over SQL for as long as the samples are taken.
    let blocker_poller = collect::blockers::BlockerPoller::start(
        sql_facts::connect_target(&options, layout_source),
        collect::blockers::TRACE_INTERVAL,
        None,
    );
    let started = Instant::now();
    let start_unix_nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut session = Session::new(
        stack_symbolizer,
        off_cpu_measured,
        options.query_id,
        Some(collect::live::LiveCounts::default()),
    );
    session.add_instance(attached.context);
    session.settings_seen = Some(collect::settings_seen::SettingsSeen::default());
    // Handlers first: a Ctrl-C once the user is told it works must end the trace cleanly.
    let signals = Signals::install()?;
    note!(
        "pgscope: profiling {} at {} Hz for {:?} (Ctrl-C to stop early)",
        target.describe(),
        options.frequency_hz,
        options.duration
    );
    let ended_early = collect(
        &mut session,
        &mut probes,
        (&mut probe_set, &mut trigger_probes),
        ring,
        &options,
        started,
        signals,
    )
    .await?;
    let elapsed = started.elapsed();
    let (blocker_evidence, blockers_stopped) = blocker_poller.finish().await;
    if let Some(why) = blockers_stopped {
        note!("pgscope: sessions blocking others are not named: {why}");
    }
    // All probe counts are read at one instant, and attached time ends there: detaching takes a
    // kernel grace period per probe, during which functions detached later would count on.
    probe_set.stop_clock(&traced_pids(&probes, layout_source));
    let counters = probes.counters()?;
    let sampled_totals = if session.off_cpu.samples() {
        probes.wait_sample_totals().unwrap_or_else(|error| {
            warn!("cannot read the sampled off-CPU totals: {error:#}");
            Vec::new()
        })
    } else {
        Vec::new()
    };
    let exact_at_runs = if session.off_cpu == crate::collect::off_cpu::OffCpuMode::Both {
        probes.exact_at_runs_totals().unwrap_or_else(|error| {
            warn!("cannot read the exact off-CPU state at the sampler's runs: {error:#}");
            Vec::new()
        })
    } else {
        Vec::new()
    };
    let (off_cpu_totals, open_waits) = if session.off_cpu.traces() {
        let totals = probes.off_cpu_totals().unwrap_or_else(|error| {
            warn!("cannot read the off-CPU totals: {error:#}");
            Vec::new()
        });
        let open = probes.open_off_cpu_waits().unwrap_or_else(|error| {
            warn!("cannot read the off-CPU waits still open: {error:#}");
            Vec::new()
        });
        (totals, open)
    } else {
        (Vec::new(), Vec::new())
    };
    let probe_results = probes::ProbeResults::collect(&probes, &probe_set, elapsed, target.pid())?;
    let pids = traced_pids(&probes, layout_source);
    probe_set.detach_all(&mut probes, &pids)?;
    trigger_probes.detach_at_end(&mut probes);
    if let Some(because) = trigger_probes.detached_because() {
        note!("pgscope: triggers were named only until the trigger probes were detached: {because}");
    }
    // Kernel symbols while pgscope's own BPF programs are still loaded: they name its frames.
    let kernel = match KernelSymbols::load() {
        Ok(symbols) => Some(symbols),
        Err(error) => {
            warn!("kernel frames will be unnamed: {error}");
            None
        }
    };
    // Detached before the slow part (symbolization, output) starts, and beside it: the database
    // is left alone at once, and the kernel's grace periods for each link pass meanwhile.
    let detaching = Detaching::start(probes);
    // Samples whose statement never reported a queryid are what they are.
    session.release_held_samples();
    if ended_early {
        note!("pgscope: stopped early after {:.1} s", elapsed.as_secs_f64());
    }
    let sql_facts = sql_facts::fetch(
        &options,
        layout_source,
        &session,
        &probe_results,
        start.pgss.as_ref(),
        start.views.as_ref(),
        &blocker_evidence
            .iter()
            .flat_map(|evidence| evidence.blockers.iter())
            .filter_map(|b| b.query_id)
            .collect::<Vec<_>>(),
    )
    .await;
    session.add_waits_without_stack(
        WaitWithoutStack::from_totals(&off_cpu_totals).chain(WaitWithoutStack::from_open(&open_waits)),
        WaitSource::Traced,
    );
    session.add_waits_without_stack(
        WaitWithoutStack::from_totals(&sampled_totals),
        WaitSource::Sampled,
    );
    session.add_exact_at_runs(WaitWithoutStack::from_totals(&exact_at_runs));
    let measured = report::Measured {
        counters,
        probe_results,
        kernel,
        start_unix_nanos,
        elapsed,
        sql_facts,
        pgss_start: start.pgss.map(|start| start.info),
        blockers: blocker_evidence,
    };
    let finished = report::finish(&options, &target, session, measured);
    drop(detaching);
    finished
}

/// The traced processes, all of the one instance (or backend) rooted at `root`.
fn traced_pids(probes: &OnCpuProbes, root: u32) -> PidsByRoot {
    let pids = probes.target_pids().unwrap_or_else(|error| {
        warn!("cannot list the traced processes to count statements: {error:#}");
        Vec::new()
    });
    PidsByRoot::from([(root, pids)])
}

/// `pgscope calibrate`: what a probe hit costs on this machine — the floor (a uprobe running an
/// empty program) and pgscope's function probes (entry + return, full programs).
pub fn calibrate() -> Result<()> {
    preflight::check_all()?;
    let mut probes = OnCpuProbes::load()?;
    let floor = calibrate::measure_floor_ns_per_hit(&mut probes)?;
    let full = calibrate::measure_ns_per_hit(&mut probes)?;
    out!("uprobe + uretprobe with empty programs: {floor:.0} ns per call");
    out!("pgscope function probe (entry + return programs): {full:.0} ns per call");
    Ok(())
}

/// Queries and wait events the live view shows.
const LIVE_ROWS: usize = 5;

/// Collects until the duration passes or a signal arrives, keeping the function probes and the
/// trigger probes (`budgeted`) within their budget. Returns whether the session ended before
/// its duration.
async fn collect(
    session: &mut Session,
    probes: &mut OnCpuProbes,
    budgeted: (&mut ProbeSet, &mut TriggerProbes),
    ring: RingBuf<MapData>,
    options: &TraceOptions,
    started: Instant,
    signals: Signals,
) -> Result<bool> {
    let (probe_set, trigger_probes) = budgeted;
    let mut policy = TraceLoop {
        probe_set,
        trigger_probes,
        frequency_hz: options.frequency_hz,
        started,
        progress: progress::Progress::new(options.duration),
        instance_cpu_ns_per_s: 1e9,
        cpu_rate_of_a_second: false,
        last_samples: 0,
        last_tick_samples: 0,
        target_pid: session.only().map_or(0, |instance| instance.context.root),
        deadline: Box::pin(tokio::time::sleep(options.duration)),
        signals,
        ended_early: false,
    };
    driver::run(ring, session, probes, &mut policy, options.frequency_hz).await?;
    policy.progress.finish();
    Ok(policy.ended_early)
}

/// The trace's part of the collection loop: the live view, the probes' duty cycle against the
/// instance's CPU, and the end (its duration, or a signal).
struct TraceLoop<'a> {
    probe_set: &'a mut ProbeSet,
    trigger_probes: &'a mut TriggerProbes,
    frequency_hz: u64,
    started: Instant,
    progress: progress::Progress,
    /// CPU the instance uses (ns per second), from its on-CPU samples: over the last second,
    /// or since the start until a whole second was measured.
    instance_cpu_ns_per_s: f64,
    cpu_rate_of_a_second: bool,
    last_samples: u64,
    /// The kernel's sample counter at the last duty tick.
    last_tick_samples: u64,
    target_pid: u32,
    deadline: Pin<Box<Sleep>>,
    signals: Signals,
    ended_early: bool,
}

/// What ends a trace.
enum TraceEvent {
    Deadline,
    Signal,
}

impl Policy for TraceLoop<'_> {
    type Event = TraceEvent;

    async fn next_event(&mut self) -> TraceEvent {
        tokio::select! {
            _ = &mut self.deadline => TraceEvent::Deadline,
            _ = self.signals.interrupt.recv() => TraceEvent::Signal,
            _ = self.signals.terminate.recv() => TraceEvent::Signal,
            _ = self.signals.hangup.recv() => TraceEvent::Signal,
        }
    }

    async fn handle(
        &mut self,
        event: TraceEvent,
        _: &mut Session,
        _: &mut OnCpuProbes,
        _: &mut RingBuf<MapData>,
    ) -> Result<Flow> {
        self.ended_early = matches!(event, TraceEvent::Signal);
        Ok(Flow::Stop)
    }

    fn each_second(&mut self, session: &mut Session, probes: &mut OnCpuProbes) {
        match probes.counters() {
            Ok(counters) => {
                let samples = counters.get(Counter::Samples);
                if self.last_samples > 0 {
                    let per_second = samples.saturating_sub(self.last_samples) as f64;
                    self.instance_cpu_ns_per_s = per_second / self.frequency_hz as f64 * 1e9;
                    self.cpu_rate_of_a_second = true;
                }
                self.last_samples = samples;
                let mut table = session
                    .live
                    .as_ref()
                    .map(|live| live.lines(LIVE_ROWS))
                    .unwrap_or_default();
                table.extend(self.probe_set.live_lines());
                let stats = session
                    .only()
                    .map(|i| i.stacks.on_cpu.stats())
                    .unwrap_or_default();
                self.progress
                    .update(self.started.elapsed(), &counters, &stats, &table);
            }
            Err(error) => warn!("cannot read BPF counters: {error:#}"),
        }
    }

    fn duty_tick(&mut self, _: &Session, probes: &mut OnCpuProbes) -> Result<()> {
        // The CPU time since the last tick, from the samples the kernel took (not the rate of
        // the last second: a statement of a second or two would be mostly missed by it).
        if let Ok(counters) = probes.counters() {
            let samples = counters.get(Counter::Samples);
            let since = samples.saturating_sub(self.last_tick_samples);
            self.last_tick_samples = samples;
            self.probe_set
                .account_cpu(since as f64 / self.frequency_hz as f64 * 1e9);
            // The first plan comes a quarter second in: budgeted on an assumed CPU, a quiet
            // instance's probes would take several times its budget until the second is
            // measured.
            let elapsed = self.started.elapsed().as_secs_f64();
            if !self.cpu_rate_of_a_second && elapsed > 0.0 {
                self.instance_cpu_ns_per_s = samples as f64 / self.frequency_hz as f64 * 1e9 / elapsed;
            }
        }
        self.trigger_probes
            .tick(probes, DUTY_TICK, self.instance_cpu_ns_per_s);
        let pids = traced_pids(probes, self.target_pid);
        self.probe_set
            .tick(probes, DUTY_TICK, self.instance_cpu_ns_per_s, &pids)
            .context("duty-cycling the probes")
    }
}
