//! A backend's current statement as its status entry shows it now, read from its memory: the
//! statement's start (`st_activity_start_timestamp`) and the queryid reported for it
//! (`st_query_id`). Postgres keeps both after the statement ends, until the next one starts,
//! so a backend waiting for its client still names the statement it last ran: what resolves
//! the samples taken before that statement reported its queryid (`statement_link`) when no
//! later sample of it came.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};

use crate::postgres::backend_settings::BackendGlobals;
use crate::postgres::{memory, VersionTable};

/// Attempts at a consistent read of an entry its backend is writing.
const READ_ATTEMPTS: usize = 3;

/// Reads backends' current statements; remembers where each instance keeps `MyBEEntry`.
#[derive(Debug, Default)]
pub struct StatementReader {
    /// The address of `MyBEEntry` (the same in every process of an instance), by instance
    /// root; None when it cannot be located.
    my_be_entry: HashMap<u32, Option<u64>>,
}

impl StatementReader {
    /// `(statement start, queryid)` of backend `pid` of the instance of `root` now; None when
    /// its memory cannot be read (it exited) or its entry changed under every read.
    pub fn current_statement(&mut self, root: u32, pid: u32, table: &VersionTable) -> Option<(u64, i64)> {
        let my_be_entry = *self
            .my_be_entry
            .entry(root)
            .or_insert_with(|| BackendGlobals::locate(root, table).my_be_entry);
        read_statement(pid, my_be_entry?, table)
            .map_err(|error| tracing::trace!(pid, "current statement not read: {error:#}"))
            .ok()
    }
}

/// Reads the entry as Postgres' own readers do (`pgstat_read_current_status`): its change count
/// is even and the same before and after, or the backend was writing it meanwhile.
fn read_statement(pid: u32, my_be_entry: u64, table: &VersionTable) -> Result<(u64, i64)> {
    let entry = memory::read_u64(pid, my_be_entry)?;
    if entry == 0 {
        bail!("PID {pid} has no status entry");
    }
    let offset = |field: u32| usize::try_from(field).context("offset");
    let (count_at, start_at, query_id_at) = (
        offset(table.st_changecount_offset)?,
        offset(table.st_activity_start_offset)?,
        offset(table.st_query_id_offset)?,
    );
    let len = count_at.max(start_at).max(query_id_at) + 8;
    let mut bytes = vec![0u8; len];
    for _ in 0..READ_ATTEMPTS {
        memory::read_into(pid, entry, &mut bytes)?;
        let before = i32_at(&bytes, count_at)?;
        let after = memory::read_i32(pid, entry + count_at as u64)?;
        if before == after && before % 2 == 0 {
            let start = u64_at(&bytes, start_at)?;
            // 14-17 keep it as uint64, SQL shows it as bigint: the same bits, signed.
            let query_id = u64_at(&bytes, query_id_at)? as i64;
            return Ok((start, query_id));
        }
    }
    bail!("PID {pid}'s status entry changed under {READ_ATTEMPTS} reads")
}

fn u64_at(bytes: &[u8], at: usize) -> Result<u64> {
    let field = bytes.get(at..at + 8).context("field past the read")?;
    Ok(u64::from_ne_bytes(field.try_into()?))
}

fn i32_at(bytes: &[u8], at: usize) -> Result<i32> {
    let field = bytes.get(at..at + 4).context("field past the read")?;
    Ok(i32::from_ne_bytes(field.try_into()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::table_for;

    /// This process stands in for a backend: a status entry laid out as 15's, and a
    /// `MyBEEntry` pointing at it, read through /proc/self/mem.
    #[test]
    fn reads_start_and_queryid_when_the_entry_is_stable() {
        let table = table_for(15).expect("supported");
        let mut entry = vec![0u8; table.status_entry_size as usize];
        let put = |entry: &mut Vec<u8>, at: u32, value: &[u8]| {
            entry[at as usize..at as usize + value.len()].copy_from_slice(value);
        };
        put(
            &mut entry,
            table.st_activity_start_offset,
            &812_345_678u64.to_ne_bytes(),
        );
        put(&mut entry, table.st_query_id_offset, &(-42i64).to_ne_bytes());
        let pointer = Box::new(entry.as_ptr() as u64);
        let my_be_entry = &*pointer as *const u64 as u64;
        let pid = std::process::id();
        assert_eq!(
            read_statement(pid, my_be_entry, table).ok(),
            Some((812_345_678, -42))
        );
        // Odd: the backend is writing it.
        put(&mut entry, table.st_changecount_offset, &1i32.to_ne_bytes());
        assert!(read_statement(pid, my_be_entry, table).is_err());
        let null = Box::new(0u64);
        assert!(read_statement(pid, &*null as *const u64 as u64, table).is_err());
    }
}
