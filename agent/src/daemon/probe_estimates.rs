//! The agent's estimate of a duty-cycled probe's calls per upload interval: what was measured
//! while the probe was attached, plus the detached part at the rate measured while attached.
//!
//! Two things keep it unbiased whatever share of the time the probe is attached. The rate is
//! kept per instance and queryid, not per backend, so a backend that connects while the probe
//! is detached is estimated at its queryid's rate from the start. And a key first measured
//! after a detached stretch (a workload that began while the probe was off, which happens
//! every time a new workload meets a low duty cycle) also gets the stretch before the interval
//! it was first seen in: its calls there were estimated by nothing, as it had no rate yet.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::bpf::abi::{CallStats, Function, ProbedCall};
use crate::collect::probes::IntervalShare;

/// (calls, nanoseconds) per (function, queryid) of one instance.
pub(super) type CallsAndTime = BTreeMap<(ProbedCall, i64), (u64, u64)>;

/// How long a rate measured while attached stands in for intervals the duty cycle left the
/// probe detached: longer than the longest detached stretch (half a second attached at a 2%
/// duty: 25 s), short enough that a query that stopped is not counted on for long.
pub(super) const RATE_FRESH: Duration = Duration::from_secs(40);

/// Weight an interval's measurements keep in the rate at the next interval: the rate follows
/// a changing workload over a few intervals while one attached window's noise is averaged out.
const RATE_DECAY: f64 = 0.7;

/// Calls and nanoseconds per attached unit (statement or second), decayed over intervals, and
/// when the probe was last attached.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Rate {
    sums: (f64, f64, f64),
    attached_at: Option<Instant>,
}

impl Rate {
    fn add(&mut self, measured: (u64, u64), attached: f64, now: Instant) {
        if attached <= 0.0 {
            return;
        }
        self.sums = (
            self.sums.0 * RATE_DECAY + measured.0 as f64,
            self.sums.1 * RATE_DECAY + measured.1 as f64,
            self.sums.2 * RATE_DECAY + attached,
        );
        self.attached_at = Some(now);
    }

    /// Calls and nanoseconds for `units` at this rate, if it is fresh.
    fn estimate(&self, units: f64, now: Instant) -> Option<(u64, u64)> {
        let fresh = self.attached_at.is_some_and(|at| now - at <= RATE_FRESH);
        (fresh && self.sums.2 > 0.0).then(|| {
            let per_unit = |sum: f64| (sum / self.sums.2 * units).round() as u64;
            (per_unit(self.sums.0), per_unit(self.sums.1))
        })
    }
}

/// One (instance, function, queryid) across upload intervals. What was measured while the
/// probe was attached is sent as measured; the part of the interval it was detached is
/// estimated at the rate measured while attached over the recent intervals: calls per
/// statement of the instance where its statement clock counted, else calls per second.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Estimate {
    per_statement: Rate,
    per_second: Rate,
    /// When a call was last measured: a key without any for [`RATE_FRESH`] is forgotten.
    called_at: Option<Instant>,
}

impl Estimate {
    /// The interval's calls and nanoseconds from what was `measured` in it. `first`: no call
    /// of this key was measured before, so the detached stretch the interval began in
    /// (`share`'s unseen part) had no rate to be estimated at; it is estimated now, at the
    /// rate just measured, as the key's calls there were not counted anywhere.
    fn advance(
        &mut self,
        measured: (u64, u64),
        share: IntervalShare,
        now: Instant,
        first: bool,
    ) -> (u64, u64) {
        let (all_time, attached_time) = (share.time.0.as_secs_f64(), share.time.1.as_secs_f64());
        if measured.0 > 0 {
            self.called_at = Some(now);
        }
        self.per_second.add(measured, attached_time, now);
        let by_statements = share.statements.and_then(|statements| {
            self.per_statement.add(measured, statements.attached as f64, now);
            let all = statements.all?;
            let before = if first { statements.unseen } else { 0 };
            self.per_statement
                .estimate((all.saturating_sub(statements.attached) + before) as f64, now)
        });
        let unmeasured = by_statements.or_else(|| {
            let before = if first {
                share.unseen_time.as_secs_f64()
            } else {
                0.0
            };
            self.per_second
                .estimate((all_time - attached_time).max(0.0) + before, now)
        });
        match unmeasured {
            Some((calls, ns)) => (measured.0 + calls, measured.1 + ns),
            None => measured,
        }
    }

    /// Whether a call was measured recently enough to keep estimating the key.
    fn is_recent(&self, now: Instant) -> bool {
        self.called_at.is_some_and(|at| now - at <= RATE_FRESH)
    }
}

