//! Postgres' subsystems as families of functions: which part of Postgres a sampled frame
//! belongs to, what that part does, what usually makes it costly and which of Postgres' own
//! counters confirm or rule that out. A finding written from a family (with the measured path
//! and the counters) speaks of statements no rule was written for: the sort that spills is
//! named by the sort's functions and `temp_blks_written`, whatever the query is.
//!
//! The names are those of Postgres 14 to 18. A few exist in some majors only (`StartReadBuffer`
//! from 17, `hashagg_spill_*` from 13 on); a name a build lacks is never sampled, so the
//! families need no per-major table.

/// One of Postgres' subsystems, as its functions show on a stack.
#[derive(Debug, PartialEq, Eq)]
pub struct Subsystem {
    /// Stable name: a JSON value and the key statements count samples by.
    pub name: &'static str,
    /// What it does, in a DBA's words ("sorting rows (tuplesort)").
    pub what: &'static str,
    /// Its functions, exactly.
    pub functions: &'static [&'static str],
    /// Prefixes of its functions' names.
    pub prefixes: &'static [&'static str],
    /// Prefixes of the file names of the libraries that are wholly part of it (`libLLVM`).
    pub modules: &'static [&'static str],
    /// Frames under which its work is not what makes it costly but the remedy at work (an
    /// index's recheck of the rows it found) or the value's plain use (sending it to the
    /// client): a sample with one of them on its stack does not count for the family.
    pub except_under: &'static [&'static str],
    /// What usually makes it costly, and the first thing to check.
    pub usual_causes: &'static str,
    /// What confirms or rules out those causes, in Postgres' own counters and views.
    pub confirmed_by: &'static str,
    /// The pg_stat_statements columns among them (empty where none counts it).
    pub pgss_columns: &'static [&'static str],
}

impl Subsystem {
    /// Whether a sample whose user frames are `names` is outside the work this family counts
    /// ([`Self::except_under`]).
    pub fn excepted(&self, names: &[&str]) -> bool {
        !self.except_under.is_empty() && names.iter().any(|name| self.except_under.contains(name))
    }

    /// Whether `function` (in the library `module`, when known) is one of this subsystem's.
    pub fn holds(&self, function: &str, module: Option<&str>) -> bool {
        self.functions.contains(&function)
            || self.prefixes.iter().any(|p| function.starts_with(p))
            || module.is_some_and(|m| self.modules.iter().any(|p| m.starts_with(p)))
    }
}

pub const SORT: Subsystem = Subsystem {
    name: "sort",
    what: "sorting rows (tuplesort: ORDER BY, merge joins, DISTINCT, index builds)",
    // The sort's own work: not ExecSort, under which its input's plan runs too.
    functions: &[
        "mergeruns",
        "mergeonerun",
        "dumptuples",
        "puttuple_common",
        "inittapes",
        "selectnewtape",
    ],
    prefixes: &["tuplesort_", "comparetup_", "qsort_tuple", "qsort_ssup", "ApplySortComparator"],
    modules: &[],
    except_under: &[],
    usual_causes: "more rows than work_mem holds: the sort writes runs to temporary files and \
                   merges them (temp_blks_written); else many rows or costly comparisons \
                   (non-C collations, numeric, wide keys)",
    confirmed_by: "temp_blks_written of the statement (pg_stat_statements), temp_bytes (pg_stat_database), log_temp_files",
    pgss_columns: &["temp_blks_written", "temp_blks_read", "rows"],
};

pub const HASH_AGGREGATE: Subsystem = Subsystem {
    name: "hash_aggregate",
    what: "grouping rows in a hash table (HashAggregate: GROUP BY, DISTINCT)",
    // The table's own work: not agg_fill_hash_table, under which the input's plan runs too.
    functions: &[
        "agg_retrieve_hash_table_in_memory",
        "agg_refill_hash_table",
        "lookup_hash_entries",
        "LookupTupleHashEntry",
        "LookupTupleHashEntryHash",
        "TupleHashTableHash",
        "BuildTupleHashTableExt",
        "build_hash_tables",
    ],
    prefixes: &["hashagg_"],
    modules: &[],
    except_under: &[],
    usual_causes: "more groups than work_mem × hash_mem_multiplier holds: the groups spill to \
                   temporary files and are aggregated again in batches (temp_blks_written); \
                   else many rows or groups",
    confirmed_by: "temp_blks_written of the statement, log_temp_files; EXPLAIN ANALYZE shows the batches",
    pgss_columns: &["temp_blks_written", "temp_blks_read", "rows"],
};

