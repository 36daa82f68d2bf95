//! Checks a major's table against that major's own server headers with the C compiler: every
//! offset, size and constant the table holds is printed by a C program built against the
//! headers, and every probed function's prototype and every global the table names is
//! redeclared there (a redeclaration whose types differ does not compile). Each `vNN` module's
//! tests call these; 15's headers are the distro's, the others' come from `scripts/pg-majors.sh`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use super::signatures::{BT_GETROOT_FROM_16, BT_GETROOT_UNTIL_15};
use super::status_slots::StatusSlots;
use super::VersionTable;
use crate::bpf::abi::Function;

/// Where Debian's `postgresql-server-dev-15` puts the server headers.
const DISTRO_15_INCLUDE: &str = "/usr/include/postgresql/15/server";

/// `include/server` of `major`: the distro's for 15, the cached upstream headers of the others
/// (`scripts/pg-majors.sh` prints `MAJOR PATH` per major and fetches them when missing).
fn server_include(major: u32) -> PathBuf {
    let include = if major == 15 {
        PathBuf::from(DISTRO_15_INCLUDE)
    } else {
        upstream_dirs()
            .iter()
            .find(|(m, _)| *m == major)
            .unwrap_or_else(|| panic!("scripts/pg-majors.sh lists no PostgreSQL {major}"))
            .1
            .join("include/server")
    };
    assert!(
        include.join("utils/backend_status.h").is_file(),
        "`{}` holds no PostgreSQL {major} server headers: install them (`make deps` for 15, \
         `make pg-majors` for the others)",
        include.display()
    );
    include
}

/// `(major, cache dir)` of every upstream build, from one run of `scripts/pg-majors.sh`.
pub(super) fn upstream_dirs() -> &'static [(u32, PathBuf)] {
    static DIRS: OnceLock<Vec<(u32, PathBuf)>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/pg-majors.sh");
        let run = Command::new(&script)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            run.status.success(),
            "{} failed (run `make pg-majors`):\n{}",
            script.display(),
            String::from_utf8_lossy(&run.stderr)
        );
        String::from_utf8_lossy(&run.stdout)
            .lines()
            .filter_map(|line| {
                let (major, dir) = line.split_once(' ')?;
                Some((major.parse().ok()?, PathBuf::from(dir)))
            })
            .collect()
    })
}

/// Compiles `source` against `include` (and links and runs it when `run`).
fn compile(include: &Path, source: &str, run: bool) -> (Output, Option<Output>) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("check.c");
    std::fs::write(&path, source).expect("cannot write the C unit");
    let program = dir.path().join("check");
    let mut cc = Command::new("cc");
    cc.arg(format!("-I{}", include.display())).arg("-Werror");
    if run {
        cc.arg("-o").arg(&program);
    } else {
        cc.arg("-fsyntax-only");
    }
    let cc = cc.arg(&path).output().expect("cannot run `cc` (build-essential)");
    let ran = (run && cc.status.success())
        .then(|| Command::new(&program).output().expect("cannot run the C program"));
    (cc, ran)
}

/// The value the table gives `plan_cache_mode` setting `name`.
fn plan_cache_mode(table: &VersionTable, name: &str) -> u32 {
    let index = table.plan_cache_modes.iter().position(|&m| m == name);
    u32::try_from(index.expect("every table names the three modes")).expect("small")
}

