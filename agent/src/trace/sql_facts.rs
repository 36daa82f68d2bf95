//! What a trace reads over SQL once the probes are detached: the texts of the queries the
//! summary names and pg_stat_statements' counters, from a database that has the extension
//! (`sql::find_pgss`), and the names of the sampled databases and the settings the findings
//! quote. Best effort: when the instance cannot be reached, one line says what is missing and
//! why.

use std::collections::{BTreeSet, HashMap};

use super::probes::ProbeResults;
use super::{Session, TraceOptions};
use crate::bpf::abi::Function;
use crate::postgres::{pgss_counters, role_settings, sql, stat_views};
use crate::redact::{self, Secret};

/// Query texts by queryid and database names by OID; empty when they could not be read.
#[derive(Debug, Default)]
pub struct SqlFacts {
    pub query_texts: HashMap<i64, String>,
    pub database_names: HashMap<u32, String>,
    /// (database OID, `pg_trigger.oid`) → the trigger label of the triggers samples ran in.
    pub trigger_names: HashMap<(u32, u32), String>,
    /// pg_stat_statements' counters at the end, when they were read at the start too.
    pub pgss_end: Option<sql::PgssInfo>,
    /// Settings and sizes the findings quote.
    pub instance: Option<sql::InstanceFacts>,
}

/// How long reading the counters at the start may take: it delays the trace.
const PGSS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

pub(super) fn connect_target(options: &TraceOptions, pid: u32) -> anyhow::Result<sql::Connect> {
    Ok(match &options.conninfo {
        Some(info) => sql::Connect::Conninfo(Secret::new(info.clone())),
        None => sql::Connect::for_process(pid)?,
    })
}

/// pg_stat_statements' counters before the trace, for the findings.
#[derive(Clone, Debug)]
pub struct PgssStart {
    pub info: sql::PgssInfo,
    /// Every statement's counters (empty where they could not be read).
    pub counters: HashMap<i64, pgss_counters::Counters>,
    /// The database its view was read in: [`fetch`] reads the counters at the end there too,
    /// without searching again.
    pub database: String,
}

/// What is read before the trace, over one connection: the instance's pg_stat_database and
/// pg_stat_io counters, and pg_stat_statements' (its eviction counter and every statement's
/// counters, for the findings) from the database that has the extension. Each is None
/// (quietly, in the debug log) where it could not be read within [`PGSS_TIMEOUT`].
#[derive(Debug, Default)]
pub struct StartSnapshot {
    pub pgss: Option<PgssStart>,
    pub views: Option<stat_views::StatViews>,
}

pub async fn start_snapshot(options: &TraceOptions, pid: u32) -> StartSnapshot {
    let mut snapshot = StartSnapshot::default();
    let read = async {
        let target = connect_target(options, pid)?;
        let client = sql::connect(&target).await?;
        match stat_views::read(&client).await {
            Ok(views) => snapshot.views = Some(views),
            Err(error) => tracing::debug!("no pg_stat_database or pg_stat_io counters: {}", shown(&error)),
        }
        match sql::find_pgss(&target, client).await? {
            sql::PgssConnection::Found { client, database } => {
                let Some(info) = sql::pgss_info(&client).await? else {
                    return Ok(());
                };
                let counters = pgss_counters::read(&client, None).await.unwrap_or_else(|error| {
                    tracing::debug!("no pg_stat_statements counters per statement: {}", shown(&error));
                    HashMap::new()
                });
                snapshot.pgss = Some(PgssStart {
                    info,
                    database,
                    counters,
                });
            }
            sql::PgssConnection::Absent { .. } => {
                tracing::debug!("no pg_stat_statements counters: the extension is created in no database")
            }
        }
        anyhow::Ok(())
    };
    match tokio::time::timeout(PGSS_TIMEOUT, read).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::debug!("no counters before the trace: {}", shown(&error)),
        Err(_) => tracing::debug!("no counters before the trace: the instance took over {PGSS_TIMEOUT:?}"),
    }
    snapshot
}