pub const HASH_JOIN: Subsystem = Subsystem {
    name: "hash_join",
    what: "joining rows through a hash table (Hash Join)",
    // The join's own work: not ExecHashJoin or MultiExecHash, under which both inputs' plans
    // run too.
    functions: &[
        "ExecHashJoinNewBatch",
        "ExecHashJoinSaveTuple",
        "ExecHashJoinGetSavedTuple",
        "ExecScanHashBucket",
        "ExecHashGetHashValue",
    ],
    prefixes: &["ExecHashTable", "ExecHashIncrease", "ExecParallelHashTable"],
    modules: &[],
    except_under: &[],
    usual_causes: "an inner side larger than work_mem × hash_mem_multiplier: the join splits \
                   into batches written to temporary files (temp_blks_written); else a large \
                   inner side, or a row estimate far below the real count",
    confirmed_by: "temp_blks_written of the statement; EXPLAIN ANALYZE shows Batches above 1",
    pgss_columns: &["temp_blks_written", "temp_blks_read", "rows"],
};

pub const TEMP_FILES: Subsystem = Subsystem {
    name: "temp_files",
    what: "reading and writing temporary files (sorts, hashes and materializations that \
           outgrew work_mem)",
    functions: &["OpenTemporaryFile", "PathNameCreateTemporaryFile"],
    prefixes: &[
        "BufFile",
        "LogicalTape",
        "ltsWriteBlock",
        "ltsReadBlock",
        "ltsReadFillBuffer",
    ],
    modules: &[],
    except_under: &[],
    usual_causes: "an operator that outgrew work_mem (log_temp_files and temp_blks_written \
                   say how much it wrote)",
    confirmed_by: "temp_blks_written and temp_blks_read of the statement, temp_files (pg_stat_database)",
    pgss_columns: &["temp_blks_written", "temp_blks_read"],
};

pub const JIT: Subsystem = Subsystem {
    name: "jit",
    what: "compiling expressions to machine code (JIT, LLVM)",
    functions: &["jit_compile_expr", "llvm_compile_expr", "llvm_get_function"],
    prefixes: &["llvm_", "LLVM"],
    modules: &["libLLVM", "llvmjit"],
    except_under: &[],
    usual_causes: "a plan whose estimated cost passes jit_above_cost (often through a bad \
                   row estimate) compiled at every execution, for less time than compiling \
                   takes (jit_*_time against total_exec_time)",
    confirmed_by: "jit_functions and the jit_*_time columns of the statement against its total_exec_time",
    pgss_columns: &[
        "jit_functions",
        "jit_generation_time",
        "jit_inlining_time",
        "jit_optimization_time",
        "jit_emission_time",
    ],
};

pub const COLLATION: Subsystem = Subsystem {
    name: "collation",
    what: "comparing text under a linguistic collation (ICU, or the C library's strcoll)",
    // Postgres' entry points to the provider (`pg_strcoll` and kin from 16, `varstr_cmp` and
    // the sort's comparator before), and the providers' own functions.
    functions: &[
        "varstr_cmp",
        "varstrfastcmp_locale",
        "pg_strcoll",
        "pg_strncoll",
        "pg_strxfrm",
        "pg_strnxfrm",
        "pg_strxfrm_prefix",
        "pg_strnxfrm_prefix",
        "strcoll_l",
        "__strcoll_l",
        "strxfrm_l",
        "__strxfrm_l",
    ],
    prefixes: &["ucol_"],
    modules: &["libicui18n", "libicuuc"],
    except_under: &[],
    usual_causes: "text sorted, grouped, deduplicated or searched in a B-tree under a \
                   linguistic collation, where byte order would serve (codes, identifiers, \
                   hashes): each comparison goes through the provider instead of a memcmp",
    confirmed_by: "the collation of the column or database (pg_attribute.attcollation, \
                   pg_database.datcollate); EXPLAIN ANALYZE of the statement with COLLATE \"C\"",
    pgss_columns: &[],
};

