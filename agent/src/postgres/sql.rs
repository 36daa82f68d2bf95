//! Facts only SQL can give, read at the end of a trace over one connection: the normalized query
//! texts of pg_stat_statements and the names of the databases. By default pgscope connects through the instance's own Unix socket (its
//! directory and port are in `postmaster.pid`) as the OS user that owns the data directory, so
//! that peer authentication works as it does for `sudo -u postgres psql`; `--conninfo` says
//! otherwise. Texts are normalized by Postgres (`$1` for constants): parameters never leave the
//! server.

use super::attribution::trigger_label;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use tokio_postgres::{Client, Config, NoTls};

use crate::redact::{self, Secret};

/// How to reach the instance.
#[derive(Clone, Debug)]
pub enum Connect {
    /// A libpq-style connection string from `--conninfo`: it may hold a password, so it is
    /// only ever shown redacted.
    Conninfo(Secret),
    /// The instance's Unix socket, as the data directory's owner.
    Socket {
        dir: PathBuf,
        port: u16,
        owner_uid: u32,
        user: String,
    },
}

impl Connect {
    /// Reads socket directory and port from the `postmaster.pid` of `pid`'s data directory
    /// (every Postgres process has the data directory as working directory).
    pub fn for_process(pid: u32) -> Result<Self> {
        let data_dir = PathBuf::from(format!("/proc/{pid}/cwd"));
        let pid_file = super::read_pid_file(pid)
            .with_context(|| format!("reading postmaster.pid in the data directory of PID {pid}"))?;
        let lines: Vec<&str> = pid_file.lines().collect();
        let port = lines
            .get(3)
            .and_then(|l| l.trim().parse().ok())
            .context("postmaster.pid has no port")?;
        let socket = lines.get(4).map(|l| l.trim()).filter(|l| !l.is_empty());
        let Some(socket) = socket else {
            bail!(
                "the instance listens on no Unix socket (unix_socket_directories is empty): pass --conninfo"
            );
        };
        // A socket path is inside the process's mount namespace: reach it through
        // /proc/PID/root only when that is not ours (a container), since that path needs ptrace
        // rights the connection, made as the data directory's owner, does not have.
        let same_namespace = fs::read_link(format!("/proc/{pid}/ns/mnt"))
            .ok()
            .is_some_and(|theirs| {
                fs::read_link("/proc/self/ns/mnt")
                    .ok()
                    .is_some_and(|ours| ours == theirs)
            });
        let dir = if same_namespace {
            PathBuf::from(socket)
        } else {
            Path::new(&format!("/proc/{pid}/root")).join(socket.trim_start_matches('/'))
        };
        let owner_uid = fs::metadata(&data_dir)
            .with_context(|| format!("reading the data directory of PID {pid}"))?
            .uid();
        let user = user_name(owner_uid).unwrap_or_else(|| "postgres".to_string());
        Ok(Connect::Socket {
            dir,
            port,
            owner_uid,
            user,
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Connect::Conninfo(info) => format!("--conninfo `{}`", redact::text(info.expose())),
            Connect::Socket { dir, port, user, .. } => {
                format!("the socket in `{}` (port {port}) as `{user}`", dir.display())
            }
        }
    }
}

/// The name of OS user `uid`, from /etc/passwd.
fn user_name(uid: u32) -> Option<String> {
    user_name_in(&fs::read_to_string("/etc/passwd").ok()?, uid)
}

/// The name of `uid` in the text of a passwd file (`name:x:uid:gid:…`).
pub(crate) fn user_name_in(passwd: &str, uid: u32) -> Option<String> {
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let id: u32 = fields.nth(1)?.parse().ok()?;
        (id == uid).then(|| name.to_string())
    })
}

/// Connects over the instance's socket `dir/.s.PGSQL.port` as OS user `uid`: peer
/// authentication reads the credentials the connecting thread had when it called connect(2)
/// (SO_PEERCRED), and only then. The socket is connected by a thread of its own that takes the
/// uid for itself alone (the raw setresuid system call: glibc's wrapper would switch every
/// thread of pgscope, and did — the wait sampler's thread lost its real-time priority and the
/// collection loop its reads of /proc/PID/mem while a connection was being made), and ends
/// with it; the connection is then used as root like any other. The runtime's thread awaits
/// the connector rather than joining it: connect(2) on a Unix socket blocks while the server's
/// listen queue is full, and the collection loop runs on that thread.
async fn connect_as(config: &Config, dir: &Path, port: u16, uid: u32) -> Result<Client> {
    let path = dir.join(format!(".s.PGSQL.{port}"));
    let (sender, connected) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("pgscope-connect".into())
        .spawn(move || {
            let _ = sender.send(connect_socket_as(&path, uid));
        })
        .context("starting the thread that connects as the data directory's owner")?;
    let stream = connected
        .await
        .map_err(|_| anyhow!("the thread that connects as the data directory's owner ended early"))??;
    stream
        .set_nonblocking(true)
        .context("making the socket non-blocking")?;
    let stream = tokio::net::UnixStream::from_std(stream).context("registering the socket")?;
    let (client, connection) = config.connect_raw(stream, NoTls).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!("connection to Postgres ended: {error}");
        }
    });
    Ok(client)
}

