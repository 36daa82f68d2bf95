//! PostgreSQL 15. Offsets, sizes and constants come from the server headers
//! (`postgresql-server-dev-15`: `utils/backend_status.h`, `postmaster/bgworker.h`,
//! `storage/lwlock.h`, `utils/wait_event.h`): `tests::offsets_match_the_server_headers`
//! recomputes them with a C program, `tests/tests/pg15_names.rs` decodes live backends' memory against
//! `pg_stat_activity`, and `tests/tests/attribution.rs` checks the sample labels end to end.

pub mod names;
mod probes;

use super::{InstanceNameGlobals, SampleGlobals, StatusSlotGlobals, VersionTable};

/// The major this module describes.
pub const MAJOR: u32 = 15;

/// Where Debian's `postgresql-server-dev-15` puts the server headers the tests check against.
#[cfg(test)]
const SERVER_INCLUDE: &str = "/usr/include/postgresql/15/server";

pub static TABLE: VersionTable = VersionTable {
    major: MAJOR,
    sample_globals: SampleGlobals {
        my_be_entry: "MyBEEntry",
        my_wait_event_info: "my_wait_event_info",
        my_backend_type: "MyBackendType",
        my_database_id: "MyDatabaseId",
    },
    status_slot_globals: StatusSlotGlobals {
        backend_id: "MyBackendId",
        aux_proc_type: "MyAuxProcType",
        max_backends: "MaxBackends",
    },
    instance_name_globals: InstanceNameGlobals {
        named_tranche_array: "NamedLWLockTrancheArray",
        named_tranche_requests: "NamedLWLockTrancheRequests",
        my_bgworker_entry: "MyBgworkerEntry",
    },
    probe_signature: probes::signature,
    st_changecount_offset: 0,
    status_entry_size: 432,
    aux_proc_types: 6,
    st_state_offset: 232,
    st_query_id_offset: 424,
    bg_worker_backend_type: 4,
    bgw_type_offset: 96,
    bgw_maxlen: 96,
    pg_wait_lwlock: 0x0100_0000,
    lwtranche_first_user_defined: 75,
    named_lwlock_tranche_size: 16,
    tranche_id_offset: 0,
    tranche_name_offset: 8,
    backend_type_name: names::backend_type,
    backend_state_name: names::backend_state,
    wait_event_name: names::wait_event,
};

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use super::{SERVER_INCLUDE, TABLE};

    /// Prints the offsets pgscope reads, as the C compiler lays the struct out.
    const OFFSETS_C: &str = r#"
#include "postgres.h"
/* port.h maps printf to pg_printf, which lives in libpgport; the program links only libc. */
#undef printf
#include <stddef.h>
#include <stdio.h>
#include "miscadmin.h"
#include "postmaster/bgworker.h"
#include "storage/lwlock.h"
#include "utils/backend_status.h"
#include "utils/wait_event.h"

int main(void)
{
    printf("%zu %zu %zu\n", offsetof(PgBackendStatus, st_changecount), offsetof(PgBackendStatus, st_state),
           offsetof(PgBackendStatus, st_query_id));
    printf("%zu %u\n", sizeof(PgBackendStatus), (unsigned) NUM_AUXPROCTYPES);
    printf("%u %zu %u\n", (unsigned) B_BG_WORKER, offsetof(BackgroundWorker, bgw_type), (unsigned) BGW_MAXLEN);
    printf("%u %u\n", (unsigned) PG_WAIT_LWLOCK, (unsigned) LWTRANCHE_FIRST_USER_DEFINED);
    printf("%zu %zu %zu\n", sizeof(NamedLWLockTranche), offsetof(NamedLWLockTranche, trancheId),
           offsetof(NamedLWLockTranche, trancheName));
    return 0;
}
"#;

    /// A directory removed on drop (the agent has no tempfile dependency).
    struct ScratchDir(PathBuf);

    impl ScratchDir {
        fn new() -> Self {
            let dir = std::env::temp_dir().join(format!(
                "pgscope-pg15-offsets-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("cannot create a scratch dir in the temp dir");
            ScratchDir(dir)
        }
    }

    impl Drop for ScratchDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn offsets_match_the_server_headers() {
        assert!(
            Path::new(SERVER_INCLUDE).join("utils/backend_status.h").is_file(),
            "`{SERVER_INCLUDE}/utils/backend_status.h` is missing: install the PostgreSQL 15 server \
             headers (`postgresql-server-dev-15`, which scripts/install-deps.sh installs)"
        );
        let dir = ScratchDir::new();
        let source = dir.0.join("offsets.c");
        let program = dir.0.join("offsets");
        std::fs::write(&source, OFFSETS_C).expect("cannot write the C program");
        let cc = Command::new("cc")
            .arg(format!("-I{SERVER_INCLUDE}"))
            .arg("-o")
            .arg(&program)
            .arg(&source)
            .output()
            .expect("cannot run `cc` (build-essential)");
        assert!(
            cc.status.success(),
            "`cc` failed on the offsets program: {}",
            String::from_utf8_lossy(&cc.stderr)
        );
        let run = Command::new(&program)
            .output()
            .expect("cannot run the offsets program");
        assert!(run.status.success(), "the offsets program failed: {}", run.status);
        let stdout = String::from_utf8_lossy(&run.stdout);
        let lines: Vec<Vec<u32>> = stdout
            .lines()
            .map(|line| {
                line.split_whitespace()
                    .map(|n| n.parse().expect("the offsets program prints numbers"))
                    .collect()
            })
            .collect();
        let expected = [
            (
                "offsetof(PgBackendStatus, st_changecount / st_state / st_query_id)",
                vec![
                    TABLE.st_changecount_offset,
                    TABLE.st_state_offset,
                    TABLE.st_query_id_offset,
                ],
            ),
            (
                "sizeof(PgBackendStatus), NUM_AUXPROCTYPES",
                vec![TABLE.status_entry_size, TABLE.aux_proc_types],
            ),
            (
                "B_BG_WORKER, offsetof(BackgroundWorker, bgw_type), BGW_MAXLEN",
                vec![
                    TABLE.bg_worker_backend_type,
                    TABLE.bgw_type_offset,
                    TABLE.bgw_maxlen,
                ],
            ),
            (
                "PG_WAIT_LWLOCK, LWTRANCHE_FIRST_USER_DEFINED",
                vec![TABLE.pg_wait_lwlock, TABLE.lwtranche_first_user_defined],
            ),
            (
                "sizeof(NamedLWLockTranche), offsetof(NamedLWLockTranche, trancheId / trancheName)",
                vec![
                    TABLE.named_lwlock_tranche_size,
                    TABLE.tranche_id_offset,
                    TABLE.tranche_name_offset,
                ],
            ),
        ];
        assert_eq!(
            lines.len(),
            expected.len(),
            "the offsets program printed:\n{stdout}"
        );
        for ((what, table), headers) in expected.iter().zip(&lines) {
            assert_eq!(headers, table, "{what} in the server headers vs. v15::TABLE");
        }
    }
}
