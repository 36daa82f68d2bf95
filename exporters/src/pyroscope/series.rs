//! A profile → Pyroscope series: one per label set, within the server's limits.
//!
//! Pyroscope turns pprof sample labels into series labels itself, but then one profile's
//! label sets cannot be checked against its limits before sending. Here each label set
//! becomes its own series whose pprof carries no sample labels: names are made valid, the
//! label count is capped, and profiles too big for one push are split by samples.

use std::collections::BTreeMap;

use prost::Message;
use pyroscope::encode::gen::push::{PushRequest, RawProfileSeries, RawSample};
use pyroscope::encode::gen::types::LabelPair;

use crate::pprof::{gzip, to_pprof};
use crate::{Error, Profile, StackSample};

/// Pyroscope's ingestion limits (its defaults).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Label names per series, `__name__` and `service_name` included.
    pub max_labels: usize,
    pub max_label_name_bytes: usize,
    pub max_label_value_bytes: usize,
    /// Samples per profile.
    pub max_samples: usize,
    /// Size of a profile before compression.
    pub max_profile_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_labels: 30,
            max_label_name_bytes: 1024,
            max_label_value_bytes: 2048,
            max_samples: 16_000,
            max_profile_bytes: 4 << 20,
        }
    }
}

/// One series' profile, ready to push.
#[derive(Clone, Debug, PartialEq)]
pub struct SeriesProfile {
    /// Sorted by name; `__name__` and `service_name` among them.
    pub labels: Vec<(String, String)>,
    pub pprof_gzip: Vec<u8>,
    /// Distinct stacks in the profile.
    pub samples: usize,
}

/// The series of one profile, and what had to be left out to respect the limits.
#[derive(Clone, Debug, Default)]
pub struct Built {
    pub series: Vec<SeriesProfile>,
    /// Labels left out of series that would have had more than `max_labels`.
    pub labels_dropped: u64,
    /// Stacks left out because a profile of that one stack exceeds `max_profile_bytes`.
    pub samples_dropped: u64,
}

/// Labels the caller sets that samples cannot override.
const RESERVED: [&str; 2] = ["__name__", "service_name"];

/// Splits `profile` into series named `name` (`__name__`: `process_cpu`, `offcpu`, …), each
/// labelled with `base` plus its samples' labels (a sample label wins over a base label of the
/// same name, except `service_name`). Deterministic: series sorted by labels.
pub fn build_series(
    profile: &Profile,
    name: &str,
    base: &[(String, String)],
    limits: &Limits,
) -> Result<Built, Error> {
    let mut groups: BTreeMap<Vec<(String, String)>, Vec<StackSample>> = BTreeMap::new();
    for sample in &profile.samples {
        if sample.count == 0 {
            continue;
        }
        let mut labels = sample.labels.clone();
        labels.sort();
        groups.entry(labels).or_default().push(StackSample {
            frames: sample.frames.clone(),
            labels: Vec::new(),
            count: sample.count,
        });
    }
    let mut built = Built::default();
    for (sample_labels, samples) in groups {
        let (labels, dropped) = series_labels(name, base, &sample_labels, limits)?;
        built.labels_dropped += dropped;
        let mut chunks = Vec::new();
        for chunk in samples.chunks(limits.max_samples.max(1)) {
            encode_within(profile, chunk, limits, &mut chunks, &mut built.samples_dropped)?;
        }
        for (pprof, count) in chunks {
            built.series.push(SeriesProfile {
                labels: labels.clone(),
                pprof_gzip: gzip(&pprof)?,
                samples: count,
            });
        }
    }
    Ok(built)
}

/// Encodes `samples` as one pprof, or as several when it would exceed the byte limit
/// (halving until each part fits; one stack alone over the limit is dropped and counted).
fn encode_within(
    profile: &Profile,
    samples: &[StackSample],
    limits: &Limits,
    out: &mut Vec<(Vec<u8>, usize)>,
    dropped: &mut u64,
) -> Result<(), Error> {
    let part = Profile {
        meta: profile.meta.clone(),
        samples: samples.to_vec(),
    };
    let bytes = to_pprof(&part)?.encode_to_vec();
    if bytes.len() <= limits.max_profile_bytes {
        out.push((bytes, samples.len()));
        return Ok(());
    }
    if samples.len() == 1 {
        *dropped += 1;
        return Ok(());
    }
    let (left, right) = samples.split_at(samples.len() / 2);
    encode_within(profile, left, limits, out, dropped)?;
    encode_within(profile, right, limits, out, dropped)
}

/// The labels of one series, valid and within the count limit: `__name__`, `service_name`,
/// then the base labels, then the sample labels, kept in that order of priority.
fn series_labels(
    name: &str,
    base: &[(String, String)],
    sample_labels: &[(String, String)],
    limits: &Limits,
) -> Result<(Vec<(String, String)>, u64), Error> {
    let mut ordered: Vec<(String, String)> = vec![("__name__".to_string(), name.to_string())];
    let mut put = |name: &str, value: &str, overriding: bool| {
        let name = truncate(&sanitize(name), limits.max_label_name_bytes);
        let value = truncate(value, limits.max_label_value_bytes);
        match ordered.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) if overriding && !RESERVED.contains(&name.as_str()) => slot.1 = value,
            Some(_) => {}
            None => ordered.push((name, value)),
        }
    };
    if let Some((_, service)) = base.iter().find(|(n, _)| n == "service_name") {
        put("service_name", service, false);
    }
    for (label, value) in base {
        put(label, value, false);
    }
    for (label, value) in sample_labels {
        if !RESERVED.contains(&sanitize(label).as_str()) {
            put(label, value, true);
        }
    }
    if !ordered.iter().any(|(n, v)| n == "service_name" && !v.is_empty()) {
        return Err(Error::NoServiceName);
    }
    // Empty values carry nothing (Pyroscope treats them as absent).
    ordered.retain(|(_, value)| !value.is_empty());
    let dropped = ordered.len().saturating_sub(limits.max_labels.max(2)) as u64;
    ordered.truncate(limits.max_labels.max(2));
    ordered.sort();
    Ok((ordered, dropped))
}

