//! Reading a setting from a backend's own memory: the GUC variable it runs with, whatever set
//! it (role, database, client, `SET`). `collect::settings_seen` keeps what was read per
//! statement.

use anyhow::{anyhow, Result};

use super::{memory, ExportedGlobals, VersionTable};

/// The exported GUC variable of `plan_cache_mode` (`utils/plancache.h`, an int).
pub const PLAN_CACHE_MODE_GLOBAL: &str = "plan_cache_mode";

/// The address of `plan_cache_mode` in the processes of the instance of `root` (the same in
/// every process forked from one postmaster); None when it is not exported or unreadable.
pub fn plan_cache_mode_address(root: u32) -> Option<u64> {
    ExportedGlobals::resolve(root, &[PLAN_CACHE_MODE_GLOBAL])
        .and_then(|globals| globals.address(PLAN_CACHE_MODE_GLOBAL))
        .map_err(|error| tracing::debug!(root, "plan_cache_mode not located: {error:#}"))
        .ok()
}

/// `plan_cache_mode` as process `pid` runs it, named as `SHOW` names it.
pub fn plan_cache_mode_at(pid: u32, address: u64, table: &VersionTable) -> Result<&'static str> {
    let value = memory::read_i32(pid, address)?;
    usize::try_from(value)
        .ok()
        .and_then(|index| table.plan_cache_modes.get(index).copied())
        .ok_or_else(|| anyhow!("PID {pid} holds plan_cache_mode {value}, not a PlanCacheMode"))
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
}