pub const PLPGSQL: Subsystem = Subsystem {
    name: "plpgsql",
    what: "running PL/pgSQL functions (its interpreter, and the statements it runs through SPI)",
    functions: &[
        "plpgsql_call_handler",
        "plpgsql_exec_function",
        "plpgsql_inline_handler",
    ],
    prefixes: &["plpgsql_", "exec_stmt_"],
    modules: &["plpgsql"],
    except_under: &[],
    usual_causes: "a function called once per row (in WHERE, the select list or a join \
                   condition) whose body the planner cannot inline: the interpreter's setup and \
                   its expressions run at every call; or a function that runs a query per call",
    confirmed_by: "calls and self_time of the function in pg_stat_user_functions (track_functions \
                   = 'pl'); EXPLAIN VERBOSE shows the call in the filter or target list",
    pgss_columns: &[],
};

pub const TOAST: Subsystem = Subsystem {
    name: "toast",
    what: "reading and writing large values compressed or out of line (TOAST)",
    // Each read of a compressed or out-of-line value goes through `detoast_attr` (or its slice
    // and external forms); each write compresses in `toast_compress_datum` and stores the
    // chunks in `toast_save_datum`. The compressors themselves are not listed: LZ4's are also
    // WAL compression's, and pglz's are not exported by the distro build (their callers are).
    functions: &[
        "detoast_attr",
        "detoast_attr_slice",
        "detoast_external_attr",
        "heap_fetch_toast_slice",
        "toast_fetch_datum",
        "toast_fetch_datum_slice",
        "toast_decompress_datum",
        "toast_decompress_datum_slice",
        "pglz_decompress",
        "toast_compress_datum",
        "toast_save_datum",
        "toast_delete_datum",
        "toast_tuple_try_compression",
        "toast_tuple_externalize",
        "heap_toast_insert_or_update",
    ],
    prefixes: &[],
    modules: &[],
    // A value sent to the client (or written by COPY TO) whole is read whole: its output
    // function detoasts it under OutputFunctionCall, and no column of its own would spare it.
    except_under: &["OutputFunctionCall"],
    usual_causes: "a large value (jsonb, text, bytea over about 2 kB) read whole for a small \
                   part of it in every row (one key of a document), or rewritten whole for a \
                   small change: each access decompresses and reassembles it",
    confirmed_by: "toast_blks_hit and toast_blks_read of the table in pg_statio_user_tables; \
                   pg_column_size() of the values against their length",
    pgss_columns: &[],
};

pub const PATTERN_MATCHING: Subsystem = Subsystem {
    name: "pattern_matching",
    what: "matching text against LIKE patterns and regular expressions",
    // The operators' and functions' entry points (LIKE's matcher is inlined into them) and the
    // regular-expression engine's exported ones; its internals are static. Not `pg_regcomp`:
    // pg_trgm compiles each pattern with it to choose the trigrams its index reads, the work of
    // the remedy, not of the cause.
    functions: &[
        "textlike",
        "textnlike",
        "texticlike",
        "texticnlike",
        "bpcharlike",
        "bpcharnlike",
        "bpchariclike",
        "bpcharicnlike",
        "namelike",
        "namenlike",
        "nameiclike",
        "nameicnlike",
        "bytealike",
        "byteanlike",
        "nameregexeq",
        "nameregexne",
        "nameicregexeq",
        "nameicregexne",
        "RE_compile_and_cache",
        "RE_compile_and_execute",
        "pg_regexec",
    ],
    prefixes: &["textregex", "texticregex", "regexp_"],
    modules: &[],
    // An index scan's recheck of the candidate rows (a pg_trgm index's, whose matches are
    // lossy): the remedy at work. A filter on rows an index on another column found is
    // evaluated in ExecScan, outside these, and counts.
    except_under: &[
        "BitmapHeapNext",
        "IndexNext",
        "IndexNextWithReorder",
        "IndexOnlyNext",
    ],
    usual_causes: "a pattern no B-tree can serve (a leading wildcard, ILIKE, a regular \
                   expression) tested against the text of every row a scan reads",
    confirmed_by: "EXPLAIN ANALYZE: a Seq Scan or Filter with the pattern and its Rows Removed \
                   by Filter; pg_trgm's GIN or GiST index serves such patterns",
    pgss_columns: &[],
};

