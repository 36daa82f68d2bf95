//! The functions that take the most samples, as `perf report` and `py-spy top` show them.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::Arc;

use crate::{sanitize, Frame, FrameKind, Profile};

/// One function's share of a profile.
#[derive(Clone, Debug, PartialEq)]
pub struct FunctionShare {
    /// Function name as symbolized (unsanitized, without `_[k]`).
    pub name: Arc<str>,
    /// User or kernel; a user and a kernel function with the same name are separate entries.
    pub kind: FrameKind,
    /// Samples where the function is the leaf (running itself).
    pub self_count: u64,
    /// Samples where the function is anywhere on the stack, counted once per sample even when
    /// it recurses.
    pub total_count: u64,
    /// `self_count` as a percentage of all samples of the profile.
    pub self_pct: f64,
    /// `total_count` as a percentage of all samples of the profile.
    pub total_pct: f64,
}

/// The `n` functions with the most self samples, sorted by self count (descending), then name
/// and kind. Percentages are of [`Profile::total_count`], which includes samples without frames.
pub fn top_functions(profile: &Profile, n: usize) -> Vec<FunctionShare> {
    let mut shares = function_shares(profile);
    shares.sort_by(|a, b| {
        b.self_count
            .cmp(&a.self_count)
            .then_with(|| a.name.cmp(&b.name))
            .then_with(|| a.kind.cmp(&b.kind))
    });
    shares.truncate(n);
    shares
}

/// The `n` functions with the most total samples (anywhere on the stack), then most self
/// samples, name and kind: `perf report --children`'s order.
pub fn top_functions_by_total(profile: &Profile, n: usize) -> Vec<FunctionShare> {
    let mut shares = function_shares(profile);
    shares.sort_by(|a, b| {
        b.total_count
            .cmp(&a.total_count)
            .then_with(|| b.self_count.cmp(&a.self_count))
            .then_with(|| a.name.cmp(&b.name))
            .then_with(|| a.kind.cmp(&b.kind))
    });
    shares.truncate(n);
    shares
}

/// Every function's self and total samples, unsorted.
fn function_shares(profile: &Profile) -> Vec<FunctionShare> {
    let total_samples = profile.total_count();
    // (self, total) per function.
    let mut counts: HashMap<(&Arc<str>, FrameKind), (u64, u64)> = HashMap::new();
    let mut seen = HashSet::new();
    for sample in &profile.samples {
        seen.clear();
        for frame in &sample.frames {
            let key = (&frame.name, frame.kind);
            if seen.insert(key) {
                counts.entry(key).or_default().1 += sample.count;
            }
        }
        if let Some(leaf) = sample.frames.last() {
            counts.entry((&leaf.name, leaf.kind)).or_default().0 += sample.count;
        }
    }

    let pct = |count: u64| {
        if total_samples == 0 {
            0.0
        } else {
            count as f64 * 100.0 / total_samples as f64
        }
    };
    counts
        .into_iter()
        .map(|((name, kind), (self_count, total_count))| FunctionShare {
            name: name.clone(),
            kind,
            self_count,
            total_count,
            self_pct: pct(self_count),
            total_pct: pct(total_count),
        })
        .collect()
}

/// One module's share of a profile: an executable, a shared library, or the kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleShare {
    /// The file's basename (`postgres`, `llvmjit.so`), or [`KERNEL_MODULE`].
    pub name: Arc<str>,
    /// Samples whose leaf frame is in the module.
    pub self_count: u64,
    /// Samples with a frame of the module anywhere on the stack, counted once per sample.
    pub total_count: u64,
    pub self_pct: f64,
    pub total_pct: f64,
}

/// What kernel frames count under in [`module_totals`].
pub const KERNEL_MODULE: &str = "[kernel]";

