//! The off-CPU tables: time off CPU per (backend type, wait event, class) over everything, and
//! per queryid per (wait event, class) with where in Postgres its longest stack waited. Each
//! row knows whether it is time blocked (not the client's — idle, or `Client:*` inside a
//! transaction — nor a sleep asked for), so that views and rules leave the same time out.
//! Computed once from the off-CPU profile.

use std::collections::BTreeMap;

use exporters::{Frame, FrameKind, Profile};

use super::labels::{self, SampleLabels};
use super::QueryId;
use crate::bpf::abi::OffCpuClass;
use crate::collect::off_cpu::SHORT_WAITS_FRAME;

/// The wait column of samples that carry no wait event.
pub const NO_WAIT_EVENT: &str = "(no wait event)";

/// Off-CPU time of one (backend type, wait event, class) over the whole profile.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WaitRow {
    pub backend_type: String,
    /// `Type:Name`, or [`NO_WAIT_EVENT`].
    pub wait: String,
    pub class: String,
    pub ns: u64,
}

impl WaitRow {
    /// Whether it is time blocked: neither the client's nor a sleep asked for.
    pub fn is_blocked(&self) -> bool {
        labels::is_blocked(Some(&self.class), Some(&self.wait))
    }

    /// Whether it is an idle process's or client's time (a background process in its main
    /// loop, a client backend between statements).
    pub fn is_idle(&self) -> bool {
        self.class == OffCpuClass::Idle.name()
    }
}

/// One wait of one query: its total, and where in Postgres its longest stack waited.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueryWait {
    pub wait: String,
    pub class: String,
    pub ns: u64,
    /// Where its longest stack waited, innermost first ([`where_it_waits`]).
    pub stack: String,
    /// Weight of that longest stack.
    longest: u64,
}

impl QueryWait {
    pub fn is_idle(&self) -> bool {
        self.class == OffCpuClass::Idle.name()
    }

    /// Whether it is time blocked: neither the client's nor a sleep asked for.
    pub fn is_blocked(&self) -> bool {
        labels::is_blocked(Some(&self.class), Some(&self.wait))
    }

    /// Whether it is run-queue delay: runnable, waiting for a CPU the host did not have.
    pub fn is_preempted(&self) -> bool {
        self.class == OffCpuClass::Preempted.name()
    }
}

/// One queryid's waits, longest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueryWaits {
    pub query_id: QueryId,
    pub waits: Vec<QueryWait>,
}

impl QueryWaits {
    /// Every nanosecond of it off CPU, idle and client time included.
    pub fn total_ns(&self) -> u64 {
        self.waits.iter().map(|w| w.ns).sum()
    }

    /// Its waits without the client's time and sleeps asked for, longest first.
    pub fn blocked(&self) -> impl Iterator<Item = &QueryWait> {
        self.waits.iter().filter(|w| w.is_blocked())
    }

    /// Its waits without idle time (client waits inside a transaction kept), longest first.
    pub fn not_idle(&self) -> impl Iterator<Item = &QueryWait> {
        self.waits.iter().filter(|w| !w.is_idle())
    }
}

/// The off-CPU profile's tables.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WaitTables {
    /// Off-CPU time in waits shorter than the stack threshold, counted without a stack.
    pub short_waits_ns: u64,
    /// Per (backend type, wait event, class), longest first.
    pub by_wait: Vec<WaitRow>,
    /// Per queryid (samples without one left out), most off-CPU time first.
    pub by_query: Vec<QueryWaits>,
}

impl WaitTables {
    pub fn from_profile(profile: &Profile) -> Self {
        Self {
            short_waits_ns: profile
                .samples
                .iter()
                .filter(|s| s.frames.first().is_some_and(|f| &*f.name == SHORT_WAITS_FRAME))
                .map(|s| s.count)
                .sum(),
            by_wait: by_wait(profile),
            by_query: by_query(profile),
        }
    }

    /// Every nanosecond off CPU, idle waits included.
    pub fn total_ns(&self) -> u64 {
        self.by_wait.iter().map(|row| row.ns).sum()
    }

    /// The time statements were blocked: off CPU, the client's time and sleeps asked for
    /// left out.
    pub fn blocked_ns(&self) -> u64 {
        self.by_wait
            .iter()
            .filter(|row| row.is_blocked())
            .map(|row| row.ns)
            .sum()
    }

    /// Of the blocked time, the part in wait event `wait`.
    pub fn blocked_in(&self, wait: &str) -> u64 {
        self.by_wait
            .iter()
            .filter(|row| row.is_blocked() && row.wait == wait)
            .map(|row| row.ns)
            .sum()
    }

    /// Of the blocked time, the part runnable and waiting for a CPU (class `preempted`).
    pub fn preempted_ns(&self) -> u64 {
        self.by_wait
            .iter()
            .filter(|row| row.is_blocked() && row.class == OffCpuClass::Preempted.name())
            .map(|row| row.ns)
            .sum()
    }
}