/// Connects to the Unix socket `path` with this thread's effective uid set to `uid`. Called on
/// a thread that ends right after: its credentials are never restored, nor need to be.
fn connect_socket_as(path: &Path, uid: u32) -> Result<std::os::unix::net::UnixStream> {
    const UNCHANGED: libc::c_long = -1;
    // SAFETY: setresuid with the real and saved ids unchanged alters only this thread's
    // credentials (the raw system call, not glibc's process-wide wrapper); this thread does
    // nothing else but connect and end.
    let rc = unsafe { libc::syscall(libc::SYS_setresuid, UNCHANGED, libc::c_long::from(uid), UNCHANGED) };
    if rc != 0 {
        return Err(anyhow!(std::io::Error::last_os_error()).context(format!("switching to uid {uid}")));
    }
    std::os::unix::net::UnixStream::connect(path)
        .with_context(|| format!("connecting to `{}`", path.display()))
}

/// A connection to the instance: to database `postgres` over its socket, or to the database
/// `--conninfo` names.
pub async fn connect(target: &Connect) -> Result<Client> {
    connect_db(target, None).await
}

/// A connection to database `dbname` of the instance (None: [`connect`]'s), with the same
/// credentials.
pub async fn connect_db(target: &Connect, dbname: Option<&str>) -> Result<Client> {
    connect_to(target, dbname).await.with_context(|| match dbname {
        Some(name) => format!("connecting to database `{name}` through {}", target.describe()),
        None => format!("connecting through {}", target.describe()),
    })
}

/// A connection whose own statements Postgres does not identify (`compute_query_id = off`, a
/// startup option only a superuser may give): pg_stat_statements does not count them, and
/// their samples carry no queryid, so that a connection pgscope keeps polling over leaves no
/// statement in the users' view or in pgscope's own findings. Where the option is refused (a
/// role that is not a superuser), an ordinary connection.
pub async fn connect_untracked(target: &Connect) -> Result<Client> {
    match connect_with(target, None, Some(UNTRACKED)).await {
        Ok(client) => Ok(client),
        Err(error) => {
            tracing::debug!("connecting without compute_query_id = off: {error:#}");
            connect(target).await
        }
    }
}

/// The startup option of [`connect_untracked`].
const UNTRACKED: &str = "-c compute_query_id=off";

async fn connect_to(target: &Connect, dbname: Option<&str>) -> Result<Client> {
    connect_with(target, dbname, None).await
}

async fn connect_with(target: &Connect, dbname: Option<&str>, options: Option<&str>) -> Result<Client> {
    match target {
        Connect::Conninfo(info) => {
            let mut config: Config = info.expose().parse().context("parsing --conninfo")?;
            if let Some(name) = dbname {
                config.dbname(name);
            }
            if let Some(options) = options {
                // After the user's own options, not instead of them.
                let combined = match config.get_options() {
                    Some(theirs) if !theirs.is_empty() => format!("{theirs} {options}"),
                    _ => options.to_string(),
                };
                config.options(&combined);
            }
            let (client, connection) = config.connect(NoTls).await?;
            tokio::spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!("connection to Postgres ended: {error}");
                }
            });
            Ok(client)
        }
        Connect::Socket {
            dir,
            port,
            owner_uid,
            user,
        } => {
            // The OS user's own role first (peer authentication maps it), then the usual
            // superuser role, for clusters initialized with `initdb -U postgres` by another user.
            let mut last_error = None;
            for role in [user.as_str(), "postgres"] {
                let mut config = Config::new();
                config
                    .host_path(dir)
                    .port(*port)
                    .user(role)
                    .dbname(dbname.unwrap_or("postgres"))
                    .application_name("pgscope");
                if let Some(options) = options {
                    config.options(options);
                }
                match connect_as(&config, dir, *port, *owner_uid).await {
                    Ok(client) => return Ok(client),
                    Err(error) => last_error = Some(error),
                }
                if user == "postgres" {
                    break;
                }
            }
            Err(last_error.unwrap_or_else(|| anyhow!("no role to connect as")))
        }
    }
}

