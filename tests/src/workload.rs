//! CPU-bound queries whose hot functions are known and stable across builds.
//!
//! The function lists come from `perf record -F 199 --call-graph dwarf,16384` on PG 15.20 (distro)
//! and the same source built without frame pointers (`scripts/build-postgres-nofp.sh`).
//! Only exported functions are listed: they carry the same name in both builds, while static
//! ones (`ExecInterpExpr`, `ExecProjectSRF`, `mul_var`) are unnamed in the stripped distro build.

/// One backend busy for ~100 s on a 2-core VM (1e7 rows take 0.5 s), longer than any test trace.
///
/// `generate_series` sits in the select list on purpose: in `FROM` it is materialised into a
/// tuplestore first, which spills tens of GB to disk and profiles `BufFileWrite` instead.
///
/// Self time measured with perf (distro / nofp, % of samples): unnamed statics 50/51
/// (mostly `ExecInterpExpr`, then `ExecProjectSRF`, `tts_virtual_clear`, `ExecProjectSet`),
/// `generate_series_step_int4` 12/10, `ExecMakeFunctionResultSet` 8/10, `MemoryContextReset` 8/8,
/// `int4mod` 5/7, `ExecScan` 4/2, `pgstat_init_function_usage` 4/2, `int4eq` 2.5/4,
/// `check_stack_depth` 2/1, `pgstat_end_function_usage` 2/2.
pub const CPU_BOUND: &str =
    "SELECT count(*) FROM (SELECT generate_series(1, 2000000000) AS g) s WHERE g % 7 = 3";

/// Exported functions that are the leaf (self time) of at least ~30% of [`CPU_BOUND`] samples
/// together, in both builds.
pub const CPU_BOUND_HOT_LEAVES: &[&str] = &[
    "generate_series_step_int4",
    "ExecMakeFunctionResultSet",
    "MemoryContextReset",
    "int4mod",
];

/// Hashes every row: ~80% of samples have `md5_text` → `pg_md5_hash` → OpenSSL (`MD5_Final`,
/// `EVP_DigestFinal_ex`) on the stack; runs for ~30 min.
pub const MD5_BOUND: &str =
    "SELECT count(*) FROM (SELECT generate_series(1, 2000000000) AS g) s WHERE md5(g::text) LIKE 'fff%'";

/// Numeric arithmetic on every row: ~75% of samples have `numeric_mul_opt_error`,
/// `numeric_div_opt_error`, `numeric_avg_accum` or `int4_numeric` on the stack (the leaf is
/// mostly the static `mul_var`/`div_var`); runs for ~10 min.
pub const NUMERIC_BOUND: &str =
    "SELECT sum(g::numeric * 1.0000001 / 3.3) FROM (SELECT generate_series(1, 2000000000) AS g) s";

/// A frame only [`MD5_BOUND`] produces.
pub fn is_md5_frame(frame: &str) -> bool {
    matches!(frame, "md5_text" | "pg_md5_hash") || frame.starts_with("MD5_")
}

/// A frame only [`NUMERIC_BOUND`] produces.
pub fn is_numeric_frame(frame: &str) -> bool {
    frame.starts_with("numeric_") || frame == "int4_numeric"
}

/// The published reproduction of pg_stat_statements eviction storms: 128 tables and 16
/// pgbench scripts, each a transaction of eight selects on its own tables, so that 16 clients
/// run 128 distinct statements. Creates the tables in `cluster`, writes the scripts into a
/// directory the cluster's OS user can read, and returns it with pgbench's `-f` arguments.
pub fn pgss_eviction_scripts(cluster: &crate::PgCluster) -> anyhow::Result<(tempfile::TempDir, Vec<String>)> {
    crate::app_database::distinct_selects_in(cluster, "postgres", 16, 8)
}

/// Writes `text` to a file `name` in a new directory the cluster's OS user can read (pgbench and
/// psql run as it; the test's temp dirs are its own), and returns the directory, which removes
/// the file when dropped, with the file's path.
pub fn readable_script(name: &str, text: &str) -> anyhow::Result<(tempfile::TempDir, std::path::PathBuf)> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(dir.path(), PermissionsExt::from_mode(0o755))?;
    let script = dir.path().join(name);
    std::fs::write(&script, text)?;
    std::fs::set_permissions(&script, PermissionsExt::from_mode(0o644))?;
    Ok((dir, script))
}

/// Tables [`large_catalog_vacuums`] creates: each VACUUM's `vac_update_datfrozenxid` then reads
/// ~20000 `pg_class` rows (~1000 pages) through `systable_getnext`, about 10 ms a VACUUM here.
pub const LARGE_CATALOG_TABLES: u32 = 20_000;

/// The VACUUM over a large catalog: [`LARGE_CATALOG_TABLES`] empty tables in
/// `cluster`, and a SQL file (in a directory the cluster's OS user can read) of `vacuums`
/// `VACUUM` commands of one of them, to run with [`crate::PgCluster::spawn_script_session`].
/// Most of each VACUUM is the scan of `pg_class` at its end (perf, distro / nofp, inclusive:
/// `vac_update_datfrozenxid` 94/95%, `systable_getnext` 83/85%, `heapgetpage` 50/50%).
pub fn large_catalog_vacuums(
    cluster: &crate::PgCluster,
    vacuums: u32,
) -> anyhow::Result<(tempfile::TempDir, std::path::PathBuf)> {
    // One transaction per thousand tables: a table's creation holds a lock until commit, and
    // the lock table has room for max_locks_per_transaction × max_connections.
    for first in (1..=LARGE_CATALOG_TABLES).step_by(1000) {
        let last = (first + 999).min(LARGE_CATALOG_TABLES);
        cluster.psql(&format!(
            "DO $$ BEGIN FOR i IN {first}..{last} LOOP \
             EXECUTE format('CREATE TABLE catalog_filler_%s (a int)', i); END LOOP; END $$"
        ))?;
    }
    readable_script(
        "vacuums.sql",
        &"VACUUM catalog_filler_1;\n".repeat(vacuums as usize),
    )
}