fn wait_of(sample: &exporters::StackSample) -> (String, String) {
    (
        sample.wait_event().unwrap_or(NO_WAIT_EVENT).to_string(),
        sample.off_cpu_class().unwrap_or("?").to_string(),
    )
}

fn by_wait(profile: &Profile) -> Vec<WaitRow> {
    let mut rows: BTreeMap<(String, String, String), u64> = BTreeMap::new();
    for sample in &profile.samples {
        let backend_type = sample.label(labels::BACKEND_TYPE).unwrap_or("?").to_string();
        let (wait, class) = wait_of(sample);
        *rows.entry((backend_type, wait, class)).or_insert(0) += sample.count;
    }
    let mut rows: Vec<WaitRow> = rows
        .into_iter()
        .map(|((backend_type, wait, class), ns)| WaitRow {
            backend_type,
            wait,
            class,
            ns,
        })
        .collect();
    rows.sort_by(|a, b| b.ns.cmp(&a.ns).then(a.wait.cmp(&b.wait)));
    rows
}

fn by_query(profile: &Profile) -> Vec<QueryWaits> {
    let mut per_query: BTreeMap<QueryId, BTreeMap<(String, String), QueryWait>> = BTreeMap::new();
    for sample in &profile.samples {
        let Some(query_id) = sample.query_id() else {
            continue;
        };
        let (wait, class) = wait_of(sample);
        let entry = per_query
            .entry(query_id)
            .or_default()
            .entry((wait.clone(), class.clone()))
            .or_insert_with(|| QueryWait {
                wait,
                class,
                ..QueryWait::default()
            });
        entry.ns += sample.count;
        if sample.count > entry.longest {
            entry.longest = sample.count;
            entry.stack = where_it_waits(&sample.frames);
        }
    }
    let mut out: Vec<QueryWaits> = per_query
        .into_iter()
        .map(|(query_id, waits)| {
            let mut waits: Vec<QueryWait> = waits.into_values().collect();
            // Stable: equal waits stay in (wait event, class) order.
            waits.sort_by_key(|row| std::cmp::Reverse(row.ns));
            QueryWaits { query_id, waits }
        })
        .collect();
    out.sort_by_key(|query| std::cmp::Reverse(query.total_ns()));
    out
}

/// Frames shown of a wait's stack.
const WAIT_FRAMES: usize = 4;

/// Functions that are how a backend waits, not what it waits for: C library wrappers of the
/// blocking system calls, and Postgres' latch, semaphore, condition-variable and lock-manager
/// waiting code. Every wait goes through some of them, so they name no cause.
fn is_wait_machinery(name: &str) -> bool {
    const MACHINERY: &[&str] = &[
        // The C library's blocking calls and their internal steps.
        "epoll_wait",
        "epoll_pwait",
        "poll",
        "__poll",
        "ppoll",
        "select",
        "__select",
        "syscall",
        "sem_wait",
        "sem_timedwait",
        "sem_clockwait",
        "do_futex_wait",
        "__new_sem_wait_slow",
        "__new_sem_wait_slow64",
        "__futex_abstimed_wait_common",
        "__futex_abstimed_wait_common64",
        "futex_wait",
        "__lll_lock_wait",
        "nanosleep",
        "clock_nanosleep",
        "__clock_nanosleep",
        "__nanosleep",
        "usleep",
        // Latches and wait event sets.
        "WaitEventSetWait",
        "WaitEventSetWaitBlock",
        "WaitLatch",
        "WaitLatchOrSocket",
        // Semaphores, LWLocks and condition variables.
        "PGSemaphoreLock",
        "LWLockAcquire",
        "LWLockAcquireOrWait",
        "LWLockWaitForVar",
        "LWLockQueueSelf",
        "ConditionVariableSleep",
        "ConditionVariableTimedSleep",
        // The heavyweight lock manager's wait.
        "ProcSleep",
        "WaitOnLock",
        "LockAcquire",
        "LockAcquireExtended",
        // Spinning on a spinlock, and sleeping between spins.
        "pg_usleep",
        "perform_spin_delay",
        "s_lock",
    ];
    // glibc's versioned and cloned copies: `__new_sem_wait_slow64.constprop.0`.
    let base = name.split('.').next().unwrap_or(name);
    MACHINERY.contains(&base)
}