/// Most databases searched for pg_stat_statements: one connection each, at the end of a trace.
pub const PGSS_SEARCH_MAX_DATABASES: usize = 64;

/// Where pg_stat_statements can be read. Its entries are the whole instance's, but its view
/// exists only in the databases where `CREATE EXTENSION pg_stat_statements` was run — usually
/// the application's, not `postgres`.
pub enum PgssConnection {
    /// A connection to a database that has the view.
    Found { client: Client, database: String },
    /// No database has it (of the first [`PGSS_SEARCH_MAX_DATABASES`] searched).
    Absent {
        /// Whether the library is loaded (`shared_preload_libraries`): then creating the
        /// extension in any database is all it takes.
        loaded: bool,
        searched: usize,
    },
}

impl PgssConnection {
    /// The one line a trace prints when there is no view to read.
    pub fn absent_advice(loaded: bool, searched: usize) -> String {
        let scope = if searched >= PGSS_SEARCH_MAX_DATABASES {
            format!("in the first {searched} databases")
        } else {
            "in any database of this instance".to_string()
        };
        if loaded {
            format!(
                "pg_stat_statements is loaded but not created {scope}: no query texts or eviction \
                 counts; `CREATE EXTENSION pg_stat_statements;` in any one database adds them"
            )
        } else {
            format!(
                "pg_stat_statements is not loaded (shared_preload_libraries) nor created {scope}: no \
                 query texts or eviction counts, and no queryids unless compute_query_id is on"
            )
        }
    }
}

/// Whether the connected database has pg_stat_statements' view.
async fn has_pgss(client: &Client) -> Result<bool> {
    client
        .query_one("SELECT to_regclass('pg_stat_statements') IS NOT NULL", &[])
        .await
        .context("looking for pg_stat_statements")?
        .try_get(0)
        .context("looking for pg_stat_statements")
}

/// A connection to a database where pg_stat_statements' view exists: `client`'s own database
/// if it has it, else the first other one that does, in name order (templates and databases
/// that refuse connections left out).
pub async fn find_pgss(target: &Connect, client: Client) -> Result<PgssConnection> {
    let here: String = client
        .query_one("SELECT current_database()::text", &[])
        .await
        .context("reading current_database()")?
        .try_get(0)
        .context("current_database()")?;
    if has_pgss(&client).await? {
        return Ok(PgssConnection::Found {
            client,
            database: here,
        });
    }
    let loaded: String = client
        .query_one("SELECT current_setting('shared_preload_libraries')", &[])
        .await
        .context("reading shared_preload_libraries")?
        .try_get(0)
        .context("shared_preload_libraries")?;
    let loaded = loaded
        .split(',')
        .any(|l| l.trim().trim_matches('"') == "pg_stat_statements");
    let others: Vec<String> = client
        .query(
            "SELECT datname::text FROM pg_database \
             WHERE datallowconn AND NOT datistemplate AND datname <> current_database() \
             ORDER BY datname",
            &[],
        )
        .await
        .context("listing the databases")?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()
        .context("pg_database.datname")?;
    drop(client);
    let mut searched = 1;
    for database in others.into_iter().take(PGSS_SEARCH_MAX_DATABASES - 1) {
        searched += 1;
        // A database this role may not connect to is not an error: the next one may do.
        let Ok(other) = connect_db(target, Some(&database)).await else {
            tracing::debug!(database, "cannot connect to look for pg_stat_statements");
            continue;
        };
        if has_pgss(&other).await? {
            return Ok(PgssConnection::Found {
                client: other,
                database,
            });
        }
    }
    Ok(PgssConnection::Absent { loaded, searched })
}

/// Normalized texts of `query_ids` from pg_stat_statements (those it still holds).
pub async fn query_texts(client: &Client, query_ids: &[i64]) -> Result<HashMap<i64, String>> {
    let rows = client
        .query(
            "SELECT queryid, query FROM pg_stat_statements WHERE queryid = ANY($1)",
            &[&query_ids],
        )
        .await
        .context("reading pg_stat_statements")?;
    let mut texts = HashMap::new();
    for row in rows {
        let query_id: i64 = row.try_get(0)?;
        let text: String = row.try_get(1)?;
        texts.insert(query_id, text);
    }
    Ok(texts)
}

/// pg_stat_statements' eviction counter and capacity, at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PgssInfo {
    /// `pg_stat_statements_info.dealloc`: times entries were evicted to make room.
    pub dealloc: i64,
    /// `pg_stat_statements.max`.
    pub max: i64,
}

