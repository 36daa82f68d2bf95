//! `pgscope agent`: profiles every Postgres instance on the host continuously and ships the
//! profiles to Grafana Pyroscope — the collection core of `trace`, run without end, with
//! discovery, an upload interval, an upload queue and its own metrics.

mod cardinality;
pub mod config;
mod discovery;
mod export;
mod findings_state;
mod http;
mod metrics;
mod off_cpu_totals;
pub(crate) mod pods;
mod probe_estimates;
mod probes;
mod query_texts;
mod trigger_probes;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use tracing::{info, warn};

use crate::bpf::abi::{Counter, TARGET_OFF_CPU};
use crate::bpf::OnCpuProbes;
use crate::collect::driver::{self, Flow, Policy, DUTY_TICK};
use crate::collect::instance::{self, Scope};
use crate::collect::off_cpu::OffCpuMode;
use crate::collect::probes::statement_clock::CounterLayout;
use crate::collect::{self, Session};
use crate::preflight;
use crate::signals::Signals;
use config::AgentConfig;
use symbolizer::{Symbolizer, SymbolizerOptions};

/// How often new and vanished postmasters are looked for.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(2);
/// How long stopping may take from SIGTERM to exit, the last push included: well inside a
/// pod's grace period, and short enough that a restart or rollout is not held up by an
/// unreachable Pyroscope (what it did not take by then is counted as dropped, and logged).
const STOP_BUDGET: Duration = Duration::from_millis(1200);
/// The last push gets at least this long, however long the final interval took to encode.
const LAST_PUSH_MIN: Duration = Duration::from_millis(200);

/// Where the configuration comes from, to load it again on SIGHUP.
pub struct ConfigSource {
    pub file: Option<PathBuf>,
    pub flags: config::Overrides,
}

impl ConfigSource {
    pub fn load(&self) -> Result<AgentConfig> {
        AgentConfig::load(
            self.file.as_deref(),
            &|name| std::env::var(name).ok(),
            &self.flags,
        )
    }
}

/// Runs until SIGTERM or SIGINT: then flushes what it can within a deadline and detaches.
pub async fn run(source: ConfigSource, mut config: AgentConfig) -> Result<()> {
    preflight::check_all()?;
    let shared = Arc::new(http::Shared::default());
    shared.beat();
    let metrics_addr = http::serve(config.server.metrics_addr, shared.clone())?;
    info!(%metrics_addr, "serving /metrics, /healthz and /readyz");
    let pod_index = Arc::new(std::sync::RwLock::new(pods::PodIndex::default()));
    match std::env::var("PGSCOPE_NODE_NAME").ok().filter(|n| !n.is_empty()) {
        // On Kubernetes (the chart sets the node name): pod metadata for this node's pods.
        Some(node) => drop(tokio::spawn(pods::watch(node, pod_index.clone()))),
        None => info!("PGSCOPE_NODE_NAME is not set: no pod metadata (set it on Kubernetes)"),
    }
    let mut exporter = export::Exporter::start(&config, pod_index)?;

    let mut probes = OnCpuProbes::load()?;
    probes.attach_process_tracking()?;
    let off_cpu = crate::collect::off_cpu::attach(
        &mut probes,
        config.collection.off_cpu,
        config.collection.off_cpu_min_stack,
        config.collection.off_cpu_stack_rate,
        |what, error| warn!("{what}: {error:#}; on-CPU profiling goes on"),
    );
    let ring = probes.take_samples()?;
    probes.attach_sampling(config.collection.frequency)?;
    let symbolizer = Symbolizer::new(SymbolizerOptions {
        debug_dirs: config.collection.debug_dirs.clone(),
    });
    let mut session = Session::new(symbolizer, off_cpu, None, None);
    let mut totals = off_cpu_totals::Trackers::default();
    let mut state = LoopState::default();
    let mut function_probes = probes::AgentProbes::new(&config);
    let mut agent_findings = findings_state::AgentFindings::default();
    let mut discoverer = Discoverer {
        probes: &mut probes,
        session: &mut session,
        exporter: &mut exporter,
        function_probes: &mut function_probes,
        findings: &mut agent_findings,
        enqueued: &mut state.enqueued,
        facts: &mut state.facts,
    };
    discoverer.discover(&config, off_cpu);
    shared.ready.store(true, Ordering::Relaxed);

    let mut upload = tokio::time::interval(config.collection.upload_interval);
    upload.reset();
    info!(
        frequency_hz = config.collection.frequency,
        upload_interval = ?config.collection.upload_interval,
        off_cpu = off_cpu.name(),
        "profiling"
    );
    // A reload that changes the frequency restarts the agent (`restart_needed`).
    let frequency_hz = config.collection.frequency;
    let mut policy = AgentLoop {
        source: &source,
        config: &mut config,
        shared: &shared,
        exporter: &mut exporter,
        function_probes: &mut function_probes,
        findings: &mut agent_findings,
        state: &mut state,
        totals: &mut totals,
        off_cpu,
        interval_start: unix_nanos(),
        discovery: tokio::time::interval(DISCOVERY_INTERVAL),
        upload,
        signals: Signals::install()?,
    };
    let ring = driver::run(ring, &mut session, &mut probes, &mut policy, frequency_hz).await?;
    let interval_start = policy.interval_start;
    let stopping = Instant::now();
    info!("stopping: sending what was collected");
    shared.ready.store(false, Ordering::Relaxed);
    totals.add_new_waits(&mut probes, &mut session);
    let rows = function_probes.take_interval(&mut probes, &session);
    function_probes.detach_all(&mut probes, &session);
    // Everything is read: detach before encoding and the network, the databases are left
    // alone at once.
    drop(ring);
    drop(probes);
    exporter
        .upload(
            &mut session,
            &config,
            interval_start..unix_nanos(),
            &rows,
            &mut state.enqueued,
            &mut agent_findings,
        )
        .await;
    let flush = STOP_BUDGET.saturating_sub(stopping.elapsed()).max(LAST_PUSH_MIN);
    let unsent = exporter.shutdown(flush).await;
    if unsent > 0 {
        warn!(
            batches = unsent,
            "Pyroscope did not take everything before the shutdown deadline; those profiles are lost"
        );
    }
    info!("stopped");
    Ok(())
}

