//! Static functions reached only through tables of function pointers, named on the stripped
//! distro build: a sequential scan over a wide table spends most of its CPU deforming tuples in
//! the static `tts_buffer_heap_getsomeattrs` (held by the exported `TTSOpsBufferHeapTuple`),
//! and an index scan fetches each heap tuple in the static `heapam_index_fetch_tuple` (held by
//! `heapam_methods`, returned by the exported `GetHeapamTableAmRoutine`). Stripped of symbols,
//! both were `postgres+0x…` frames. Each major's generated tables are also checked against the
//! headers and the build they were generated from (`scripts/gen-pg-pointer-tables.py --check`).

use std::path::Path;
use std::process::Command;

use anyhow::{ensure, Context, Result};
use pgscope_tests::{require_root_and_bpf, Connection, PgCluster, PgInstall, Profile, Trace};

/// Columns of the wide table: a sum over its last column deforms every column before it.
const COLUMNS: usize = 60;
const ROWS: u64 = 100_000;
/// Executions of each statement while traced.
const EXECUTIONS: u64 = 20;

#[test]
fn generated_tables_match_each_majors_headers_and_build() -> Result<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gen-pg-pointer-tables.py");
    for major in [14, 15, 16, 17, 18] {
        let output = Command::new(&script)
            .args(["--major", &major.to_string(), "--check"])
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        ensure!(
            output.status.success(),
            "PostgreSQL {major}: agent/src/postgres/v{major}/pointer_tables.rs differs from what \
             the headers and the build give:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

#[test]
fn scans_name_tuple_deforming_and_heap_fetches_on_the_stripped_build() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::distro()?;
    let cluster = PgCluster::start_with_pg_stat_statements(
        &install,
        &[("max_parallel_workers_per_gather", "0"), ("jit", "off")],
    )?;
    let columns: Vec<String> = (1..=COLUMNS).map(|c| format!("g + {c} AS c{c}")).collect();
    cluster.psql(&format!(
        "CREATE TABLE wide AS SELECT g AS id, {} FROM generate_series(1, {ROWS}) g; \
         CREATE INDEX wide_id ON wide (id)",
        columns.join(", ")
    ))?;
    // Not in one transaction with the rest: VACUUM refuses to run inside one.
    cluster.psql("VACUUM ANALYZE wide")?;
    let mut connection = cluster.connect()?;
    // A nested loop over the index: one index scan, and one heap fetch, per outer row.
    for setting in [
        "enable_hashjoin",
        "enable_mergejoin",
        "enable_bitmapscan",
        "enable_material",
    ] {
        connection.query(&format!("SET {setting} = off"))?;
    }
    // One trace per statement: each share is then judged within the statement that shows
    // it, whatever the two statements' relative speed on this machine.
    let scan = trace_statement(&mut connection, &format!("SELECT sum(c{COLUMNS}) FROM wide"))?;
    let join = trace_statement(
        &mut connection,
        &format!("SELECT sum(w.c1) FROM generate_series(1, {ROWS}) s JOIN wide w ON w.id = s"),
    )?;
    let deforming = scan.with("tts_buffer_heap_getsomeattrs");
    let fetching = join.with("heapam_index_fetch_tuple");
    eprintln!(
        "scan: tts_buffer_heap_getsomeattrs in {deforming} of {} samples; join: \
         heapam_index_fetch_tuple in {fetching} of {} samples",
        scan.total, join.total
    );
    ensure!(scan.total > 0 && join.total > 0, "no samples");
    // Deforming 60 columns of every row is the scan's main work (about 70% of its samples).
    ensure!(
        deforming * 3 >= scan.total,
        "tts_buffer_heap_getsomeattrs in only {deforming} of the scan's {} samples",
        scan.total
    );
    // Each of the join's index scans fetches its row: a visible part of its time (about 13%).
    ensure!(
        fetching * 20 >= join.total,
        "heapam_index_fetch_tuple in only {fetching} of the join's {} samples",
        join.total
    );
    Ok(())
}

/// The folded samples of one statement's executions.
struct Traced {
    profile: Profile,
    total: u64,
}

impl Traced {
    /// Samples with `function` anywhere in their stack.
    fn with(&self, function: &str) -> u64 {
        self.profile
            .stacks
            .iter()
            .filter(|s| s.frames.iter().any(|f| f == function))
            .map(|s| s.count)
            .sum()
    }
}

/// Traces the connection's backend while it runs `sql` [`EXECUTIONS`] times.
fn trace_statement(connection: &mut Connection, sql: &str) -> Result<Traced> {
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("stacks.folded");
    let trace = Trace::pid(connection.pid())
        .duration_secs(600)
        .frequency(499)
        .folded(&folded)
        .spawn()?;
    for _ in 0..EXECUTIONS {
        connection.query(sql)?;
    }
    trace.interrupt()?;
    let profile = Profile::read_folded(&folded)?;
    let total = profile.stacks.iter().map(|s| s.count).sum();
    Ok(Traced { profile, total })
}
