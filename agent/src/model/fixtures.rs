//! Samples and profiles for the tests of the model, its views and the rules.

use std::sync::Arc;

use exporters::{Frame, FrameKind, Profile, ProfileMeta, StackSample};

use super::labels;

/// A sample with user frames (root first) and the given labels.
pub fn labelled(frames: &[&str], labels: &[(&str, &str)], count: u64) -> StackSample {
    StackSample {
        frames: frames
            .iter()
            .map(|name| Frame {
                name: Arc::from(*name),
                kind: FrameKind::User,
                module: None,
            })
            .collect(),
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        count,
    }
}

/// An on-CPU sample of `query_id` in `phase`, user frames root first.
pub fn sample(query_id: i64, phase: &str, frames: &[&str], count: u64) -> StackSample {
    let query_id = query_id.to_string();
    labelled(
        frames,
        &[(labels::PHASE, phase), (labels::QUERY_ID, &query_id)],
        count,
    )
}

/// An on-CPU profile at 99 Hz.
pub fn profile(samples: Vec<StackSample>) -> Profile {
    Profile {
        meta: ProfileMeta::cpu(99, 0, 1),
        samples,
    }
}

/// An off-CPU profile (weights in nanoseconds).
pub fn off_cpu(samples: Vec<StackSample>) -> Profile {
    Profile {
        meta: ProfileMeta::off_cpu(0, 1),
        samples,
    }
}
