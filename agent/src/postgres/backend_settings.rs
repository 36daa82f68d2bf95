//! Reading a backend's own memory for what it runs with: the GUC variables it has, whatever set
//! them (role, database, client, `SET`), and the database and role its session is, which name
//! the `ALTER ROLE … SET` / `ALTER DATABASE … SET` rows it started with.
//! `collect::settings_seen` keeps what was read per statement.

use anyhow::{anyhow, Result};

use super::{memory, ExportedGlobals, VersionTable};

/// The exported GUC variable of `plan_cache_mode` (`utils/plancache.h`, an int).
pub const PLAN_CACHE_MODE_GLOBAL: &str = "plan_cache_mode";
/// The exported GUC variable of `jit` (`jit/jit.h`, a bool).
pub const JIT_GLOBAL: &str = "jit_enabled";

/// Where the globals read are in the processes of one instance (the same in every process
/// forked from one postmaster); None where one is not exported.
#[derive(Clone, Copy, Debug, Default)]
pub struct BackendGlobals {
    pub plan_cache_mode: Option<u64>,
    pub jit: Option<u64>,
    /// `PgBackendStatus *MyBEEntry`.
    pub my_be_entry: Option<u64>,
    /// `Oid MyDatabaseId`.
    pub my_database_id: Option<u64>,
}

impl BackendGlobals {
    /// The globals of the instance of `root`; all None when its symbols cannot be read.
    pub fn locate(root: u32, table: &VersionTable) -> Self {
        let names = table.sample_globals;
        let wanted = [
            PLAN_CACHE_MODE_GLOBAL,
            JIT_GLOBAL,
            names.my_be_entry,
            names.my_database_id,
        ];
        let Ok(globals) = ExportedGlobals::resolve(root, &wanted)
            .map_err(|error| tracing::debug!(root, "backend settings not located: {error:#}"))
        else {
            return Self::default();
        };
        let at = |name: &str| {
            globals
                .address(name)
                .map_err(|error| tracing::debug!(root, "{error:#}"))
                .ok()
        };
        Self {
            plan_cache_mode: at(PLAN_CACHE_MODE_GLOBAL),
            jit: at(JIT_GLOBAL),
            my_be_entry: at(names.my_be_entry),
            my_database_id: at(names.my_database_id),
        }
    }
}

/// `plan_cache_mode` as process `pid` runs it, named as `SHOW` names it.
pub fn plan_cache_mode_at(pid: u32, address: u64, table: &VersionTable) -> Result<&'static str> {
    let value = memory::read_i32(pid, address)?;
    usize::try_from(value)
        .ok()
        .and_then(|index| table.plan_cache_modes.get(index).copied())
        .ok_or_else(|| anyhow!("PID {pid} holds plan_cache_mode {value}, not a PlanCacheMode"))
}

/// `jit` as process `pid` runs it. A C bool is one byte: the first of the four read (in memory
/// order) is the variable, the others are its neighbours in `.data`.
pub fn jit_at(pid: u32, address: u64) -> Result<bool> {
    match memory::read_i32(pid, address)?.to_ne_bytes()[0] {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(anyhow!("PID {pid} holds jit {other}, not a bool")),
    }
}

/// The (database OID, role OID) of process `pid`'s session: `MyDatabaseId`, and the session
/// user its status entry records (`st_userid`, set once at connection). Either is 0 where the
/// process has none (an auxiliary process).
pub fn session_at(pid: u32, globals: &BackendGlobals, table: &VersionTable) -> Result<(u32, u32)> {
    let (Some(entry), Some(database)) = (globals.my_be_entry, globals.my_database_id) else {
        return Err(anyhow!("MyBEEntry or MyDatabaseId is not exported"));
    };
    let oid = |address| memory::read_i32(pid, address).map(|v| u32::from_ne_bytes(v.to_ne_bytes()));
    let entry = memory::read_u64(pid, entry)?;
    if entry == 0 {
        return Err(anyhow!("PID {pid} has no status entry"));
    }
    Ok((oid(database)?, oid(entry + u64::from(table.st_userid_offset))?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::table_for;

    /// This process stands in for a backend: its own variable, read through /proc/self/mem.
    #[test]
    fn reads_each_mode_by_its_table_name() {
        let table = table_for(15).expect("supported");
        let pid = std::process::id();
        for (value, name) in [(0, "auto"), (1, "force_generic_plan"), (2, "force_custom_plan")] {
            let variable = Box::new(value);
            let address = &*variable as *const i32 as u64;
            assert_eq!(plan_cache_mode_at(pid, address, table).ok(), Some(name));
        }
        let outside = Box::new(7i32);
        assert!(plan_cache_mode_at(pid, &*outside as *const i32 as u64, table).is_err());
    }

    #[test]
    fn reads_jit_as_the_bool_at_its_address() {
        let pid = std::process::id();
        let bytes = Box::new([1u8, 0xff, 0xff, 0xff, 0, 0, 0, 0, 2, 0, 0, 0]);
        let at = |i: usize| &bytes[i] as *const u8 as u64;
        assert_eq!(jit_at(pid, at(0)).ok(), Some(true));
        assert_eq!(jit_at(pid, at(4)).ok(), Some(false));
        assert!(jit_at(pid, at(8)).is_err());
    }

    /// A fake status entry with `st_userid` where the table puts it, pointed to by a fake
    /// `MyBEEntry`, beside a fake `MyDatabaseId`.
    #[test]
    fn reads_the_session_through_the_status_entry() {
        let table = table_for(15).expect("supported");
        let pid = std::process::id();
        let mut entry = vec![0u8; table.status_entry_size as usize];
        let at = table.st_userid_offset as usize;
        entry[at..at + 4].copy_from_slice(&16_385u32.to_ne_bytes());
        let my_be_entry = Box::new(entry.as_ptr() as u64);
        let my_database_id = Box::new(16_384u32);
        let globals = BackendGlobals {
            my_be_entry: Some(&*my_be_entry as *const u64 as u64),
            my_database_id: Some(&*my_database_id as *const u32 as u64),
            ..BackendGlobals::default()
        };
        assert_eq!(session_at(pid, &globals, table).ok(), Some((16_384, 16_385)));
        let none = Box::new(0u64);
        let without = BackendGlobals {
            my_be_entry: Some(&*none as *const u64 as u64),
            ..globals
        };
        assert!(session_at(pid, &without, table).is_err());
        assert!(session_at(pid, &BackendGlobals::default(), table).is_err());
    }
}
