//! Whether pgscope's sample labels agree with what Postgres itself reports: queryid labels with
//! `pg_stat_statements` (per protocol), and a traced backend's backend type, state, queryid and
//! wait event with `pg_stat_activity`. Shared by the PG 15 attribution tests and the majors
//! matrix, which run the same checks on every major.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;
use std::thread;
use std::time::Duration;

use anyhow::{ensure, Context, Result};

use crate::activity::{has_labels, label_sets, Activity, CLIENT_BACKEND};
use crate::workload::{is_md5_frame, is_numeric_frame};
use crate::{LabeledProfile, LabeledSample, PgCluster, Trace};

/// A queryid label needs this many samples before the checks insist pg_stat_statements knows
/// it: a statement still running when pgbench is stopped is never recorded there.
const MIN_SAMPLES_PER_QUERYID: u64 = 3;

/// One statement of [`SCRIPT`].
pub struct Statement {
    pub name: &'static str,
    pub sql: &'static str,
    /// A fragment of its normalised text in pg_stat_statements that the others do not have.
    pub text: &'static str,
    /// A frame only this statement's execution has on the stack.
    pub marker: fn(&str) -> bool,
}

fn is_tuplesort_frame(frame: &str) -> bool {
    frame.starts_with("tuplesort_")
}

/// Three statements that each burn a few milliseconds of CPU in disjoint code (hashing, numeric
/// arithmetic, sorting), so a sample's stack tells which one was running and its `queryid`
/// label can be checked against that. `:n` becomes a literal (`-M simple`) or a parameter
/// (`-M extended`, `-M prepared`); the structures differ, so the three have distinct queryids.
pub const SCRIPT: [Statement; 3] = [
    Statement {
        name: "md5",
        sql: "SELECT count(*) FROM generate_series(1, 20000) g WHERE md5((g + :n)::text) LIKE 'ff%';",
        text: "md5(",
        marker: is_md5_frame,
    },
    Statement {
        name: "numeric",
        sql: "SELECT sum(g::numeric * 1.0000001 / 3.3) FROM generate_series(1, 20000) g WHERE g > :n;",
        text: "::numeric",
        marker: is_numeric_frame,
    },
    Statement {
        name: "sort",
        sql: "SELECT max(x) FROM (SELECT g * :n AS x FROM generate_series(1, 20000) g ORDER BY g DESC) s;",
        text: "ORDER BY",
        marker: is_tuplesort_frame,
    },
];

/// How one trace of pgbench running [`SCRIPT`] is taken.
#[derive(Clone, Copy, Debug)]
pub struct QueryidRun {
    pub trace_secs: u64,
    pub frequency: u32,
}

/// What the runs of [`QueryidRun::measure`] found, one entry per protocol.
#[derive(Debug, Default)]
pub struct QueryidAgreement {
    /// Per protocol, the pg_stat_statements queryids of [`SCRIPT`]'s statements, in order.
    pub queryids: BTreeMap<String, Vec<String>>,
    /// Samples executing one of [`SCRIPT`]'s statements, over every protocol.
    pub executing: u64,
    /// Of those, the samples whose queryid label is that statement's.
    pub agreeing: u64,
}

impl QueryidAgreement {
    /// `queryid_agree_pct`: of the client-backend samples taken while one of [`SCRIPT`]'s
    /// statements was executing (a frame only that statement runs is on the stack, and the
    /// sample's `phase` label is `run`), over every protocol measured, the percentage whose
    /// `queryid` label equals the queryid pg_stat_statements recorded for that statement under
    /// that protocol (its one row whose normalised text contains the statement's fragment).
    /// `None` without such samples.
    pub fn pct(&self) -> Option<f64> {
        (self.executing > 0).then(|| 100.0 * self.agreeing as f64 / self.executing as f64)
    }
}

impl QueryidRun {
    /// For each of `protocols` (pgbench's `-M`): resets pg_stat_statements, runs [`SCRIPT`]
    /// with pgbench (2 clients) while `pgscope trace --instance` records it, stops pgbench and
    /// checks the queryid labels against the rows pg_stat_statements recorded meanwhile (see
    /// [`check_queryids`]). Counts the agreement of every protocol it got to before an error;
    /// the error, if any, is the second element.
    pub fn measure(&self, cluster: &PgCluster, protocols: &[&str]) -> (QueryidAgreement, Result<()>) {
        let mut agreement = QueryidAgreement::default();
        let result = self.measure_into(cluster, protocols, &mut agreement);
        (agreement, result)
    }