/// Every module of `profile`'s frames, most self samples first (then total, then name).
/// Placeholder frames, which are in no file, count for none; percentages are of
/// [`Profile::total_count`].
pub fn module_totals(profile: &Profile) -> Vec<ModuleShare> {
    let kernel: Arc<str> = Arc::from(KERNEL_MODULE);
    let module_of = |frame: &Frame| match frame.kind {
        FrameKind::Kernel => Some(kernel.clone()),
        FrameKind::User => frame.module.clone(),
    };
    let total_samples = profile.total_count();
    let mut counts: HashMap<Arc<str>, (u64, u64)> = HashMap::new();
    let mut seen = HashSet::new();
    for sample in &profile.samples {
        seen.clear();
        for module in sample.frames.iter().filter_map(module_of) {
            if seen.insert(module.clone()) {
                let entry = counts.entry(module).or_default();
                entry.1 = entry.1.saturating_add(sample.count);
            }
        }
        if let Some(module) = sample.frames.last().and_then(module_of) {
            let entry = counts.entry(module).or_default();
            entry.0 = entry.0.saturating_add(sample.count);
        }
    }
    let pct = |count: u64| match total_samples {
        0 => 0.0,
        total => count as f64 * 100.0 / total as f64,
    };
    let mut shares: Vec<ModuleShare> = counts
        .into_iter()
        .map(|(name, (self_count, total_count))| ModuleShare {
            name,
            self_count,
            total_count,
            self_pct: pct(self_count),
            total_pct: pct(total_count),
        })
        .collect();
    shares.sort_by(|a, b| {
        b.self_count
            .cmp(&a.self_count)
            .then_with(|| b.total_count.cmp(&a.total_count))
            .then_with(|| a.name.cmp(&b.name))
    });
    shares
}