/// Where a wait's stack says what was being done, innermost first: the wait machinery (and the
/// unnamed static frames within it) left out, then [`WAIT_FRAMES`] frames, e.g.
/// `XactLockTableWait ← heap_update ← ExecUpdate ← ExecModifyTable` for a row-lock wait whose
/// stack begins `epoll_wait ← WaitEventSetWait ← WaitLatch ← ProcSleep`. A stack that is all
/// machinery keeps its innermost frames. The full stacks stay in the flamegraphs.
fn where_it_waits(frames: &[Frame]) -> String {
    let user: Vec<&str> = frames
        .iter()
        .rev()
        .filter(|f| f.kind == FrameKind::User)
        .map(|f| &*f.name)
        .collect();
    let cause = user
        .iter()
        .position(|name| !is_wait_machinery(name) && !super::is_unnamed_frame(name))
        .unwrap_or(0);
    user[cause..]
        .iter()
        .take(WAIT_FRAMES)
        .copied()
        .collect::<Vec<_>>()
        .join(" ← ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{labelled as sample, off_cpu};

    fn user_frames(names_root_first: &[&str]) -> Vec<Frame> {
        names_root_first
            .iter()
            .map(|name| Frame {
                name: (*name).into(),
                kind: FrameKind::User,
                module: None,
            })
            .collect()
    }

    #[test]
    fn a_row_lock_wait_is_shown_by_what_waits_not_how() {
        let stack = user_frames(&[
            "main",
            "PostgresMain",
            "ExecModifyTable",
            "ExecUpdate",
            "heap_update",
            "XactLockTableWait",
            "LockAcquireExtended",
            "postgres+0x3f1a20", // WaitOnLock, static
            "ProcSleep",
            "WaitLatch",
            "WaitEventSetWait",
            "epoll_wait",
        ]);
        assert_eq!(
            where_it_waits(&stack),
            "XactLockTableWait ← heap_update ← ExecUpdate ← ExecModifyTable"
        );
    }

    #[test]
    fn glibc_copies_and_spinlocks_are_machinery_too() {
        let stack = user_frames(&[
            "XLogFlush",
            "LWLockAcquireOrWait",
            "PGSemaphoreLock",
            "__new_sem_wait_slow64.constprop.0",
            "__futex_abstimed_wait_common",
        ]);
        assert_eq!(where_it_waits(&stack), "XLogFlush");
        let spin = user_frames(&[
            "LWLockWaitListLock",
            "s_lock",
            "perform_spin_delay",
            "pg_usleep",
            "__select",
        ]);
        assert_eq!(where_it_waits(&spin), "LWLockWaitListLock");
    }

    #[test]
    fn a_stack_of_machinery_alone_keeps_its_innermost_frames() {
        let stack = user_frames(&["postgres+0x100", "WaitLatch", "WaitEventSetWait", "epoll_wait"]);
        assert_eq!(
            where_it_waits(&stack),
            "epoll_wait ← WaitEventSetWait ← WaitLatch ← postgres+0x100"
        );
        // An unnamed frame after the cause is shown: it may be the caller that matters.
        let io = user_frames(&[
            "ReadBuffer_common",
            "postgres+0x44a690",
            "mdread",
            "FileRead",
            "__libc_pread",
        ]);
        assert_eq!(
            where_it_waits(&io),
            "__libc_pread ← FileRead ← mdread ← postgres+0x44a690"
        );
    }

    #[test]
    fn waits_are_summed_per_event_and_per_query_with_where_they_wait() {
        let lwlock = [
            ("queryid", "7"),
            ("wait_event", "LWLock:pg_stat_statements"),
            ("off_cpu", "futex"),
        ];
        let profile = off_cpu(vec![
            sample(
                &[
                    "main",
                    "pgss_store",
                    "LWLockAcquire",
                    "PGSemaphoreLock",
                    "sem_wait",
                ],
                &lwlock,
                3_000_000,
            ),
            sample(&[SHORT_WAITS_FRAME], &lwlock, 1_000_000),
            sample(
                &["[idle]"],
                &[
                    ("queryid", "7"),
                    ("wait_event", "Client:ClientRead"),
                    ("off_cpu", "idle"),
                ],
                9_000_000,
            ),
            sample(
                &["[client]"],
                &[
                    ("queryid", "8"),
                    ("wait_event", "Client:ClientRead"),
                    ("off_cpu", "latch"),
                ],
                2_000_000,
            ),
            sample(
                &["x"],
                &[("wait_event", "IO:DataFileRead"), ("off_cpu", "io")],
                500,
            ),
        ]);
        let tables = WaitTables::from_profile(&profile);
        assert_eq!(tables.total_ns(), 15_000_500);
        assert_eq!(tables.short_waits_ns, 1_000_000);
        assert_eq!(tables.by_wait[0].wait, "Client:ClientRead");
        assert_eq!(tables.by_wait[0].backend_type, "?");
        assert_eq!(tables.blocked_ns(), 4_000_500);
        assert_eq!(tables.blocked_in("LWLock:pg_stat_statements"), 4_000_000);
        let q7 = &tables.by_query[0];
        assert_eq!(q7.query_id, QueryId(7));
        assert_eq!(q7.total_ns(), 13_000_000);
        assert_eq!(q7.blocked().map(|w| w.ns).sum::<u64>(), 4_000_000);
        let lwlock_row = q7.blocked().next().expect("a blocked wait");
        assert_eq!(lwlock_row.ns, 4_000_000);
        assert_eq!(lwlock_row.stack, "pgss_store ← main");
        assert_eq!(q7.not_idle().count(), 1);
        // Client waits inside a transaction are not blocked time, but they are not idle either.
        let q8 = &tables.by_query[1];
        assert_eq!((q8.blocked().count(), q8.not_idle().count()), (0, 1));
        // Samples without a queryid are in the totals, not in a query's row.
        assert_eq!(tables.by_query.len(), 2);
    }
}
