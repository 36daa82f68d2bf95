//! PostgreSQL 18's signatures of the functions pgscope probes: `pgss_store` and
//! `_bt_getroot`, which differ between majors, here; the others are unchanged since 14
//! (`signatures::unchanged_since_14`). The header test of `super` compiles every one against
//! the 18 server headers, and `signatures::tests` checks the argument positions against
//! the prototypes' parameters.

use crate::bpf::abi::Function;
use crate::postgres::signatures::{unchanged_since_14, BT_GETROOT_FROM_16, PGSS_STORE_ARGS};
use crate::postgres::ProbeSignature;

/// Every probeable function is known in 18.
pub(super) fn signature(function: Function) -> Option<ProbeSignature> {
    match function {
        // Static in contrib/pg_stat_statements/pg_stat_statements.c (REL_18_STABLE; read in
        // Debian's postgresql-18 18.6 source): `queryId` became int64, and two parallel-worker
        // counts follow `jstate`.
        Function::PgssStore => Some(ProbeSignature {
            prototype:
                "void pgss_store(const char *query, int64 queryId, int query_location, int query_len, \
             pgssStoreKind kind, double total_time, uint64 rows, const BufferUsage *bufusage, \
             const WalUsage *walusage, const struct JitInstrumentation *jitusage, JumbleState *jstate, \
             int parallel_workers_to_launch, int parallel_workers_launched)",
            header: None,
            args: PGSS_STORE_ARGS,
        }),
        Function::BtGetroot => Some(BT_GETROOT_FROM_16),
        other => unchanged_since_14(other),
    }
}
