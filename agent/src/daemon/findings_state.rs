//! The findings of each instance, evaluated every upload interval over what the interval
//! measured (the same rules as `pgscope trace`), for /metrics and the logs. Logs say what
//! changed — a finding that appeared, one that cleared — so that a steady instance does not
//! repeat itself every interval.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use exporters::Profile;
use tracing::{debug, info};

use super::probes::CallRow;
use crate::collect::blockers::{BlockerPoller, AGENT_INTERVAL};
use crate::findings::{self, Finding, Severity};
use crate::model::{Analysis, Measurements, PgssEvidence, ProbeRow, QueryId};
use crate::postgres::blockers::BlockerEvidence;
use crate::postgres::sql;

/// Findings kept per instance, most severe first: /metrics has one series per finding, and
/// a rule speaks of one queryid at a time, so this bounds the series an instance can add.
pub const MAX_PER_INSTANCE: usize = 20;
/// Of the rules that report something whatever the workload (where the CPU and the blocked
/// time go), the first this many are kept: with a mixed workload their queryids change from
/// one interval to the next, and each would be a new series.
pub const MAX_ALWAYS_REPORTED: usize = 3;
/// Those rules' kinds (findings::cpu::top_consumers, findings::waits::top_waiters).
pub const ALWAYS_REPORTED: [&str; 2] = ["top_cpu", "top_wait"];
/// How long reading pg_stat_statements' eviction counter may take: the upload waits on it.
const PGSS_TIMEOUT: Duration = Duration::from_secs(2);
/// After a failed read, how long before the next try: an instance the agent cannot connect
/// to must not cost a connection attempt every interval.
const PGSS_RETRY: Duration = Duration::from_secs(60);
/// After finding the extension not created: creating it is rare, and a look costs the
/// instance a connection.
const PGSS_ABSENT_RETRY: Duration = Duration::from_secs(600);

/// What identifies a finding from one interval to the next: its rule, the queryid it names
/// and its severity. Its numbers change every time and are not part of it; a severity that
/// changes is a new finding (the old one clears), as a Prometheus series would be.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FindingKey {
    pub kind: &'static str,
    pub query_id: Option<QueryId>,
    pub severity: Severity,
}

impl FindingKey {
    fn of(finding: &Finding) -> Self {
        Self {
            kind: finding.kind,
            query_id: finding.query_ids.first().copied(),
            severity: finding.severity,
        }
    }

    /// The `queryid` label and log field: empty when the finding names no statement.
    pub fn query_label(&self) -> String {
        self.query_id.map(|q| q.to_string()).unwrap_or_default()
    }
}

/// An instance's findings in force, each with the title it had when last found (a cleared
/// finding is logged with it) and the evaluations since that did not find it.
type InForce = BTreeMap<FindingKey, Held>;

#[derive(Clone, Debug)]
struct Held {
    title: String,
    misses: u32,
}

/// A finding clears when this many evaluations in a row do not find it, unless another
/// severity of it replaced it (that clears it at once). One interval can hold too few samples
/// of a statement to find what still goes on: beside two CPU hogs a commit-phase finding
/// cleared and came back 2 s later while its workload ran on, and an alert that flaps pages
/// twice.
const CLEAR_AFTER_MISSES: u32 = 2;

/// What an interval changed, as logged.
#[derive(Debug, Default, PartialEq)]
struct Changes {
    appeared: Vec<FindingKey>,
    cleared: Vec<FindingKey>,
}

/// pg_stat_statements' eviction counter of one instance, at its last read, and the connection
/// it is read over: kept open, so that an instance logging its connections does not log one
/// every interval.
#[derive(Debug, Default)]
struct PgssReading {
    client: Option<tokio_postgres::Client>,
    last: Option<(sql::PgssInfo, Instant)>,
    retry_at: Option<Instant>,
}

/// Per instance (by its name, as its series are labelled): the findings of its last interval.
#[derive(Debug, Default)]
pub struct AgentFindings {
    current: BTreeMap<String, InForce>,
    /// By postmaster PID: a restarted instance keeps its name but starts its counter anew.
    pgss: HashMap<u32, PgssReading>,
    /// By postmaster PID: who blocks whom, polled for as long as the instance is watched.
    blockers: HashMap<u32, BlockerPoller>,
    evaluated: u64,
}

