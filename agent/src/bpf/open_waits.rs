//! Off-CPU waits still open, read from the task storage through pidfds: `trace` counts them up
//! to its end, and the agent ships them in parts while they last (see `Session::ship_open_waits`).

use std::os::fd::AsFd;

use anyhow::{anyhow, Context, Result};
use aya::maps::Map;

use super::abi::{OffCpuTask, RawAttribution};
use super::{monotonic_ns, task_storage, OnCpuProbes};

/// A traced thread switched out and not back in yet.
#[derive(Clone, Copy, Debug)]
pub struct OpenWait {
    pub tgid: u32,
    pub tid: u32,
    /// When it blocked (CLOCK_MONOTONIC): with `tid`, the wait's identity.
    pub start_ns: u64,
    /// Its attribution when it blocked.
    pub attr: RawAttribution,
    /// How long it has been blocked, up to a moment it was seen still blocked: never more
    /// than the wait lasts.
    pub so_far_ns: u64,
}

impl OnCpuProbes {
    /// The waits the traced processes (single-threaded Postgres processes) are in now.
    pub fn open_off_cpu_waits(&self) -> Result<Vec<OpenWait>> {
        let Map::Unsupported(tasks) = self.map("off_cpu_tasks")? else {
            return Err(anyhow!(
                "`off_cpu_tasks` is not the task storage map it should be"
            ));
        };
        let mut open = Vec::new();
        for pid in self.target_pids()? {
            // Read before the task: a wait seen open was open at least until then.
            let now = monotonic_ns();
            // SAFETY: OffCpuTask is the map's value type, generated from pgscope.h.
            let task = unsafe { task_storage::lookup::<OffCpuTask>(tasks.fd().as_fd(), pid) }
                .with_context(|| format!("reading the off-CPU state of PID {pid}"))?;
            if let Some(task) = task.filter(|t| t.measured == 1 && t.start_ns != 0) {
                open.push(OpenWait {
                    tgid: task.tgid,
                    tid: pid,
                    start_ns: task.start_ns,
                    attr: task.attr,
                    so_far_ns: now.saturating_sub(task.start_ns),
                });
            }
        }
        Ok(open)
    }
}
