//! Stack samples with counts: parsed from pgscope's folded output or from `perf script`, and the
//! questions the tests ask of them.
//!
//! Frames are stored root first, as in the folded format; kernel frames end with `_[k]`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::compare::SelfTable;

/// Suffix of kernel frames in the folded format.
pub const KERNEL_SUFFIX: &str = "_[k]";

/// Names a fully unwound user stack can start with: the executable's entry point, glibc's
/// start code, or `main` itself when the unwinder (frame pointers) cannot step into glibc,
/// which is built without them.
pub const ROOT_FRAMES: &[&str] = &[
    "_start",
    "__libc_start_main",
    "__libc_start_main_impl",
    "__libc_start_call_main",
    "main",
];

/// One distinct stack and how many samples had it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stack {
    /// Root first.
    pub frames: Vec<String>,
    pub count: u64,
}

/// All samples of one profile.
#[derive(Debug, Clone, Default)]
pub struct Profile {
    pub stacks: Vec<Stack>,
}

impl Profile {
    /// Parses Brendan Gregg's folded format: `frame;frame;…;leaf count` per line.
    pub fn parse_folded(text: &str) -> Result<Self> {
        let mut stacks = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let Some((stack, count)) = line.rsplit_once(' ') else {
                bail!("folded line {} has no count: `{line}`", i + 1);
            };
            let count: u64 = count
                .trim()
                .parse()
                .with_context(|| format!("folded line {} ends with `{count}`, not a count", i + 1))?;
            let frames: Vec<String> = stack.split(';').map(str::to_owned).collect();
            if frames.iter().any(String::is_empty) {
                bail!("folded line {} has an empty frame: `{line}`", i + 1);
            }
            stacks.push(Stack { frames, count });
        }
        Ok(Profile { stacks })
    }

    /// Reads and parses a folded file.
    pub fn read_folded(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read `{}`", path.display()))?;
        Self::parse_folded(&text).with_context(|| format!("in `{}`", path.display()))
    }

    /// Number of samples.
    pub fn total(&self) -> u64 {
        self.stacks.iter().map(|s| s.count).sum()
    }

    /// Number of samples whose stack satisfies `pred`.
    pub fn count_where(&self, pred: impl Fn(&Stack) -> bool) -> u64 {
        self.stacks.iter().filter(|s| pred(s)).map(|s| s.count).sum()
    }

    /// Share of samples (0..=1) whose stack satisfies `pred`; 0 for an empty profile.
    pub fn fraction_where(&self, pred: impl Fn(&Stack) -> bool) -> f64 {
        let total = self.total();
        if total == 0 {
            return 0.0;
        }
        self.count_where(pred) as f64 / total as f64
    }

    /// The `n` most frequent stacks satisfying `pred`, rendered folded (for failure messages).
    pub fn examples_where(&self, pred: impl Fn(&Stack) -> bool, n: usize) -> String {
        let mut matching: Vec<&Stack> = self.stacks.iter().filter(|s| pred(s)).collect();
        matching.sort_by_key(|s| std::cmp::Reverse(s.count));
        matching
            .iter()
            .take(n)
            .map(|s| format!("  {} {}\n", s.frames.join(";"), s.count))
            .collect()
    }

    /// Samples per process, for stacks rooted at a `postgres-<pid>` frame (`--instance`).
    pub fn samples_by_pid(&self) -> BTreeMap<u32, u64> {
        let mut by_pid = BTreeMap::new();
        for s in &self.stacks {
            if let Some(pid) = s.process_pid() {
                *by_pid.entry(pid).or_insert(0) += s.count;
            }
        }
        by_pid
    }

    /// Self time per function in percent of all samples: the leaf frame (kernel frames
    /// included, without `_[k]`), renamed by `name` (to merge names two profilers spell
    /// differently).
    pub fn self_table(&self, name: impl Fn(&str) -> String) -> SelfTable {
        let total = self.total().max(1) as f64;
        let mut pct = BTreeMap::new();
        for s in &self.stacks {
            if let Some(leaf) = s.frames.last() {
                *pct.entry(name(strip_kernel_suffix(leaf))).or_insert(0.0) += s.count as f64 * 100.0 / total;
            }
        }
        SelfTable(pct)
    }

    /// The stacks that satisfy `pred`, as a profile of their own.
    pub fn only(&self, pred: impl Fn(&Stack) -> bool) -> Profile {
        Profile {
            stacks: self.stacks.iter().filter(|s| pred(s)).cloned().collect(),
        }
    }

    /// Inclusive time per function in percent of all samples: the samples with the function
    /// anywhere in their user frames (each sample counted once per function, however often it
    /// recurses), renamed by `name`.
    pub fn inclusive_table(&self, name: impl Fn(&str) -> String) -> SelfTable {
        let total = self.total().max(1) as f64;
        let mut pct = BTreeMap::new();
        for s in &self.stacks {
            let names: BTreeSet<String> = s.user_frames().iter().map(|f| name(f)).collect();
            for function in names {
                *pct.entry(function).or_insert(0.0) += s.count as f64 * 100.0 / total;
            }
        }
        SelfTable(pct)
    }
}