impl AgentFindings {
    /// pg_stat_statements' evictions since the last interval of the instance of `root`, read
    /// over the same kind of connection as the database names (its socket, as the data
    /// directory's owner), kept open between intervals. None for the first interval, or when
    /// the counter cannot be read: tried again over a new connection a minute later (no
    /// access, no answer), or ten minutes later (extension created in no database).
    pub async fn read_pgss(&mut self, root: u32) -> Option<PgssEvidence> {
        let reading = self.pgss.entry(root).or_default();
        if reading.retry_at.is_some_and(|at| Instant::now() < at) {
            return None;
        }
        if reading.client.as_ref().is_some_and(|c| c.is_closed()) {
            reading.client = None;
        }
        let client = &mut reading.client;
        let read = async {
            let connected = match client.take() {
                Some(open) => open,
                None => {
                    let target = sql::Connect::for_process(root)?;
                    // The view is where the extension was created, often not `postgres`.
                    match sql::find_pgss(&target, sql::connect(&target).await?).await? {
                        sql::PgssConnection::Found { client, .. } => client,
                        sql::PgssConnection::Absent { .. } => return Ok(None),
                    }
                }
            };
            let info = sql::pgss_info(&connected).await;
            *client = Some(connected);
            info
        };
        let (why_not, retry) = match tokio::time::timeout(PGSS_TIMEOUT, read).await {
            Ok(Ok(Some(info))) => {
                let now = Instant::now();
                reading.retry_at = None;
                let (before, then) = reading.last.replace((info, now))?;
                return pgss_evidence(before, info, now.duration_since(then));
            }
            Ok(Ok(None)) => (
                "the extension is created in no database of the instance".to_string(),
                PGSS_ABSENT_RETRY,
            ),
            Ok(Err(error)) => (format!("{error:#}"), PGSS_RETRY),
            Err(_) => ("the read timed out".to_string(), PGSS_RETRY),
        };
        debug!(
            postmaster = root,
            "no pg_stat_statements eviction counts ({why_not}): tried again in {retry:?}"
        );
        // The connection is closed until then: an instance without the extension keeps no
        // idle backend of the agent's.
        *reading = PgssReading {
            retry_at: Some(Instant::now() + retry),
            ..PgssReading::default()
        };
        None
    }

    /// The sessions that held others' locks in the instance of `root` since the last call,
    /// polled on a connection of their own (started at the first call: None then, and when
    /// the instance cannot be polled; a failed connection is tried again a minute later).
    pub fn take_blockers(&mut self, root: u32) -> Option<BlockerEvidence> {
        self.blockers
            .entry(root)
            .or_insert_with(|| {
                BlockerPoller::start(sql::Connect::for_process(root), AGENT_INTERVAL, Some(PGSS_RETRY))
            })
            .take()
    }

    /// Lends the open connection to the database that has pg_stat_statements (query texts are
    /// read over it): one connection, one backend of the agent's, per instance, besides the
    /// blocker poller's ([`Self::take_blockers`]).
    pub fn lend_pgss(&mut self, root: u32) -> Option<tokio_postgres::Client> {
        self.pgss.get_mut(&root)?.client.take()
    }

    /// Takes back what [`Self::lend_pgss`] lent.
    pub fn return_pgss(&mut self, root: u32, client: tokio_postgres::Client) {
        if let Some(reading) = self.pgss.get_mut(&root) {
            reading.client = Some(client);
        }
    }