/// A backend's calls for one key since the last read, from the kernel's cumulative counts
/// `stats` and those of the last read `last` (updated).
pub(super) fn delta(last: &mut (u64, u64), stats: &CallStats) -> (u64, u64) {
    if stats.calls < last.0 {
        // The map entry was removed and made again: it counts from zero.
        *last = (0, 0);
    }
    let measured = (stats.calls - last.0, stats.total_ns.saturating_sub(last.1));
    *last = (stats.calls, stats.total_ns);
    measured
}

/// An estimate's key: instance (root PID), probed call, queryid.
pub(super) type EstimateKey = (u32, ProbedCall, i64);

/// One upload interval's calls and nanoseconds per instance (root PID), from the calls
/// `measured` per key in it (its backends' summed): every key measured now or with a recent
/// rate, estimated over its instance's share of the interval ([`Estimate::advance`]).
/// `share_of(root, function)` is None for an instance no longer probed: its keys go.
pub(super) fn estimate_interval(
    estimates: &mut BTreeMap<EstimateKey, Estimate>,
    measured: &BTreeMap<EstimateKey, (u64, u64)>,
    share_of: impl Fn(u32, Function) -> Option<IntervalShare>,
    now: Instant,
) -> BTreeMap<u32, CallsAndTime> {
    let keys: BTreeSet<EstimateKey> = measured.keys().chain(estimates.keys()).copied().collect();
    let mut out: BTreeMap<u32, CallsAndTime> = BTreeMap::new();
    for key in keys {
        let (root, call, query_id) = key;
        let Some(share) = share_of(root, call.function) else {
            estimates.remove(&key);
            continue;
        };
        let measured = measured.get(&key).copied().unwrap_or((0, 0));
        let first = !estimates.contains_key(&key);
        if first && measured.0 == 0 {
            continue;
        }
        let (calls, ns) = estimates
            .entry(key)
            .or_default()
            .advance(measured, share, now, first);
        if calls > 0 {
            out.entry(root).or_default().insert((call, query_id), (calls, ns));
        }
    }
    estimates.retain(|_, estimate| estimate.is_recent(now));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::probes::StatementShare;

    const PORTAL_START: ProbedCall = ProbedCall {
        function: Function::PortalStart,
        detail: 0,
    };

    fn share(all: u64, attached: u64, time_attached: Duration) -> IntervalShare {
        IntervalShare {
            time: (Duration::from_secs(2), time_attached),
            unseen_time: Duration::ZERO,
            statements: Some(StatementShare {
                attached,
                all: Some(all),
                unseen: 0,
            }),
        }
    }

    #[test]
    fn what_was_measured_is_sent_and_the_detached_part_estimated_at_the_recent_rate() {
        let secs = Duration::from_secs;
        let start = Instant::now();
        let mut key = Estimate::default();
        // Attached for 100 of 400 statements: 100 calls measured, 300 estimated at 1 per
        // statement.
        assert_eq!(
            key.advance((100, 1000), share(400, 100, secs(1)), start, true),
            (400, 4000)
        );
        // Detached the whole interval: the rate × 300 statements.
        let later = start + secs(15);
        assert_eq!(
            key.advance((0, 0), share(300, 0, Duration::ZERO), later, false),
            (300, 3000)
        );
        // Attached again at half a call per statement: the rate is the decayed mix of both
        // windows, (0.7 × 100 + 50) / (0.7 × 100 + 100) per statement.
        let (calls, _) = key.advance((50, 500), share(400, 100, secs(1)), later, false);
        assert_eq!(calls, 50 + (120.0_f64 / 170.0 * 300.0).round() as u64);
        // No statement count this interval (the clock had just started): calls per second.
        let no_statements = IntervalShare {
            time: (secs(2), Duration::ZERO),
            unseen_time: Duration::ZERO,
            statements: None,
        };
        let per_second = (100.0 * 0.7 + 50.0) / (1.0 * 0.7 + 1.0);
        assert_eq!(
            key.advance((0, 0), no_statements, later, false).0,
            (per_second * 2.0_f64).round() as u64
        );
        // A rate too old is not used: only what was measured.
        let stale = later + RATE_FRESH + secs(1);
        assert_eq!(
            key.advance((0, 0), share(300, 0, Duration::ZERO), stale, false),
            (0, 0)
        );
    }

    #[test]
    fn a_clock_that_started_mid_interval_still_gives_the_rate_of_its_attached_statements() {
        let secs = Duration::from_secs;
        let now = Instant::now();
        let mut key = Estimate::default();
        // The first interval: 300 calls over 100 statements counted while attached, but the
        // clock missed the interval's start, so the detached second is estimated per second.
        let first = IntervalShare {
            time: (secs(2), secs(1)),
            unseen_time: Duration::ZERO,
            statements: Some(StatementShare {
                attached: 100,
                all: None,
                unseen: 0,
            }),
        };
        assert_eq!(key.advance((300, 3000), first, now, true), (600, 6000));
        // Then detached for a whole counted interval of 500 statements: 3 calls each, not the
        // per-second rate (which would give 600).
        assert_eq!(
            key.advance((0, 0), share(500, 0, Duration::ZERO), now, false),
            (1500, 15000)
        );
    }

    #[test]
    fn a_backend_counts_from_zero_when_its_map_entry_is_made_again() {
        let stats = |calls, total_ns| CallStats {
            calls,
            total_ns,
            ..Default::default()
        };
        let mut last = (0, 0);
        assert_eq!(delta(&mut last, &stats(10, 100)), (10, 100));
        assert_eq!(delta(&mut last, &stats(15, 160)), (5, 60));
        assert_eq!(delta(&mut last, &stats(5, 50)), (5, 50));
    }

    /// Ten-millisecond steps of one instance under a duty cycle: the probe is attached for
    /// the first 50 steps (half a second) of every `period`, shifted by `phase`; from step
    /// `start` to step `end` a workload runs 120 statements and 10 probed calls a step;
    /// uploads every 200 steps. Each interval's share and measured calls are what `ProbeSet`
    /// and the kernel would give. Returns the calls shipped and the calls made.
    fn synthetic_run(period: u64, phase: u64, start: u64, end: u64) -> (u64, u64) {
        const STEP: Duration = Duration::from_millis(10);
        const INTERVAL: u64 = 200;
        let attached = |t: u64| (t + phase) % period < 50;
        let running = |t: u64| (start..end).contains(&t);
        let statements = |t: u64| if running(t) { 120 } else { 0 };
        let calls = |t: u64| if running(t) { 10 } else { 0 };
        let steps = |n: u64| STEP * u32::try_from(n).expect("a short run");
        let key = (1, PORTAL_START, 42);
        let mut estimates = BTreeMap::new();
        let base = Instant::now();
        let (mut shipped, mut made) = (0, 0);
        for first_step in (0..end).step_by(INTERVAL as usize) {
            let interval = first_step..first_step + INTERVAL;
            let on: Vec<u64> = interval.clone().filter(|&t| attached(t)).collect();
            let all: u64 = interval.clone().map(statements).sum();
            made += interval.clone().map(calls).sum::<u64>();
            let measured_calls: u64 = on.iter().map(|&t| calls(t)).sum();
            // The detached stretch the interval began in, back to the last attached step.
            let before: Vec<u64> = (0..first_step).rev().take_while(|&t| !attached(t)).collect();
            let share = IntervalShare {
                time: (steps(INTERVAL), steps(on.len() as u64)),
                unseen_time: steps(before.len() as u64),
                statements: Some(StatementShare {
                    attached: on.iter().map(|&t| statements(t)).sum(),
                    all: (all > 0).then_some(all),
                    unseen: before.iter().map(|&t| statements(t)).sum(),
                }),
            };
            let measured = if measured_calls > 0 {
                BTreeMap::from([(key, (measured_calls, measured_calls * 1000))])
            } else {
                BTreeMap::new()
            };
            let now = base + steps(first_step + INTERVAL);
            let out = estimate_interval(&mut estimates, &measured, |_, _| Some(share), now);
            shipped += out
                .get(&1)
                .and_then(|rows| rows.get(&(key.1, key.2)))
                .map_or(0, |&(calls, _)| calls);
        }
        (shipped, made)
    }

    #[test]
    fn estimates_are_unbiased_whatever_share_of_the_time_the_probe_is_attached() {
        // Duty cycles from 5% to 85%, every phase of the schedule against a workload that
        // begins a third into an upload interval or just before its end: begun while the
        // probe is detached, its first calls are measured only at the next window, often in
        // a later interval. The rates are exact here: only rounding may differ.
        for period in [1000, 500, 200, 100, 70, 59] {
            for phase in (0..period).step_by(7) {
                for start in [67, 195] {
                    let (shipped, made) = synthetic_run(period, phase, start, 2400);
                    assert!(
                        shipped.abs_diff(made) <= made / 10_000,
                        "duty {:.2}, phase {phase}, start {start}: {shipped} shipped for {made} calls",
                        50.0 / period as f64
                    );
                }
            }
        }
    }
}
