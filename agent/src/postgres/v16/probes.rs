//! PostgreSQL 16's signatures of the functions pgscope probes: `pgss_store` and
//! `_bt_getroot`, which differ between majors, here; the others are unchanged since 14
//! (`signatures::unchanged_since_14`). The header test of `super` compiles every one against
//! the 16 server headers, and `signatures::tests` checks the argument positions against
//! the prototypes' parameters.

use crate::bpf::abi::Function;
use crate::postgres::signatures::{unchanged_since_14, BT_GETROOT_FROM_16, PGSS_STORE_ARGS};
use crate::postgres::ProbeSignature;

/// Every probeable function is known in 16.
pub(super) fn signature(function: Function) -> Option<ProbeSignature> {
    match function {
        // Static in contrib/pg_stat_statements/pg_stat_statements.c (REL_16_STABLE), so no
        // header declares it. No 16 source is in the registries here: the upstream
        // build's `pgss_ExecutorEnd` passes 4 arguments on the stack (`bufusage`, `walusage`,
        // `jitusage`, `jstate`) after the six register arguments, as 15's does, with
        // `PGSS_EXEC` in the 5th.
        Function::PgssStore => Some(ProbeSignature {
            prototype:
                "void pgss_store(const char *query, uint64 queryId, int query_location, int query_len, \
             pgssStoreKind kind, double total_time, uint64 rows, const BufferUsage *bufusage, \
             const WalUsage *walusage, const struct JitInstrumentation *jitusage, JumbleState *jstate)",
            header: None,
            args: PGSS_STORE_ARGS,
        }),
        Function::BtGetroot => Some(BT_GETROOT_FROM_16),
        other => unchanged_since_14(other),
    }
}
