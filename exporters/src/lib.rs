//! Output formats for pgscope profiles: folded stacks, SVG flame graphs, gzipped pprof and a
//! text table of the top functions.
//!
//! Every exporter reads the same [`Profile`]: aggregated stacks (root first) with their labels and
//! sample counts, plus the [`ProfileMeta`] that says what a count measures. All outputs are
//! deterministic for a given profile (sorted lines, stable pprof tables), whatever order the
//! aggregator produced the samples in.
//!
//! Kernel frames carry the `_[k]` suffix, as `stackcollapse-perf.pl` writes them, in the folded
//! lines and the pprof function names, so both name functions alike; the SVG colours them
//! orange (inferno drops the suffix from the frame text, as flamegraph.pl does).

use std::num::ParseIntError;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub mod folded;
pub mod hot_paths;
pub mod pprof;
pub mod pyroscope;
pub mod svg;
pub mod top;

pub use folded::{parse_folded, write_folded, FoldedOptions};
pub use hot_paths::{hot_paths, HotPath, PathStep};
pub use pprof::encode_pprof_gzip;
pub use svg::{write_svg, SvgOptions};
pub use top::{
    module_totals, render_top_table, top_functions, top_functions_by_total, FunctionShare, ModuleShare,
    KERNEL_MODULE,
};

/// Where a frame executes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FrameKind {
    /// A user-space frame (Postgres, its extensions, libc, ...).
    User,
    /// A kernel frame; written with the `_[k]` suffix.
    Kernel,
}

/// One symbolized stack frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Frame {
    /// The function name as the symbolizer found it (may contain anything; exporters sanitize).
    pub name: Arc<str>,
    /// User or kernel.
    pub kind: FrameKind,
    /// The file a user frame's code is in (`postgres`, `libc.so.6`, `llvmjit.so`), where known;
    /// `None` for kernel frames and the placeholders pgscope adds (`[incomplete stack]`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<Arc<str>>,
}

/// One aggregated stack: frames ROOT FIRST, labels sorted by key, value in the profile's unit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StackSample {
    /// Frames from the outermost caller (index 0) to the leaf (last).
    pub frames: Vec<Frame>,
    /// `(key, value)` pairs sorted by key, e.g. `("pid", "1234")`.
    pub labels: Vec<(String, String)>,
    /// How many times this stack was sampled.
    pub count: u64,
}

impl StackSample {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// What the samples measure, e.g. on-CPU at 99 Hz: sample_type ("cpu","nanoseconds"),
/// period = 1e9/99 ns, each sample's value in pprof = count * period.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProfileMeta {
    /// pprof sample type of the weighted value, e.g. `cpu`.
    pub sample_type: String,
    /// Unit of the weighted value, e.g. `nanoseconds`.
    pub unit: String,
    /// pprof period type, e.g. `cpu`.
    pub period_type: String,
    /// pprof period unit, e.g. `nanoseconds`.
    pub period_unit: String,
    /// Amount of `period_unit` one sample stands for.
    pub period: u64,
    /// Start of the profile, nanoseconds since the Unix epoch.
    pub start_unix_nanos: u64,
    /// Length of the profile in nanoseconds.
    pub duration_nanos: u64,
}

impl ProfileMeta {
    /// On-CPU sampling at `frequency_hz`, with the types Grafana Alloy uses for CPU profiles
    /// (`cpu`/`nanoseconds` for both the sample and the period type, period = 1e9 / Hz).
    ///
    /// A frequency of 0 is treated as 1 Hz rather than dividing by zero.
    pub fn cpu(frequency_hz: u64, start_unix_nanos: u64, duration_nanos: u64) -> Self {
        ProfileMeta {
            sample_type: "cpu".to_string(),
            unit: "nanoseconds".to_string(),
            period_type: "cpu".to_string(),
            period_unit: "nanoseconds".to_string(),
            period: 1_000_000_000 / frequency_hz.max(1),
            start_unix_nanos,
            duration_nanos,
        }
    }

    /// Off-CPU time: each sample's count is nanoseconds spent off CPU (sample and period type
    /// `offcpu`/`nanoseconds`, period 1, as Grafana Alloy names off-CPU profiles).
    pub fn off_cpu(start_unix_nanos: u64, duration_nanos: u64) -> Self {
        ProfileMeta {
            sample_type: "offcpu".to_string(),
            unit: "nanoseconds".to_string(),
            period_type: "offcpu".to_string(),
            period_unit: "nanoseconds".to_string(),
            period: 1,
            start_unix_nanos,
            duration_nanos,
        }
    }
}

/// Aggregated stacks plus what they measure. Serializable, so that a trace can be saved as a
/// recording and reported on later.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Profile {
    /// Sample and period types, time range.
    pub meta: ProfileMeta,
    /// The stacks; order does not matter, and the same stack may appear more than once.
    pub samples: Vec<StackSample>,
}

