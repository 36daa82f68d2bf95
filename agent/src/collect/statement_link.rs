//! Samples taken before their statement's queryid was known, given that queryid. Postgres
//! reports a statement's queryid after parse analysis (and after pg_stat_statements'
//! `post_parse_analyze` hook has stored a new statement, evicting others when its table is
//! full), so raw parsing, analysis and that store read queryid 0 in the backend's status. The
//! statement's start time (`st_activity_start_timestamp`) is set before any of it and stays
//! until the statement (or protocol message) ends: a later sample of the same thread with the
//! same start and a queryid names the statement the earlier ones belong to.
//!
//! Held samples wait for that sample: they are released with the queryid when it comes, and
//! as queryid 0 when the thread shows another statement, when too many wait, or when the
//! caller releases everything (the end of a trace, an agent interval). A statement too short to
//! be sampled again is often followed by a wait for the client's next one, during which its
//! status still shows its start and queryid: the caller reads that from the backend's memory
//! ([`StatementLink::resolve_from`]) while samples wait.

use std::collections::HashMap;

use symbolizer::UnwoundStack;

use crate::postgres::attribution::Attribution;

/// Samples one thread holds at most: a statement whose parsing takes more than a few seconds
/// of samples is released as queryid 0 rather than held without bound.
const MAX_HELD_PER_THREAD: usize = 512;

/// One on-CPU sample waiting for its statement's queryid.
#[derive(Debug)]
pub struct Held {
    pub root: u32,
    pub tgid: u32,
    pub attribution: Attribution,
    pub kernel: Vec<u64>,
    pub user: UnwoundStack,
}

#[derive(Debug)]
struct Waiting {
    statement_start: u64,
    samples: Vec<Held>,
}

/// Held samples by thread.
#[derive(Debug, Default)]
pub struct StatementLink {
    by_thread: HashMap<u32, Waiting>,
}

impl StatementLink {
    /// A sample of thread `tid` in the statement that started at `statement_start`, whose
    /// queryid is not reported yet. Returns the samples to add now as they are (queryid 0):
    /// those of an earlier statement of the thread, or all when too many wait.
    pub fn hold(&mut self, tid: u32, statement_start: u64, held: Held) -> Vec<Held> {
        let mut released = Vec::new();
        let waiting = self.by_thread.entry(tid).or_insert_with(|| Waiting {
            statement_start,
            samples: Vec::new(),
        });
        if waiting.statement_start != statement_start || waiting.samples.len() >= MAX_HELD_PER_THREAD {
            released = std::mem::take(&mut waiting.samples);
            waiting.statement_start = statement_start;
        }
        waiting.samples.push(held);
        released
    }

    /// A sample of thread `tid` in the statement that started at `statement_start`, with
    /// queryid `query_id`: the thread's held samples of the same statement are returned with
    /// it set, and those of another statement as they are.
    pub fn resolve(&mut self, tid: u32, statement_start: u64, query_id: i64) -> Vec<Held> {
        let Some(waiting) = self.by_thread.remove(&tid) else {
            return Vec::new();
        };
        let mut samples = waiting.samples;
        if statement_start != 0 && waiting.statement_start == statement_start {
            for held in &mut samples {
                held.attribution.query_id = Some(query_id);
            }
        }
        samples
    }

    /// Resolves the held samples of each thread from what `current` reads of its status now:
    /// the statement's start and reported queryid. The samples of a thread whose statement
    /// reports its queryid are returned with it, those of a thread on to another statement as
    /// they are (queryid 0); a thread still before its queryid, or not read, keeps waiting.
    pub fn resolve_from(&mut self, mut current: impl FnMut(u32, &Held) -> Option<(u64, i64)>) -> Vec<Held> {
        let mut done = Vec::new();
        for (&tid, waiting) in &self.by_thread {
            let Some(first) = waiting.samples.first() else {
                done.push((tid, None));
                continue;
            };
            match current(tid, first) {
                Some((start, query_id)) if start == waiting.statement_start && query_id != 0 => {
                    done.push((tid, Some(query_id)));
                }
                Some((start, _)) if start != waiting.statement_start => done.push((tid, None)),
                _ => {}
            }
        }
        let mut released = Vec::new();
        for (tid, query_id) in done {
            let Some(waiting) = self.by_thread.remove(&tid) else {
                continue;
            };
            for mut held in waiting.samples {
                if let Some(query_id) = query_id {
                    held.attribution.query_id = Some(query_id);
                }
                released.push(held);
            }
        }
        released
    }

