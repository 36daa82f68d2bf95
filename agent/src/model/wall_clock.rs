//! Each statement's wall-clock time split into CPU and what it waited on. With sampled off-CPU
//! time, an on-CPU sample and an off-CPU sample weigh the same tick, so a queryid's samples on
//! and off CPU add up to the time its backends spent in it; the split says where that time
//! went: `CPU 38% · LWLock:pg_stat_statements 41% · IO:DataFileRead 12% · preempted 9%`.
//!
//! The client's time (idle between statements, waiting for the client inside a transaction)
//! is not the statement's and is left out, as everywhere else.

use std::collections::BTreeMap;

use exporters::Profile;

use super::labels::SampleLabels;
use super::statements::{has_frame, in_probe_trap, StatementCpu};
use super::QueryId;

/// The part of a statement's time on CPU.
pub const CPU: &str = "CPU";

/// Parts smaller than this share of a statement's time are summed into [`OTHER_WAITS`] when
/// rendered.
const SHOWN_PCT: f64 = 1.0;
/// The rendered sum of the parts too small to name.
pub const OTHER_WAITS: &str = "other waits";

/// One part of a statement's time: on CPU, or one wait.
#[derive(Clone, Debug, PartialEq)]
pub struct WallPart {
    /// [`CPU`], a wait event as pg_stat_activity shows it (`LWLock:pg_stat_statements`), or
    /// for time off CPU without one, its class (`preempted`, `io`, `futex`, …).
    pub name: String,
    pub ns: u64,
}

/// One statement's wall-clock time and its parts, largest first.
#[derive(Clone, Debug, PartialEq)]
pub struct StatementWall {
    pub query_id: QueryId,
    pub total_ns: u64,
    pub parts: Vec<WallPart>,
}

impl StatementWall {
    /// Share of the statement's time in `part`, in percent.
    pub fn pct(&self, ns: u64) -> f64 {
        if self.total_ns == 0 {
            0.0
        } else {
            100.0 * ns as f64 / self.total_ns as f64
        }
    }

    /// Its time in any of `events`.
    pub fn waited(&self, events: &[&str]) -> u64 {
        self.parts
            .iter()
            .filter(|part| events.contains(&part.name.as_str()))
            .map(|part| part.ns)
            .sum()
    }

    /// `CPU 38% · LWLock:pg_stat_statements 41% · preempted 9%`: parts of at least 1%, the
    /// rest summed.
    pub fn render(&self) -> String {
        let mut shown: Vec<String> = Vec::new();
        let mut rest = 0;
        for part in &self.parts {
            if self.pct(part.ns) >= SHOWN_PCT {
                shown.push(format!("{} {:.0}%", part.name, self.pct(part.ns)));
            } else {
                rest += part.ns;
            }
        }
        if rest > 0 {
            let pct = self.pct(rest);
            if pct < SHOWN_PCT {
                shown.push(format!("{OTHER_WAITS} <1%"));
            } else {
                shown.push(format!("{OTHER_WAITS} {pct:.0}%"));
            }
        }
        shown.join(" · ")
    }
}

/// Each statement's split, largest total first. Only meaningful with off-CPU time measured;
/// CPU time is samples × period, pgscope's own probe traps left out.
pub fn statement_walls(statements: &[StatementCpu], period_ns: u64, off_cpu: &Profile) -> Vec<StatementWall> {
    let mut parts: BTreeMap<QueryId, BTreeMap<String, u64>> = BTreeMap::new();
    for statement in statements.iter().filter(|s| s.query_id.is_statement()) {
        let cpu = statement.samples * period_ns;
        if cpu > 0 {
            parts
                .entry(statement.query_id)
                .or_default()
                .insert(CPU.to_string(), cpu);
        }
    }
    for sample in &off_cpu.samples {
        if sample.is_client_time() {
            continue;
        }
        let Some(query_id) = sample.query_id().filter(|q| q.is_statement()) else {
            continue;
        };
        let name = match sample.wait_event() {
            Some(wait) => wait.to_string(),
            None => sample.off_cpu_class().unwrap_or("off CPU").to_string(),
        };
        *parts.entry(query_id).or_default().entry(name).or_insert(0) += sample.count;
    }
    let mut walls: Vec<StatementWall> = parts
        .into_iter()
        .map(|(query_id, parts)| {
            let mut parts: Vec<WallPart> = parts
                .into_iter()
                .map(|(name, ns)| WallPart { name, ns })
                .collect();
            // Stable: equal parts stay in name order.
            parts.sort_by_key(|p| std::cmp::Reverse(p.ns));
            StatementWall {
                query_id,
                total_ns: parts.iter().map(|p| p.ns).sum(),
                parts,
            }
        })
        .collect();
    walls.sort_by_key(|w| std::cmp::Reverse(w.total_ns));
    walls
}