pub const CATALOG_CHANGES: Subsystem = Subsystem {
    name: "catalog_changes",
    what: "creating and dropping relations (rows of the system catalogs, their files, \
           invalidations)",
    // Not `PreCommit_on_commit_actions`: it also truncates the tables ON COMMIT DELETE ROWS, the
    // temporary table kept for the session that the advice recommends; the drops it makes go
    // through `performMultipleDeletions`.
    functions: &[
        "heap_create_with_catalog",
        "heap_create",
        "heap_drop_with_catalog",
        "DefineRelation",
        "RemoveRelations",
        "performDeletion",
        "performMultipleDeletions",
        "index_create",
        "index_drop",
        "InsertPgAttributeTuples",
        "InsertPgClassTuple",
        "RelationCreateStorage",
        "RelationDropStorage",
        "smgrdounlinkall",
        "smgrDoPendingDeletes",
        "NewRelationCreateToastTable",
        "AlterTableCreateToastTable",
    ],
    prefixes: &["CatalogTuple"],
    modules: &[],
    except_under: &[],
    usual_causes: "tables (often temporary ones) created and dropped in every transaction: each \
                   writes rows of pg_class, pg_attribute and pg_type, creates and unlinks files \
                   and sends every session invalidations",
    confirmed_by: "n_tup_ins and n_tup_del of pg_class and pg_attribute in pg_stat_sys_tables \
                   against the transactions (xact_commit of pg_stat_database)",
    pgss_columns: &[],
};

pub const SESSIONS: Subsystem = Subsystem {
    name: "sessions",
    what: "starting and ending sessions (forking a backend, authenticating it, filling its \
           caches, exiting)",
    // The postmaster's fork, the new backend's setup up to its first statement, and its exit.
    // Not what the whole session runs under (`BackendRun`, `BackendMain`,
    // `postmaster_child_launch`, `PostgresMain`): only work that a kept connection does not
    // repeat.
    functions: &[
        "fork_process",
        "BackendInitialize",
        "ProcessStartupPacket",
        "ClientAuthentication",
        "PerformAuthentication",
        "InitProcess",
        "InitPostgres",
        "pq_init",
        "proc_exit",
    ],
    prefixes: &[],
    modules: &[],
    except_under: &[],
    usual_causes: "an application that opens a connection per request or per transaction \
                   (no connection pool): each one forks a backend, authenticates it, loads its \
                   catalog caches and exits",
    confirmed_by: "sessions in pg_stat_database (14+): sessions opened by the hundred each \
                   second where connections are not kept",
    pgss_columns: &[],
};

pub const PLANNER: Subsystem = Subsystem {
    name: "planner",
    what: "planning (choosing join orders, paths and indexes)",
    functions: &[
        "planner",
        "standard_planner",
        "subquery_planner",
        "grouping_planner",
        "query_planner",
        "make_one_rel",
        "get_relation_info",
        "standard_join_search",
    ],
    prefixes: &["join_search_", "add_paths_to_", "set_base_rel_", "create_plan"],
    modules: &[],
    except_under: &[],
    usual_causes: "many relations or partitions to plan (join_collapse_limit, partition \
                   pruning at plan time), or a statement planned at every execution \
                   (plans against calls)",
    confirmed_by: "plans against calls and total_plan_time (with track_planning on) of the statement",
    pgss_columns: &["plans", "total_plan_time", "calls"],
};