/// Pyroscope's label names are `[a-zA-Z_][a-zA-Z0-9_]*`: other characters become `_`, and a
/// leading digit gets a `_` in front.
pub fn sanitize(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() || out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

/// At most `max` bytes, cut at a character boundary.
fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// The body of one push: every series with its one profile, each sample with a fresh ID.
pub fn encode_push_request(series: &[SeriesProfile]) -> Vec<u8> {
    PushRequest {
        series: series
            .iter()
            .map(|s| RawProfileSeries {
                labels: s
                    .labels
                    .iter()
                    .map(|(name, value)| LabelPair {
                        name: name.clone(),
                        value: value.clone(),
                    })
                    .collect(),
                samples: vec![RawSample {
                    raw_profile: s.pprof_gzip.clone(),
                    id: uuid::Uuid::new_v4().to_string(),
                }],
            })
            .collect(),
    }
    .encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{sample, user};
    use crate::ProfileMeta;

    fn base() -> Vec<(String, String)> {
        vec![
            ("service_name".into(), "postgres/main".into()),
            ("instance".into(), "main".into()),
        ]
    }

    fn profile(samples: Vec<StackSample>) -> Profile {
        Profile {
            meta: ProfileMeta::cpu(19, 1, 2),
            samples,
        }
    }

    #[test]
    fn one_series_per_label_set_with_no_sample_labels_left() {
        let p = profile(vec![
            sample(
                vec![user("main"), user("a")],
                &[("queryid", "1"), ("wait-event", "x")],
                3,
            ),
            sample(
                vec![user("main"), user("b")],
                &[("queryid", "1"), ("wait-event", "x")],
                2,
            ),
            sample(vec![user("main"), user("c")], &[("queryid", "2")], 5),
        ]);
        let built = build_series(&p, "process_cpu", &base(), &Limits::default()).expect("builds");
        assert_eq!(built.series.len(), 2);
        let first = &built.series[0];
        assert_eq!(
            first.labels,
            vec![
                ("__name__".to_string(), "process_cpu".to_string()),
                ("instance".into(), "main".into()),
                ("queryid".into(), "1".into()),
                ("service_name".into(), "postgres/main".into()),
                ("wait_event".into(), "x".into()),
            ]
        );
        assert_eq!(first.samples, 2);
    }

    #[test]
    fn service_name_is_required_and_not_overridden_by_samples() {
        let p = profile(vec![sample(vec![user("f")], &[("service_name", "evil")], 1)]);
        let built = build_series(&p, "process_cpu", &base(), &Limits::default()).expect("builds");
        assert!(built.series[0]
            .labels
            .contains(&("service_name".to_string(), "postgres/main".to_string())));
        let error = build_series(&p, "process_cpu", &[], &Limits::default()).unwrap_err();
        assert!(matches!(error, Error::NoServiceName));
    }

    #[test]
    fn label_count_is_capped_keeping_the_reserved_ones() {
        let many: Vec<(String, String)> = (0..40).map(|i| (format!("l{i:02}"), "v".to_string())).collect();
        let refs: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let p = profile(vec![sample(vec![user("f")], &refs, 1)]);
        let built = build_series(&p, "process_cpu", &base(), &Limits::default()).expect("builds");
        let labels = &built.series[0].labels;
        assert_eq!(labels.len(), 30);
        // __name__, the two base labels and 40 sample labels.
        assert_eq!(built.labels_dropped, 43 - 30);
        for reserved in ["__name__", "service_name", "instance"] {
            assert!(labels.iter().any(|(n, _)| n == reserved), "{reserved} kept");
        }
    }

    #[test]
    fn names_are_made_valid() {
        assert_eq!(sanitize("wait-event"), "wait_event");
        assert_eq!(sanitize("9lives"), "_9lives");
        assert_eq!(sanitize("k8s.pod/name"), "k8s_pod_name");
    }

    #[test]
    fn large_profiles_are_split_without_losing_a_sample() {
        let samples: Vec<StackSample> = (0..250)
            .map(|i| sample(vec![user("main"), user(&format!("f{i}"))], &[], 1 + i as u64))
            .collect();
        let total: u64 = samples.iter().map(|s| s.count).sum();
        let limits = Limits {
            max_samples: 100,
            ..Limits::default()
        };
        let built = build_series(&profile(samples.clone()), "process_cpu", &base(), &limits).expect("builds");
        assert_eq!(built.series.len(), 3);
        assert_eq!(built.series.iter().map(|s| s.samples).sum::<usize>(), 250);
        let limits = Limits {
            max_profile_bytes: 2000,
            ..Limits::default()
        };
        let built = build_series(&profile(samples), "process_cpu", &base(), &limits).expect("builds");
        assert!(built.series.len() > 3);
        assert_eq!(built.samples_dropped, 0);
        let mut sum = 0;
        for series in &built.series {
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(
                &mut flate2::read::GzDecoder::new(series.pprof_gzip.as_slice()),
                &mut bytes,
            )
            .expect("gunzip");
            assert!(bytes.len() <= 2000);
            let pprof = crate::pprof::PprofProfile::decode(bytes.as_slice()).expect("decode");
            sum += pprof.sample.iter().map(|s| s.value[0] as u64).sum::<u64>();
        }
        assert_eq!(sum, total);
    }
}