impl Stack {
    /// The pid of a leading `postgres-<pid>` frame (how `--instance` attributes samples).
    pub fn process_pid(&self) -> Option<u32> {
        self.frames.first()?.strip_prefix("postgres-")?.parse().ok()
    }

    /// The user-space part: without the leading `postgres-<pid>` frame and the trailing kernel
    /// frames.
    pub fn user_frames(&self) -> &[String] {
        let start = usize::from(self.process_pid().is_some());
        let end = self.frames.len()
            - self
                .frames
                .iter()
                .rev()
                .take_while(|f| is_kernel_frame(f))
                .count();
        &self.frames[start.min(end)..end]
    }

    /// Whether any frame satisfies `pred`.
    pub fn any_frame(&self, pred: impl Fn(&str) -> bool) -> bool {
        self.frames.iter().any(|f| pred(f))
    }

    /// Whether the user stack was unwound up to the process's first frame (see [`ROOT_FRAMES`]).
    /// Also accepted: unnamed start code (`libc.so.6+0x…` when glibc has no symbols,
    /// `postgres+0x…` for `_start` in a stripped binary) directly above `main`.
    pub fn starts_at_process_root(&self) -> bool {
        let user = self.user_frames();
        let Some(first) = user.first() else { return false };
        if ROOT_FRAMES.contains(&first.as_str()) {
            return true;
        }
        let start_code = user.iter().take_while(|f| is_unnamed_frame(f)).count();
        (1..=3).contains(&start_code) && user.get(start_code).is_some_and(|f| f == "main")
    }
}

/// `true` for a kernel frame (`name_[k]`).
pub fn is_kernel_frame(frame: &str) -> bool {
    frame.ends_with(KERNEL_SUFFIX)
}

/// The frame name without its `_[k]` suffix.
pub fn strip_kernel_suffix(frame: &str) -> &str {
    frame.strip_suffix(KERNEL_SUFFIX).unwrap_or(frame)
}

/// `true` for a frame pgscope could not name: `<object>+0x<hex>` (e.g. `postgres+0x47c61c`).
pub fn is_unnamed_frame(frame: &str) -> bool {
    frame.rsplit_once("+0x").is_some_and(|(object, hex)| {
        !object.is_empty() && !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

/// `true` for a frame in the stripped `postgres` executable that pgscope could not name.
pub fn is_unnamed_postgres_frame(frame: &str) -> bool {
    frame.starts_with("postgres+0x") && is_unnamed_frame(frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FOLDED: &str = "\
postgres-42;_start;__libc_start_call_main;main;PostmasterMain;postgres+0x3f930b;PostgresMain;postgres+0x47c61c;PortalRun;int4mod 7
postgres-42;main;PostmasterMain;PostgresMain;exec_simple_query;ExecScan;entry_SYSCALL_64_[k];do_syscall_64_[k] 2
postgres-43;PortalRun;ExecScan 1
";

    #[test]
    fn parses_folded_and_finds_roots() {
        let p = Profile::parse_folded(FOLDED).unwrap();
        assert_eq!(p.total(), 10);
        assert_eq!(p.samples_by_pid(), BTreeMap::from([(42, 9), (43, 1)]));
        let roots: Vec<bool> = p.stacks.iter().map(Stack::starts_at_process_root).collect();
        assert_eq!(roots, [true, true, false]);
        assert_eq!(p.stacks[1].user_frames().last().unwrap(), "ExecScan");
        let table = p.self_table(|f| f.to_owned());
        assert_eq!(table.0["int4mod"], 70.0);
        assert_eq!(table.0["do_syscall_64"], 20.0);
    }

    #[test]
    fn inclusive_time_counts_a_sample_once_per_function_and_no_kernel_frame() {
        let p = Profile::parse_folded(
            "postgres-42;main;PortalRun;ExecScan;ExecScan;int4mod 3\n\
             postgres-42;main;PortalRun;entry_SYSCALL_64_[k] 1\n",
        )
        .unwrap();
        let table = p.inclusive_table(|f| f.to_owned());
        assert_eq!(table.0["main"], 100.0);
        assert_eq!(table.0["ExecScan"], 75.0);
        assert_eq!(table.0["int4mod"], 75.0);
        assert!(!table.0.contains_key("entry_SYSCALL_64_[k]"));
        assert!(!table.0.contains_key("postgres-42"));
    }

    #[test]
    fn unnamed_start_code_above_main_counts_as_root() {
        let s = Stack {
            frames: ["postgres+0x155f50", "libc.so.6+0x27249", "main", "PostmasterMain"]
                .map(String::from)
                .to_vec(),
            count: 1,
        };
        assert!(s.starts_at_process_root());
        let s = Stack {
            frames: ["postgres+0x47c61c", "PortalRun"].map(String::from).to_vec(),
            count: 1,
        };
        assert!(!s.starts_at_process_root());
    }

    #[test]
    fn rejects_malformed_lines() {
        assert!(Profile::parse_folded("a;b;c").is_err());
        assert!(Profile::parse_folded("a;;c 3").is_err());
        assert!(Profile::parse_folded("a;b x").is_err());
    }
}
