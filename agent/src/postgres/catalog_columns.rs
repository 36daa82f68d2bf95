//! The numeric columns of a view, found in the catalog, for the counters read at a trace's
//! ends (`pgss_counters`, `stat_views`): their columns differ by major, and no per-major table
//! has to keep up.

use anyhow::{Context, Result};
use tokio_postgres::types::Type;
use tokio_postgres::Client;

/// The numeric columns of `relation` (as `to_regclass` reads it), in their order; empty when
/// it does not exist.
pub async fn numeric_columns(client: &Client, relation: &str) -> Result<Vec<String>> {
    let rows = client
        .query(
            "SELECT attname::text, atttypid FROM pg_attribute \
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
            &[&relation],
        )
        .await
        .with_context(|| format!("listing {relation}'s columns"))?;
    let numeric = [
        Type::INT2,
        Type::INT4,
        Type::INT8,
        Type::FLOAT4,
        Type::FLOAT8,
        Type::NUMERIC,
    ];
    let mut columns = Vec::new();
    for row in rows {
        let name: String = row.try_get(0)?;
        let type_oid: u32 = row.try_get(1)?;
        if numeric.iter().any(|t| t.oid() == type_oid) {
            columns.push(name);
        }
    }
    Ok(columns)
}

/// `name` as an SQL identifier.
pub fn quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