pub const BUFFER_MANAGER: Subsystem = Subsystem {
    name: "buffer_manager",
    what: "finding pages in shared buffers and reading them in",
    functions: &[
        "ReadBuffer_common",
        "ReadBufferExtended",
        "StartReadBuffer",
        "StartReadBuffers",
        "WaitReadBuffers",
        "BufferAlloc",
        "FlushBuffer",
        "PinBuffer",
        "UnpinBuffer",
    ],
    prefixes: &[],
    modules: &[],
    except_under: &[],
    usual_causes: "pages read from outside shared buffers (shared_blks_read against \
                   shared_blks_hit): a working set larger than shared_buffers, or a scan \
                   reading far more pages than the rows it returns need",
    confirmed_by: "shared_blks_read against shared_blks_hit of the statement; reads in pg_stat_io (16+)",
    pgss_columns: &["shared_blks_hit", "shared_blks_read", "shared_blks_dirtied"],
};

pub const DATA_FILE_READS: Subsystem = Subsystem {
    name: "data_file_reads",
    what: "reading pages from the data files into shared buffers (from the kernel's page \
           cache or the disk), and making room for them",
    functions: &[
        "mdread",
        "mdreadv",
        "smgrread",
        "smgrreadv",
        "FileRead",
        "FileReadV",
        "WaitReadBuffers",
        // Making room for the page: a victim buffer is found (and evicted) for misses only.
        "StrategyGetBuffer",
        "GetVictimBuffer",
        "InvalidateVictimBuffer",
    ],
    prefixes: &[],
    modules: &[],
    except_under: &[],
    usual_causes: "a working set larger than shared_buffers (shared_blks_read against \
                   shared_blks_hit), or a plan reading far more pages than its rows need",
    confirmed_by: "shared_blks_read against shared_blks_hit of the statement; IO:DataFileRead \
                   waits; reads in pg_stat_io (16+)",
    pgss_columns: &["shared_blks_read", "shared_blks_hit"],
};

pub const WAL: Subsystem = Subsystem {
    name: "wal",
    what: "writing the write-ahead log",
    functions: &[
        "XLogInsert",
        "XLogInsertRecord",
        "XLogRecordAssemble",
        "CopyXLogRecordToWAL",
        "XLogFlush",
        "XLogWrite",
        "XLogBackgroundFlush",
        "log_newpage_buffer",
    ],
    prefixes: &["XLogRegister"],
    modules: &[],
    except_under: &[],
    usual_causes: "full-page images after each checkpoint (wal_fpi against wal_records: \
                   checkpoint_timeout, max_wal_size), or waiting for the WAL flush at commit \
                   (synchronous_commit, many small transactions)",
    confirmed_by: "wal_fpi against wal_records of the statement; checkpoints_req in pg_stat_bgwriter (pg_stat_checkpointer from 17)",
    pgss_columns: &["wal_records", "wal_fpi", "wal_bytes"],
};

pub const LOCK_MANAGER: Subsystem = Subsystem {
    name: "lock_manager",
    what: "taking and releasing heavyweight locks (relations, tuples, transactions)",
    functions: &[
        "LockAcquire",
        "LockAcquireExtended",
        "LockRelease",
        "LockReleaseAll",
        "LockRelationOid",
        "UnlockRelationId",
        "FastPathGrantRelationLock",
        "FastPathUnGrantRelationLock",
        "SetupLockInTable",
    ],
    prefixes: &[],
    modules: &[],
    except_under: &[],
    usual_causes: "many relations locked per statement (partitions, indexes: beyond 16 the \
                   fast path is full and the shared lock table's LWLocks are contended)",
    confirmed_by: "pg_locks rows with fastpath = false for the statement's backends",
    pgss_columns: &[],
};

pub const CATALOG_CACHES: Subsystem = Subsystem {
    name: "catalog_caches",
    what: "looking up and rebuilding catalog caches (relations, types, functions)",
    functions: &[
        "RelationBuildDesc",
        "RelationCacheInvalidate",
        "AcceptInvalidationMessages",
        "ReceiveSharedInvalidMessages",
        "InvalidateSystemCaches",
    ],
    prefixes: &[
        "SearchCatCache",
        "SearchSysCache",
        "CatalogCache",
        "RelationIdGetRelation",
    ],
    modules: &[],
    except_under: &[],
    usual_causes: "caches rebuilt after invalidations (DDL, temporary tables, ANALYZE in a \
                   loop) or a first access to many relations in each new session (no \
                   connection pooling)",
    confirmed_by:
        "none in pg_stat_statements; invalidations show as the statement's time in AcceptInvalidationMessages",
    pgss_columns: &[],
};

