//! The statements that wait the most, always reported beside the top CPU consumers: blocked
//! time (off CPU) per queryid, with the wait event most of it was spent in. Waits for the
//! client are left out — idle ones, and `Client:*` waits inside a transaction too: they are
//! the client's think time and round trips (the transaction's previous statement keeps its
//! queryid meanwhile), not time the statement spent in the database.

use std::collections::BTreeMap;

use exporters::Profile;

use super::{is_client_time, percent, Finding, Severity};

/// Statements named, at most, and the share of all waiting a statement needs to be named.
const TOP: usize = 3;
const TOP_MIN_SHARE: f64 = 0.01;

/// Blocked nanoseconds per (wait event, off-CPU class).
type Waits = BTreeMap<(String, String), u64>;

pub fn top_waiters(off_cpu: Option<&Profile>) -> Vec<Finding> {
    let Some(profile) = off_cpu else {
        return Vec::new();
    };
    // Per queryid: per (wait event, class), nanoseconds.
    let mut per_query: BTreeMap<i64, Waits> = BTreeMap::new();
    let mut total = 0u64;
    for sample in &profile.samples {
        if is_client_time(sample) {
            continue;
        }
        total += sample.count;
        let Some(query_id) = sample.label("queryid").and_then(|q| q.parse::<i64>().ok()) else {
            continue;
        };
        let wait = sample
            .label("wait_event")
            .unwrap_or("(no wait event)")
            .to_string();
        let class = sample.label("off_cpu").unwrap_or("?").to_string();
        *per_query
            .entry(query_id)
            .or_default()
            .entry((wait, class))
            .or_insert(0) += sample.count;
    }
    if total == 0 {
        return Vec::new();
    }
    let mut queries: Vec<(i64, u64, Waits)> = per_query
        .into_iter()
        .filter(|(query_id, _)| *query_id != 0)
        .map(|(query_id, waits)| (query_id, waits.values().sum(), waits))
        .collect();
    queries.sort_by_key(|(query_id, ns, _)| (std::cmp::Reverse(*ns), *query_id));
    queries
        .into_iter()
        .filter(|(_, ns, _)| *ns as f64 / total as f64 >= TOP_MIN_SHARE)
        .take(TOP)
        .map(|(query_id, ns, waits)| {
            let share = ns as f64 / total as f64;
            let mut numbers = vec![
                ("share of the blocked time".to_string(), percent(share)),
                ("ms blocked".to_string(), format!("{:.1}", ns as f64 / 1e6)),
            ];
            let main = waits
                .iter()
                .max_by_key(|(key, n)| (**n, std::cmp::Reverse((*key).clone())));
            if let Some(((wait, class), n)) = main {
                numbers.push((format!("in {wait} ({class})"), percent(*n as f64 / ns as f64)));
            }
            Finding {
                kind: "top_wait",
                severity: Severity::Info,
                title: format!(
                    "queryid {query_id} accounts for {} of the time statements were blocked",
                    percent(share)
                ),
                numbers,
                query_ids: vec![query_id],
                frames: Vec::new(),
                action: "the off-CPU flamegraph filtered on this queryid shows where it waits; the \
                         wait event names what it waited for (a lock, I/O, a CPU: `preempted`)"
                    .into(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use exporters::{ProfileMeta, StackSample};

    fn wait(query_id: i64, wait_event: &str, class: &str, ns: u64) -> StackSample {
        StackSample {
            frames: Vec::new(),
            labels: vec![
                ("off_cpu".into(), class.into()),
                ("queryid".into(), query_id.to_string()),
                ("wait_event".into(), wait_event.into()),
            ],
            count: ns,
        }
    }

    #[test]
    fn the_longest_waiters_are_named_with_their_main_wait_and_idle_time_is_not_waiting() {
        let profile = Profile {
            meta: ProfileMeta::off_cpu(0, 1),
            samples: vec![
                wait(7, "LWLock:pg_stat_statements", "futex", 600),
                wait(7, "IO:WALSync", "io", 100),
                wait(8, "Lock:transactionid", "latch", 300),
                // Client time, idle or in a transaction, is the client's, not the statement's.
                wait(9, "Client:ClientRead", "idle", 100_000),
                wait(9, "Client:ClientRead", "latch", 100_000),
                wait(0, "IO:DataFileRead", "io", 5),
            ],
        };
        let found = top_waiters(Some(&profile));
        assert_eq!(
            found.iter().map(|f| f.query_ids[0]).collect::<Vec<_>>(),
            vec![7, 8]
        );
        assert!(found[0]
            .numbers
            .iter()
            .any(|(k, v)| k == "in LWLock:pg_stat_statements (futex)" && v == "85.7%"));
        assert!(top_waiters(None).is_empty());
    }
}