    /// Evaluates the rules over one instance's interval — the profiles about to be shipped and
    /// the probes' counts — and logs what changed since its last interval.
    pub fn evaluate(
        &mut self,
        instance: &str,
        profiles: &[(&'static str, Profile)],
        rows: Option<&[CallRow]>,
        pgss: Option<PgssEvidence>,
        blockers: Option<&BlockerEvidence>,
        postgres_major: Option<u32>,
    ) {
        let Some(on_cpu) = profiles
            .iter()
            .find(|(name, _)| *name == "process_cpu")
            .map(|(_, p)| p)
        else {
            return;
        };
        let off_cpu = profiles
            .iter()
            .find(|(name, _)| *name == "offcpu")
            .map(|(_, p)| p);
        let probes: Vec<ProbeRow> = rows
            .unwrap_or_default()
            .iter()
            .map(|row| ProbeRow {
                query_id: QueryId(row.query_id),
                function: row.call.function,
                calls: row.calls,
                total_ns: row.total_ns,
                detail: row.call.detail,
            })
            .collect();
        let found = findings::evaluate(&Analysis::new(Measurements {
            on_cpu,
            off_cpu,
            probes: &probes,
            // The agent's probes count calls; call sites are `pgscope trace --probes s_lock`'s.
            spin_sites: &[],
            pgss,
            // Settings are quoted by `pgscope trace`; the agent reads only the counter above.
            instance: None,
            blockers,
            // Each wait event's meaning in the server's own words where the major has them
            // (pg_wait_events, 17 and later), as the trace gives them.
            postgres_major,
        }));
        self.evaluated += 1;
        self.update(instance, &found);
    }

    /// Replaces an instance's findings with `found` (bounded) and logs each finding that
    /// appeared and each that cleared; nothing when the set is the same.
    fn update(&mut self, instance: &str, found: &[Finding]) -> Changes {
        let kept = bounded(found);
        let before = self.current.remove(instance).unwrap_or_default();
        let mut now = InForce::new();
        let mut changes = Changes::default();
        for finding in kept {
            let key = FindingKey::of(finding);
            if now.contains_key(&key) {
                continue;
            }
            now.insert(
                key.clone(),
                Held {
                    title: finding.title.clone(),
                    misses: 0,
                },
            );
            if before.contains_key(&key) {
                continue;
            }
            info!(
                instance,
                kind = key.kind,
                severity = key.severity.name(),
                queryid = %key.query_label(),
                title = %finding.title,
                action = %finding.action,
                "finding appeared"
            );
            changes.appeared.push(key);
        }
        for (key, held) in &before {
            if now.contains_key(key) {
                continue;
            }
            let replaced = now
                .keys()
                .any(|other| other.kind == key.kind && other.query_id == key.query_id);
            if !replaced && held.misses + 1 < CLEAR_AFTER_MISSES {
                let missed = Held {
                    title: held.title.clone(),
                    misses: held.misses + 1,
                };
                now.insert(key.clone(), missed);
                continue;
            }
            info!(
                instance,
                kind = key.kind,
                severity = key.severity.name(),
                queryid = %key.query_label(),
                title = %held.title,
                "finding cleared"
            );
            changes.cleared.push(key.clone());
        }
        self.current.insert(instance.to_string(), now);
        changes
    }

    /// The instance is gone: its findings go with it, and its counter reading.
    pub fn forget(&mut self, instance: &str, root: u32) {
        self.current.remove(instance);
        self.pgss.remove(&root);
        self.blockers.remove(&root);
    }

    /// For /metrics: per instance, its findings in force.
    pub fn snapshot(&self) -> FindingsSnapshot {
        FindingsSnapshot {
            current: self
                .current
                .iter()
                .map(|(instance, in_force)| (instance.clone(), in_force.keys().cloned().collect()))
                .collect(),
            evaluated: self.evaluated,
        }
    }
}

/// The findings an instance shows: at most [`MAX_ALWAYS_REPORTED`] of the always-reported
/// kinds, then at most [`MAX_PER_INSTANCE`] distinct ones, in the rules' order (most severe
/// first), so what is cut is the least severe.
fn bounded(found: &[Finding]) -> Vec<&Finding> {
    let mut always: HashMap<&str, usize> = HashMap::new();
    let mut keys = Vec::new();
    let mut kept = Vec::new();
    for finding in found {
        if finding.severity == Severity::Info && ALWAYS_REPORTED.contains(&finding.kind) {
            let seen = always.entry(finding.kind).or_insert(0);
            *seen += 1;
            if *seen > MAX_ALWAYS_REPORTED {
                continue;
            }
        }
        // A rule may name a queryid twice (one finding per probed function): one series.
        let key = FindingKey::of(finding);
        if keys.contains(&key) {
            continue;
        }
        if kept.len() == MAX_PER_INSTANCE {
            break;
        }
        keys.push(key);
        kept.push(finding);
    }
    kept
}

/// The evictions between two reads of the counter; None when it went back
/// (`pg_stat_statements_reset()` zeroes it): that interval's count is unknown.
fn pgss_evidence(before: sql::PgssInfo, after: sql::PgssInfo, elapsed: Duration) -> Option<PgssEvidence> {
    let evictions = after.dealloc.checked_sub(before.dealloc).filter(|n| *n >= 0)?;
    Some(PgssEvidence {
        evictions,
        max: after.max,
        seconds: elapsed.as_secs_f64(),
    })
}

/// What /metrics shows of the findings.
#[derive(Clone, Debug, Default)]
pub struct FindingsSnapshot {
    pub current: BTreeMap<String, Vec<FindingKey>>,
    pub evaluated: u64,
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;

    fn finding(kind: &'static str, query_id: i64, severity: Severity) -> Finding {
        Finding {
            kind,
            severity,
            title: format!("{kind} of {query_id}"),
            numbers: Vec::new(),
            query_ids: vec![QueryId(query_id)],
            frames: Vec::new(),
            action: "consider".into(),
            cause: None,
        }
    }

    /// Log lines written through a JSON subscriber, as `--log-json` writes them.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log buffer").extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Runs `run` with logs going to a JSON subscriber, as `--log-json` writes them, and returns
    /// what it returned and the `fields` of each line it logged.
    fn logging<R>(run: impl FnOnce() -> R) -> (R, Vec<serde_json::Value>) {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_writer(move || writer.clone())
            .finish();
        let returned = tracing::subscriber::with_default(subscriber, run);
        let bytes = captured.0.lock().expect("log buffer").clone();
        let lines = String::from_utf8(bytes)
            .expect("UTF-8 logs")
            .lines()
            .map(|line| {
                serde_json::from_str::<serde_json::Value>(line).expect("a JSON log line")["fields"].clone()
            })
            .collect();
        (returned, lines)
    }

    /// Runs `update` and returns what it returned and the `fields` of each line it logged.
    fn logged(
        findings: &mut AgentFindings,
        instance: &str,
        found: &[Finding],
    ) -> (Changes, Vec<serde_json::Value>) {
        logging(|| findings.update(instance, found))
    }

    /// The `action` of each finding `evaluate` logged as appearing.
    fn actions_evaluated(
        findings: &mut AgentFindings,
        profiles: &[(&'static str, Profile)],
        postgres_major: Option<u32>,
    ) -> Vec<String> {
        let ((), lines) = logging(|| findings.evaluate("a", profiles, None, None, None, postgres_major));
        lines
            .iter()
            .filter_map(|fields| fields["action"].as_str().map(str::to_owned))
            .collect()
    }

    /// The agent explains a wait as `pgscope trace` does: in the server's own words where its
    /// major has them (pg_wait_events, 17 and later), else by the wait's type.
    #[test]
    fn a_wait_is_explained_in_the_servers_own_words_where_its_major_has_them() {
        use crate::model::fixtures::{labelled, off_cpu, profile, sample};
        let on_cpu = profile(vec![sample(7, "run", &["ExecScan"], 10)]);
        let period = on_cpu.meta.period;
        let waits = off_cpu(vec![labelled(
            &[],
            &[
                ("off_cpu", "io"),
                ("queryid", "7"),
                ("wait_event", "IO:ControlFileRead"),
            ],
            90 * period,
        )]);
        let profiles = [("process_cpu", on_cpu), ("offcpu", waits)];
        let explained = |major| {
            actions_evaluated(&mut AgentFindings::default(), &profiles, major)
                .into_iter()
                .find(|action| action.starts_with("IO:ControlFileRead"))
                .expect("a finding explaining the wait")
        };
        assert!(
            explained(Some(17))
                .contains("Waiting for a read from the pg_control file (PostgreSQL's description)"),
            "{}",
            explained(Some(17))
        );
        assert!(
            !explained(None).contains("PostgreSQL's description"),
            "{}",
            explained(None)
        );
    }

    fn key(kind: &'static str, query_id: i64, severity: Severity) -> FindingKey {
        FindingKey {
            kind,
            query_id: Some(QueryId(query_id)),
            severity,
        }
    }

    #[test]
    fn a_finding_that_appears_is_logged_once_with_its_title_and_action() {
        let mut findings = AgentFindings::default();
        let storm = finding("pgss_evictions", 0, Severity::Critical);
        let top = finding("top_cpu", 7, Severity::Info);
        let (changes, lines) = logged(&mut findings, "a", &[storm.clone(), top.clone()]);
        assert_eq!(
            changes.appeared,
            vec![
                key("pgss_evictions", 0, Severity::Critical),
                key("top_cpu", 7, Severity::Info)
            ]
        );
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["message"], "finding appeared");
        assert_eq!(lines[0]["instance"], "a");
        assert_eq!(lines[0]["kind"], "pgss_evictions");
        assert_eq!(lines[0]["severity"], "critical");
        assert_eq!(lines[0]["queryid"], "0");
        assert_eq!(lines[0]["title"], "pgss_evictions of 0");
        assert_eq!(lines[0]["action"], "consider");
        assert_eq!(lines[1]["kind"], "top_cpu");
        assert_eq!(lines[1]["queryid"], "7");
    }

    #[test]
    fn an_unchanged_set_logs_nothing_whatever_its_numbers_did() {
        let mut findings = AgentFindings::default();
        let phase = finding("phase_dominance", 3, Severity::Warning);
        logged(&mut findings, "a", std::slice::from_ref(&phase));
        let renumbered = Finding {
            title: "phase_dominance of 3, other numbers".into(),
            numbers: vec![("samples".into(), "99".into())],
            ..phase
        };
        let (changes, lines) = logged(&mut findings, "a", &[renumbered]);
        assert_eq!(changes, Changes::default());
        assert!(lines.is_empty(), "{lines:?}");
        // Another instance's findings are its own.
        let (changes, _) = logged(&mut findings, "b", &[]);
        assert_eq!(changes, Changes::default());
        assert_eq!(findings.snapshot().current["a"].len(), 1);
    }

    #[test]
    fn a_finding_missed_by_one_interval_and_found_again_never_cleared() {
        let mut findings = AgentFindings::default();
        let phase = finding("phase_dominance", 3, Severity::Critical);
        logged(&mut findings, "a", std::slice::from_ref(&phase));
        let (changes, lines) = logged(&mut findings, "a", &[]);
        assert_eq!(changes, Changes::default());
        assert!(lines.is_empty(), "{lines:?}");
        let (changes, lines) = logged(&mut findings, "a", std::slice::from_ref(&phase));
        assert_eq!(changes, Changes::default());
        assert!(lines.is_empty(), "{lines:?}");
        // The miss was forgotten: one more miss does not clear it either.
        let (changes, _) = logged(&mut findings, "a", &[]);
        assert_eq!(changes, Changes::default());
    }

    #[test]
    fn a_finding_that_clears_is_logged_once_and_a_new_severity_is_a_new_finding() {
        let mut findings = AgentFindings::default();
        logged(
            &mut findings,
            "a",
            &[
                finding("phase_dominance", 3, Severity::Warning),
                finding("top_cpu", 3, Severity::Info),
            ],
        );
        let (changes, lines) = logged(
            &mut findings,
            "a",
            &[
                finding("phase_dominance", 3, Severity::Critical),
                finding("top_cpu", 3, Severity::Info),
            ],
        );
        assert_eq!(
            changes,
            Changes {
                appeared: vec![key("phase_dominance", 3, Severity::Critical)],
                cleared: vec![key("phase_dominance", 3, Severity::Warning)],
            }
        );
        let said: Vec<(&str, &str)> = lines
            .iter()
            .map(|l| {
                (
                    l["message"].as_str().unwrap_or(""),
                    l["severity"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert_eq!(
            said,
            vec![("finding appeared", "critical"), ("finding cleared", "warning")]
        );
        assert_eq!(
            lines[1]["title"], "phase_dominance of 3",
            "logged with its last title"
        );
        assert!(lines[1].get("action").is_none());
        // Not found once: still in force, nothing said.
        let (changes, lines) = logged(&mut findings, "a", &[]);
        assert_eq!(changes, Changes::default());
        assert!(lines.is_empty(), "{lines:?}");
        assert_eq!(findings.snapshot().current["a"].len(), 2);
        // Not found twice in a row: cleared, one line each, then silence.
        let (changes, lines) = logged(&mut findings, "a", &[]);
        assert_eq!(changes.cleared.len(), 2);
        assert_eq!(lines.len(), 2);
        assert!(findings.snapshot().current["a"].is_empty());
        let (_, lines) = logged(&mut findings, "a", &[]);
        assert!(lines.is_empty(), "{lines:?}");
    }

    #[test]
    fn at_most_twenty_findings_per_instance_the_most_severe() {
        let mut found: Vec<Finding> = (0..15)
            .map(|q| finding("planning_dominated", q, Severity::Critical))
            .collect();
        found.extend((100..115).map(|q| finding("index_descents", q, Severity::Warning)));
        let mut findings = AgentFindings::default();
        let (changes, _) = logged(&mut findings, "a", &found);
        assert_eq!(changes.appeared.len(), MAX_PER_INSTANCE);
        let kept = &findings.snapshot().current["a"];
        assert_eq!(kept.len(), MAX_PER_INSTANCE);
        assert_eq!(
            kept.iter().filter(|k| k.severity == Severity::Critical).count(),
            15
        );
        // The same queryid named twice by one rule (two probed functions) is one series.
        let twice = [
            finding("function_dominance", 5, Severity::Warning),
            finding("function_dominance", 5, Severity::Warning),
        ];
        assert_eq!(bounded(&twice).len(), 1);
    }

    #[test]
    fn of_the_always_reported_kinds_three_are_kept_and_do_not_crowd_out_the_others() {
        let mut found: Vec<Finding> = (0..19)
            .map(|q| finding("phase_dominance", q, Severity::Warning))
            .collect();
        found.extend((100..105).map(|q| finding("top_cpu", q, Severity::Info)));
        found.extend((200..205).map(|q| finding("top_wait", q, Severity::Info)));
        let kept = bounded(&found);
        assert_eq!(kept.len(), MAX_PER_INSTANCE);
        assert_eq!(kept.iter().filter(|f| f.kind == "phase_dominance").count(), 19);
        assert_eq!(
            kept.last().map(|f| (f.kind, f.query_ids[0].0)),
            Some(("top_cpu", 100))
        );

        let tops: Vec<Finding> = (100..105)
            .map(|q| finding("top_cpu", q, Severity::Info))
            .chain((200..205).map(|q| finding("top_wait", q, Severity::Info)))
            .collect();
        let kept: Vec<(&str, i64)> = bounded(&tops)
            .iter()
            .map(|f| (f.kind, f.query_ids[0].0))
            .collect();
        assert_eq!(
            kept,
            vec![
                ("top_cpu", 100),
                ("top_cpu", 101),
                ("top_cpu", 102),
                ("top_wait", 200),
                ("top_wait", 201),
                ("top_wait", 202)
            ]
        );
        // Only the info ones are capped: a rule of that kind that warned would be kept.
        let mut warned = tops.clone();
        warned.insert(0, finding("top_cpu", 99, Severity::Warning));
        assert_eq!(bounded(&warned).len(), 7);
    }

    #[test]
    fn a_finding_without_a_queryid_has_an_empty_label() {
        let mut none = finding("spinlock_contention", 0, Severity::Warning);
        none.query_ids.clear();
        assert_eq!(FindingKey::of(&none).query_label(), "");
        assert_eq!(
            FindingKey::of(&finding("top_cpu", -12, Severity::Info)).query_label(),
            "-12"
        );
    }

    #[test]
    fn a_stopped_instance_takes_its_findings_with_it() {
        let mut findings = AgentFindings::default();
        logged(&mut findings, "a", &[finding("top_cpu", 1, Severity::Info)]);
        logged(&mut findings, "b", &[finding("top_cpu", 2, Severity::Info)]);
        findings.forget("a", 42);
        let snapshot = findings.snapshot();
        assert!(!snapshot.current.contains_key("a"));
        assert_eq!(snapshot.current["b"], vec![key("top_cpu", 2, Severity::Info)]);
    }

    #[test]
    fn evictions_are_counted_between_reads_and_unknown_across_a_reset() {
        let info = |dealloc| sql::PgssInfo { dealloc, max: 100 };
        assert_eq!(
            pgss_evidence(info(10), info(40), Duration::from_secs(15)),
            Some(PgssEvidence {
                evictions: 30,
                max: 100,
                seconds: 15.0
            })
        );
        assert_eq!(pgss_evidence(info(40), info(3), Duration::from_secs(15)), None);
    }
}
