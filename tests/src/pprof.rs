//! Reading pgscope's pprof output back: every sample's stack, string labels and count, and the
//! questions the attribution tests ask of them.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use exporters::pprof::PprofProfile;
use prost::Message;

/// One pprof sample: a distinct (stack, labels) pair and how many samples had it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabeledSample {
    /// Root first, as in the folded output (pprof stores them leaf first).
    pub frames: Vec<String>,
    /// String labels (`pid`, `backend_type`, `queryid`, …).
    pub labels: BTreeMap<String, String>,
    pub count: u64,
}

/// All samples of one pprof profile.
#[derive(Debug, Clone, Default)]
pub struct LabeledProfile {
    pub samples: Vec<LabeledSample>,
}

impl LabeledProfile {
    /// Reads a gzipped pprof file as `pgscope trace --pprof` writes it. The first sample value
    /// is the sample count.
    pub fn read_pprof(path: &Path) -> Result<Self> {
        let compressed = std::fs::read(path).with_context(|| format!("cannot read `{}`", path.display()))?;
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(compressed.as_slice())
            .read_to_end(&mut raw)
            .with_context(|| format!("`{}` is not gzip", path.display()))?;
        let pprof = PprofProfile::decode(raw.as_slice())
            .with_context(|| format!("`{}` is not a pprof protobuf", path.display()))?;
        Self::from_pprof(&pprof).with_context(|| format!("in `{}`", path.display()))
    }

    /// Resolves string and location indices of a decoded profile.
    pub fn from_pprof(pprof: &PprofProfile) -> Result<Self> {
        let string = |index: i64| -> Result<String> {
            usize::try_from(index)
                .ok()
                .and_then(|i| pprof.string_table.get(i))
                .cloned()
                .with_context(|| format!("string index {index} outside the string table"))
        };
        let mut function_names = BTreeMap::new();
        for function in &pprof.function {
            function_names.insert(function.id, string(function.name)?);
        }
        let mut location_names = BTreeMap::new();
        for location in &pprof.location {
            let names = location
                .line
                .iter()
                .map(|line| {
                    function_names
                        .get(&line.function_id)
                        .cloned()
                        .with_context(|| format!("no function {}", line.function_id))
                })
                .collect::<Result<Vec<_>>>()?;
            location_names.insert(location.id, names);
        }
        let mut samples = Vec::with_capacity(pprof.sample.len());
        for sample in &pprof.sample {
            let mut frames = Vec::new();
            for id in sample.location_id.iter().rev() {
                let names = location_names
                    .get(id)
                    .with_context(|| format!("no location {id}"))?;
                // A location's lines are innermost first: root first means outermost first.
                frames.extend(names.iter().rev().cloned());
            }
            let mut labels = BTreeMap::new();
            for label in &sample.label {
                ensure!(
                    label.str != 0,
                    "label `{}` is numeric, not a string",
                    string(label.key)?
                );
                labels.insert(string(label.key)?, string(label.str)?);
            }
            let count = sample.value.first().copied().context("a sample without values")?;
            let count = u64::try_from(count).with_context(|| format!("negative sample count {count}"))?;
            samples.push(LabeledSample {
                frames,
                labels,
                count,
            });
        }
        Ok(LabeledProfile { samples })
    }

    /// Number of samples.
    pub fn total(&self) -> u64 {
        self.samples.iter().map(|s| s.count).sum()
    }

    /// Number of samples satisfying `pred`.
    pub fn count_where(&self, pred: impl Fn(&LabeledSample) -> bool) -> u64 {
        self.samples.iter().filter(|s| pred(s)).map(|s| s.count).sum()
    }

    /// How many samples satisfying `pred` have each value of label `key` (`None`: no such
    /// label).
    pub fn label_values(
        &self,
        key: &str,
        pred: impl Fn(&LabeledSample) -> bool,
    ) -> BTreeMap<Option<String>, u64> {
        let mut values = BTreeMap::new();
        for s in self.samples.iter().filter(|s| pred(s)) {
            *values.entry(s.label(key).map(str::to_owned)).or_insert(0) += s.count;
        }
        values
    }

    /// Samples per `pid` label.
    pub fn samples_by_pid(&self) -> BTreeMap<u32, u64> {
        let mut by_pid = BTreeMap::new();
        for s in &self.samples {
            if let Some(pid) = s.pid() {
                *by_pid.entry(pid).or_insert(0) += s.count;
            }
        }
        by_pid
    }

    /// The `n` most frequent samples satisfying `pred`, with labels and leaf frames (for
    /// failure messages).
    pub fn examples_where(&self, pred: impl Fn(&LabeledSample) -> bool, n: usize) -> String {
        let mut matching: Vec<&LabeledSample> = self.samples.iter().filter(|s| pred(s)).collect();
        matching.sort_by_key(|s| std::cmp::Reverse(s.count));
        matching
            .iter()
            .take(n)
            .map(|s| {
                let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                let leaves = &s.frames[s.frames.len().saturating_sub(6)..];
                format!("  {} [{}] …;{}\n", s.count, labels.join(" "), leaves.join(";"))
            })
            .collect()
    }
}

impl LabeledSample {
    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.get(key).map(String::as_str)
    }

    /// The `pid` label.
    pub fn pid(&self) -> Option<u32> {
        self.label("pid")?.parse().ok()
    }

    /// Whether any frame satisfies `pred`.
    pub fn any_frame(&self, pred: impl Fn(&str) -> bool) -> bool {
        self.frames.iter().any(|f| pred(f))
    }
}

#[cfg(test)]
mod tests {
    use exporters::{Frame, FrameKind, Profile, ProfileMeta, StackSample};

    use super::*;

    #[test]
    fn reads_back_what_the_exporter_wrote() {
        let frame = |name: &str| Frame {
            name: name.into(),
            kind: FrameKind::User,
            module: None,
        };
        let labels = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let profile = Profile {
            meta: ProfileMeta::cpu(99, 0, 0),
            samples: vec![
                StackSample {
                    frames: vec![frame("main"), frame("PortalRun"), frame("int4mod")],
                    labels: labels(&[("pid", "42"), ("queryid", "-7")]),
                    count: 3,
                },
                StackSample {
                    frames: vec![frame("main"), frame("CheckpointerMain")],
                    labels: labels(&[("backend_type", "checkpointer"), ("pid", "43")]),
                    count: 2,
                },
            ],
        };
        let pprof = exporters::pprof::to_pprof(&profile).unwrap();
        let read = LabeledProfile::from_pprof(&pprof).unwrap();
        assert_eq!(read.total(), 5);
        assert_eq!(read.samples_by_pid(), BTreeMap::from([(42, 3), (43, 2)]));
        let query = read.samples.iter().find(|s| s.pid() == Some(42)).unwrap();
        assert_eq!(query.frames, ["main", "PortalRun", "int4mod"]);
        assert_eq!(query.label("queryid"), Some("-7"));
        assert_eq!(
            read.label_values("queryid", |_| true),
            BTreeMap::from([(None, 2), (Some("-7".to_string()), 3)])
        );
    }
}