/// The agent's part of the collection loop: discovery, uploads, reloads, its metrics and the
/// probes' duty cycles, until a signal stops it.
struct AgentLoop<'a> {
    source: &'a ConfigSource,
    config: &'a mut AgentConfig,
    shared: &'a http::Shared,
    exporter: &'a mut export::Exporter,
    function_probes: &'a mut probes::AgentProbes,
    findings: &'a mut findings_state::AgentFindings,
    state: &'a mut LoopState,
    totals: &'a mut off_cpu_totals::Trackers,
    off_cpu: OffCpuMode,
    /// When the interval being collected began (Unix ns).
    interval_start: u64,
    discovery: tokio::time::Interval,
    upload: tokio::time::Interval,
    signals: Signals,
}

enum AgentEvent {
    Discovery,
    Upload,
    Reload,
    Stop,
}

impl Policy for AgentLoop<'_> {
    type Event = AgentEvent;

    async fn next_event(&mut self) -> AgentEvent {
        tokio::select! {
            _ = self.discovery.tick() => AgentEvent::Discovery,
            _ = self.upload.tick() => AgentEvent::Upload,
            _ = self.signals.hangup.recv() => AgentEvent::Reload,
            _ = self.signals.terminate.recv() => AgentEvent::Stop,
            _ = self.signals.interrupt.recv() => AgentEvent::Stop,
        }
    }

    async fn handle(
        &mut self,
        event: AgentEvent,
        session: &mut Session,
        probes: &mut OnCpuProbes,
        ring: &mut RingBuf<MapData>,
    ) -> Result<Flow> {
        match event {
            AgentEvent::Discovery => Discoverer {
                probes,
                session,
                exporter: self.exporter,
                function_probes: self.function_probes,
                findings: self.findings,
                enqueued: &mut self.state.enqueued,
                facts: &mut self.state.facts,
            }
            .discover(self.config, self.off_cpu),
            AgentEvent::Upload => {
                let now = unix_nanos();
                // Records already in the ring buffer belong to this interval: the stacks of
                // waits still open among them, and the ends of waits no longer open.
                collect::drain(ring, session);
                self.totals.add_new_waits(probes, session);
                let rows = self.function_probes.take_interval(probes, session);
                self.exporter
                    .upload(
                        session,
                        self.config,
                        self.interval_start..now,
                        &rows,
                        &mut self.state.enqueued,
                        self.findings,
                    )
                    .await;
                self.interval_start = now;
            }
            AgentEvent::Reload => self.reload()?,
            AgentEvent::Stop => return Ok(Flow::Stop),
        }
        Ok(Flow::Continue)
    }

    fn each_second(&mut self, session: &mut Session, probes: &mut OnCpuProbes) {
        self.shared.beat();
        self.function_probes.measure_cpu(session, Duration::from_secs(1));
        self.shared.publish(self.state.snapshot(
            probes,
            session,
            self.exporter,
            self.function_probes,
            self.findings,
            self.off_cpu,
        ));
    }

    fn duty_tick(&mut self, session: &Session, probes: &mut OnCpuProbes) -> Result<()> {
        self.function_probes.tick(probes, session, DUTY_TICK);
        Ok(())
    }
}