    fn measure_into(
        &self,
        cluster: &PgCluster,
        protocols: &[&str],
        agreement: &mut QueryidAgreement,
    ) -> Result<()> {
        let dir = tempfile::tempdir()?;
        let script = write_script(dir.path())?;
        let script = script.to_str().context("temp dir path is not UTF-8")?;
        for &protocol in protocols {
            cluster.psql("SELECT pg_stat_statements_reset()")?;
            let pprof = dir.path().join(format!("{protocol}.pb.gz"));
            // -n: no vacuum of pgbench's own tables, which may not exist.
            let mut pgbench =
                cluster.spawn_pgbench(&["-n", "-M", protocol, "-f", script, "-c", "2", "-T", "300"], 2)?;
            Trace::instance(cluster.data_dir())
                .duration_secs(self.trace_secs)
                .frequency(self.frequency)
                .pprof(&pprof)
                .run()?;
            ensure!(pgbench.is_running()?, "pgbench ended during the trace");
            pgbench.stop()?;

            let statements = pg_stat_statements(cluster)?;
            let profile = LabeledProfile::read_pprof(&pprof)?;
            let (executing, agreeing) = executing_agreement(&profile, &statements);
            agreement.executing += executing;
            agreement.agreeing += agreeing;
            let ids = check_queryids(protocol, self, &profile, &statements)?;
            agreement.queryids.insert(protocol.to_owned(), ids);
        }
        Ok(())
    }
}

/// Writes [`SCRIPT`] as a pgbench script into `dir`.
fn write_script(dir: &Path) -> Result<std::path::PathBuf> {
    let path = dir.join("burn.sql");
    let mut text = String::from("\\set n random(1, 1000)\n");
    for statement in &SCRIPT {
        text.push_str(statement.sql);
        text.push('\n');
    }
    fs::write(&path, text).with_context(|| format!("cannot write `{}`", path.display()))?;
    Ok(path)
}

/// `queryid → query` of every top-level pg_stat_statements row.
pub fn pg_stat_statements(cluster: &PgCluster) -> Result<BTreeMap<String, String>> {
    let out = cluster.psql(
        "SELECT queryid, regexp_replace(query, '\\s+', ' ', 'g') FROM pg_stat_statements WHERE toplevel",
    )?;
    out.lines()
        .map(|line| {
            let (id, query) = line
                .split_once('|')
                .with_context(|| format!("unexpected pg_stat_statements row `{line}`"))?;
            Ok((id.to_owned(), query.to_owned()))
        })
        .collect()
}

/// The queryid of the one pg_stat_statements row whose text contains `fragment`.
pub fn queryid_of(statements: &BTreeMap<String, String>, fragment: &str) -> Result<String> {
    let matching: Vec<&String> = statements
        .iter()
        .filter(|(_, query)| query.contains(fragment))
        .map(|(id, _)| id)
        .collect();
    ensure!(
        matching.len() == 1,
        "{} pg_stat_statements rows contain `{fragment}`: {statements:#?}",
        matching.len()
    );
    Ok(matching[0].clone())
}

/// A backend leaving (pgscope's own connection for pg_stat_statements, closed as sampling
/// starts, runs OpenSSL's exit handlers) runs no statement: it has no queryid to carry.
fn exiting(s: &LabeledSample) -> bool {
    s.any_frame(|f| f == "proc_exit" || f == "exit")
}

fn in_client(s: &LabeledSample) -> bool {
    s.label("backend_type") == Some(CLIENT_BACKEND) && !exiting(s)
}

/// A client-backend sample with a status entry (see [`check_queryids`]).
fn client(s: &LabeledSample) -> bool {
    in_client(s) && s.label("state").is_some()
}