/// `query_id`'s wall-clock time, where off-CPU time was measured and it has any.
pub fn total_of(walls: &[StatementWall], query_id: QueryId) -> Option<u64> {
    walls
        .iter()
        .find(|w| w.query_id == query_id)
        .map(|w| w.total_ns)
        .filter(|&total| total > 0)
}

/// The time `query_id` waited in any of `events` (as pg_stat_activity names them:
/// `LWLock:LockManager`), from its split; 0 without off-CPU time.
pub fn waited_in(walls: &[StatementWall], query_id: QueryId, events: &[&str]) -> u64 {
    walls
        .iter()
        .filter(|w| w.query_id == query_id)
        .map(|w| w.waited(events))
        .sum()
}

/// Each statement (queryid 0 left out) with time measured, its time in any of `events` and
/// that time's share of its own: what the rules on one kind of wait read.
pub fn waiting_shares<'a>(
    walls: &'a [StatementWall],
    events: &'a [&str],
) -> impl Iterator<Item = (&'a StatementWall, u64, f64)> + 'a {
    walls
        .iter()
        .filter(|w| w.query_id.is_statement() && w.total_ns > 0)
        .map(|w| {
            let waited = w.waited(events);
            (w, waited, waited as f64 / w.total_ns as f64)
        })
}

/// The part of `query_id`'s time with `function` anywhere on the stack, counted as the
/// statement's time is: on-CPU samples × period (pgscope's own probe traps left out) and its
/// off-CPU time (the client's left out). Time off CPU sampled without a stack (over the
/// per-tick budget) shows no frame and is not counted.
pub fn time_with_frame(on_cpu: &Profile, off_cpu: &Profile, query_id: QueryId, function: &str) -> u64 {
    let cpu_samples: u64 = on_cpu
        .samples
        .iter()
        .filter(|s| s.query_id() == Some(query_id) && !in_probe_trap(&s.frames) && has_frame(s, function))
        .map(|s| s.count)
        .sum();
    let blocked_ns: u64 = off_cpu
        .samples
        .iter()
        .filter(|s| s.query_id() == Some(query_id) && !s.is_client_time() && has_frame(s, function))
        .map(|s| s.count)
        .sum();
    cpu_samples * on_cpu.meta.period + blocked_ns
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{labelled, off_cpu, profile, sample};
    use crate::model::labels;
    use crate::model::statements::statements;

    fn wait(query_id: &str, wait_event: Option<&str>, class: &str, ns: u64) -> exporters::StackSample {
        let mut labels = vec![(labels::OFF_CPU, class), (labels::QUERY_ID, query_id)];
        if let Some(wait_event) = wait_event {
            labels.push((labels::WAIT_EVENT, wait_event));
        }
        labelled(&["x"], &labels, ns)
    }

    #[test]
    fn a_statements_time_splits_into_cpu_and_each_wait_without_the_clients() {
        let on_cpu = profile(vec![sample(7, "run", &["ExecScan"], 38)]);
        let period = on_cpu.meta.period;
        let off = off_cpu(vec![
            wait("7", Some("LWLock:pg_stat_statements"), "futex", 41 * period),
            wait("7", Some("IO:DataFileRead"), "io", 12 * period),
            wait("7", None, "preempted", 9 * period),
            // The client's time is not the statement's.
            wait("7", Some("Client:ClientRead"), "latch", 500 * period),
            wait("7", Some("Client:ClientRead"), "idle", 900 * period),
            wait("8", Some("Lock:transactionid"), "latch", 3 * period),
        ]);
        let walls = statement_walls(&statements(&on_cpu), period, &off);
        let seven = &walls[0];
        assert_eq!(seven.query_id, QueryId(7));
        assert_eq!(seven.total_ns, 100 * period);
        assert_eq!(
            seven.render(),
            "LWLock:pg_stat_statements 41% · CPU 38% · IO:DataFileRead 12% · preempted 9%"
        );
        assert_eq!(seven.parts[1].name, CPU);
        assert_eq!(seven.pct(seven.parts[1].ns), 38.0);
        assert_eq!(walls[1].render(), "Lock:transactionid 100%");
    }

    #[test]
    fn parts_under_one_percent_are_summed() {
        let on_cpu = profile(vec![sample(7, "run", &["ExecScan"], 995)]);
        let period = on_cpu.meta.period;
        let off = off_cpu(vec![
            wait("7", Some("IO:DataFileRead"), "io", 3 * period),
            wait("7", Some("IO:WALWrite"), "io", 2 * period),
        ]);
        let walls = statement_walls(&statements(&on_cpu), period, &off);
        assert_eq!(walls[0].render(), "CPU 100% · other waits <1%");
    }
}
