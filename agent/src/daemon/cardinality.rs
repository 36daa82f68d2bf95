//! Bounded label cardinality: what keeps one instance's series in Pyroscope from growing with
//! the number of statements. Pyroscope (and whoever pays for it) counts active series, and a
//! series per queryid × backend type × state × wait event × phase grows without bound on a
//! host with thousands of statements. Two controls, applied to an instance's profiles of one
//! interval after the findings have read them (they see every queryid):
//!
//! - **The top K queryids keep their label**, ranked by weight (CPU plus off-CPU time that is
//!   not the client's) decayed over the last minutes; the others become `queryid="other"`. A
//!   queryid labelled in the last interval keeps its place unless a newcomer outweighs it by
//!   half again: one hovering at the boundary does not flap between its own series and `other`.
//!   The decay is what bounds the series Pyroscope holds, not only those of one push: it keeps
//!   a queryid's series active for minutes after its last push, and with a long flat tail of
//!   statements (thousands, each a sample now and then) a ranking of one interval drew a new
//!   random hundred from the tail every interval (measured: 1274 queryid values in 5 minutes
//!   with K = 100). Ranked over minutes, the tail's places change slowly; a statement that
//!   takes over the instance still outweighs the whole window in the interval it does.
//! - **A cap on series per push**: over it, the lightest series are folded, coarser step by
//!   step (their queryid, then their statement detail, then their database become `other`)
//!   until the push fits.
//!
//! Before both, unless asked for, the statement's `state` and `phase` labels are left out: the
//! phase is on the stack itself (planner, executor and commit functions), and the state mostly
//! repeats the wait event (`Client:ClientRead` off CPU inside a transaction is "idle in
//! transaction"); together they made one statement of pgbench's TPC-B script 20-30 series
//! instead of 10 (measured: 230 series for the instance, 104 without them).
//!
//! Folding only relabels samples: every sample's weight is pushed, under a coarser label set.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use exporters::{Profile, StackSample};

use crate::model::labels::{self, SampleLabels};

/// The label value of what was folded.
pub const OTHER: &str = "other";

/// How much more a newcomer must weigh than a queryid labelled last interval to take its place.
const INCUMBENT_BONUS: f64 = 1.5;

/// After this long a queryid's weight counts half in the ranking. Measured in a simulation of
/// bench/scale.sh's workload (4990 statements sharing 190 samples an interval, 10 heavy ones,
/// K = 100, 15 s intervals): the queryids labelled over 10 minutes were 1947 ranked by one
/// interval, 832 with a half-life of 60 s, 464 with 150 s and 338 with 300 s. 150 s is the
/// shorter of the last two: a newcomer three times as heavy as the lightest labelled queryid
/// takes its place after one half-life, twice as heavy after two, and one as heavy as the
/// labelled ones together within three intervals (see the tests).
const HALF_LIFE: Duration = Duration::from_secs(150);

/// A queryid whose decayed weight falls below this share of the K-th heaviest is forgotten: it
/// could not come back into the top K before it would have been seen again anyway.
const FORGET_BELOW: f64 = 1e-3;

/// At most this many queryids per labelled one are remembered (the heaviest): literal-varying
/// statements can make new queryids faster than their weights decay away.
const REMEMBERED_PER_LABEL: usize = 100;

/// The profile type whose weight ranks queryids, with `offcpu`.
const CPU_PROFILE: &str = "process_cpu";
const OFF_CPU_PROFILE: &str = "offcpu";

/// Why series were folded (`pgscope_series_folded_total{reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FoldReason {
    /// A queryid outside the top K became `other`.
    QueryIdTopK,
    /// The push had more series than the cap.
    SeriesCap,
}

impl FoldReason {
    pub const ALL: [FoldReason; 2] = [FoldReason::QueryIdTopK, FoldReason::SeriesCap];

    pub fn name(self) -> &'static str {
        match self {
            FoldReason::QueryIdTopK => "queryid_top_k",
            FoldReason::SeriesCap => "series_cap",
        }
    }
}

/// The limits, from `[labels]`: 0 means no limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub top_queryids: usize,
    pub max_series: usize,
    /// Keep the `state` and `phase` labels.
    pub statement_detail: bool,
}

/// The labels only [`Limits::statement_detail`] keeps.
const DETAIL_LABELS: [&str; 2] = [labels::STATE, labels::PHASE];

