//! What the tests judge counts against: the CPU time the traced processes were given during the
//! same run, from the scheduler's own accounting (`/proc/PID/schedstat`), never the machine's
//! speed. A busy machine gives a backend less CPU and pgscope fewer samples of it, in the same
//! proportion: a count compared with `CPU seconds × frequency` holds on any machine, and a wait
//! for "enough CPU time" replaces a fixed duration.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{ensure, Context, Result};

use crate::process::wait_for;

/// A thread's time on CPU and waiting on a run queue (runnable, not running) so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedTime {
    pub on_cpu: Duration,
    pub runnable: Duration,
}

impl SchedTime {
    /// `/proc/PID/schedstat`: nanoseconds on CPU, nanoseconds waiting on a run queue, time
    /// slices. Postgres backends are single-threaded, so the main thread's is the process's.
    pub fn of(pid: u32) -> Result<Self> {
        let path = format!("/proc/{pid}/schedstat");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read `{path}`"))?;
        let mut fields = text.split_whitespace().map(str::parse::<u64>);
        let mut next = |what: &str| -> Result<u64> {
            fields
                .next()
                .and_then(|f| f.ok())
                .with_context(|| format!("`{path}` has no {what}: `{}`", text.trim()))
        };
        Ok(Self {
            on_cpu: Duration::from_nanos(next("time on CPU")?),
            runnable: Duration::from_nanos(next("run-queue time")?),
        })
    }

    fn since(self, start: Self) -> Self {
        Self {
            on_cpu: self.on_cpu.saturating_sub(start.on_cpu),
            runnable: self.runnable.saturating_sub(start.runnable),
        }
    }
}

/// The scheduler times of a set of processes from a start on: how much CPU they were given
/// over a window, and how long they waited for it.
pub struct CpuWindow {
    start: BTreeMap<u32, SchedTime>,
}

impl CpuWindow {
    /// Starts counting now for each of `pids`.
    pub fn start(pids: &[u32]) -> Result<Self> {
        ensure!(!pids.is_empty(), "a CPU window needs at least one process");
        let start = pids
            .iter()
            .map(|&pid| Ok((pid, SchedTime::of(pid)?)))
            .collect::<Result<_>>()?;
        Ok(Self { start })
    }

    pub fn pids(&self) -> Vec<u32> {
        self.start.keys().copied().collect()
    }

    /// Each process's times since the start.
    pub fn used_by(&self) -> Result<BTreeMap<u32, SchedTime>> {
        self.start
            .iter()
            .map(|(&pid, &start)| Ok((pid, SchedTime::of(pid)?.since(start))))
            .collect()
    }

    /// The processes' summed times since the start.
    pub fn used(&self) -> Result<SchedTime> {
        Ok(self
            .used_by()?
            .values()
            .fold(SchedTime::default(), |sum, t| SchedTime {
                on_cpu: sum.on_cpu + t.on_cpu,
                runnable: sum.runnable + t.runnable,
            }))
    }

    /// Waits until the processes together have used `wanted` of CPU since the start; returns
    /// their times. `timeout` bounds the wait; its expiry names the CPU time reached.
    pub fn await_cpu(&self, wanted: Duration, timeout: Duration) -> Result<SchedTime> {
        let mut last = SchedTime::default();
        let reached = wait_for(
            &format!("processes {:?} to use {wanted:?} of CPU", self.pids()),
            timeout,
            || {
                last = self.used()?;
                Ok((last.on_cpu >= wanted).then_some(last))
            },
        );
        reached.with_context(|| {
            format!(
                "they used {:?} on CPU and waited {:?} for one in {timeout:?}",
                last.on_cpu, last.runnable
            )
        })
    }

    /// Waits until each process has used `wanted` of CPU since the start; returns their times.
    pub fn await_cpu_each(&self, wanted: Duration, timeout: Duration) -> Result<BTreeMap<u32, SchedTime>> {
        wait_for(
            &format!("processes {:?} to use {wanted:?} of CPU each", self.pids()),
            timeout,
            || {
                let used = self.used_by()?;
                Ok(used.values().all(|t| t.on_cpu >= wanted).then_some(used))
            },
        )
    }
}