/// pg_stat_statements' counters (PG14+); None where the extension is not created in the
/// connected database (see [`find_pgss`]). Asked first whether its view exists, so that an
/// instance without it does not log an error for every try.
pub async fn pgss_info(client: &Client) -> Result<Option<PgssInfo>> {
    let created: bool = client
        .query_one("SELECT to_regclass('pg_stat_statements_info') IS NOT NULL", &[])
        .await
        .context("looking for pg_stat_statements_info")?
        .try_get(0)
        .context("looking for pg_stat_statements_info")?;
    if !created {
        return Ok(None);
    }
    let row = client
        .query_one(
            "SELECT dealloc, current_setting('pg_stat_statements.max')::bigint FROM pg_stat_statements_info",
            &[],
        )
        .await
        .context("reading pg_stat_statements_info")?;
    Ok(Some(PgssInfo {
        dealloc: row.try_get(0).context("pg_stat_statements_info.dealloc")?,
        max: row.try_get(1).context("pg_stat_statements.max")?,
    }))
}

/// `pg_database.datname` by OID, as `pg_stat_activity.datname` shows it (pg_database is shared
/// by all databases, so any connection sees every one).
/// The rows of pg_class in the database `client` is connected to.
pub async fn pg_class_rows(client: &Client) -> Result<i64> {
    client
        .query_one("SELECT count(*) FROM pg_class", &[])
        .await
        .context("counting pg_class rows")?
        .try_get(0)
        .context("count(*)")
}

pub async fn database_names(client: &Client) -> Result<HashMap<u32, String>> {
    let rows = client
        .query("SELECT oid, datname::text FROM pg_database", &[])
        .await
        .context("reading pg_database")?;
    let mut names = HashMap::new();
    for row in rows {
        let oid: u32 = row.try_get(0).context("pg_database.oid")?;
        let name: String = row.try_get(1).context("pg_database.datname")?;
        names.insert(oid, name);
    }
    Ok(names)
}

/// The trigger labels of `oids` (`pg_trigger.oid`), read in the database they belong to:
/// a constraint's trigger by its constraint's name ([`trigger_label`]).
pub async fn trigger_names(client: &Client, oids: &[u32]) -> Result<HashMap<u32, String>> {
    let rows = client
        .query(
            "SELECT t.oid, t.tgname::text, c.conname::text FROM pg_trigger t \
             LEFT JOIN pg_constraint c ON c.oid = t.tgconstraint WHERE t.oid = ANY($1)",
            &[&oids],
        )
        .await
        .context("reading pg_trigger")?;
    let mut names = HashMap::new();
    for row in rows {
        let oid: u32 = row.try_get(0).context("pg_trigger.oid")?;
        let trigger: String = row.try_get(1).context("pg_trigger.tgname")?;
        let constraint: Option<String> = row.try_get(2).context("pg_constraint.conname")?;
        names.insert(oid, trigger_label(&trigger, constraint.as_deref()));
    }
    Ok(names)
}

/// The samples of a statement taken in backends of one session kind: database `database`
/// (`MyDatabaseId`) and role `role` (the session user, `PgBackendStatus.st_userid`), OIDs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SessionSamples {
    pub database: u32,
    pub role: u32,
    pub samples: u64,
}

/// A setting as sessions of database `database` and role `role` start with it, resolved from
/// the catalog (`postgres::role_settings`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SessionSetting {
    pub database: u32,
    pub role: u32,
    /// None where it could not be known (the server-wide value was hidden, see
    /// `role_settings`).
    pub value: Option<bool>,
    /// Where the value comes from, as a finding quotes it: `ALTER ROLE app SET`,
    /// `server setting`.
    pub source: String,
}

