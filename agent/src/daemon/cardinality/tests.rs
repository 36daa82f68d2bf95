use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::model::fixtures::{labelled, off_cpu, profile};

/// An on-CPU sample of `query_id` at 99 Hz with a state and a backend type.
fn cpu(query_id: u32, state: &str, count: u64) -> StackSample {
    let id = query_id.to_string();
    labelled(
        &["PostgresMain", "exec_simple_query"],
        &[
            (labels::BACKEND_TYPE, "client backend"),
            (labels::QUERY_ID, &id),
            (labels::STATE, state),
        ],
        count,
    )
}

/// An off-CPU sample of `query_id` in `wait_event`, weighing `ns`.
fn waiting(query_id: u32, wait_event: &str, ns: u64) -> StackSample {
    let id = query_id.to_string();
    labelled(
        &["PostgresMain", "WaitEventSetWait"],
        &[
            (labels::BACKEND_TYPE, "client backend"),
            (labels::OFF_CPU, "futex"),
            (labels::QUERY_ID, &id),
            (labels::WAIT_EVENT, wait_event),
        ],
        ns,
    )
}

fn queryids(profiles: &[(&'static str, Profile)]) -> BTreeSet<String> {
    profiles
        .iter()
        .flat_map(|(_, p)| p.samples.iter())
        .filter_map(|s| s.label(labels::QUERY_ID).map(str::to_string))
        .collect()
}

fn totals(profiles: &[(&'static str, Profile)]) -> Vec<u64> {
    profiles.iter().map(|(_, p)| p.total_count()).collect()
}

/// The agent's default upload interval.
const INTERVAL: Duration = Duration::from_secs(15);

/// Folds the next interval of `ranking`'s instance: one [`INTERVAL`] after its last.
fn step(ranking: &mut QueryIdRanking, profiles: &mut [(&'static str, Profile)], limits: Limits) -> Folded {
    let end = ranking.last_end.map_or(INTERVAL, |last| last + INTERVAL);
    ranking.fold(profiles, limits, end)
}

fn limits(top_queryids: usize, max_series: usize) -> Limits {
    Limits {
        top_queryids,
        max_series,
        statement_detail: true,
    }
}

#[test]
fn state_and_phase_are_left_out_unless_asked_for() {
    let phased = |phase: &str| {
        labelled(
            &["PostgresMain", "exec_simple_query"],
            &[
                (labels::PHASE, phase),
                (labels::QUERY_ID, "7"),
                (labels::STATE, "active"),
            ],
            1,
        )
    };
    let profiles = vec![("process_cpu", profile(vec![phased("plan"), phased("run")]))];
    let mut plain = profiles.clone();
    let folded = QueryIdRanking::default().fold(
        &mut plain,
        Limits {
            statement_detail: false,
            ..limits(0, 0)
        },
        INTERVAL,
    );
    assert_eq!(series_count(&plain), 1);
    assert!(plain[0]
        .1
        .samples
        .iter()
        .all(|s| s.labels == [(labels::QUERY_ID.to_string(), "7".to_string())]));
    assert_eq!(folded, Folded::default(), "leaving labels out is not folding");
    let mut detailed = profiles;
    QueryIdRanking::default().fold(&mut detailed, limits(0, 0), INTERVAL);
    assert_eq!(series_count(&detailed), 2);
}

fn set(ids: &[&str]) -> BTreeSet<String> {
    ids.iter().map(|id| id.to_string()).collect()
}

#[test]
fn the_heaviest_queryids_keep_their_label_and_the_rest_become_other() {
    // Statement i weighs i CPU samples: the top 3 of 10 are 8, 9 and 10.
    let mut profiles = vec![(
        "process_cpu",
        profile((1..=10).map(|i| cpu(i, "active", u64::from(i))).collect()),
    )];
    let before = totals(&profiles);
    let folded = QueryIdRanking::default().fold(&mut profiles, limits(3, 0), INTERVAL);
    assert_eq!(queryids(&profiles), set(&["10", "8", "9", OTHER]));
    assert_eq!(totals(&profiles), before, "folding loses no weight");
    assert_eq!(folded.by_reason.get(&FoldReason::QueryIdTopK), Some(&6));
    assert_eq!(folded.by_reason.get(&FoldReason::SeriesCap), None);
}

#[test]
fn off_cpu_time_ranks_a_statement_but_the_clients_time_does_not() {
    // Query 1 has one CPU sample (~10 ms) and 500 ms of lock waits; query 2 two CPU samples
    // and 900 ms in ClientRead inside its transaction (its client's time, not its own).
    let mut profiles = vec![
        (
            "process_cpu",
            profile(vec![cpu(1, "active", 1), cpu(2, "active", 2)]),
        ),
        (
            "offcpu",
            off_cpu(vec![
                waiting(1, "Lock:transactionid", 500_000_000),
                waiting(2, "Client:ClientRead", 900_000_000),
            ]),
        ),
    ];
    QueryIdRanking::default().fold(&mut profiles, limits(1, 0), INTERVAL);
    assert_eq!(queryids(&profiles), set(&["1", OTHER]));
}

/// One interval of CPU samples: (queryid, samples).
fn interval_of(weights: &[(u32, u64)]) -> Vec<(&'static str, Profile)> {
    vec![(
        "process_cpu",
        profile(weights.iter().map(|&(id, n)| cpu(id, "active", n)).collect()),
    )]
}

/// The interval (counted from 1) in which `newcomer`, at `newcomer_samples` an interval, first
/// keeps its label against `k` queryids that have had 10 samples an interval for ten minutes;
/// `None` if not within 100 intervals.
fn intervals_to_take_a_place(k: u32, newcomer: u32, newcomer_samples: u64) -> Option<usize> {
    let mut ranking = QueryIdRanking::default();
    let incumbents: Vec<(u32, u64)> = (1..=k).map(|id| (id, 10)).collect();
    for _ in 0..40 {
        step(&mut ranking, &mut interval_of(&incumbents), limits(k as usize, 0));
    }
    (1..=100).find(|_| {
        let mut weights = incumbents.clone();
        weights.push((newcomer, newcomer_samples));
        let mut profiles = interval_of(&weights);
        step(&mut ranking, &mut profiles, limits(k as usize, 0));
        queryids(&profiles).contains(&newcomer.to_string())
    })
}

#[test]
fn a_labelled_queryid_keeps_its_place_unless_a_newcomer_outweighs_it_by_half() {
    let mut ranking = QueryIdRanking::default();
    let mut first = interval_of(&[(1, 10), (2, 9)]);
    step(&mut ranking, &mut first, limits(1, 0));
    assert_eq!(queryids(&first), set(&["1", OTHER]));
    // Query 2 is now a little heavier, for ten minutes: query 1 stays (no flapping at the
    // boundary).
    for _ in 0..40 {
        let mut next = interval_of(&[(1, 10), (2, 14)]);
        step(&mut ranking, &mut next, limits(1, 0));
        assert_eq!(queryids(&next), set(&["1", OTHER]));
    }
}

#[test]
fn a_newcomer_takes_a_place_sooner_the_heavier_it_is() {
    // 150 s half-lives of 15 s intervals: the lightest labelled queryid's decayed weight is
    // ~15 intervals of its samples, and a newcomer must reach 1.5 times that.
    let place = |samples| intervals_to_take_a_place(10, 99, samples);
    assert_eq!(place(14), None, "never, below the bonus");
    assert_eq!(place(20), Some(20), "twice as heavy: two half-lives");
    assert_eq!(place(30), Some(10), "three times: one half-life");
    assert_eq!(place(100), Some(3), "as heavy as the ten together");
    assert_eq!(place(1000), Some(1), "taking over the instance");
}

#[test]
fn weights_decay_over_the_time_an_instance_pushed_nothing() {
    // Query 1 was the instance's statement for ten minutes; after an hour with nothing to push,
    // query 2, a tenth as heavy, takes the only place at once: the hour decayed query 1's
    // weight although no interval was folded in it.
    let mut ranking = QueryIdRanking::default();
    for _ in 0..40 {
        step(&mut ranking, &mut interval_of(&[(1, 100)]), limits(1, 0));
    }
    let later = ranking.last_end.unwrap_or_default() + Duration::from_secs(3600);
    let mut profiles = interval_of(&[(2, 10)]);
    ranking.fold(&mut profiles, limits(1, 0), later);
    assert_eq!(queryids(&profiles), set(&["2"]));
}

#[test]
fn a_long_flat_tail_does_not_rotate_through_the_labels() {
    // bench/scale.sh's shape: 4990 statements share 190 samples an interval at random, 10
    // heavy ones have 10 each; K = 100. Ranked by one interval, the 90 places left to the
    // tail were drawn anew each interval: ~1950 queryids labelled in 10 minutes.
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut random = move |below: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % below
    };
    let mut ranking = QueryIdRanking::default();
    let mut labelled = BTreeSet::new();
    for _ in 0..40 {
        let mut weights: BTreeMap<u32, u64> = (0..10).map(|heavy| (heavy, 10)).collect();
        for _ in 0..190 {
            *weights.entry(10 + random(4990) as u32).or_default() += 1;
        }
        let mut profiles = interval_of(&weights.into_iter().collect::<Vec<_>>());
        step(&mut ranking, &mut profiles, limits(100, 0));
        let pushed = queryids(&profiles);
        assert!(pushed.len() <= 101);
        for heavy in 0..10 {
            assert!(pushed.contains(&heavy.to_string()), "heavy {heavy} folded");
        }
        labelled.extend(pushed.into_iter().filter(|id| id != OTHER));
    }
    assert!(
        labelled.len() <= 600,
        "{} queryids labelled in 10 minutes",
        labelled.len()
    );
}

#[test]
fn the_ranking_remembers_a_bounded_number_of_queryids() {
    // Literal-varying statements: a new queryid every sample.
    let mut ranking = QueryIdRanking::default();
    for interval in 0..50u32 {
        let mut profiles = interval_of(&(0..1000).map(|i| (interval * 1000 + i, 1)).collect::<Vec<_>>());
        step(&mut ranking, &mut profiles, limits(5, 0));
        assert!(ranking.weights.len() <= 5 * REMEMBERED_PER_LABEL);
    }
    // Those that stopped are forgotten once far below the top K.
    for _ in 0..200 {
        step(
            &mut ranking,
            &mut interval_of(&[(1, 10), (2, 10), (3, 10), (4, 10), (5, 10)]),
            limits(5, 0),
        );
    }
    assert_eq!(ranking.weights.len(), 5);
}

#[test]
fn no_limits_fold_nothing() {
    let mut profiles = vec![(
        "process_cpu",
        profile((1..=50).map(|i| cpu(i, "active", 1)).collect()),
    )];
    let before = profiles.clone();
    let folded = QueryIdRanking::default().fold(&mut profiles, limits(0, 0), INTERVAL);
    assert_eq!(folded, Folded::default());
    assert_eq!(profiles[0].1.samples, before[0].1.samples);
}

#[test]
fn over_the_cap_the_lightest_series_are_folded_first() {
    // 20 queries × 2 states = 40 series, the cap 10: the heaviest stay as they are.
    let mut samples = Vec::new();
    for i in 1..=20 {
        samples.push(cpu(i, "active", u64::from(i) * 10));
        samples.push(cpu(i, "idle in transaction", 1));
    }
    let mut profiles = vec![("process_cpu", profile(samples))];
    let before = totals(&profiles);
    let folded = QueryIdRanking::default().fold(&mut profiles, limits(0, 10), INTERVAL);
    assert!(
        series_count(&profiles) <= 10,
        "{} series",
        series_count(&profiles)
    );
    assert_eq!(totals(&profiles), before);
    assert_eq!(
        folded.by_reason.get(&FoldReason::SeriesCap).copied(),
        Some(40 - series_count(&profiles) as u64)
    );
    let kept = queryids(&profiles);
    for heavy in ["20", "19", "18", "17", "16"] {
        assert!(kept.contains(heavy), "{heavy} folded: {kept:?}");
    }
    // What was folded keeps its backend type.
    assert!(profiles[0]
        .1
        .samples
        .iter()
        .all(|s| s.label(labels::BACKEND_TYPE) == Some("client backend")));
}

#[test]
fn the_cap_folds_statement_detail_when_queryids_alone_do_not_fit() {
    // One query, 30 wait events: folding the queryid does not help, the wait events must go.
    let samples = (0..30)
        .map(|i| waiting(7, &format!("LWLock:tranche{i}"), 1000 + i))
        .collect();
    let mut profiles = vec![("offcpu", off_cpu(samples))];
    let before = totals(&profiles);
    QueryIdRanking::default().fold(&mut profiles, limits(0, 5), INTERVAL);
    assert!(series_count(&profiles) <= 5);
    assert_eq!(totals(&profiles), before);
    let events: BTreeSet<_> = profiles[0]
        .1
        .samples
        .iter()
        .filter_map(|s| s.label(labels::WAIT_EVENT))
        .collect();
    assert!(events.contains(OTHER), "{events:?}");
}

fn arbitrary_profiles() -> impl Strategy<Value = Vec<(&'static str, Profile)>> {
    let sample = (0u32..40, 0usize..3, 0usize..4, 1u64..1000);
    (
        prop::collection::vec(sample.clone(), 0..120),
        prop::collection::vec(sample, 0..120),
    )
        .prop_map(|(on, off)| {
            let states = ["active", "idle in transaction", "fastpath function call"];
            let events = [
                "Lock:tuple",
                "IO:DataFileRead",
                "Client:ClientRead",
                "LWLock:WALWrite",
            ];
            vec![
                (
                    "process_cpu",
                    profile(on.into_iter().map(|(q, s, _, n)| cpu(q, states[s], n)).collect()),
                ),
                (
                    "offcpu",
                    off_cpu(
                        off.into_iter()
                            .map(|(q, _, e, n)| waiting(q, events[e], n * 1000))
                            .collect(),
                    ),
                ),
            ]
        })
}

/// The weight of each (profile, label set) after folding, summed.
fn by_series(profiles: &[(&'static str, Profile)]) -> BTreeMap<(usize, Vec<(String, String)>), u64> {
    let mut out = BTreeMap::new();
    for (index, (_, profile)) in profiles.iter().enumerate() {
        for sample in &profile.samples {
            *out.entry((index, sorted_labels(&sample.labels))).or_default() += sample.count;
        }
    }
    out
}

proptest! {
    #[test]
    fn folding_keeps_every_samples_weight_and_respects_the_limits(
        profiles in arbitrary_profiles(),
        k in 0usize..10,
        max in 0usize..30,
    ) {
        let mut folded_profiles = profiles.clone();
        let series_before = series_count(&profiles);
        let folded = QueryIdRanking::default().fold(&mut folded_profiles, limits(k, max), INTERVAL);
        // Nothing lost: each profile's total, and each stack's, is what it was.
        prop_assert_eq!(totals(&folded_profiles), totals(&profiles));
        for ((_, a), (_, b)) in profiles.iter().zip(&folded_profiles) {
            prop_assert_eq!(a.samples.len(), b.samples.len());
            for (x, y) in a.samples.iter().zip(&b.samples) {
                prop_assert_eq!(&x.frames, &y.frames);
                prop_assert_eq!(x.count, y.count);
            }
        }
        let labelled = queryids(&folded_profiles).into_iter().filter(|q| q != OTHER).count();
        if k > 0 {
            prop_assert!(labelled <= k, "{} queryids labelled, k = {}", labelled, k);
        }
        let after = series_count(&folded_profiles);
        let counted: u64 = folded.by_reason.values().sum();
        prop_assert_eq!(counted, (series_before - after) as u64);
        // Over the cap only when every series is as coarse as folding makes it.
        if max > 0 && after > max {
            let coarsest = CAP_STEPS[CAP_STEPS.len() - 1];
            for (_, labels) in by_series(&folded_profiles).keys() {
                prop_assert_eq!(&coarsened(labels, coarsest), labels);
            }
        }
    }
}