impl Profile {
    /// Sum of all sample counts.
    pub fn total_count(&self) -> u64 {
        // Saturating: a recording or a corrupt record may hold counts that add past u64.
        self.samples
            .iter()
            .fold(0, |total, s| total.saturating_add(s.count))
    }
}

/// Errors of the exporters.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The destination writer failed.
    #[error("cannot write the {format} output")]
    Write {
        /// `folded` or `svg`.
        format: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// inferno could not render the flame graph.
    #[error("cannot render the flame graph")]
    Flamegraph(#[source] std::io::Error),
    /// Compressing the pprof profile failed.
    #[error("cannot gzip the pprof profile")]
    Gzip(#[source] std::io::Error),
    /// A series has no `service_name`, which Pyroscope requires.
    #[error("the series has no service_name label")]
    NoServiceName,
    /// A value does not fit pprof's signed 64-bit integers.
    #[error("{field} {value} does not fit in a pprof int64")]
    PprofOverflow {
        /// Which field overflowed, e.g. `sample value`.
        field: &'static str,
        /// The value, or the operands' product saturated to `u64::MAX`.
        value: u64,
    },
    /// A folded line has no ` <count>` at its end.
    #[error("folded line {line} has no sample count: `{text}`")]
    FoldedMissingCount {
        /// 1-based line number.
        line: usize,
        /// The offending line.
        text: String,
    },
    /// A folded line's count is not an unsigned integer.
    #[error("folded line {line} has an invalid sample count `{count}`")]
    FoldedInvalidCount {
        /// 1-based line number.
        line: usize,
        /// The text found where the count should be.
        count: String,
        #[source]
        source: ParseIntError,
    },
    /// A folded line has an empty stack or an empty frame (`a;;b`).
    #[error("folded line {line} has an empty frame: `{text}`")]
    FoldedEmptyFrame {
        /// 1-based line number.
        line: usize,
        /// The offending line.
        text: String,
    },
}

/// Name of a frame as written in folded stacks, flame graphs and pprof: control characters
/// (newlines included) become spaces and `;` becomes `:` so a folded line stays one line with
/// `;` only between frames; kernel frames get the `_[k]` suffix. Empty names become `[unknown]`.
pub(crate) fn display_name(frame: &Frame) -> String {
    let mut name = sanitize(&frame.name);
    if frame.kind == FrameKind::Kernel {
        name.push_str("_[k]");
    }
    name
}

/// See [`display_name`]; also used for label values that become root frames.
pub fn sanitize(text: &str) -> String {
    let mapped: String = text
        .chars()
        .map(|c| match c {
            ';' => ':',
            c if c.is_control() => ' ',
            c => c,
        })
        .collect();
    // Trimmed after the mapping: a control character at either end (a NUL before the name) must
    // not leave a space there, which inferno reads as the end of an empty frame.
    let trimmed = mapped.trim();
    if trimmed.is_empty() {
        return "[unknown]".to_string();
    }
    trimmed.to_string()
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    pub fn user(name: &str) -> Frame {
        Frame {
            name: Arc::from(name),
            kind: FrameKind::User,
            module: None,
        }
    }

    pub fn kernel(name: &str) -> Frame {
        Frame {
            name: Arc::from(name),
            kind: FrameKind::Kernel,
            module: None,
        }
    }

    pub fn sample(frames: Vec<Frame>, labels: &[(&str, &str)], count: u64) -> StackSample {
        StackSample {
            frames,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            count,
        }
    }

    /// Two backends running a query; one is in the kernel, one recurses.
    pub fn small_profile() -> Profile {
        let exec = || vec![user("main"), user("PostmasterMain"), user("exec_simple_query")];
        let with = |base: Vec<Frame>, more: &[Frame]| base.into_iter().chain(more.iter().cloned()).collect();
        Profile {
            meta: ProfileMeta::cpu(99, 1_700_000_000_000_000_000, 30_000_000_000),
            samples: vec![
                sample(with(exec(), &[user("LockRelationOid")]), &[("pid", "42")], 3),
                sample(with(exec(), &[user("_bt_getroot")]), &[("pid", "42")], 5),
                sample(
                    with(exec(), &[user("__libc_recv"), kernel("tcp_recvmsg")]),
                    &[("pid", "43")],
                    2,
                ),
                // The same stack as the first one, from another aggregation bucket.
                sample(with(exec(), &[user("LockRelationOid")]), &[("pid", "42")], 1),
                sample(
                    with(
                        exec(),
                        &[user("ExecProcNode"), user("ExecProcNode"), user("ExecScan")],
                    ),
                    &[("pid", "43")],
                    4,
                ),
            ],
        }
    }
}