impl AgentLoop<'_> {
    /// SIGHUP: the configuration file again; a broken one keeps the old configuration.
    fn reload(&mut self) -> Result<()> {
        match self.source.load() {
            Ok(new) => {
                apply_reload(self.config, &new);
                self.exporter.reconfigure(&new)?;
                if new.collection.upload_interval != self.config.collection.upload_interval {
                    self.upload = tokio::time::interval(new.collection.upload_interval);
                    self.upload.reset();
                }
                *self.config = new;
                self.state.reloads_ok += 1;
                info!("configuration reloaded");
            }
            Err(error) => {
                self.state.reloads_failed += 1;
                warn!("configuration not reloaded, the old one stays: {error:#}");
            }
        }
        Ok(())
    }
}

/// Settings a reload cannot change in a running agent, said once.
fn apply_reload(old: &AgentConfig, new: &AgentConfig) {
    let fixed = [
        (
            "collection.frequency",
            old.collection.frequency != new.collection.frequency,
        ),
        (
            "collection.off_cpu",
            old.collection.off_cpu != new.collection.off_cpu,
        ),
        (
            "collection.off_cpu_min_stack",
            old.collection.off_cpu_min_stack != new.collection.off_cpu_min_stack,
        ),
        (
            "collection.off_cpu_stack_rate",
            old.collection.off_cpu_stack_rate != new.collection.off_cpu_stack_rate,
        ),
        (
            "server.metrics_addr",
            old.server.metrics_addr != new.server.metrics_addr,
        ),
        (
            "server.log_format",
            old.server.log_format != new.server.log_format,
        ),
    ];
    for (key, changed) in fixed {
        if changed {
            warn!("{key} changed: it takes effect when the agent restarts");
        }
    }
}

/// Discovery with what it changes: the kernel's filter, the session's instances, the
/// exporter's last uploads and the function probes.
struct Discoverer<'a> {
    probes: &'a mut OnCpuProbes,
    session: &'a mut Session,
    exporter: &'a mut export::Exporter,
    function_probes: &'a mut probes::AgentProbes,
    findings: &'a mut findings_state::AgentFindings,
    /// Batches queued per profile type (`pgscope_profiles_enqueued_total`).
    enqueued: &'a mut BTreeMap<&'static str, u64>,
    facts: &'a mut discovery::FactsCache,
}

impl Discoverer<'_> {
    /// Attaches postmasters that appeared (and that the configuration lets in); sends and drops
    /// instances whose postmaster is gone or that the configuration now leaves out.
    fn discover(&mut self, config: &AgentConfig, off_cpu: OffCpuMode) {
        let Discoverer {
            probes,
            session,
            exporter,
            function_probes,
            findings,
            enqueued,
            facts,
        } = self;
        let attached: Vec<u32> = session
            .instances()
            .map(|instance| instance.context.root)
            .collect();
        // The followed children of profiled instances, not their roots: a root must be found
        // again, or it is taken for gone.
        let children: HashSet<u32> = probes
            .target_pids()
            .unwrap_or_else(|error| {
                warn!("cannot list the profiled processes, the scan reads them all: {error:#}");
                Vec::new()
            })
            .into_iter()
            .filter(|pid| !attached.contains(pid))
            .collect();
        let found = discovery::scan(&config.discovery, &children, facts);
        for root in &attached {
            if found.iter().any(|f| f.postmaster.pid == *root) {
                continue;
            }
            function_probes.remove_instance(probes, session, *root);
            if let Some(gone) = session.remove_instance(*root) {
                let name = exporter.instance_name(&gone.context);
                info!(postmaster = root, instance = %name, "instance gone (stopped, restarted or excluded); its findings go with it");
                findings.forget(&name, *root);
                exporter.upload_instance(session, gone, config, enqueued);
            }
            // Its processes leave the filter as they exit; those of a still-running instance that
            // the configuration now excludes leave it now (errors: already gone).
            for child in crate::target::children_of(*root) {
                let _ = probes.remove_target(child.pid);
            }
            let _ = probes.remove_target(*root);
        }
        let flags = if off_cpu.traces() { TARGET_OFF_CPU } else { 0 };
        for found in found {
            if attached.contains(&found.postmaster.pid) {
                continue;
            }
            match instance::attach(probes, &found.postmaster, Scope::Instance, flags) {
                Ok(attached) => {
                    if let Some(error) = &attached.no_attribution {
                        warn!(
                            postmaster = found.postmaster.pid,
                            "no query or wait-event labels: {error:#}"
                        );
                    }
                    if let Some(error) = &attached.no_instance_names {
                        warn!(
                            postmaster = found.postmaster.pid,
                            "extension LWLocks and background workers keep generic names: {error:#}"
                        );
                    }
                    info!(
                        postmaster = found.postmaster.pid,
                        instance = %exporter.instance_name(&attached.context),
                        data_dir = ?found.facts.data_dir,
                        major = ?found.facts.major,
                        processes = attached.children + 1,
                        "profiling instance"
                    );
                    let root = attached.context.root;
                    let counter = attached.layout.as_ref().and_then(|(layout, table)| {
                        CounterLayout::for_process(root, layout, table)
                            .map_err(|error| {
                                warn!(
                                    postmaster = root,
                                    "duty-cycled probe counts will be scaled by time: {error:#}"
                                )
                            })
                            .ok()
                    });
                    if let Some(offset) =
                        crate::postgres::pgss_hooks::name_in_stacks(&mut session.symbolizer, root)
                    {
                        tracing::debug!(
                            postmaster = root,
                            offset,
                            "pgss_store named in stacks through pg_stat_statements' hooks"
                        );
                    }
                    if let Some((_, table)) = &attached.layout {
                        let named = crate::postgres::pointer_tables::name_in_stacks(
                            &mut session.symbolizer,
                            root,
                            table,
                        );
                        tracing::debug!(
                            postmaster = root,
                            named,
                            "static functions named through tables of function pointers"
                        );
                    }
                    session.add_instance(attached.context);
                    function_probes.add_instance(probes, session, root, counter);
                }
                Err(error) => warn!(
                    postmaster = found.postmaster.pid,
                    "cannot profile this instance, the others go on: {error:#}"
                ),
            }
        }
    }
}

