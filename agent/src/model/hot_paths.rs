//! A statement's hot path as one line of text, for the printed summary and the HTML report:
//! the frames every sample of the statement goes through (`_start` … `exec_simple_query`) are
//! left out but the last, long middles are cut, and a recursion shows once with its depth.

use exporters::{FrameKind, HotPath, PathStep};

/// A step is part of the statement's trunk, left out of the line, when it holds this share of
/// the statement's samples.
pub const TRUNK_SHARE: f64 = 0.95;
/// Frames shown at most: the first after the trunk, then the last ones (the work).
const SHOWN_FRAMES: usize = 7;

/// `… → PortalRun → … (3) → ExecSort → tuplesort_performsort → qsort_tuple`: `path` from the
/// last frame that holds [`TRUNK_SHARE`] of `statement_samples`, with runs of one function
/// folded (`ExecProcNode ×2`), the user part's middle cut to [`SHOWN_FRAMES`] and the kernel
/// part's to its first and last frames.
pub fn path_text(path: &HotPath, statement_samples: u64) -> String {
    let start = trunk_end(path, statement_samples);
    let steps = &path.steps[start..];
    let kernel_from = steps
        .iter()
        .position(|step| step.frame.kind == FrameKind::Kernel)
        .unwrap_or(steps.len());
    let user = folded_names(&steps[..kernel_from]);
    let kernel = folded_names(&steps[kernel_from..]);
    let mut parts: Vec<String> = Vec::new();
    if start > 0 {
        parts.push("…".to_string());
    }
    parts.extend(cut_middle(user, SHOWN_FRAMES));
    // Where it entered the kernel and where it is there: the way between is the kernel's.
    parts.extend(
        cut_middle(kernel, 2)
            .into_iter()
            .map(|name| match name.starts_with('…') {
                true => name,
                false => format!("{name} [k]"),
            }),
    );
    parts.join(" → ")
}

/// The index of the path's last step that holds [`TRUNK_SHARE`] of `statement_samples` (0
/// when none does): where what the statement does differs from what every statement does.
fn trunk_end(path: &HotPath, statement_samples: u64) -> usize {
    let trunk_min = (statement_samples as f64 * TRUNK_SHARE).ceil() as u64;
    path.steps
        .iter()
        .rposition(|step| step.count >= trunk_min)
        .unwrap_or(0)
}

/// The path's frames from its trunk's last on, as a finding cites them.
pub fn cited_frames(path: &HotPath, statement_samples: u64) -> Vec<String> {
    path.steps[trunk_end(path, statement_samples)..]
        .iter()
        .map(|step| step.frame.name.to_string())
        .collect()
}

/// The steps' names, runs of one function folded (`ExecProcNode ×2`).
fn folded_names(steps: &[PathStep]) -> Vec<String> {
    let mut names: Vec<(String, usize)> = Vec::new();
    for step in steps {
        let name = exporters::sanitize(&step.frame.name);
        match names.last_mut() {
            Some((last, depth)) if *last == name => *depth += 1,
            _ => names.push((name, 1)),
        }
    }
    names
        .into_iter()
        .map(|(name, depth)| match depth {
            1 => name,
            depth => format!("{name} ×{depth}"),
        })
        .collect()
}

/// `names` with its middle cut to `… (n)` when longer than `shown` and one more: the first, then
/// the last ones.
fn cut_middle(names: Vec<String>, shown: usize) -> Vec<String> {
    if names.len() <= shown + 1 {
        return names;
    }
    let cut = names.len() - shown;
    let mut kept = vec![names[0].clone(), format!("… ({cut})")];
    kept.extend(names[cut + 1..].iter().cloned());
    kept
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use exporters::Frame;

    use super::*;

    fn path(steps: &[(&str, u64)]) -> HotPath {
        HotPath {
            steps: steps
                .iter()
                .map(|&(name, count)| PathStep {
                    frame: Frame {
                        name: Arc::from(name.trim_end_matches("_k")),
                        kind: if name.ends_with("_k") {
                            FrameKind::Kernel
                        } else {
                            FrameKind::User
                        },
                        module: None,
                    },
                    count,
                })
                .collect(),
            count: steps.last().map_or(0, |s| s.1),
            self_count: 0,
        }
    }

    #[test]
    fn the_trunk_is_left_out_but_its_last_frame() {
        let p = path(&[
            ("main", 100),
            ("PostgresMain", 100),
            ("exec_simple_query", 97),
            ("PortalRun", 80),
            ("ExecSort", 60),
        ]);
        assert_eq!(path_text(&p, 100), "… → exec_simple_query → PortalRun → ExecSort");
    }

    #[test]
    fn recursion_shows_once_with_its_depth_and_kernel_frames_are_marked() {
        let p = path(&[
            ("ExecAgg", 50),
            ("ExecAgg", 50),
            ("ExecSeqScan", 40),
            ("read_k", 30),
        ]);
        assert_eq!(path_text(&p, 100), "ExecAgg ×2 → ExecSeqScan → read [k]");
    }

    #[test]
    fn the_kernel_part_shows_where_it_entered_and_where_it_is() {
        let p = path(&[
            ("XLogFlush", 50),
            ("fdatasync", 50),
            ("entry_SYSCALL_64_k", 50),
            ("do_syscall_64_k", 50),
            ("do_fsync_k", 40),
            ("ext4_sync_file_k", 30),
        ]);
        assert_eq!(
            path_text(&p, 100),
            "XLogFlush → fdatasync → entry_SYSCALL_64 [k] → … (2) → ext4_sync_file [k]"
        );
    }

    #[test]
    fn a_long_middle_is_cut_and_the_work_kept() {
        let names: Vec<String> = (0..12).map(|i| format!("f{i}")).collect();
        let steps: Vec<(&str, u64)> = names.iter().map(|n| (n.as_str(), 50)).collect();
        assert_eq!(
            path_text(&path(&steps), 100),
            "f0 → … (5) → f6 → f7 → f8 → f9 → f10 → f11"
        );
    }
}
