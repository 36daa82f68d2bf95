//! A database of the application's own beside `postgres`, as real servers have: psql and
//! pgbench in it, and a workload of many distinct statements there.

use std::time::Duration;

use anyhow::{Context, Result};
use tempfile::TempDir;

use crate::cluster::PgCluster;
use crate::process::run_checked;

const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);
/// Long enough for any `-T` a test passes plus initialisation.
const PGBENCH_TIMEOUT: Duration = Duration::from_secs(600);

/// `psql -c sql` in database `database` of `cluster`, output as [`PgCluster::psql`] gives it.
pub fn psql_in(cluster: &PgCluster, database: &str, sql: &str) -> Result<String> {
    let mut command = cluster.psql_command();
    // The last -d wins: psql_command names `postgres`.
    command.args(["-d", database, "-c", sql]);
    let out = run_checked(&mut command, CLIENT_TIMEOUT)
        .with_context(|| format!("query failed in database {database}: {sql}"))?;
    Ok(out.trim_end_matches('\n').to_owned())
}

/// `pgbench <args> <database>`; returns its report.
pub fn pgbench_in(cluster: &PgCluster, database: &str, args: &[&str]) -> Result<String> {
    let mut command = cluster.client("pgbench");
    command.args(args).arg(database);
    run_checked(&mut command, PGBENCH_TIMEOUT)
}

/// `scripts` pgbench scripts over `scripts × per_script` tables created in `database`, each a
/// transaction of `per_script` selects on its own tables: clients running them run that many
/// distinct statements (one queryid per table). Returns the scripts' directory (readable by the
/// cluster's OS user, as pgbench runs as it) and pgbench's `-f` arguments.
pub fn distinct_selects_in(
    cluster: &PgCluster,
    database: &str,
    scripts: usize,
    per_script: usize,
) -> Result<(TempDir, Vec<String>)> {
    let tables = scripts * per_script;
    psql_in(
        cluster,
        database,
        &format!(
            "DO $$ BEGIN FOR i IN 1..{tables} LOOP \
             EXECUTE format('CREATE TABLE t%s (x int); INSERT INTO t%s VALUES (1)', i, i); \
             END LOOP; END $$"
        ),
    )?;
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let mut args = Vec::new();
    for script in 0..scripts {
        let mut text = String::from("BEGIN;\n");
        for table in 0..per_script {
            text.push_str(&format!("SELECT 1 FROM t{};\n", script * per_script + table + 1));
        }
        text.push_str("COMMIT;\n");
        let path = dir.path().join(format!("script{script}.sql"));
        std::fs::write(&path, text).with_context(|| format!("cannot write `{}`", path.display()))?;
        args.push("-f".to_owned());
        args.push(path.display().to_string());
    }
    Ok((dir, args))
}