/// Settings and sizes the findings explain their numbers with: as pgscope's own session sees
/// them, and, where they were read, as each observed backend runs them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct InstanceFacts {
    /// `plan_cache_mode` of pgscope's session: auto, force_generic_plan or force_custom_plan.
    pub plan_cache_mode: String,
    /// `plan_cache_mode` as the backends running each statement had it: samples per mode, by
    /// queryid (`collect::settings_seen`); empty where it could not be read.
    #[serde(default)]
    pub plan_cache_modes_by_query: BTreeMap<String, BTreeMap<String, u64>>,
    /// `jit` as the backends running each statement had it: samples per value (`on`/`off`),
    /// by queryid (`collect::settings_seen`).
    #[serde(default)]
    pub jit_by_query: BTreeMap<String, BTreeMap<String, u64>>,
    /// `pg_stat_statements.track_planning` of pgscope's own session, where the extension is
    /// loaded: quoted only where the statement's backends' sessions were not read.
    pub track_planning: Option<bool>,
    /// The (database, role) each statement's backends ran as, with their samples, by queryid.
    #[serde(default)]
    pub sessions_by_query: BTreeMap<String, Vec<SessionSamples>>,
    /// `pg_stat_statements.track_planning` as each (database, role) of `sessions_by_query`
    /// starts with it: the variable is static in its library, so it is resolved from
    /// pg_db_role_setting and the server's value rather than read from memory.
    #[serde(default)]
    pub track_planning_by_session: Vec<SessionSetting>,
    /// The connected database's name and its pg_class rows, which every VACUUM command's
    /// vac_update_datfrozenxid scans.
    pub database: String,
    pub relations: i64,
    /// pg_class rows of each database statements were sampled in, read there: a catalog is
    /// per database, and the statements' is rarely pgscope's.
    #[serde(default)]
    pub relations_by_database: BTreeMap<String, i64>,
    /// The databases each statement was sampled in, by queryid, most samples first.
    #[serde(default)]
    pub databases_by_query: BTreeMap<String, Vec<String>>,
    /// What each statement's pg_stat_statements counters grew by over the trace (every
    /// additive column the installed version has: `calls`, `plans`, `rows`, `shared_blks_read`,
    /// `temp_blks_written`, `wal_bytes`, `jit_functions`, …), by queryid, for the statements
    /// the summary names (`postgres::pgss_counters`).
    #[serde(default)]
    pub pgss_deltas_by_query: BTreeMap<String, BTreeMap<String, f64>>,
    /// What `pg_stat_database`'s counters grew by over the trace, by database, the databases
    /// whose counters did not move left out (`postgres::stat_views`).
    #[serde(default)]
    pub database_deltas: BTreeMap<String, BTreeMap<String, f64>>,
    /// The same of `pg_stat_io` (PostgreSQL 16+), by `backend type/object/context`.
    #[serde(default)]
    pub io_deltas: BTreeMap<String, BTreeMap<String, f64>>,
    /// Each statement's command (the first word of its normalized text, upper case: `SELECT`,
    /// `VACUUM`), by queryid, where pg_stat_statements had its text: the shape findings are
    /// grouped by.
    #[serde(default)]
    pub commands_by_query: BTreeMap<String, String>,
}

/// `SELECT` for `select abalance from …`, `WITH` for a common table expression: the command a
/// statement's text begins with (comments and parentheses skipped); None for an empty text.
pub fn command_of(text: &str) -> Option<String> {
    let mut rest = text.trim_start();
    loop {
        if let Some(after) = rest.strip_prefix("--") {
            rest = after.split_once('\n').map_or("", |(_, r)| r).trim_start();
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.split_once("*/").map_or("", |(_, r)| r).trim_start();
        } else if let Some(after) = rest.strip_prefix('(') {
            rest = after.trim_start();
        } else {
            break;
        }
    }
    let word: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphabetic() || *c == '_')
        .collect();
    (!word.is_empty()).then(|| word.to_ascii_uppercase())
}

pub async fn instance_facts(client: &Client) -> Result<InstanceFacts> {
    let row = client
        .query_one(
            "SELECT current_setting('plan_cache_mode'), \
                    current_setting('pg_stat_statements.track_planning', true), \
                    current_database()::text, \
                    (SELECT count(*) FROM pg_class)",
            &[],
        )
        .await
        .context("reading plan_cache_mode, track_planning and the size of pg_class")?;
    let track_planning: Option<String> = row.try_get(1).context("pg_stat_statements.track_planning")?;
    Ok(InstanceFacts {
        plan_cache_mode: row.try_get(0).context("plan_cache_mode")?,
        track_planning: track_planning.map(|v| v == "on"),
        database: row.try_get(2).context("current_database()")?,
        relations: row.try_get(3).context("count(*) FROM pg_class")?,
        ..InstanceFacts::default()
    })
}

#[cfg(test)]
mod command_tests {
    use super::command_of;

    #[test]
    fn the_command_is_the_first_word_past_comments_and_parentheses() {
        assert_eq!(command_of("select 1").as_deref(), Some("SELECT"));
        assert_eq!(command_of("  VACUUM t1").as_deref(), Some("VACUUM"));
        assert_eq!(
            command_of("/* app */ -- x\n (SELECT 1) UNION SELECT 2").as_deref(),
            Some("SELECT")
        );
        assert_eq!(
            command_of("with a as (select 1) select * from a").as_deref(),
            Some("WITH")
        );
        assert_eq!(command_of("  ").as_deref(), None);
        assert_eq!(command_of("/* never closed").as_deref(), None);
    }
}