/// The values the table holds, each as (what, C expression, table value).
fn table_values(table: &VersionTable) -> Vec<(&'static str, &'static str, u32)> {
    vec![
        (
            "st_changecount",
            "offsetof(PgBackendStatus, st_changecount)",
            table.st_changecount_offset,
        ),
        (
            "st_state",
            "offsetof(PgBackendStatus, st_state)",
            table.st_state_offset,
        ),
        (
            "st_query_id",
            "offsetof(PgBackendStatus, st_query_id)",
            table.st_query_id_offset,
        ),
        (
            "st_activity_start_timestamp",
            "offsetof(PgBackendStatus, st_activity_start_timestamp)",
            table.st_activity_start_offset,
        ),
        (
            "st_userid",
            "offsetof(PgBackendStatus, st_userid)",
            table.st_userid_offset,
        ),
        (
            "status entry size",
            "sizeof(PgBackendStatus)",
            table.status_entry_size,
        ),
        ("STATE_IDLE", "STATE_IDLE", table.state_idle),
        (
            "PLAN_CACHE_MODE_AUTO",
            "PLAN_CACHE_MODE_AUTO",
            plan_cache_mode(table, "auto"),
        ),
        (
            "PLAN_CACHE_MODE_FORCE_GENERIC_PLAN",
            "PLAN_CACHE_MODE_FORCE_GENERIC_PLAN",
            plan_cache_mode(table, "force_generic_plan"),
        ),
        (
            "PLAN_CACHE_MODE_FORCE_CUSTOM_PLAN",
            "PLAN_CACHE_MODE_FORCE_CUSTOM_PLAN",
            plan_cache_mode(table, "force_custom_plan"),
        ),
        (
            "WAIT_EVENT_CLIENT_READ",
            "WAIT_EVENT_CLIENT_READ",
            table.wait_event_client_read,
        ),
        (
            "aux slots",
            table.status_slots.aux_slots_constant(),
            table.status_slots.aux_slots(),
        ),
        ("B_BG_WORKER", "B_BG_WORKER", table.bg_worker_backend_type),
        (
            "bgw_type",
            "offsetof(BackgroundWorker, bgw_type)",
            table.bgw_type_offset,
        ),
        ("BGW_MAXLEN", "BGW_MAXLEN", table.bgw_maxlen),
        ("PG_WAIT_LWLOCK", "PG_WAIT_LWLOCK", table.pg_wait_lwlock),
        (
            "LWTRANCHE_FIRST_USER_DEFINED",
            "LWTRANCHE_FIRST_USER_DEFINED",
            table.lwtranche_first_user_defined,
        ),
        (
            "NamedLWLockTranche size",
            "sizeof(NamedLWLockTranche)",
            table.named_lwlock_tranche_size,
        ),
        (
            "trancheId",
            "offsetof(NamedLWLockTranche, trancheId)",
            table.tranche_id_offset,
        ),
        (
            "trancheName",
            "offsetof(NamedLWLockTranche, trancheName)",
            table.tranche_name_offset,
        ),
        ("T_TriggerData", "T_TriggerData", table.triggers.trigger_data_tag),
        (
            "FunctionCallInfoBaseData.context",
            "offsetof(FunctionCallInfoBaseData, context)",
            table.triggers.fcinfo_context_offset.into(),
        ),
        (
            "TriggerData.tg_trigger",
            "offsetof(TriggerData, tg_trigger)",
            table.triggers.tg_trigger_offset.into(),
        ),
        (
            "Trigger.tgoid",
            "offsetof(Trigger, tgoid)",
            table.triggers.tgoid_offset.into(),
        ),
        (
            "Trigger.tgconstraint",
            "offsetof(Trigger, tgconstraint)",
            table.triggers.tgconstraint_offset.into(),
        ),
    ]
}

/// Headers declaring what the table's values and globals name.
fn headers(table: &VersionTable) -> Vec<&'static str> {
    let mut headers = vec![
        "commands/trigger.h",
        "fmgr.h",
        "jit/jit.h",
        "pgstat.h",
        "miscadmin.h",
        "postmaster/bgworker.h",
        "storage/lwlock.h",
        "storage/proc.h",
        "utils/backend_status.h",
        "utils/plancache.h",
        "utils/wait_event.h",
    ];
    headers.push(match table.status_slots {
        StatusSlots::BackendIdThenAuxType { .. } => "storage/backendid.h",
        StatusSlots::ProcNumber { .. } => "storage/procnumber.h",
    });
    headers
}

fn includes(headers: &[&str]) -> String {
    headers.iter().map(|h| format!("#include \"{h}\"\n")).collect()
}