/// (samples executing a [`SCRIPT`] statement, those carrying its queryid): the terms of
/// [`QueryidAgreement::pct`]. A statement pg_stat_statements has no single row for counts all
/// its executing samples as disagreeing.
fn executing_agreement(profile: &LabeledProfile, statements: &BTreeMap<String, String>) -> (u64, u64) {
    let (mut executing, mut agreeing) = (0, 0);
    for statement in &SCRIPT {
        let running =
            |s: &LabeledSample| client(s) && s.any_frame(statement.marker) && s.label("phase") == Some("run");
        executing += profile.count_where(running);
        if let Ok(id) = queryid_of(statements, statement.text) {
            agreeing += profile.count_where(|s| running(s) && s.label("queryid") == Some(id.as_str()));
        }
    }
    (executing, agreeing)
}

/// Checks the queryid labels of one pgbench run of [`SCRIPT`] against the pg_stat_statements
/// rows it left (`statements`); returns the queryids of the script's statements.
pub fn check_queryids(
    protocol: &str,
    run: &QueryidRun,
    profile: &LabeledProfile,
    statements: &BTreeMap<String, String>,
) -> Result<Vec<String>> {
    // A backend without a status entry has no queryid either: MyBEEntry is NULL until
    // pgstat_beinit at start and again after pgstat_beshutdown_hook at exit, so such a sample
    // has no state (late in exit its stack may not even unwind, so `exiting` cannot see it).
    // Those moments are short: a status read that failed for running backends would leave many
    // samples without a state, which the check below refuses.
    let without_status = profile.count_where(|s| in_client(s) && s.label("state").is_none());
    ensure!(
        without_status * 100 <= profile.count_where(in_client),
        "{without_status} of {} client-backend samples have no status entry (no state label):\n{}",
        profile.count_where(in_client),
        profile.examples_where(|s| in_client(s) && s.label("state").is_none(), 5)
    );
    let by_queryid = profile.label_values("queryid", client);
    let mut rows: Vec<(&Option<String>, &u64)> = by_queryid.iter().collect();
    rows.sort_by_key(|(_, n)| std::cmp::Reverse(**n));
    eprintln!("-- {protocol} protocol: client-backend samples per queryid label");
    eprintln!("{:>21} {:>7}  query", "queryid", "samples");
    for (id, n) in &rows {
        let query = match id.as_deref() {
            None => "(no queryid label)",
            Some("0") => "(not computed)",
            Some(id) => statements
                .get(id)
                .map_or("(not in pg_stat_statements)", String::as_str),
        };
        eprintln!("{:>21} {n:>7}  {query}", id.as_deref().unwrap_or("-"));
    }

    let QueryidRun {
        trace_secs,
        frequency,
    } = run;
    ensure!(
        profile.count_where(client) >= 200,
        "only {} client-backend samples in the {protocol} run (2 busy clients, {trace_secs} s at {frequency} Hz)",
        profile.count_where(client)
    );
    let unlabelled = by_queryid.get(&None).copied().unwrap_or(0);
    ensure!(
        unlabelled == 0,
        "{unlabelled} client-backend samples have no queryid label:\n{}",
        profile.examples_where(|s| client(s) && s.label("queryid").is_none(), 5)
    );
    let unknown: Vec<(&str, u64)> = by_queryid
        .iter()
        .filter_map(|(id, &n)| Some((id.as_deref()?, n)))
        .filter(|&(id, n)| id != "0" && n >= MIN_SAMPLES_PER_QUERYID && !statements.contains_key(id))
        .collect();
    ensure!(
        unknown.is_empty(),
        "{protocol}: queryid labels (queryid, samples) {unknown:?} are not in pg_stat_statements {statements:#?}"
    );

    let mut ids = Vec::new();
    for statement in &SCRIPT {
        let id = queryid_of(statements, statement.text).with_context(|| format!("{protocol} protocol"))?;
        let name = statement.name;
        let own = |s: &LabeledSample| client(s) && s.label("queryid") == Some(id.as_str());
        let marked = |s: &LabeledSample| client(s) && s.any_frame(statement.marker);
        let labelled = profile.count_where(own);
        let labelled_marked = profile.count_where(|s| own(s) && marked(s));
        eprintln!(
            "{protocol}: {name} (queryid {id}): {labelled} samples, {labelled_marked} with its own functions"
        );
        ensure!(
            labelled >= 20,
            "{protocol}: only {labelled} samples carry the {name} statement's queryid {id}; \
             samples with its functions:\n{}",
            profile.examples_where(marked, 5)
        );
        // In the executor, its functions run only after ExecutorStart reported its queryid, and
        // the next statement resets it only when it starts: any other label there is a stale or
        // wrong read. (Parsing may call e.g. `numeric_in` while the queryid is still 0.)
        let executing = |s: &LabeledSample| marked(s) && s.label("phase") == Some("run");
        let mislabelled = profile.count_where(|s| executing(s) && !own(s));
        ensure!(
            mislabelled == 0,
            "{protocol}: {mislabelled} samples running the {name} statement carry another queryid than {id}:\n{}",
            profile.examples_where(|s| executing(s) && !own(s), 5)
        );
        // And the converse: samples with its queryid mostly run its functions.
        ensure!(
            labelled_marked * 10 >= labelled * 3,
            "{protocol}: only {labelled_marked} of the {labelled} samples with the {name} statement's \
             queryid {id} run its functions:\n{}",
            profile.examples_where(own, 5)
        );
        ids.push(id);
    }
    Ok(ids)
}

