//! `pgscope agent`, off CPU sampled (the default) and exact: a backend blocked across upload
//! intervals is in each interval's off-CPU profile as far as its wait went, not all at once in
//! the interval it ends in — and the parts add up to the wait, counted once.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use pgscope_tests::pyroscope_capture::{decode_push, Series};
use pgscope_tests::{require_root_and_bpf, wait_for, PgCluster, PgInstall, PyroscopeCapture, RunningAgent};

/// How long session A holds the row lock once B waits for it: several upload intervals.
const HOLD: Duration = Duration::from_secs(8);
const WAIT_EVENT: &str = "Lock:transactionid";

/// An offcpu series of the row-lock wait itself: blocked in the latch (epoll) under
/// `Lock:transactionid`. A backend preempted just as it wakes still shows the wait event, but
/// that is time waiting for a CPU, not for the lock.
fn is_lock_wait(series: &Series) -> bool {
    series.label("__name__") == Some("offcpu")
        && series.label("wait_event") == Some(WAIT_EVENT)
        && series.label("off_cpu") == Some("latch")
}

/// Nanoseconds of `Lock:transactionid` latch waits in the offcpu series of one push.
fn lock_ns(series: &[Series]) -> i64 {
    series
        .iter()
        .filter(|s| is_lock_wait(s))
        .flat_map(|s| s.stacks())
        .map(|(_, values)| values.first().copied().unwrap_or(0))
        .sum()
}

/// Whether every `Lock:transactionid` latch-wait stack of one push runs through ProcSleep →
/// WaitLatch: the stacks the wait was taken with when it began.
fn lock_stacks_through_proc_sleep(series: &[Series]) -> bool {
    series
        .iter()
        .filter(|s| is_lock_wait(s))
        .flat_map(|s| s.stacks())
        .all(|(frames, _)| frames.iter().any(|f| f == "ProcSleep") && frames.iter().any(|f| f == "WaitLatch"))
}

/// Per accepted push, in order: its `Lock:transactionid` latch-wait nanoseconds.
fn lock_ns_per_push(capture: &PyroscopeCapture) -> Result<Vec<i64>> {
    capture
        .requests()
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| decode_push(r).map(|series| lock_ns(&series)))
        .collect()
}

#[test]
fn a_sampled_wait_across_intervals_is_shipped_in_parts_that_add_up_to_it() -> Result<()> {
    wait_across_intervals("sampled")
}

#[test]
fn an_exact_wait_across_intervals_is_shipped_in_parts_that_add_up_to_it() -> Result<()> {
    wait_across_intervals("exact")
}

/// Sampled, each tick of the wait falls in the interval it was taken in; exact, the open wait
/// is shipped as far as it went at each upload and its end carries the rest.
fn wait_across_intervals(mode: &str) -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.psql("CREATE TABLE held (id int PRIMARY KEY, v int); INSERT INTO held VALUES (1, 0)")?;
    let capture = PyroscopeCapture::start()?;
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"2s\"\noff_cpu = \"{mode}\"\n\
         [[discovery.include]]\ndata_dir = \"{}\"\n",
        capture.url(),
        cluster.data_dir().display()
    );
    let agent = RunningAgent::start(&config, &[])?;
    agent.wait_for_instances(1)?;

    let mut holder = cluster.connect()?;
    holder.query("BEGIN")?;
    holder.query("UPDATE held SET v = v + 1 WHERE id = 1")?;
    let waiter = cluster.spawn_session("UPDATE held SET v = v + 10 WHERE id = 1")?;
    waiter.wait_until_waiting_on(WAIT_EVENT)?;
    let blocked = Instant::now();
    // While B is still blocked, its wait so far reaches Pyroscope. B wakes once after
    // deadlock_timeout (1 s) to check for a deadlock, which ends its first wait: more than
    // that is its second wait, still open.
    let before_the_end = wait_for(
        "a part of the open lock wait in a push while it is still going on",
        HOLD - Duration::from_secs(1),
        || {
            let shipped: i64 = lock_ns_per_push(&capture)?.iter().sum();
            Ok((shipped >= 2_000_000_000).then_some(shipped))
        },
    )
    .with_context(|| format!("agent log:\n{}", agent.log()))?;
    ensure!(
        waiter.is_active()?,
        "the waiter stopped waiting before the test committed"
    );
    std::thread::sleep(HOLD.saturating_sub(blocked.elapsed()));
    holder.query("COMMIT")?;
    let held = blocked.elapsed();
    waiter.wait_until_finished()?;
    drop(waiter);
    holder.close()?;

    // Two more uploads: the wait's end, with what was not shipped of it, is in one of them. An
    // agent sends nothing for an interval with nothing in it (sampled, an idle instance's time
    // is idle, which is not shipped): a sleeping session gives the next intervals something.
    let _sleeper = cluster.spawn_session("SELECT pg_sleep(10)")?;
    let pushes = capture.requests().len();
    wait_for("two more uploads", Duration::from_secs(20), || {
        Ok((capture.requests().len() >= pushes + 2).then_some(()))
    })
    .with_context(|| format!("agent log:\n{}", agent.log()))?;
    let per_push = lock_ns_per_push(&capture)?;
    let total = Duration::from_nanos(per_push.iter().sum::<i64>().max(0) as u64);
    let parts = per_push.iter().filter(|&&ns| ns > 0).count();
    eprintln!(
        "{mode}: {WAIT_EVENT}: {total:?} in {parts} pushes ({per_push:?} ns per push), {:?} shipped before the \
         commit; {held:?} between the wait being seen and the commit",
        Duration::from_nanos(before_the_end as u64)
    );
    ensure!(
        parts >= 3,
        "a wait of {held:?} with uploads every 2 s reached Pyroscope in {parts} pushes: {per_push:?}"
    );
    // Counted once: parts shipped while it was open are left out of its end. B blocked a
    // little before the test saw it wait and wakes a little after the commit.
    let ratio = total.as_secs_f64() / held.as_secs_f64();
    ensure!(
        (0.9..=1.1).contains(&ratio),
        "{WAIT_EVENT} time shipped {total:?} is not within 10% of the {held:?} the lock was held: \
         {per_push:?}"
    );
    // A part goes where the wait's end goes: under the stacks taken when it began.
    for request in capture.requests().iter().filter(|r| r.status == 200) {
        let series = decode_push(request)?;
        ensure!(
            lock_stacks_through_proc_sleep(&series),
            "a push has {WAIT_EVENT} time without the wait's stack through ProcSleep → WaitLatch: {:?}",
            series
                .iter()
                .filter(|s| is_lock_wait(s))
                .flat_map(|s| s.stacks())
                .collect::<Vec<_>>()
        );
    }
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "the agent exited with {status}:\n{log}");
    Ok(())
}