/// One instance's folding state: each queryid's decayed weight, those labelled in its last
/// interval, and when that interval ended.
#[derive(Debug, Default)]
pub struct QueryIdRanking {
    weights: HashMap<String, f64>,
    labelled: HashSet<String>,
    last_end: Option<Duration>,
}

/// Series folded by one call, per reason.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Folded {
    pub by_reason: BTreeMap<FoldReason, u64>,
}

impl QueryIdRanking {
    /// Folds the instance's profiles of one interval, ending at `end` (since the Unix epoch),
    /// in place (see the module's text). The weights decay by the time since the last
    /// interval folded, not by one interval: an instance with nothing to push for a while
    /// comes back with its old weights decayed by that while.
    pub fn fold(
        &mut self,
        profiles: &mut [(&'static str, Profile)],
        limits: Limits,
        end: Duration,
    ) -> Folded {
        let mut folded = Folded::default();
        if !limits.statement_detail {
            for (_, profile) in profiles.iter_mut() {
                for sample in &mut profile.samples {
                    sample
                        .labels
                        .retain(|(name, _)| !DETAIL_LABELS.contains(&name.as_str()));
                }
            }
        }
        let before = series_count(profiles);
        if limits.top_queryids > 0 {
            self.add_interval(profiles, end);
            let kept = self.rank(limits.top_queryids);
            for (_, profile) in profiles.iter_mut() {
                for sample in &mut profile.samples {
                    if let Some(slot) = label_slot(sample, labels::QUERY_ID) {
                        if slot != OTHER && !kept.contains(slot.as_str()) {
                            *slot = OTHER.to_string();
                        }
                    }
                }
            }
            self.labelled = kept;
        } else {
            self.weights.clear();
            self.labelled.clear();
            self.last_end = None;
        }
        let after_top_k = series_count(profiles);
        add(&mut folded, FoldReason::QueryIdTopK, before - after_top_k);
        if limits.max_series > 0 && after_top_k > limits.max_series {
            cap_series(profiles, limits.max_series);
            add(
                &mut folded,
                FoldReason::SeriesCap,
                after_top_k - series_count(profiles),
            );
        }
        folded
    }

    /// Decays the weights by the time since the last interval's end and adds this interval's.
    fn add_interval(&mut self, profiles: &[(&'static str, Profile)], end: Duration) {
        let elapsed = self
            .last_end
            .map_or(Duration::ZERO, |last| end.saturating_sub(last));
        self.last_end = Some(end);
        let decay = 0.5f64.powf(elapsed.as_secs_f64() / HALF_LIFE.as_secs_f64());
        for weight in self.weights.values_mut() {
            *weight *= decay;
        }
        for (kind, profile) in profiles {
            if *kind != CPU_PROFILE && *kind != OFF_CPU_PROFILE {
                continue;
            }
            let period = profile.meta.period as f64;
            for sample in &profile.samples {
                if *kind == OFF_CPU_PROFILE && sample.is_client_time() {
                    continue;
                }
                if let Some(id) = sample.label(labels::QUERY_ID).filter(|id| *id != OTHER) {
                    let weight = sample.count as f64 * period;
                    match self.weights.get_mut(id) {
                        Some(total) => *total += weight,
                        None => {
                            self.weights.insert(id.to_string(), weight);
                        }
                    }
                }
            }
        }
    }

    /// The queryids that keep their label this interval; forgets those too light to matter.
    fn rank(&mut self, k: usize) -> HashSet<String> {
        let mut ranked: Vec<(f64, &str)> = self
            .weights
            .iter()
            .map(|(id, weight)| {
                let bonus = if self.labelled.contains(id) {
                    INCUMBENT_BONUS
                } else {
                    1.0
                };
                (weight * bonus, id.as_str())
            })
            .collect();
        // Heaviest first; equal weights by queryid, so that the choice does not depend on
        // hash order.
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1)));
        let kept: HashSet<String> = ranked.iter().take(k).map(|(_, id)| id.to_string()).collect();
        let floor = ranked
            .get(k.saturating_sub(1))
            .map_or(0.0, |(weight, _)| weight * FORGET_BELOW);
        let forgotten: Vec<String> = ranked
            .iter()
            .enumerate()
            .filter(|(place, (weight, _))| {
                *place >= k.saturating_mul(REMEMBERED_PER_LABEL) || *weight < floor
            })
            .map(|(_, (_, id))| id.to_string())
            .collect();
        for id in forgotten {
            self.weights.remove(&id);
        }
        kept
    }
}

fn add(folded: &mut Folded, reason: FoldReason, series: usize) {
    if series > 0 {
        *folded.by_reason.entry(reason).or_default() += series as u64;
    }
}

/// The value of label `name` of a sample, to rewrite.
fn label_slot<'a>(sample: &'a mut StackSample, name: &str) -> Option<&'a mut String> {
    sample
        .labels
        .iter_mut()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value)
}