pub const EXPRESSIONS: Subsystem = Subsystem {
    name: "expressions",
    what: "evaluating expressions (WHERE clauses, projections, function calls)",
    functions: &["ExecInterpExpr", "ExecQual", "ExecProject"],
    prefixes: &["ExecEval", "ExecJust"],
    modules: &[],
    except_under: &[],
    usual_causes: "a filter evaluated for many rows it then discards (an index the planner \
                   could not use), or costly functions in the select list",
    confirmed_by: "rows against the rows the plan reads (EXPLAIN ANALYZE: Rows Removed by Filter)",
    pgss_columns: &["rows", "calls"],
};

pub const PG_STAT_STATEMENTS: Subsystem = Subsystem {
    name: "pg_stat_statements",
    what: "pg_stat_statements recording statements",
    // Its own work: not its hooks (`pgss_ExecutorRun`, `pgss_planner`, …), which every
    // statement runs through while the extension is loaded.
    functions: &[
        "pgss_store",
        "pgss_hash_string",
        "entry_alloc",
        "entry_dealloc",
        "entry_reset",
        "gc_qtexts",
        "generate_normalized_query",
        "fill_in_constant_lengths",
    ],
    prefixes: &["qtext_"],
    modules: &[],
    except_under: &[],
    usual_causes: "more distinct statements than pg_stat_statements.max (evictions, \
                   pg_stat_statements_info.dealloc) or a statement so hot that its entry's \
                   spinlock is contended",
    confirmed_by: "dealloc in pg_stat_statements_info; the LWLock:pg_stat_statements wait",
    pgss_columns: &[],
};

pub const VACUUM: Subsystem = Subsystem {
    name: "vacuum",
    what: "vacuuming tables and freezing",
    functions: &[
        "heap_vacuum_rel",
        "lazy_scan_heap",
        "lazy_vacuum",
        "lazy_vacuum_heap_rel",
        "vac_update_datfrozenxid",
        "vac_update_relstats",
    ],
    prefixes: &["lazy_scan_", "lazy_vacuum_"],
    modules: &[],
    except_under: &[],
    usual_causes: "large tables scanned whole (the visibility map not set), indexes vacuumed \
                   again for lack of maintenance_work_mem, or pg_class scanned per database \
                   by vac_update_datfrozenxid",
    confirmed_by: "pg_stat_progress_vacuum, and n_dead_tup and last_autovacuum in pg_stat_user_tables",
    pgss_columns: &[],
};

/// Every subsystem the catalogue knows, the most specific first (a family lists the functions
/// that do its work, never one through which other work passes: a hook, an executor node
/// that runs its input's plan): a frame is the first one's
/// that holds it.
pub const ALL: &[&Subsystem] = &[
    &TEMP_FILES,
    &SORT,
    &HASH_AGGREGATE,
    &HASH_JOIN,
    &JIT,
    &PLANNER,
    &PLPGSQL,
    &COLLATION,
    &TOAST,
    &PATTERN_MATCHING,
    &CATALOG_CHANGES,
    &SESSIONS,
    &WAL,
    &DATA_FILE_READS,
    &BUFFER_MANAGER,
    &LOCK_MANAGER,
    &CATALOG_CACHES,
    &PG_STAT_STATEMENTS,
    &VACUUM,
    &EXPRESSIONS,
];

