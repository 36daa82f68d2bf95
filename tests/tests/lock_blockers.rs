//! Who blocks whom. A session that updated a row and went idle in its transaction holds four
//! others behind it (the first on `Lock:transactionid`, the rest on `Lock:tuple` behind the
//! first: a chain). The trace must name it — its pid, `idle in transaction`, the four pids —
//! and put the time they waited behind it where the test's own reading of pg_stat_activity
//! puts it. The control: the same rows updated by four clients in short transactions (hot
//! rows: each holder's lock lasts a moment, no session holds others up) gives no such finding.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::findings_json::{describe_findings, findings_while, JsonFinding};
use pgscope_tests::process::wait_for;
use pgscope_tests::workload::readable_script;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace};

/// Sessions queued behind the idle transaction.
const WAITERS: usize = 4;

/// How long the waiters wait, at least, by the test's own reading: several of pgscope's polls
/// (every 0.5 s), so that the time it measures is mostly inside the polls.
const MIN_WAIT: Duration = Duration::from_secs(4);

fn cluster() -> Result<PgCluster> {
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.psql(
        "CREATE TABLE held_rows (id int PRIMARY KEY, v bigint NOT NULL); \
         INSERT INTO held_rows SELECT g, 0 FROM generate_series(1, 3) g",
    )?;
    Ok(cluster)
}

fn blocker_findings(findings: &[JsonFinding]) -> Vec<&JsonFinding> {
    findings.iter().filter(|f| f.kind == "lock_blocker").collect()
}

#[test]
fn a_session_idle_in_its_transaction_is_named_with_the_sessions_it_holds_up() -> Result<()> {
    require_root_and_bpf();
    let cluster = cluster()?;
    let mut holder = cluster.connect()?;
    holder.query("BEGIN")?;
    holder.query("UPDATE held_rows SET v = v + 1 WHERE id = 1")?;
    let holder_pid = holder.pid();

    let traced = findings_while(Trace::instance(cluster.data_dir()), || {
        let waiters = (0..WAITERS)
            .map(|_| cluster.spawn_session("UPDATE held_rows SET v = v + 10 WHERE id = 1"))
            .collect::<Result<Vec<_>>>()?;
        let pids: BTreeSet<u32> = waiters.iter().map(|w| w.pid()).collect();
        let list = pids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        // Until every waiter has waited MIN_WAIT on a lock, by pg_stat_activity.
        let waited = wait_for(
            "every waiter waiting on a lock for the test's minimum",
            Duration::from_secs(120),
            || {
                let shortest = cluster.psql(&format!(
                    "SELECT count(*) = {WAITERS} AND min(extract(epoch FROM now() - query_start)) >= {} \
                     FROM pg_stat_activity WHERE pid IN ({list}) AND wait_event_type = 'Lock'",
                    MIN_WAIT.as_secs_f64()
                ))?;
                Ok((shortest.trim() == "t").then_some(()))
            },
        );
        waited?;
        // The independent figure: the waiters' time waiting so far, as Postgres shows it.
        let truth: f64 = cluster
            .psql(&format!(
                "SELECT sum(extract(epoch FROM now() - query_start)) FROM pg_stat_activity \
                 WHERE pid IN ({list})"
            ))?
            .trim()
            .parse()
            .context("the waiters' summed wait")?;
        holder.query("ROLLBACK")?;
        for waiter in &waiters {
            waiter.wait_until_finished()?;
        }
        Ok((pids, truth))
    })?;
    let (waiter_pids, truth) = traced.measured;
    eprintln!("{}", describe_findings(&traced.findings));
    let found = blocker_findings(&traced.findings);
    let finding = found
        .iter()
        .find(|f| f.number("blocking pid") == Some(&holder_pid.to_string()))
        .with_context(|| {
            format!(
                "no lock_blocker finding names the idle session {holder_pid}; findings:\n{}",
                describe_findings(&traced.findings)
            )
        })?;
    ensure!(
        finding.number("its state") == Some("idle in transaction")
            && finding.title.contains("idle in transaction"),
        "the blocker is not called idle in transaction: {finding:#?}"
    );
    ensure!(
        finding.is_alarm(),
        "four sessions held up for seconds is only {finding:#?}"
    );
    let held_up = finding
        .number("sessions held up")
        .context("no `sessions held up`")?;
    for pid in &waiter_pids {
        ensure!(
            held_up.contains(&pid.to_string()),
            "waiter {pid} is not among those held up: {held_up}"
        );
    }
    ensure!(
        held_up.starts_with(&format!("{WAITERS} ")),
        "expected {WAITERS} sessions held up: {held_up}"
    );
    let waits = finding.number("their waits").context("no `their waits`")?;
    ensure!(
        waits.contains("Lock:transactionid") && waits.contains("Lock:tuple"),
        "the chain (the first waiter on the transaction, the rest on the tuple) is not all \
         charged to its end: {waits}"
    );
    // Each waiter's time is its polls' intervals: at most one interval off at each end.
    let measured = finding.leading_number("time they waited behind it")?;
    let interval = 0.5;
    let slack = WAITERS as f64 * 2.0 * interval;
    eprintln!("waiters' time behind {holder_pid}: pgscope {measured:.2} s, pg_stat_activity {truth:.2} s");
    ensure!(
        (measured - truth).abs() <= slack,
        "pgscope put {measured:.2} s of waiting behind session {holder_pid}, pg_stat_activity \
         {truth:.2} s (at most {slack} s apart: one poll interval per waiter at each end)"
    );
    Ok(())
}

const HOT_ROWS: &str = "\\set id random(1, 3)\n\
                        BEGIN;\n\
                        UPDATE held_rows SET v = v + 1 WHERE id = :id;\n\
                        END;\n";

#[test]
fn contention_on_hot_rows_in_short_transactions_names_no_blocker() -> Result<()> {
    require_root_and_bpf();
    let cluster = cluster()?;
    let (_dir, script) = readable_script("hot_rows.sql", HOT_ROWS)?;
    let script_arg = script.display().to_string();
    let traced = findings_while(Trace::instance(cluster.data_dir()), || {
        let mut pgbench =
            cluster.spawn_pgbench(&["-n", "-c", "4", "-j", "2", "-T", "600", "-f", &script_arg], 4)?;
        pgbench.run_for_cpu(Duration::from_secs(4), Duration::from_secs(180))?;
        pgbench.stop()
    })?;
    eprintln!("{}", describe_findings(&traced.findings));
    let found = blocker_findings(&traced.findings);
    ensure!(
        found.is_empty(),
        "short transactions on hot rows were blamed on a session: {found:#?}"
    );
    Ok(())
}