/// Connects through `--conninfo` or the socket of `pid`'s instance if the samples name a query
/// or a database, and reads what they need.
pub async fn fetch(
    options: &TraceOptions,
    pid: u32,
    session: &Session,
    probe_results: &ProbeResults,
    pgss_start: Option<&PgssStart>,
    views_start: Option<&stat_views::StatViews>,
    blockers_query_ids: &[i64],
) -> SqlFacts {
    let mut query_ids = wanted_query_ids(session, probe_results);
    // The blockers' statements: a session idle in its transaction is never sampled.
    query_ids.extend(blockers_query_ids.iter().filter(|&&q| q != 0));
    query_ids.sort_unstable();
    query_ids.dedup();
    let texts = !query_ids.is_empty();
    let databases = session
        .on_cpu()
        .is_some_and(|stacks| !stacks.database_oids().is_empty());
    // What the one line about a failed connection says is missing. The settings the findings
    // quote are read whenever there is a connection to make for anything else.
    let missing = match (texts, databases) {
        (false, false) if pgss_start.is_none() && views_start.is_none() => return SqlFacts::default(),
        (false, false) => "counters at the end (pg_stat_statements, pg_stat_database, pg_stat_io)",
        (true, true) => "query texts or database names (database labels stay OIDs)",
        (true, false) => "query texts",
        (false, true) => "database names (database labels stay OIDs)",
    };
    let target = match connect_target(options, pid) {
        Ok(target) => target,
        Err(error) => {
            note!("pgscope: no {missing}: {}", shown(&error));
            return SqlFacts::default();
        }
    };
    let client = match sql::connect(&target).await {
        Ok(client) => client,
        Err(error) => {
            note!(
                "pgscope: no {missing}: {}; pass --conninfo to name a connection",
                shown(&error)
            );
            return SqlFacts::default();
        }
    };
    let mut facts = SqlFacts::default();
    if databases {
        match sql::database_names(&client).await {
            Ok(names) => facts.database_names = names,
            Err(error) => note!(
                "pgscope: no database names (database labels stay OIDs): {}",
                shown(&error)
            ),
        }
    }
    if databases {
        facts.trigger_names = trigger_names(&target, session, &facts.database_names).await;
    }
    match sql::instance_facts(&client).await {
        Ok(mut instance) => {
            if let Some(seen) = &session.settings_seen {
                instance.plan_cache_modes_by_query = seen.plan_cache_modes();
                instance.jit_by_query = seen.jit();
                instance.sessions_by_query = seen.sessions();
                track_planning_by_session(&client, &mut instance).await;
            }
            if probe_results.attached.contains(&Function::VacUpdateDatfrozenxid) {
                catalogs_where_sampled(&target, session, &facts.database_names, &mut instance).await;
            }
            if let Some(start) = views_start {
                match stat_views::read(&client).await {
                    Ok(end) => {
                        let grown = stat_views::delta(start, &end);
                        instance.database_deltas = grown.database;
                        instance.io_deltas = grown.io;
                    }
                    Err(error) => tracing::debug!(
                        "no pg_stat_database or pg_stat_io counters at the end: {}",
                        shown(&error)
                    ),
                }
            }
            facts.instance = Some(instance);
        }
        Err(error) => tracing::debug!("no settings for the findings: {}", shown(&error)),
    }
    if !texts && pgss_start.is_none() {
        return facts;
    }
    // pg_stat_statements' entries are the instance's, but its view is only where the
    // extension was created: usually the application's database, not `postgres`. Where the
    // start found it, it is read there again.
    let known = match pgss_start {
        Some(start) => sql::connect_db(&target, Some(&start.database))
            .await
            .ok()
            .map(|client| (client, start.database.clone())),
        None => None,
    };
    let found = match known {
        Some((client, database)) => Ok(sql::PgssConnection::Found { client, database }),
        None => sql::find_pgss(&target, client).await,
    };
    let pgss = match found {
        Ok(sql::PgssConnection::Found { client, database }) => {
            tracing::debug!(database, "reading pg_stat_statements");
            client
        }
        Ok(sql::PgssConnection::Absent { loaded, searched }) => {
            note!(
                "pgscope: {}",
                sql::PgssConnection::absent_advice(loaded, searched)
            );
            return facts;
        }
        Err(error) => {
            note!("pgscope: no query texts: {}", shown(&error));
            return facts;
        }
    };
    if texts {
        match sql::query_texts(&pgss, &query_ids).await {
            Ok(texts) => {
                if let Some(instance) = &mut facts.instance {
                    instance.commands_by_query = texts
                        .iter()
                        .filter_map(|(q, text)| Some((q.to_string(), sql::command_of(text)?)))
                        .collect();
                }
                facts.query_texts = texts;
            }
            Err(error) => {
                note!(
                    "pgscope: no query texts: {}; pass --conninfo to name a connection",
                    shown(&error)
                )
            }
        }
    }
    if let (Some(start), Some(instance)) = (pgss_start, &mut facts.instance) {
        match pgss_counters::read(&pgss, Some(&query_ids)).await {
            Ok(end) => {
                instance.pgss_deltas_by_query = end
                    .iter()
                    .map(|(query_id, counters)| {
                        let delta = pgss_counters::delta(start.counters.get(query_id), counters);
                        (query_id.to_string(), delta)
                    })
                    .collect();
            }
            Err(error) => tracing::debug!(
                "no pg_stat_statements counters per statement at the end: {}",
                shown(&error)
            ),
        }
    }
    if pgss_start.is_some() {
        match sql::pgss_info(&pgss).await {
            Ok(info) => facts.pgss_end = info,
            Err(error) => note!("pgscope: no pg_stat_statements eviction count: {}", shown(&error)),
        }
    }
    facts
}