/// Renders `shares` as an aligned table (`self%  total%  samples  function`, samples being the
/// self count) followed by a line with `total_samples`. Kernel functions end in ` [k]`; names
/// are sanitized like folded frames so each row stays one line.
pub fn render_top_table(shares: &[FunctionShare], total_samples: u64) -> String {
    if shares.is_empty() {
        return format!("no functions sampled ({total_samples} samples in total)\n");
    }
    let samples_width = shares
        .iter()
        .map(|s| s.self_count.to_string().len())
        .max()
        .unwrap_or(0)
        .max("samples".len());
    let mut table = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        table,
        "{:>7}  {:>7}  {:>samples_width$}  function",
        "self%", "total%", "samples"
    );
    for share in shares {
        let suffix = if share.kind == FrameKind::Kernel {
            " [k]"
        } else {
            ""
        };
        let _ = writeln!(
            table,
            "{:>6.2}%  {:>6.2}%  {:>samples_width$}  {}{suffix}",
            share.self_pct,
            share.total_pct,
            share.self_count,
            sanitize(&share.name),
        );
    }
    let _ = writeln!(table, "{total_samples} samples in total");
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::*;
    use crate::ProfileMeta;

    fn find<'a>(shares: &'a [FunctionShare], name: &str, kind: FrameKind) -> &'a FunctionShare {
        shares
            .iter()
            .find(|s| &*s.name == name && s.kind == kind)
            .unwrap_or_else(|| panic!("no `{name}`"))
    }

    #[test]
    fn self_and_total_counts() {
        // 4 + 5 + 2 + 4 = 15 samples.
        let shares = top_functions(&small_profile(), usize::MAX);
        let summary: Vec<(&str, FrameKind, u64, u64)> = shares
            .iter()
            .map(|s| (&*s.name, s.kind, s.self_count, s.total_count))
            .collect();
        use FrameKind::{Kernel, User};
        assert_eq!(
            summary,
            [
                ("_bt_getroot", User, 5, 5),
                ("ExecScan", User, 4, 4),
                ("LockRelationOid", User, 4, 4),
                ("tcp_recvmsg", Kernel, 2, 2),
                // Recursing twice in one stack of 4 samples counts 4, not 8.
                ("ExecProcNode", User, 0, 4),
                ("PostmasterMain", User, 0, 15),
                ("__libc_recv", User, 0, 2),
                ("exec_simple_query", User, 0, 15),
                ("main", User, 0, 15),
            ]
        );
        let bt = find(&shares, "_bt_getroot", User);
        assert!((bt.self_pct - 100.0 / 3.0).abs() < 1e-9 && (bt.total_pct - 100.0 / 3.0).abs() < 1e-9);
        assert_eq!(find(&shares, "main", User).total_pct, 100.0);
    }

    #[test]
    fn recursive_leaf_counts_once_and_kinds_stay_apart() {
        let profile = Profile {
            meta: ProfileMeta::cpu(99, 0, 0),
            samples: vec![
                sample(vec![user("f"), user("g"), user("f"), user("f")], &[], 3),
                sample(vec![user("read"), kernel("read")], &[], 1),
                sample(vec![], &[], 1),
            ],
        };
        let shares = top_functions(&profile, 10);
        let f = find(&shares, "f", FrameKind::User);
        assert_eq!((f.self_count, f.total_count), (3, 3));
        assert_eq!(f.total_pct, 60.0);
        assert_eq!(find(&shares, "read", FrameKind::Kernel).self_count, 1);
        assert_eq!(find(&shares, "read", FrameKind::User).self_count, 0);
        assert_eq!(top_functions(&profile, 1).len(), 1);
        assert_eq!(&*top_functions(&profile, 1)[0].name, "f");
    }

    #[test]
    fn empty_profile() {
        let profile = Profile {
            meta: ProfileMeta::cpu(99, 0, 0),
            samples: vec![],
        };
        assert!(top_functions(&profile, 10).is_empty());
        assert_eq!(
            render_top_table(&[], 0),
            "no functions sampled (0 samples in total)\n"
        );
    }

    #[test]
    fn table_is_aligned() {
        let shares = top_functions(&small_profile(), 4);
        let expected = [
            "  self%   total%  samples  function",
            " 33.33%   33.33%        5  _bt_getroot",
            " 26.67%   26.67%        4  ExecScan",
            " 26.67%   26.67%        4  LockRelationOid",
            " 13.33%   13.33%        2  tcp_recvmsg [k]",
            "15 samples in total",
            "",
        ]
        .join("\n");
        assert_eq!(render_top_table(&shares, 15), expected);
    }

    #[test]
    fn module_totals_count_each_sample_once_per_module_and_its_leaf_as_self() {
        let in_module = |name: &str, module: &str| Frame {
            name: Arc::from(name),
            kind: FrameKind::User,
            module: Some(Arc::from(module)),
        };
        let profile = Profile {
            samples: vec![
                sample(
                    vec![
                        in_module("main", "postgres"),
                        in_module("jit_compile", "llvmjit.so"),
                        in_module("llvm::a", "libLLVM.so"),
                        in_module("llvm::b", "libLLVM.so"),
                    ],
                    &[],
                    6,
                ),
                sample(vec![in_module("main", "postgres"), kernel("read")], &[], 3),
                sample(
                    vec![user("[incomplete stack]"), in_module("memcpy", "libc.so.6")],
                    &[],
                    1,
                ),
            ],
            meta: ProfileMeta::cpu(99, 0, 1_000_000_000),
        };
        let totals = module_totals(&profile);
        let rows: Vec<(&str, u64, u64)> = totals
            .iter()
            .map(|m| (&*m.name, m.self_count, m.total_count))
            .collect();
        assert_eq!(
            rows,
            [
                ("libLLVM.so", 6, 6),
                (KERNEL_MODULE, 3, 3),
                ("libc.so.6", 1, 1),
                ("postgres", 0, 9),
                ("llvmjit.so", 0, 6),
            ]
        );
    }

    #[test]
    fn by_total_puts_the_callers_first() {
        let shares = top_functions_by_total(&small_profile(), 3);
        let names: Vec<&str> = shares.iter().map(|s| &*s.name).collect();
        // Three at 15, in name order.
        assert_eq!(names, ["PostmasterMain", "exec_simple_query", "main"]);
        assert!(shares.iter().all(|s| s.total_count == 15));
    }
}
