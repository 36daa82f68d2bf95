//! A throw-away Postgres cluster: its own temp dir, port and socket, stopped and removed on drop.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use tempfile::TempDir;

use crate::initdb_template;
use crate::install::PgInstall;
use crate::process::{children_of, output_with_timeout, run_checked, wait_for};
use crate::system::{chown, ensure_test_user, ClusterLock, UserIds};

/// Database superuser created by `initdb`.
pub const SUPERUSER: &str = "postgres";

const INITDB_TIMEOUT: Duration = Duration::from_secs(120);
/// Every cluster's `initdb` arguments after `-D`.
const INITDB_ARGS: &[&str] = &[
    "-U",
    SUPERUSER,
    "--auth=trust",
    "--no-sync",
    "--locale=C",
    "--encoding=UTF8",
];
const START_TIMEOUT: Duration = Duration::from_secs(60);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// Settings every test cluster gets; [`PgCluster::start_with`] can override them.
///
/// No JIT, no parallel workers and no autovacuum: a query's CPU stays in its one backend, its
/// hot functions are the interpreter's (JIT code has no symbols), and the cluster's process set
/// does not change under a running trace. `fsync=off` because nothing here needs durability.
const DEFAULT_SETTINGS: &[(&str, &str)] = &[
    ("shared_buffers", "128MB"),
    ("max_connections", "50"),
    ("listen_addresses", "127.0.0.1"),
    ("jit", "off"),
    ("max_parallel_workers_per_gather", "0"),
    ("autovacuum", "off"),
    ("fsync", "off"),
];

/// A running cluster owned by the test. Dropping it stops the server (`-m immediate`) and
/// deletes its files; if the test is panicking, the tail of the server log is printed first.
pub struct PgCluster {
    install: PgInstall,
    user: UserIds,
    port: u16,
    data: PathBuf,
    log: PathBuf,
    // Dropped after `Drop::drop` stopped the server: files first, then the lock.
    dir: TempDir,
    /// None for a cluster started beside another, whose lock covers both.
    _lock: Option<ClusterLock>,
}

impl PgCluster {
    /// `initdb` + start with [`DEFAULT_SETTINGS`]. Waits for an earlier test's cluster to be
    /// gone first (one cluster at a time across all test processes).
    pub fn start(install: &PgInstall) -> Result<Self> {
        Self::start_with(install, &[])
    }

    /// Like [`PgCluster::start`], with extra `postgresql.conf` settings (they win over defaults).
    /// A cluster with pg_stat_statements preloaded (so queryids are computed) and created in
    /// database `postgres`, plus `settings`.
    pub fn start_with_pg_stat_statements(install: &PgInstall, settings: &[(&str, &str)]) -> Result<Self> {
        let mut all = vec![("shared_preload_libraries", "pg_stat_statements")];
        all.extend_from_slice(settings);
        let cluster = Self::start_with(install, &all)?;
        cluster.psql("CREATE EXTENSION pg_stat_statements")?;
        Ok(cluster)
    }

    pub fn start_with(install: &PgInstall, settings: &[(&str, &str)]) -> Result<Self> {
        Self::start_locked(install, settings, Some(ClusterLock::acquire()?))
    }

    /// A second (third, …) cluster while the test holds `first`: tests of several instances
    /// side by side. `first`'s lock keeps other tests' clusters away from all of them.
    pub fn start_beside(install: &PgInstall, settings: &[(&str, &str)], first: &PgCluster) -> Result<Self> {
        ensure!(
            first._lock.is_some(),
            "start_beside needs the cluster that holds the lock"
        );
        Self::start_locked(install, settings, None)
    }

