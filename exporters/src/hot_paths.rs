//! Hot paths: the call paths that hold most of a set of samples, each followed from the root
//! down to the deepest function that still holds its share. A top list by self time misses
//! the time of a library whose every function is small on its own, or of a function whose
//! time is in many callees; its hot path names the function under which that time is, with
//! the share of every frame on the way.

use std::collections::HashMap;
use std::sync::Arc;

use crate::{Frame, FrameKind, StackSample};

/// One frame of a hot path and the samples with it at this place of the path (its inclusive
/// count there).
#[derive(Clone, Debug, PartialEq)]
pub struct PathStep {
    pub frame: Frame,
    pub count: u64,
}

/// A call path, root first, ending where its samples spread over callees none of which holds
/// the threshold, or in the function itself.
#[derive(Clone, Debug, PartialEq)]
pub struct HotPath {
    pub steps: Vec<PathStep>,
    /// The samples under the path's last frame that no longer listed path holds: the paths of
    /// one set never count a sample twice.
    pub count: u64,
    /// The samples with the last frame as their leaf (running itself, not in a callee).
    pub self_count: u64,
}

impl HotPath {
    /// The samples under the path's last frame, those of longer listed paths included.
    pub fn inclusive(&self) -> u64 {
        self.steps.last().map_or(0, |step| step.count)
    }
}

#[derive(Default)]
struct Node {
    frame: Option<Frame>,
    count: u64,
    self_count: u64,
    children: HashMap<(Arc<str>, FrameKind), usize>,
}

/// The hot paths of `samples`: every path whose last frame holds at least `min_count` samples
/// and none of whose callees does, plus, for a frame with such callees, the frame itself when
/// what its listed callees leave holds `min_count` (its own time, or time spread thin). Most
/// samples first (ties: shorter, then by names), at most `limit`.
pub fn hot_paths<'a>(
    samples: impl IntoIterator<Item = &'a StackSample>,
    min_count: u64,
    limit: usize,
) -> Vec<HotPath> {
    let mut nodes = vec![Node::default()];
    for sample in samples {
        let mut at = 0;
        nodes[0].count = nodes[0].count.saturating_add(sample.count);
        for frame in &sample.frames {
            let key = (frame.name.clone(), frame.kind);
            let next = match nodes[at].children.get(&key) {
                Some(&child) => child,
                None => {
                    nodes.push(Node {
                        frame: Some(frame.clone()),
                        ..Node::default()
                    });
                    let child = nodes.len() - 1;
                    nodes[at].children.insert(key, child);
                    child
                }
            };
            at = next;
            nodes[at].count = nodes[at].count.saturating_add(sample.count);
        }
        if at != 0 {
            nodes[at].self_count = nodes[at].self_count.saturating_add(sample.count);
        }
    }
    let min_count = min_count.max(1);
    let mut paths = Vec::new();
    let mut stack: Vec<(usize, Vec<usize>)> = vec![(0, Vec::new())];
    while let Some((at, path)) = stack.pop() {
        let node = &nodes[at];
        let hot: Vec<usize> = node
            .children
            .values()
            .copied()
            .filter(|&child| nodes[child].count >= min_count)
            .collect();
        let left = node.count - hot.iter().map(|&child| nodes[child].count).sum::<u64>();
        if at != 0 && (hot.is_empty() || left >= min_count) {
            paths.push(HotPath {
                // Every node on a path has a frame: only the root has none.
                steps: path
                    .iter()
                    .filter_map(|&index| {
                        let step = &nodes[index];
                        step.frame.clone().map(|frame| PathStep {
                            frame,
                            count: step.count,
                        })
                    })
                    .collect(),
                count: left,
                self_count: node.self_count,
            });
        }
        for child in hot {
            let mut longer = path.clone();
            longer.push(child);
            stack.push((child, longer));
        }
    }
    paths.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then_with(|| a.steps.len().cmp(&b.steps.len()))
            .then_with(|| names(a).cmp(&names(b)))
    });
    paths.truncate(limit);
    paths
}

fn names(path: &HotPath) -> Vec<&str> {
    path.steps.iter().map(|step| &*step.frame.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::*;

    fn path_names(path: &HotPath) -> Vec<&str> {
        names(path)
    }

    #[test]
    fn a_library_of_small_functions_is_one_hot_path() {
        // 90 samples in 9 functions of 10 each under `jit`: none is hot by self time, the
        // path down to `jit` holds them all.
        let mut samples = Vec::new();
        for i in 0..9 {
            let leaf = format!("llvm_{i}");
            samples.push(sample(vec![user("main"), user("jit"), user(&leaf)], &[], 10));
        }
        samples.push(sample(vec![user("main"), user("parse")], &[], 10));
        let paths = hot_paths(&samples, 15, 10);
        assert_eq!(paths.len(), 1);
        assert_eq!(path_names(&paths[0]), ["main", "jit"]);
        assert_eq!(paths[0].count, 90);
        assert_eq!(paths[0].self_count, 0);
        assert_eq!(paths[0].steps[0].count, 100);
    }

    #[test]
    fn paths_split_where_the_time_does_and_never_count_a_sample_twice() {
        let samples = vec![
            sample(
                vec![user("main"), user("run"), user("sort"), user("cmp")],
                &[],
                40,
            ),
            sample(vec![user("main"), user("run"), user("scan")], &[], 30),
            sample(vec![user("main"), user("run")], &[], 20),
            sample(vec![user("main"), user("run"), user("misc")], &[], 2),
            sample(vec![user("main"), kernel("read")], &[], 8),
        ];
        let paths = hot_paths(&samples, 10, 10);
        let listed: Vec<(Vec<&str>, u64, u64)> = paths
            .iter()
            .map(|p| (path_names(p), p.count, p.self_count))
            .collect();
        assert_eq!(
            listed,
            [
                (vec!["main", "run", "sort", "cmp"], 40, 40),
                (vec!["main", "run", "scan"], 30, 30),
                // What run's hot callees leave: its own 20 and misc's 2.
                (vec!["main", "run"], 22, 20),
            ]
        );
        assert_eq!(paths[2].inclusive(), 92);
        let counted: u64 = paths.iter().map(|p| p.count).sum();
        assert!(counted <= 100);
    }

    #[test]
    fn a_user_and_a_kernel_frame_of_one_name_are_different_places() {
        let samples = vec![
            sample(vec![user("main"), user("read")], &[], 10),
            sample(vec![user("main"), kernel("read")], &[], 10),
        ];
        let paths = hot_paths(&samples, 5, 10);
        assert_eq!(paths.len(), 2);
        assert!(paths.iter().all(|p| p.count == 10));
    }

    #[test]
    fn nothing_is_hot_below_the_threshold_and_the_limit_holds() {
        let samples = vec![sample(vec![user("main")], &[], 3)];
        assert!(hot_paths(&samples, 4, 10).is_empty());
        let many: Vec<StackSample> = (0..20)
            .map(|i| sample(vec![user(&format!("f{i}"))], &[], 5))
            .collect();
        assert_eq!(hot_paths(&many, 1, 7).len(), 7);
        assert!(hot_paths(&[], 1, 7).is_empty());
    }
}