/// Series the profiles make: one per profile type and label set.
fn series_count(profiles: &[(&'static str, Profile)]) -> usize {
    profiles
        .iter()
        .map(|(_, profile)| {
            profile
                .samples
                .iter()
                .filter(|s| s.count > 0)
                .map(|s| sorted_labels(&s.labels))
                .collect::<HashSet<_>>()
                .len()
        })
        .sum()
}

/// A sample's labels, sorted: what names its series within a profile.
type LabelSet = Vec<(String, String)>;

fn sorted_labels(labels: &[(String, String)]) -> LabelSet {
    let mut labels = labels.to_vec();
    labels.sort();
    labels
}

/// The labels each folding step turns into `other`, from the finest to the coarsest: the
/// backend type and the off-CPU class (a handful of values each) always stay.
const CAP_STEPS: [&[&str]; 3] = [
    &[labels::QUERY_ID],
    &[
        labels::QUERY_ID,
        labels::STATE,
        labels::WAIT_EVENT,
        labels::PHASE,
        labels::TRIGGER,
    ],
    &[
        labels::QUERY_ID,
        labels::STATE,
        labels::WAIT_EVENT,
        labels::PHASE,
        labels::TRIGGER,
        labels::DATABASE,
        labels::PID,
    ],
];

/// Folds the lightest series (by their share of their profile's total) until at most `max`
/// remain, or every series is at the coarsest step.
fn cap_series(profiles: &mut [(&'static str, Profile)], max: usize) {
    // (profile index, label set) → share of that profile's weight.
    let mut series: HashMap<(usize, LabelSet), f64> = HashMap::new();
    for (index, (_, profile)) in profiles.iter().enumerate() {
        let total = profile.total_count().max(1) as f64;
        for sample in profile.samples.iter().filter(|s| s.count > 0) {
            *series.entry((index, sorted_labels(&sample.labels))).or_default() += sample.count as f64 / total;
        }
    }
    // Per profile: original label set → the one it is pushed under.
    let mut mapping: HashMap<usize, HashMap<LabelSet, LabelSet>> = HashMap::new();
    for step in CAP_STEPS {
        if series.len() <= max {
            break;
        }
        let mut lightest: Vec<((usize, LabelSet), f64)> =
            series.iter().map(|(k, v)| (k.clone(), *v)).collect();
        lightest.sort_by(|a, b| a.1.total_cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
        for ((index, labels), share) in lightest {
            if series.len() <= max {
                break;
            }
            let coarse = coarsened(&labels, step);
            if coarse == labels {
                continue;
            }
            series.remove(&(index, labels.clone()));
            *series.entry((index, coarse.clone())).or_default() += share;
            let targets = mapping.entry(index).or_default();
            // Series folded into this one earlier follow it.
            for target in targets.values_mut().filter(|t| **t == labels) {
                *target = coarse.clone();
            }
            targets.insert(labels, coarse);
        }
    }
    for (index, (_, profile)) in profiles.iter_mut().enumerate() {
        let Some(targets) = mapping.get(&index) else {
            continue;
        };
        for sample in &mut profile.samples {
            if let Some(target) = targets.get(&sorted_labels(&sample.labels)) {
                sample.labels = target.clone();
            }
        }
    }
}

/// `labels` with those named in `step` set to `other`.
fn coarsened(labels: &[(String, String)], step: &[&str]) -> LabelSet {
    labels
        .iter()
        .map(|(name, value)| match step.contains(&name.as_str()) {
            true => (name.clone(), OTHER.to_string()),
            false => (name.clone(), value.clone()),
        })
        .collect()
}

#[cfg(test)]
mod tests;