/// The samples `cpu` of CPU time yields at `frequency` Hz.
pub fn expected_samples(cpu: Duration, frequency: u32) -> f64 {
    cpu.as_secs_f64() * f64::from(frequency)
}

/// Fails unless `samples` is at least `min_ratio` of what `cpu` of CPU time yields at
/// `frequency` Hz: a count judged against the target's own CPU time over the same window.
pub fn ensure_samples_cover(
    what: &str,
    samples: u64,
    cpu: Duration,
    frequency: u32,
    min_ratio: f64,
) -> Result<()> {
    let expected = expected_samples(cpu, frequency);
    ensure!(
        samples as f64 >= min_ratio * expected,
        "{what}: {samples} samples for {cpu:?} of CPU at {frequency} Hz, which yields {expected:.0}; \
         fewer than {:.0}% of them",
        100.0 * min_ratio
    );
    Ok(())
}

/// The client backends serving the connections named `application_name` (the tag of a
/// `spawn_pgbench` run or a session), in pid order: the processes whose CPU time a count of
/// their samples is judged against.
pub fn client_backends(cluster: &crate::PgCluster, application_name: &str) -> Result<Vec<u32>> {
    // Sorted here: tests look statements up in pg_stat_statements by fragments of their text
    // (`ORDER BY` among them), so this one stays plain.
    let mut pids = cluster
        .psql(&format!(
            "SELECT pid FROM pg_stat_activity WHERE application_name = '{}' \
             AND backend_type = 'client backend'",
            application_name.replace('\'', "''")
        ))?
        .lines()
        .map(|pid| pid.parse().with_context(|| format!("bad pid `{pid}`")))
        .collect::<Result<Vec<u32>>>()?;
    pids.sort_unstable();
    Ok(pids)
}

/// CPU time the hypervisor has taken from this VM so far, summed over its CPUs (`steal` of the
/// `cpu` line of `/proc/stat`; zero on bare metal and where the host does not report it). A
/// sampling timer that expires while the VM is descheduled fires once when it runs again, however
/// many periods it missed; where the kernel does not leave stolen time out of a process's CPU
/// time, its samples fall behind it. A failure about sample counts says how much was stolen.
pub fn stolen_time() -> Result<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").context("cannot read `/proc/stat`")?;
    let steal = stat
        .lines()
        .find_map(|line| line.strip_prefix("cpu "))
        .and_then(|fields| fields.split_whitespace().nth(7))
        .and_then(|ticks| ticks.parse::<u64>().ok())
        .context("`/proc/stat` has no steal time on its `cpu` line")?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(per_second > 0, "sysconf(_SC_CLK_TCK) returned {per_second}");
    Ok(Duration::from_secs_f64(steal as f64 / per_second as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_and_counts_forward() {
        // SAFETY: gettid has no preconditions; /proc/TID/schedstat is this test thread's own.
        let tid = unsafe { libc::gettid() } as u32;
        let window = CpuWindow::start(&[tid]).expect("own schedstat");
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let used = window.used().expect("own schedstat");
        assert!(used.on_cpu > Duration::ZERO, "{used:?}");
    }

    #[test]
    fn reads_stolen_time_forward() {
        let before = stolen_time().expect("/proc/stat");
        assert!(stolen_time().expect("/proc/stat") >= before);
    }

    #[test]
    fn judges_counts_against_cpu_time() {
        let cpu = Duration::from_secs(2);
        assert_eq!(expected_samples(cpu, 99), 198.0);
        assert!(ensure_samples_cover("t", 180, cpu, 99, 0.9).is_ok());
        let error = ensure_samples_cover("t", 170, cpu, 99, 0.9).expect_err("170 < 178.2");
        assert!(error.to_string().contains("170 samples"), "{error}");
    }
}