/// Every offset, size and constant of `table` equals what its major's headers give.
pub(super) fn offsets_match_the_server_headers(table: &VersionTable) {
    let include = server_include(table.major);
    let values = table_values(table);
    let prints: String = values
        .iter()
        .map(|(_, expr, _)| format!("    printf(\"%lu\\n\", (unsigned long) ({expr}));\n"))
        .collect();
    // port.h maps printf to pg_printf, which lives in libpgport; the program links only libc.
    let source = format!(
        "#include \"postgres.h\"\n#undef printf\n#include <stddef.h>\n#include <stdio.h>\n{}\n\
         int main(void)\n{{\n{prints}    return 0;\n}}\n",
        includes(&headers(table))
    );
    let (cc, run) = compile(&include, &source, true);
    assert!(
        cc.status.success(),
        "PostgreSQL {}: the values program does not compile against {}:\n{}\n{source}",
        table.major,
        include.display(),
        String::from_utf8_lossy(&cc.stderr)
    );
    let run = run.expect("compiled, so run");
    assert!(run.status.success(), "the values program failed: {}", run.status);
    let printed: Vec<String> = String::from_utf8_lossy(&run.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(printed.len(), values.len(), "{printed:?}");
    for ((what, expr, value), header_value) in values.iter().zip(&printed) {
        assert_eq!(
            header_value,
            &value.to_string(),
            "PostgreSQL {}: {what} (`{expr}`) in the server headers vs. the table",
            table.major
        );
    }
}

/// A C unit that includes the headers, redeclares each prototype the table knows (`replace`
/// swaps one for another) and takes the address of each global the table names.
fn declarations_unit(table: &VersionTable, replace: Option<(Function, &str)>) -> String {
    let mut all_headers = vec!["postgres.h"];
    let mut declarations = String::new();
    for function in Function::ALL {
        let Some(signature) = (table.probe_signature)(function) else {
            continue;
        };
        let Some(header) = signature.header else {
            continue;
        };
        all_headers.push(header);
        let prototype = match replace {
            Some((replaced, other)) if replaced == function => other,
            _ => signature.prototype,
        };
        declarations.push_str(&format!("extern {prototype};\n"));
    }
    all_headers.extend(headers(table));
    // The functions the trigger probes are attached to, as bpf/triggers.bpf.c reads them.
    declarations.push_str(&format!(
        "extern void {}(FunctionCallInfo fcinfo, PgStat_FunctionCallUsage *fcu);\n\
         extern void {}(PgStat_FunctionCallUsage *fcu, bool finalize);\n",
        super::TRIGGER_CALL_START,
        super::TRIGGER_CALL_END
    ));
    let sample = table.sample_globals;
    let mut globals = vec![
        sample.my_be_entry,
        sample.my_wait_event_info,
        sample.my_backend_type,
        sample.my_database_id,
    ];
    globals.extend(table.status_slots.global_names());
    globals.extend(table.instance_name_globals.names());
    globals.push(super::backend_settings::PLAN_CACHE_MODE_GLOBAL);
    globals.push(super::backend_settings::JIT_GLOBAL);
    let addresses: String = globals
        .iter()
        .map(|name| format!("    (const volatile void *) &{name},\n"))
        .collect();
    format!(
        "{}\n{declarations}\nconst volatile void *pgscope_globals[] = {{\n{addresses}}};\n",
        includes(&all_headers)
    )
}

/// Every prototype the table gives agrees with its major's headers, every global it names is
/// declared there; and, as a control, the other form of `_bt_getroot` does not compile.
pub(super) fn prototypes_and_globals_match_the_server_headers(table: &VersionTable) {
    let include = server_include(table.major);
    let source = declarations_unit(table, None);
    let (cc, _) = compile(&include, &source, false);
    assert!(
        cc.status.success(),
        "PostgreSQL {}: prototypes or globals disagree with the server headers in {}:\n{}\n{source}",
        table.major,
        include.display(),
        String::from_utf8_lossy(&cc.stderr)
    );
    let own = (table.probe_signature)(Function::BtGetroot)
        .expect("every table knows _bt_getroot")
        .prototype;
    // 15's and 16's `_bt_getroot`: each major's control swaps in the one it does not have.
    let other = if own.contains("heaprel") {
        BT_GETROOT_UNTIL_15.prototype
    } else {
        BT_GETROOT_FROM_16.prototype
    };
    let wrong = declarations_unit(table, Some((Function::BtGetroot, other)));
    let (cc, _) = compile(&include, &wrong, false);
    assert!(
        !cc.status.success(),
        "PostgreSQL {}: a wrong prototype compiled:\n{wrong}",
        table.major
    );
    assert!(
        String::from_utf8_lossy(&cc.stderr).contains("_bt_getroot"),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
}