/// `pg_stat_statements.track_planning` for each (database, role) the statements' backends ran
/// as, from the catalog (`role_settings`): it is static in its library, so unlike
/// plan_cache_mode it cannot be read from their memory.
async fn track_planning_by_session(client: &tokio_postgres::Client, instance: &mut sql::InstanceFacts) {
    let sessions: BTreeSet<(u32, u32)> = instance
        .sessions_by_query
        .values()
        .flatten()
        .map(|s| (s.database, s.role))
        .collect();
    match role_settings::resolve_sessions(client, "pg_stat_statements.track_planning", &sessions).await {
        Ok(settings) => instance.track_planning_by_session = settings,
        Err(error) => tracing::debug!("no track_planning per role and database: {}", shown(&error)),
    }
}

/// Databases whose catalog is read at most: one connection each, at the end of a trace.
const MAX_CATALOG_DATABASES: usize = 8;

/// The databases each statement was sampled in, and the pg_class rows of each (the busiest
/// [`MAX_CATALOG_DATABASES`]), read in that database: what `vac_update_datfrozenxid` scans
/// is the catalog of the database VACUUM runs in.
async fn catalogs_where_sampled(
    target: &sql::Connect,
    session: &Session,
    names: &HashMap<u32, String>,
    instance: &mut sql::InstanceFacts,
) {
    let Some(stacks) = session.on_cpu() else {
        return;
    };
    let mut samples_by_database: HashMap<&str, u64> = HashMap::new();
    for (query_id, databases) in stacks.databases_by_query() {
        let mut named: Vec<(&str, u64)> = databases
            .iter()
            .filter_map(|(oid, n)| Some((names.get(oid)?.as_str(), *n)))
            .collect();
        named.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        for (name, n) in &named {
            *samples_by_database.entry(name).or_default() += n;
        }
        instance.databases_by_query.insert(
            query_id.to_string(),
            named.iter().map(|(name, _)| name.to_string()).collect(),
        );
    }
    let mut busiest: Vec<(&str, u64)> = samples_by_database.into_iter().collect();
    busiest.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    for (database, _) in busiest.into_iter().take(MAX_CATALOG_DATABASES) {
        let rows = async { sql::pg_class_rows(&sql::connect_db(target, Some(database)).await?).await };
        match rows.await {
            Ok(rows) => {
                instance.relations_by_database.insert(database.to_string(), rows);
            }
            Err(error) => tracing::debug!(database, "no pg_class size: {}", shown(&error)),
        }
    }
}

/// The names of the triggers samples ran in, read in their databases (the busiest
/// [`MAX_CATALOG_DATABASES`]; a trigger of another stays labelled by its OID).
async fn trigger_names(
    target: &sql::Connect,
    session: &Session,
    databases: &HashMap<u32, String>,
) -> HashMap<(u32, u32), String> {
    let mut names = HashMap::new();
    let Some(stacks) = session.on_cpu() else {
        return names;
    };
    for (database, oids) in stacks
        .triggers_by_database()
        .into_iter()
        .take(MAX_CATALOG_DATABASES)
    {
        let Some(name) = databases.get(&database) else {
            continue;
        };
        let oids: Vec<u32> = oids.into_iter().collect();
        let read = async { sql::trigger_names(&sql::connect_db(target, Some(name)).await?, &oids).await };
        match read.await {
            Ok(read) => names.extend(read.into_iter().map(|(oid, label)| ((database, oid), label))),
            Err(error) => note!(
                "pgscope: no trigger names in database {name} (trigger labels stay OIDs): {}",
                shown(&error)
            ),
        }
    }
    names
}

/// An error as printed, `--conninfo`'s password redacted.
fn shown(error: &anyhow::Error) -> String {
    redact::error(error)
}

/// Most query texts asked for: one query, at the end of a trace.
const MAX_TEXTS: usize = 1000;

/// The non-zero queryids the summary and the findings may show: every statement sampled on
/// and off CPU and every one the probes counted, the busiest first, at most [`MAX_TEXTS`].
fn wanted_query_ids(session: &Session, probe_results: &ProbeResults) -> Vec<i64> {
    let sampled = |stacks: Option<&crate::aggregate::StackAggregator>| {
        stacks
            .map(|s| s.query_ids())
            .unwrap_or_default()
            .into_iter()
            .map(|(q, _)| q)
    };
    let mut wanted: Vec<i64> = sampled(session.on_cpu())
        .chain(sampled(session.off_cpu()))
        .chain(
            probe_results
                .by_query()
                .iter()
                .map(|((query_id, _), _)| *query_id),
        )
        .take(MAX_TEXTS)
        .collect();
    wanted.retain(|&q| q != 0);
    wanted.sort_unstable();
    wanted.dedup();
    wanted
}