    fn start_locked(
        install: &PgInstall,
        settings: &[(&str, &str)],
        lock: Option<ClusterLock>,
    ) -> Result<Self> {
        let user = ensure_test_user()?;
        let dir = tempfile::Builder::new()
            .prefix("pgscope-test-")
            .tempdir()
            .context("cannot create the cluster's temp dir")?;
        chown(dir.path(), user)?;
        let cluster = PgCluster {
            install: install.clone(),
            user,
            port: free_port()?,
            data: dir.path().join("data"),
            log: dir.path().join("postgres.log"),
            dir,
            _lock: lock,
        };
        cluster.initdb()?;
        cluster.write_settings(settings)?;
        // From here on `Drop` stops whatever got started.
        run_checked(
            cluster
                .as_postgres_user("pg_ctl")
                .arg("start")
                .arg("-D")
                .arg(&cluster.data)
                .arg("-l")
                .arg(&cluster.log)
                .args(["-w", "-t", "60"]),
            START_TIMEOUT,
        )
        .with_context(|| {
            format!(
                "cannot start the {} cluster:\n{}",
                install.label,
                cluster.server_log()
            )
        })?;
        cluster.wait_ready()?;
        Ok(cluster)
    }

    /// Stops the server (fast shutdown) and starts it again: a new postmaster and new backends,
    /// as after a restart by an operator.
    pub fn restart(&self) -> Result<()> {
        self.restart_with("fast")
    }

    /// `pg_ctl restart -m <mode>`: `fast`, `smart` or `immediate` (SIGQUIT to the postmaster,
    /// no shutdown checkpoint: the new server runs crash recovery).
    pub fn restart_with(&self, mode: &str) -> Result<()> {
        run_checked(
            self.as_postgres_user("pg_ctl")
                .arg("restart")
                .arg("-D")
                .arg(&self.data)
                .arg("-l")
                .arg(&self.log)
                .args(["-m", mode, "-w", "-t", "60"]),
            START_TIMEOUT,
        )
        .with_context(|| format!("cannot restart the cluster (-m {mode}):\n{}", self.server_log()))?;
        self.wait_ready()
    }

    /// The pg_stat_statements queryid of pgbench's select-only statement (`pgbench -S`), the
    /// busiest if there are several.
    pub fn pgbench_select_queryid(&self) -> Result<String> {
        let id = self.psql(
            "SELECT queryid FROM pg_stat_statements \
             WHERE query LIKE 'SELECT abalance FROM pgbench_accounts%' ORDER BY calls DESC LIMIT 1",
        )?;
        anyhow::ensure!(
            !id.trim().is_empty(),
            "pgbench's select is not in pg_stat_statements"
        );
        Ok(id.trim().to_string())
    }

    /// The build this cluster runs.
    pub fn install(&self) -> &PgInstall {
        &self.install
    }

    /// The data directory (what `pgscope trace --instance` accepts).
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Directory of the unix socket clients connect through.
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Pid of the postmaster, from the first line of `postmaster.pid`.
    pub fn postmaster_pid(&self) -> Result<u32> {
        let path = self.data.join("postmaster.pid");
        let text = fs::read_to_string(&path).with_context(|| format!("cannot read `{}`", path.display()))?;
        let first = text.lines().next().unwrap_or_default().trim();
        first
            .parse()
            .with_context(|| format!("`{}` starts with `{first}`, not a pid", path.display()))
    }

    /// The postmaster and all its current children (backends and auxiliary processes).
    pub fn process_pids(&self) -> Result<BTreeSet<u32>> {
        let postmaster = self.postmaster_pid()?;
        let mut pids: BTreeSet<u32> = children_of(postmaster).into_iter().collect();
        pids.insert(postmaster);
        Ok(pids)
    }

    /// Runs `sql` with `psql -XAtq` (unaligned, tuples only) and returns its output without the
    /// trailing newline. Errors carry psql's message.
    pub fn psql(&self, sql: &str) -> Result<String> {
        let out = run_checked(self.psql_command().arg("-c").arg(sql), CLIENT_TIMEOUT)
            .with_context(|| format!("query failed: {sql}"))?;
        Ok(out.trim_end_matches('\n').to_owned())
    }

    /// A `psql -XAtq` command connected to this cluster, to which the caller adds `-c …`.
    pub fn psql_command(&self) -> Command {
        let mut cmd = self.client("psql");
        cmd.args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", "-d", "postgres"]);
        cmd
    }

    /// Runs this build's `pgbench` against the `postgres` database with `args`, e.g.
    /// `["-i", "-s", "10"]` to initialise or `["-S", "-c", "2", "-T", "10"]` to run. Returns
    /// its stdout (the report for a run).
    pub fn pgbench(&self, args: &[&str]) -> Result<String> {
        let mut cmd = self.client("pgbench");
        cmd.args(args).arg("postgres");
        // Long enough for any `-T` a test would pass plus initialisation.
        run_checked(&mut cmd, Duration::from_secs(600))
    }