/// Runs `work` (a trace) while reading the `pg_stat_activity` rows that satisfy `condition`
/// over and over; returns what `work` returned and every distinct row seen.
pub fn reading_activity<T: Send>(
    cluster: &PgCluster,
    condition: &str,
    work: impl FnOnce() -> Result<T> + Send,
) -> Result<(T, BTreeSet<Activity>)> {
    thread::scope(|scope| {
        let working = scope.spawn(work);
        let mut seen = BTreeSet::new();
        while !working.is_finished() {
            seen.extend(Activity::read(cluster, condition)?);
            thread::sleep(Duration::from_millis(100));
        }
        let value = working.join().expect("the trace thread panicked")?;
        Ok((value, seen))
    })
}

/// How a traced backend's samples compare with its `pg_stat_activity` row.
#[derive(Debug)]
pub struct BackendAgreement {
    pub total: u64,
    /// Samples carrying exactly the row's backend type, database, state and queryid, and no
    /// wait event.
    pub agreeing: u64,
}

/// Checks the samples of backend `pid`, busy on CPU running one query for the whole trace,
/// against the `pg_stat_activity` rows read meanwhile (`seen`): one row, active, with a
/// queryid and no wait event; 90% of its samples must carry that backend type, database,
/// state and queryid, and no wait event (the rest may be caught between reads of the status
/// entry's fields). Every sample must be the backend's.
pub fn check_busy_backend(
    profile: &LabeledProfile,
    pid: u32,
    seen: &BTreeSet<Activity>,
) -> Result<BackendAgreement> {
    ensure!(
        seen.len() == 1,
        "pg_stat_activity changed for backend {pid} during the trace: {seen:#?}"
    );
    let activity = seen.iter().next().expect("one row");
    eprintln!("pg_stat_activity of the session: {activity:?}");
    ensure!(
        activity.state.as_deref() == Some("active")
            && activity.query_id.is_some()
            && activity.wait_event.is_none(),
        "the session is not running its query on CPU with a queryid: {activity:?}"
    );
    let total = profile.total();
    ensure!(total >= 200, "only {total} samples of the busy backend {pid}");
    let foreign = profile.count_where(|s| s.pid() != Some(pid));
    ensure!(
        foreign == 0,
        "{foreign} samples of `--pid {pid}` carry another pid:\n{}",
        profile.examples_where(|s| s.pid() != Some(pid), 5)
    );
    let mut expected = activity.expected_labels();
    expected.insert("wait_event", None);
    let agreeing = profile.count_where(|s| has_labels(s, &expected));
    eprintln!(
        "backend {pid}: {agreeing} of {total} samples carry {expected:?}; label sets: {}",
        label_sets(
            profile,
            pid,
            &["backend_type", "database", "state", "queryid", "wait_event"]
        )
    );
    ensure!(
        agreeing * 10 >= total * 9,
        "only {agreeing} of {total} samples of backend {pid} carry {expected:?}:\n{}",
        profile.examples_where(|s| !has_labels(s, &expected), 5)
    );
    Ok(BackendAgreement { total, agreeing })
}
