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