/// The subsystem `function` (in `module`, when known) belongs to, if the catalogue knows it.
pub fn of_frame(function: &str, module: Option<&str>) -> Option<&'static Subsystem> {
    ALL.iter().copied().find(|s| s.holds(function, module))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_map_to_the_part_of_postgres_they_run() {
        assert_eq!(of_frame("tuplesort_performsort", None), Some(&SORT));
        assert_eq!(of_frame("comparetup_heap", None), Some(&SORT));
        assert_eq!(of_frame("BufFileWrite", None), Some(&TEMP_FILES));
        assert_eq!(of_frame("LogicalTapeWrite", None), Some(&TEMP_FILES));
        assert_eq!(of_frame("hashagg_spill_tuple", None), Some(&HASH_AGGREGATE));
        assert_eq!(of_frame("ExecHashTableInsert", None), Some(&HASH_JOIN));
        assert_eq!(
            of_frame("llvm::PassManager::run", Some("libLLVM-14.so.1")),
            Some(&JIT)
        );
        assert_eq!(of_frame("XLogInsertRecord", None), Some(&WAL));
        assert_eq!(of_frame("varstr_cmp", None), Some(&COLLATION));
        assert_eq!(of_frame("plpgsql.so+0x1f2a0", Some("plpgsql.so")), Some(&PLPGSQL));
        assert_eq!(
            of_frame("ucol_strcollIter_72", Some("libicui18n.so.72")),
            Some(&COLLATION)
        );
        assert_eq!(of_frame("mdread", None), Some(&DATA_FILE_READS));
        assert_eq!(of_frame("detoast_attr", None), Some(&TOAST));
        assert_eq!(of_frame("textregexeq", None), Some(&PATTERN_MATCHING));
        assert_eq!(of_frame("regexp_replace", None), Some(&PATTERN_MATCHING));
        assert_eq!(of_frame("CatalogTupleInsert", None), Some(&CATALOG_CHANGES));
        assert_eq!(of_frame("InitPostgres", None), Some(&SESSIONS));
        // What a whole session runs under is not its setup.
        assert_eq!(of_frame("PostgresMain", None), None);
        assert_eq!(of_frame("ReadBuffer_common", None), Some(&BUFFER_MANAGER));
        assert_eq!(
            of_frame("pgss_store", Some("pg_stat_statements.so")),
            Some(&PG_STAT_STATEMENTS)
        );
        // A hook every statement runs through is not the extension's work.
        assert_eq!(of_frame("pgss_ExecutorRun", Some("pg_stat_statements.so")), None);
        // The executor's dispatch and a stripped build's unnamed frames belong to none.
        assert_eq!(of_frame("ExecProcNode", None), None);
        assert_eq!(of_frame("postgres+0x2ff300", Some("postgres")), None);
    }

    /// Every family of the server's own code holds functions of every major's executable, as
    /// its symbol table names them (the upstream builds' `.symtab`, the distro's `.dynsym`):
    /// a family whose names a major inlined or renamed would never be sampled there. (The JIT
    /// and pg_stat_statements families live in their own libraries.)
    #[test]
    fn each_family_holds_functions_of_every_major() {
        let mut binaries: Vec<(String, std::path::PathBuf, &str)> =
            super::super::header_check::upstream_dirs()
                .iter()
                .map(|(major, dir)| (major.to_string(), dir.join("bin/postgres"), "--defined-only"))
                .collect();
        binaries.push((
            "15 (distro)".into(),
            "/usr/lib/postgresql/15/bin/postgres".into(),
            "--dynamic",
        ));
        for (major, binary, table) in binaries {
            let nm = std::process::Command::new("nm")
                .args([table, "--defined-only"])
                .arg(&binary)
                .output()
                .expect("nm (binutils) is needed");
            assert!(nm.status.success(), "nm {}", binary.display());
            let names: Vec<String> = String::from_utf8_lossy(&nm.stdout)
                .lines()
                .filter_map(|line| line.split_whitespace().nth(2).map(str::to_owned))
                .collect();
            for family in ALL
                .iter()
                .filter(|f| !["jit", "pg_stat_statements", "plpgsql"].contains(&f.name))
            {
                assert!(
                    names.iter().any(|name| family.holds(name, None)),
                    "PostgreSQL {major}: no function of family `{}` in {}",
                    family.name,
                    binary.display()
                );
            }
        }
    }

    #[test]
    fn names_are_unique_and_every_family_has_functions_and_a_confirmation() {
        for (i, subsystem) in ALL.iter().enumerate() {
            assert!(ALL[i + 1..].iter().all(|s| s.name != subsystem.name));
            assert!(
                !(subsystem.functions.is_empty() && subsystem.prefixes.is_empty()),
                "{}",
                subsystem.name
            );
            assert!(!subsystem.confirmed_by.is_empty(), "{}", subsystem.name);
        }
    }
}
