//! The agent's own metrics in the Prometheus text format (version 0.0.4). The values are
//! snapshots the main loop publishes once a second (BPF counters, instances, export state)
//! plus the process's own CPU and memory read at scrape time.

use super::findings_state::{FindingsSnapshot, ALWAYS_REPORTED, MAX_ALWAYS_REPORTED, MAX_PER_INSTANCE};
use super::probes::ProbeMetrics;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::cardinality::FoldReason;
use crate::model::QueryId;
use exporters::pyroscope::SenderStats;

/// What the main loop publishes.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// BPF counters by name (`samples`, `lost_ringbuf_full`, …), cumulative.
    pub bpf_counters: Vec<(&'static str, u64)>,
    /// Samples dropped in user space, per reason (malformed, no instance owns them).
    pub dropped_in_agent: Vec<(&'static str, u64)>,
    /// Instance name → processes of it in the kernel's filter.
    pub instances: BTreeMap<String, u64>,
    /// Distinct stacks held for the current upload interval.
    pub stacks_held: u64,
    /// Off-CPU profiling is attached.
    pub off_cpu: bool,
    /// Off-CPU time the wait sampler could not stand for, in ns.
    pub off_cpu_unsampled_ns: u64,
    /// The wait sampler's runs, and their time in ns (its CPU time, taken from the backend on
    /// its CPU each tick).
    pub wait_sampler_runs: u64,
    pub wait_sampler_run_ns: u64,
    /// Profiles built and handed to the upload queue, per profile type.
    pub profiles_enqueued: BTreeMap<&'static str, u64>,
    /// Label sets cut because a series would exceed Pyroscope's limits.
    pub labels_dropped: u64,
    /// Stacks left out because one stack alone is over Pyroscope's profile size limit.
    pub stacks_dropped: u64,
    /// Series folded into coarser label sets to bound the cardinality, per reason.
    pub series_folded: BTreeMap<FoldReason, u64>,
    /// The upload queue and its sender.
    pub export: SenderStats,
    /// Config reloads that worked / failed.
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    /// Function probes: hits per function, duty cycle and state per executable.
    pub probes: ProbeMetrics,
    /// The findings in force per instance.
    pub findings: FindingsSnapshot,
}

/// Renders the snapshot, with the agent's own CPU seconds and resident memory.
pub fn render(snapshot: &Snapshot, own: &OwnUsage) -> String {
    let mut out = Text::default();
    out.family(
        "pgscope_bpf_events_total",
        "counter",
        "Events counted by the BPF programs, per kind (samples taken, sent, lost per reason).",
    );
    for (name, value) in &snapshot.bpf_counters {
        out.value("pgscope_bpf_events_total", &[("kind", name)], *value);
    }
    out.family(
        "pgscope_samples_dropped_total",
        "counter",
        "Samples the agent dropped after reading them, per reason.",
    );
    for (reason, value) in &snapshot.dropped_in_agent {
        out.value("pgscope_samples_dropped_total", &[("reason", reason)], *value);
    }
    out.family("pgscope_instances", "gauge", "Postgres instances being profiled.");
    out.value("pgscope_instances", &[], snapshot.instances.len() as u64);
    out.family(
        "pgscope_instance_processes",
        "gauge",
        "Processes of each instance being profiled: the postmaster and the processes it forked that still run.",
    );
    for (instance, processes) in &snapshot.instances {
        out.value(
            "pgscope_instance_processes",
            &[("instance", instance)],
            *processes,
        );
    }
    out.family(
        "pgscope_stacks_held",
        "gauge",
        "Distinct stacks held for the current upload interval.",
    );
    out.value("pgscope_stacks_held", &[], snapshot.stacks_held);
    out.family(
        "pgscope_off_cpu_enabled",
        "gauge",
        "1 when off-CPU profiling is attached.",
    );
    out.value("pgscope_off_cpu_enabled", &[], u64::from(snapshot.off_cpu));
    out.family(
        "pgscope_off_cpu_unsampled_seconds_total",
        "counter",
        "Off-CPU time no wait sample stood for: the sampler's thread was held up between two runs for longer than a sample may weigh.",
    );
    out.value(
        "pgscope_off_cpu_unsampled_seconds_total",
        &[],
        snapshot.off_cpu_unsampled_ns as f64 / 1e9,
    );
    out.family(
        "pgscope_wait_sampler_runs_total",
        "counter",
        "Runs of the off-CPU wait sampler (one a tick).",
    );
    out.value("pgscope_wait_sampler_runs_total", &[], snapshot.wait_sampler_runs);
    out.family(
        "pgscope_wait_sampler_run_seconds_total",
        "counter",
        "Time the off-CPU wait sampler's runs took: CPU taken, at real-time priority, from the process on its CPU.",
    );
    out.value(
        "pgscope_wait_sampler_run_seconds_total",
        &[],
        snapshot.wait_sampler_run_ns as f64 / 1e9,
    );
    out.family(
        "pgscope_profiles_enqueued_total",
        "counter",
        "Profiles built and queued for Pyroscope, per profile type.",
    );
    for (kind, value) in &snapshot.profiles_enqueued {
        out.value("pgscope_profiles_enqueued_total", &[("profile", kind)], *value);
    }
    out.family(
        "pgscope_labels_dropped_total",
        "counter",
        "Labels left out of series to stay within Pyroscope's label limit.",
    );
    out.value("pgscope_labels_dropped_total", &[], snapshot.labels_dropped);
    out.family(
        "pgscope_stacks_dropped_total",
        "counter",
        "Stacks left out because a profile of that one stack is over Pyroscope's size limit.",
    );
    out.value("pgscope_stacks_dropped_total", &[], snapshot.stacks_dropped);
    out.family(
        "pgscope_series_folded_total",
        "counter",
        "Series pushed under a coarser label set to bound the cardinality, per reason \
         (queryid_top_k: a queryid outside the top K; series_cap: over the series per push).",
    );
    for reason in FoldReason::ALL {
        let value = snapshot.series_folded.get(&reason).copied().unwrap_or(0);
        out.value("pgscope_series_folded_total", &[("reason", reason.name())], value);
    }

    let export = &snapshot.export;
    out.family(
        "pgscope_export_pushes_total",
        "counter",
        "Pushes to Pyroscope, per result.",
    );
    out.value(
        "pgscope_export_pushes_total",
        &[("result", "ok")],
        export.pushes_ok,
    );
    out.value(
        "pgscope_export_pushes_total",
        &[("result", "retryable_error")],
        export.pushes_failed_retryable,
    );
    out.value(
        "pgscope_export_pushes_total",
        &[("result", "permanent_error")],
        export.pushes_failed_permanent,
    );
    out.family(
        "pgscope_export_bytes_total",
        "counter",
        "Bytes of the pushes Pyroscope accepted (request bodies: compressed profiles and labels).",
    );
    out.value("pgscope_export_bytes_total", &[], export.bytes_ok);
    out.family(
        "pgscope_export_series_total",
        "counter",
        "Series in the pushes Pyroscope accepted.",
    );
    out.value("pgscope_export_series_total", &[], export.series_ok);
    out.family(
        "pgscope_export_retries_total",
        "counter",
        "Pushes retried after a retryable error.",
    );
    out.value("pgscope_export_retries_total", &[], export.retries);
    out.family(
        "pgscope_export_dropped_batches_total",
        "counter",
        "Batches never delivered, per reason.",
    );
    out.value(
        "pgscope_export_dropped_batches_total",
        &[("reason", "queue_full")],
        export.dropped_queue_full_batches,
    );
    out.value(
        "pgscope_export_dropped_batches_total",
        &[("reason", "rejected")],
        export.dropped_permanent_batches,
    );
    out.family(
        "pgscope_export_dropped_bytes_total",
        "counter",
        "Bytes of batches dropped because the queue was full.",
    );
    out.value(
        "pgscope_export_dropped_bytes_total",
        &[("reason", "queue_full")],
        export.dropped_queue_full_bytes,
    );
    out.family(
        "pgscope_export_queue_batches",
        "gauge",
        "Batches waiting to be sent.",
    );
    out.value("pgscope_export_queue_batches", &[], export.queue_depth_batches);
    out.family("pgscope_export_queue_bytes", "gauge", "Bytes waiting to be sent.");
    out.value("pgscope_export_queue_bytes", &[], export.queue_depth_bytes);
    out.family(
        "pgscope_export_last_success_timestamp_seconds",
        "gauge",
        "When a push last succeeded (0: never).",
    );
    out.value(
        "pgscope_export_last_success_timestamp_seconds",
        &[],
        export.last_success_unix,
    );

    out.family(
        "pgscope_config_reloads_total",
        "counter",
        "Configuration reloads (SIGHUP), per result.",
    );
    out.value(
        "pgscope_config_reloads_total",
        &[("result", "ok")],
        snapshot.reloads_ok,
    );
    out.value(
        "pgscope_config_reloads_total",
        &[("result", "failed")],
        snapshot.reloads_failed,
    );
    render_probes(&mut out, &snapshot.probes);
    render_findings(&mut out, &snapshot.findings);

    out.family(
        "process_cpu_seconds_total",
        "counter",
        "CPU time of the agent (user + system).",
    );
    out.float("process_cpu_seconds_total", own.cpu_seconds);
    out.family(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory of the agent.",
    );
    out.value("process_resident_memory_bytes", &[], own.rss_bytes);
    out.0
}

/// The function probes' families; none when no probe is configured.
fn render_probes(out: &mut Text, probes: &ProbeMetrics) {
    if probes.hits.is_empty() && probes.groups.is_empty() {
        return;
    }
    out.family(
        "pgscope_probe_calls_total",
        "counter",
        "Calls of each probed function seen while its probe was attached (not scaled by the duty cycle).",
    );
    for (function, hits) in &probes.hits {
        out.value("pgscope_probe_calls_total", &[("function", function)], *hits);
    }
    out.family(
        "pgscope_probe_calls_dropped_total",
        "counter",
        "Measured calls of probed functions attributed to no instance: their process exited before a sample placed it in one.",
    );
    out.value("pgscope_probe_calls_dropped_total", &[], probes.calls_dropped);
    out.family(
        "pgscope_probe_foreign_hits_total",
        "counter",
        "Probe traps taken by processes the agent does not profile that map the same file (excluded instances, other programs): nothing is measured for them, but each pays a trap, and the duty cycle's budget counts them.",
    );
    for (function, hits) in &probes.foreign_hits {
        out.value(
            "pgscope_probe_foreign_hits_total",
            &[("function", function)],
            *hits,
        );
    }
    out.family(
        "pgscope_probe_duty_cycle",
        "gauge",
        "Share of the time the hot probes of an executable are attached (1: always).",
    );
    for (executable, duty, _) in &probes.groups {
        out.value("pgscope_probe_duty_cycle", &[("executable", executable)], duty);
    }
    out.family(
        "pgscope_probe_attached",
        "gauge",
        "1 while a function's probe is attached; mode is `cycled` for hot probes under the duty cycle, else `always`.",
    );
    for (executable, _, states) in &probes.groups {
        for state in states {
            let mode = if state.cycled { "cycled" } else { "always" };
            out.value(
                "pgscope_probe_attached",
                &[
                    ("executable", executable),
                    ("function", state.function.name()),
                    ("mode", mode),
                ],
                u64::from(state.attached),
            );
        }
    }
}

fn render_findings(out: &mut Text, findings: &FindingsSnapshot) {
    out.family(
        "pgscope_findings_evaluated_total",
        "counter",
        "Upload intervals whose findings were evaluated (one per instance and interval).",
    );
    out.value("pgscope_findings_evaluated_total", &[], findings.evaluated);
    let help = format!(
        "1 for each finding in force over an instance's last upload interval: its kind (the rule), \
         severity and the first queryid it names (empty: none). At most {MAX_PER_INSTANCE} per \
         instance, most severe first, of which at most {MAX_ALWAYS_REPORTED} info findings of each \
         always-reported kind ({}).",
        ALWAYS_REPORTED.join(", ")
    );
    out.family("pgscope_finding", "gauge", &help);
    for (instance, in_force) in &findings.current {
        for key in in_force {
            let query_id = key.query_label();
            out.value(
                "pgscope_finding",
                &[
                    ("instance", instance),
                    ("kind", key.kind),
                    ("severity", key.severity.name()),
                    (QueryId::LABEL, &query_id),
                ],
                1,
            );
        }
    }
}

#[derive(Default)]
struct Text(String);

impl Text {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn value(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (index, (key, label_value)) in labels.iter().enumerate() {
                if index > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{key}=\"{}\"", escape(label_value));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }

    fn float(&mut self, name: &str, value: f64) {
        let _ = writeln!(self.0, "{name} {value}");
    }
}

/// Label values escape backslash, double quote and newline.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The agent's own resource use.
#[derive(Clone, Copy, Debug, Default)]
pub struct OwnUsage {
    pub cpu_seconds: f64,
    pub rss_bytes: u64,
}

impl OwnUsage {
    /// From `/proc/self/stat` (utime, stime in clock ticks) and `/proc/self/statm` (pages).
    pub fn read() -> Self {
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        // SAFETY: as above.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
        let cpu_seconds = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| {
                let rest = stat.get(stat.rfind(')')? + 2..)?;
                let fields: Vec<&str> = rest.split_whitespace().collect();
                // After the comm: state is field 3 of stat, utime 14 and stime 15.
                let utime: f64 = fields.get(11)?.parse().ok()?;
                let stime: f64 = fields.get(12)?.parse().ok()?;
                Some((utime + stime) / ticks)
            })
            .unwrap_or(0.0);
        let rss_bytes = std::fs::read_to_string("/proc/self/statm")
            .ok()
            .and_then(|statm| statm.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map(|pages| pages * page)
            .unwrap_or(0);
        Self {
            cpu_seconds,
            rss_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_valid_exposition_lines() {
        let mut snapshot = Snapshot {
            bpf_counters: vec![("samples", 10), ("lost_ringbuf_full", 1)],
            ..Snapshot::default()
        };
        snapshot.instances.insert("15/\"main\"".to_string(), 12);
        snapshot.export.pushes_ok = 3;
        snapshot.wait_sampler_runs = 990;
        snapshot.wait_sampler_run_ns = 86_130_000;
        let text = render(
            &snapshot,
            &OwnUsage {
                cpu_seconds: 1.5,
                rss_bytes: 4096,
            },
        );
        assert!(text.contains("pgscope_bpf_events_total{kind=\"samples\"} 10\n"));
        assert!(text.contains("pgscope_instance_processes{instance=\"15/\\\"main\\\"\"} 12\n"));
        assert!(text.contains("pgscope_export_pushes_total{result=\"ok\"} 3\n"));
        assert!(text.contains("process_resident_memory_bytes 4096\n"));
        assert!(text.contains("pgscope_wait_sampler_runs_total 990\n"));
        assert!(text.contains("pgscope_wait_sampler_run_seconds_total 0.08613\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, value) = line.rsplit_once(' ').expect("name and value");
            assert!(value.parse::<f64>().is_ok(), "bad value in {line}");
        }
    }

    #[test]
    fn findings_render_one_series_each_with_an_empty_queryid_when_they_name_none() {
        use super::super::findings_state::FindingKey;
        use crate::findings::Severity;
        let mut snapshot = Snapshot::default();
        snapshot.findings.evaluated = 4;
        snapshot.findings.current.insert(
            "main".to_string(),
            vec![
                FindingKey {
                    kind: "top_cpu",
                    query_id: Some(QueryId(-42)),
                    severity: Severity::Info,
                },
                FindingKey {
                    kind: "spinlock_contention",
                    query_id: None,
                    severity: Severity::Warning,
                },
            ],
        );
        let text = render(&snapshot, &OwnUsage::default());
        assert!(text.contains(
            "pgscope_finding{instance=\"main\",kind=\"top_cpu\",severity=\"info\",queryid=\"-42\"} 1\n"
        ));
        assert!(text.contains(
            "pgscope_finding{instance=\"main\",kind=\"spinlock_contention\",severity=\"warning\",queryid=\"\"} 1\n"
        ));
        assert!(text.contains("pgscope_findings_evaluated_total 4\n"));
        let help = text
            .lines()
            .find(|l| l.starts_with("# HELP pgscope_finding "))
            .expect("HELP line");
        assert!(
            help.contains("At most 20 per instance") && help.contains("at most 3 info findings"),
            "{help}"
        );
    }

    /// Only these label names exist on /metrics: each value is a count's key (kind, reason),
    /// a queryid, a function, an executable path or an instance name, never text a query
    /// holds.
    const LABELS: [&str; 10] = [
        "kind",
        "reason",
        "instance",
        "profile",
        "result",
        "function",
        "executable",
        "mode",
        "severity",
        "queryid",
    ];

    #[test]
    fn query_texts_never_reach_metrics() {
        use super::super::findings_state::AgentFindings;
        use exporters::{Frame, FrameKind, Profile, ProfileMeta, StackSample};
        const SQL: &str = "SELECT secret_literal_4711 FROM accounts WHERE password = 'hunter2'";
        // Samples as the agent builds them, here with SQL wherever text could hide: a label
        // and a frame name. Busy enough for the always-reported findings to name its queryid.
        let sample = |query_id: &str, count| StackSample {
            frames: vec![
                Frame {
                    name: "exec_simple_query".into(),
                    kind: FrameKind::User,
                    module: None,
                },
                Frame {
                    name: SQL.into(),
                    kind: FrameKind::User,
                    module: None,
                },
            ],
            labels: vec![
                ("queryid".into(), query_id.into()),
                ("query".into(), SQL.into()),
                ("backend_type".into(), "client backend".into()),
            ],
            count,
        };
        let profile = Profile {
            meta: ProfileMeta::cpu(19, 1, 15_000_000_000),
            samples: vec![sample("-42", 900), sample("7", 100)],
        };
        let mut findings = AgentFindings::default();
        findings.evaluate("main", &[("process_cpu", profile)], None, None, None, None);
        let mut snapshot = Snapshot {
            findings: findings.snapshot(),
            ..Snapshot::default()
        };
        snapshot.instances.insert("main".into(), 3);
        assert!(
            !snapshot.findings.current["main"].is_empty(),
            "the interval yields findings"
        );
        let text = render(&snapshot, &OwnUsage::default());
        assert!(text.contains("queryid=\"-42\""), "{text}");
        for needle in ["SELECT", "secret_literal_4711", "hunter2", "accounts"] {
            assert!(!text.contains(needle), "`{needle}` on /metrics:\n{text}");
        }
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((_, labels)) = line.split_once('{') else {
                continue;
            };
            for pair in labels.split("\",") {
                let name = pair.split('=').next().unwrap_or_default();
                assert!(LABELS.contains(&name), "label `{name}` in {line}");
            }
        }
    }

    #[test]
    fn own_usage_is_read_from_proc() {
        let usage = OwnUsage::read();
        assert!(usage.rss_bytes > 0);
    }
}