    /// Whether any sample waits.
    pub fn is_empty(&self) -> bool {
        self.by_thread.is_empty()
    }

    /// Every held sample, as it is (queryid 0).
    pub fn release_all(&mut self) -> Vec<Held> {
        self.by_thread.drain().flat_map(|(_, w)| w.samples).collect()
    }

    /// The held samples of the threads of exited processes `pids`, as they are.
    pub fn release_processes(&mut self, pids: &[u32]) -> Vec<Held> {
        let threads: Vec<u32> = self
            .by_thread
            .iter()
            .filter(|(_, w)| w.samples.first().is_some_and(|h| pids.contains(&h.tgid)))
            .map(|(&tid, _)| tid)
            .collect();
        threads
            .into_iter()
            .filter_map(|tid| self.by_thread.remove(&tid))
            .flat_map(|w| w.samples)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use symbolizer::UnwindEnd;

    fn held(tgid: u32) -> Held {
        Held {
            root: 1,
            tgid,
            attribution: Attribution {
                query_id: Some(0),
                ..Attribution::default()
            },
            kernel: Vec::new(),
            user: UnwoundStack {
                frames: Vec::new(),
                end: UnwindEnd::ReachedRoot,
            },
        }
    }

    fn query_ids(samples: &[Held]) -> Vec<Option<i64>> {
        samples.iter().map(|h| h.attribution.query_id).collect()
    }

    #[test]
    fn parsing_samples_get_the_queryid_their_statement_reports() {
        let mut link = StatementLink::default();
        assert!(link.hold(10, 500, held(10)).is_empty());
        assert!(link.hold(10, 500, held(10)).is_empty());
        // Another thread's statement is its own.
        assert!(link.hold(11, 900, held(11)).is_empty());
        assert_eq!(query_ids(&link.resolve(10, 500, 7)), vec![Some(7), Some(7)]);
        assert!(link.resolve(10, 500, 7).is_empty(), "released once");
        assert_eq!(query_ids(&link.release_all()), vec![Some(0)]);
    }

    #[test]
    fn samples_of_another_statement_keep_queryid_0() {
        let mut link = StatementLink::default();
        link.hold(10, 500, held(10));
        // The next statement began before the first reported a queryid (it failed to parse).
        assert_eq!(query_ids(&link.hold(10, 600, held(10))), vec![Some(0)]);
        assert_eq!(query_ids(&link.resolve(10, 700, 8)), vec![Some(0)]);
        link.hold(10, 800, held(10));
        link.hold(12, 800, held(12));
        assert_eq!(query_ids(&link.release_processes(&[10])), vec![Some(0)]);
        assert_eq!(link.release_all().len(), 1);
    }

    #[test]
    fn a_thread_holds_a_bounded_number() {
        let mut link = StatementLink::default();
        let released: usize = (0..MAX_HELD_PER_THREAD + 1)
            .map(|_| link.hold(10, 500, held(10)).len())
            .sum();
        assert_eq!(released, MAX_HELD_PER_THREAD);
        assert_eq!(link.release_all().len(), 1);
    }

    #[test]
    fn a_status_read_resolves_a_statement_that_was_not_sampled_again() {
        let mut link = StatementLink::default();
        link.hold(10, 500, held(10));
        link.hold(11, 600, held(11));
        link.hold(12, 700, held(12));
        link.hold(13, 800, held(13));
        let released = link.resolve_from(|tid, first| {
            assert_eq!(first.tgid, tid);
            match tid {
                // Idle after the statement: its start and queryid are still shown.
                10 => Some((500, 7)),
                // Still parsing: no queryid yet.
                11 => Some((600, 0)),
                // On to another statement: this one's queryid is gone.
                12 => Some((701, 9)),
                // Not readable (exited).
                _ => None,
            }
        });
        let mut by_thread: Vec<(u32, Option<i64>)> = released
            .iter()
            .map(|h| (h.tgid, h.attribution.query_id))
            .collect();
        by_thread.sort();
        assert_eq!(by_thread, vec![(10, Some(7)), (12, Some(0))]);
        assert_eq!(link.release_all().len(), 2);
        assert!(link.is_empty());
    }
}