/// Counters the loop keeps for /metrics.
#[derive(Default)]
struct LoopState {
    enqueued: BTreeMap<&'static str, u64>,
    /// Facts of the postmasters discovered, read once each.
    facts: discovery::FactsCache,
    /// The instance (root PID) of each process in the kernel's filter, for the per-instance
    /// process counts.
    roots: std::collections::HashMap<u32, u32>,
    reloads_ok: u64,
    reloads_failed: u64,
}

impl LoopState {
    fn snapshot(
        &mut self,
        probes: &OnCpuProbes,
        session: &Session,
        exporter: &export::Exporter,
        function_probes: &probes::AgentProbes,
        findings: &findings_state::AgentFindings,
        off_cpu: OffCpuMode,
    ) -> metrics::Snapshot {
        let bpf_counters = match probes.counters() {
            Ok(counters) => Counter::ALL
                .iter()
                .map(|&c| (c.name(), counters.get(c)))
                .collect(),
            Err(error) => {
                warn!("cannot read BPF counters: {error:#}");
                Vec::new()
            }
        };
        // Processes in the kernel's filter, per instance: the postmaster and every process
        // forked from it and still running (the exit tracepoint removes the others). A
        // process's instance is looked up once (its parent does not change while it runs):
        // this runs every second, and reading /proc for a thousand backends each time would
        // be most of what an idle host costs the agent.
        let targets = probes.target_pids().unwrap_or_default();
        let in_filter: HashSet<u32> = targets.iter().copied().collect();
        self.roots.retain(|pid, _| in_filter.contains(pid));
        let mut per_root: BTreeMap<u32, u64> = BTreeMap::new();
        for pid in targets {
            let root = *self
                .roots
                .entry(pid)
                .or_insert_with(|| match session.placed_in(pid) {
                    Some(root) => root,
                    None => match crate::target::ProcessInfo::read(pid) {
                        Some(process) if session.instances().any(|i| i.context.root == process.ppid) => {
                            process.ppid
                        }
                        _ => pid,
                    },
                });
            *per_root.entry(root).or_insert(0) += 1;
        }
        let instances = session
            .instances()
            .map(|instance| {
                let root = instance.context.root;
                (
                    exporter.instance_name(&instance.context),
                    per_root.get(&root).copied().unwrap_or(0),
                )
            })
            .collect();
        metrics::Snapshot {
            bpf_counters,
            dropped_in_agent: vec![
                ("malformed", session.malformed),
                ("no_instance", session.unowned),
                ("off_cpu_repeat_without_sample", session.orphan_repeats),
                ("off_cpu_end_without_stacks", session.unmatched_wait_ends()),
            ],
            instances,
            stacks_held: session.instances().map(|i| i.stacks.distinct() as u64).sum(),
            off_cpu: off_cpu.any(),
            off_cpu_unsampled_ns: session.wait_sampler.unsampled_ns,
            wait_sampler_runs: session.wait_sampler.runs,
            wait_sampler_run_ns: session.wait_sampler.run_ns,
            profiles_enqueued: self.enqueued.clone(),
            labels_dropped: exporter.labels_dropped(),
            stacks_dropped: exporter.stacks_dropped(),
            series_folded: exporter.series_folded().clone(),
            export: exporter.stats(),
            reloads_ok: self.reloads_ok,
            reloads_failed: self.reloads_failed,
            probes: function_probes.metrics(probes),
            findings: findings.snapshot(),
        }
    }
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
