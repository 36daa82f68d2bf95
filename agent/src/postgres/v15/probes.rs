//! PostgreSQL 15's signatures of the functions pgscope probes, as declared in the server headers
//! (`tests::prototypes_and_globals_match_the_server_headers` compiles them against
//! `postgresql-server-dev-15`), and where the values the probes read are among their arguments
//! (`signatures::tests` checks those against the prototypes' parameters).

use crate::bpf::abi::{ArgField, Function};
use crate::postgres::ProbeSignature;

/// Every probeable function is known in 15.
pub(super) fn signature(function: Function) -> Option<ProbeSignature> {
    let (prototype, header, args): (_, _, &'static [(ArgField, u8)]) = match function {
        // Static in contrib/pg_stat_statements/pg_stat_statements.c (REL_15_STABLE), so no
        // header declares it: its definition there reads
        //   static void pgss_store(const char *query, uint64 queryId,
        //                          int query_location, int query_len, pgssStoreKind kind,
        //                          double total_time, uint64 rows, const BufferUsage *bufusage,
        //                          const WalUsage *walusage,
        //                          const struct JitInstrumentation *jitusage,
        //                          JumbleState *jstate)
        // `total_time` travels in xmm0, so it does not shift the integer arguments after it.
        Function::PgssStore => (
            "void pgss_store(const char *query, uint64 queryId, int query_location, int query_len, \
             pgssStoreKind kind, double total_time, uint64 rows, const BufferUsage *bufusage, \
             const WalUsage *walusage, const struct JitInstrumentation *jitusage, JumbleState *jstate)",
            None,
            &[(ArgField::QueryId, 2), (ArgField::PgssKind, 5)],
        ),
        Function::SLock => (
            "int s_lock(volatile slock_t *lock, const char *file, int line, const char *func)",
            Some("storage/s_lock.h"),
            &[
                (ArgField::SpinFile, 2),
                (ArgField::SpinLine, 3),
                (ArgField::SpinFunc, 4),
            ],
        ),
        Function::LockRelationOid => (
            "void LockRelationOid(Oid relid, LOCKMODE lockmode)",
            Some("storage/lmgr.h"),
            &[(ArgField::RelId, 1), (ArgField::LockMode, 2)],
        ),
        Function::GetCachedPlan => (
            "CachedPlan *GetCachedPlan(CachedPlanSource *plansource, ParamListInfo boundParams, \
             ResourceOwner owner, QueryEnvironment *queryEnv)",
            Some("utils/plancache.h"),
            &[],
        ),
        Function::PortalStart => (
            "void PortalStart(Portal portal, ParamListInfo params, int eflags, Snapshot snapshot)",
            Some("tcop/pquery.h"),
            &[],
        ),
        Function::VacUpdateDatfrozenxid => (
            "void vac_update_datfrozenxid(void)",
            Some("commands/vacuum.h"),
            &[],
        ),
        Function::BtGetroot => (
            "Buffer _bt_getroot(Relation rel, int access)",
            Some("access/nbtree.h"),
            &[],
        ),
    };
    Some(ProbeSignature {
        prototype,
        header,
        args,
    })
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Output};

    use super::super::{SERVER_INCLUDE, TABLE};
    use crate::bpf::abi::Function;

    /// Headers declaring the globals the table names (the probed functions' headers come from
    /// their signatures).
    const GLOBALS_HEADERS: [&str; 6] = [
        "miscadmin.h",
        "storage/backendid.h",
        "storage/lwlock.h",
        "postmaster/bgworker.h",
        "utils/backend_status.h",
        "utils/wait_event.h",
    ];

    /// A C unit that includes the headers, redeclares each prototype (a redeclaration whose
    /// types differ from the header's is an error) and takes the address of each global the
    /// table names (an undeclared one is an error). `replace` swaps a prototype for another.
    fn unit(replace: Option<(Function, &str)>) -> String {
        let mut includes = vec!["postgres.h"];
        let mut declarations = String::new();
        for function in Function::ALL {
            let signature = (TABLE.probe_signature)(function).expect("every function is known in 15");
            let Some(header) = signature.header else {
                continue;
            };
            includes.push(header);
            let prototype = match replace {
                Some((replaced, other)) if replaced == function => other,
                _ => signature.prototype,
            };
            declarations.push_str(&format!("extern {prototype};\n"));
        }
        includes.extend(GLOBALS_HEADERS);
        let globals = TABLE.sample_globals;
        let slot = TABLE.status_slot_globals;
        let names = TABLE.instance_name_globals;
        let addresses: Vec<String> = [
            globals.my_be_entry,
            globals.my_wait_event_info,
            globals.my_backend_type,
            globals.my_database_id,
            slot.backend_id,
            slot.aux_proc_type,
            slot.max_backends,
            names.named_tranche_array,
            names.named_tranche_requests,
            names.my_bgworker_entry,
        ]
        .iter()
        .map(|name| format!("    (const volatile void *) &{name},\n"))
        .collect();
        let includes: String = includes.iter().map(|h| format!("#include \"{h}\"\n")).collect();
        format!(
            "{includes}\n{declarations}\nconst volatile void *pgscope_globals[] = {{\n{}}};\n",
            addresses.concat()
        )
    }

    /// Compiles `source` against the server headers (syntax and types only).
    fn compile(source: &str) -> Output {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("prototypes.c");
        std::fs::write(&path, source).expect("cannot write the C unit");
        Command::new("cc")
            .arg(format!("-I{SERVER_INCLUDE}"))
            .args(["-fsyntax-only", "-Werror"])
            .arg(&path)
            .output()
            .expect("cannot run `cc` (build-essential)")
    }

    #[test]
    fn prototypes_and_globals_match_the_server_headers() {
        assert!(
            std::path::Path::new(SERVER_INCLUDE)
                .join("storage/lmgr.h")
                .is_file(),
            "`{SERVER_INCLUDE}/storage/lmgr.h` is missing: install the PostgreSQL 15 server \
             headers (`postgresql-server-dev-15`, which scripts/install-deps.sh installs)"
        );
        let source = unit(None);
        let cc = compile(&source);
        assert!(
            cc.status.success(),
            "v15's prototypes or globals disagree with the server headers:\n{}\n{source}",
            String::from_utf8_lossy(&cc.stderr)
        );
        // The check can fail: 16's `_bt_getroot` (a heap relation before `access`) is not 15's.
        let sixteen = unit(Some((
            Function::BtGetroot,
            "Buffer _bt_getroot(Relation rel, Relation heaprel, int access)",
        )));
        let cc = compile(&sixteen);
        assert!(!cc.status.success(), "a wrong prototype compiled:\n{sixteen}");
        assert!(
            String::from_utf8_lossy(&cc.stderr).contains("_bt_getroot"),
            "{}",
            String::from_utf8_lossy(&cc.stderr)
        );
    }
}