    /// The server log so far (empty if unreadable).
    pub fn server_log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A client program of this build with connection options set; runs as root (only the
    /// server refuses root).
    pub fn client(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.install.client_bin(program));
        clear_pg_env(&mut cmd);
        cmd.arg("-h")
            .arg(self.socket_dir())
            .arg("-p")
            .arg(self.port.to_string());
        cmd.args(["-U", SUPERUSER]);
        cmd
    }

    fn as_postgres_user(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.install.bin(program));
        clear_pg_env(&mut cmd);
        // std drops root's supplementary groups when a uid is set without explicit groups.
        cmd.uid(self.user.uid)
            .gid(self.user.gid)
            .current_dir(self.dir.path())
            .env("HOME", self.dir.path());
        cmd
    }

    /// The data directory, copied from the build's `initdb` template (`initdb_template`).
    fn initdb(&self) -> Result<()> {
        initdb_template::copy_to(&self.install, self.user, INITDB_ARGS, &self.data, |data| {
            run_checked(
                self.as_postgres_user("initdb")
                    .arg("-D")
                    .arg(data)
                    .args(INITDB_ARGS),
                INITDB_TIMEOUT,
            )
            .with_context(|| format!("initdb of the {} build failed", self.install.label))?;
            Ok(())
        })
    }

    fn write_settings(&self, extra: &[(&str, &str)]) -> Result<()> {
        let socket_dir = self.socket_dir().to_string_lossy().into_owned();
        let port = self.port.to_string();
        let mut conf = String::from("\n# pgscope-tests\n");
        let fixed = [
            ("port", port.as_str()),
            ("unix_socket_directories", socket_dir.as_str()),
        ];
        for (key, value) in DEFAULT_SETTINGS.iter().chain(&fixed).chain(extra) {
            writeln!(conf, "{key} = '{}'", value.replace('\'', "''"))?;
        }
        let path = self.data.join("postgresql.conf");
        let mut text =
            fs::read_to_string(&path).with_context(|| format!("cannot read `{}`", path.display()))?;
        text.push_str(&conf);
        fs::write(&path, text).with_context(|| format!("cannot write `{}`", path.display()))
    }

    fn wait_ready(&self) -> Result<()> {
        wait_for(
            "the server to accept connections (pg_isready)",
            START_TIMEOUT,
            || {
                let mut cmd = self.client("pg_isready");
                cmd.args(["-d", "postgres", "-q"]);
                Ok(output_with_timeout(&mut cmd, CLIENT_TIMEOUT)?
                    .status
                    .success()
                    .then_some(()))
            },
        )
        .with_context(|| format!("server log:\n{}", self.server_log()))
    }

    fn stop(&self) -> Result<()> {
        if !self.data.join("postmaster.pid").exists() {
            return Ok(());
        }
        run_checked(
            self.as_postgres_user("pg_ctl")
                .arg("stop")
                .arg("-D")
                .arg(&self.data)
                .args(["-m", "immediate", "-w", "-t", "60"]),
            START_TIMEOUT,
        )?;
        Ok(())
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.server_log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- last lines of the {} server log ---", self.install.label);
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
        if let Err(e) = self.stop() {
            eprintln!("cannot stop the test cluster in `{}`: {e:#}", self.data.display());
            if let Ok(pid) = self.postmaster_pid() {
                // SIGQUIT is Postgres' immediate shutdown; it also ends the children.
                // SAFETY: plain kill(2) on a pid we read from our own cluster's pid file.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGQUIT) };
            }
        }
    }
}

/// A port nobody listens on right now: bind to port 0 and let the kernel choose.
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("cannot bind 127.0.0.1:0 to pick a port")?;
    Ok(listener.local_addr()?.port())
}

/// Removes `PG*` variables (PGHOST, PGDATA, …) a developer may have set, so every connection
/// goes to the test cluster.
fn clear_pg_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("PG") {
            cmd.env_remove(key);
        }
    }
}
