//! Brendan Gregg's folded stacks: `root;child;leaf count`, one line per distinct stack.
//!
//! The output is what `stackcollapse-perf.pl` produces and what `flamegraph.pl`, inferno,
//! speedscope and Pyroscope's `format=folded` ingest read.

use std::collections::BTreeMap;
use std::io::Write;

use crate::{display_name, sanitize, Error, Profile, StackSample};

/// Options of [`write_folded`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FoldedOptions {
    /// Label keys that become root frames, outermost first. A sample without the label gets no
    /// frame for it. `pid` is written `postgres-<pid>` (like stackcollapse-perf's `comm-pid`),
    /// any other key as `key=value`.
    pub root_labels: Vec<String>,
}

/// Writes `profile` as folded stacks.
///
/// Lines are sorted by stack, stacks that are identical once the label root frames are added
/// are merged (so `root_labels: []` merges the same stack across backends), and stacks whose
/// merged count is 0 are left out. Kernel frames end in `_[k]`; frame names are sanitized
/// (`;` → `:`, control characters → space, empty → `[unknown]`) so every line parses back. A
/// sample with neither frames nor root labels is written as `[unknown]`.
pub fn write_folded(profile: &Profile, opts: &FoldedOptions, w: &mut impl Write) -> Result<(), Error> {
    let write_error = |source| Error::Write {
        format: "folded",
        source,
    };
    for (stack, count) in fold(profile, &opts.root_labels) {
        writeln!(w, "{stack} {count}").map_err(write_error)?;
    }
    w.flush().map_err(write_error)
}

/// Parses folded stacks into `(frames root first, count)`, one entry per non-empty line, in
/// input order (no merging). The count is the last space-separated field, so frame names may
/// contain spaces; lines starting with `# ` are comments, as inferno treats them.
pub fn parse_folded(text: &str) -> Result<Vec<(Vec<String>, u64)>, Error> {
    let mut stacks = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line_number = index + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with("# ") {
            continue;
        }
        let Some((stack, count)) = line.rsplit_once(' ') else {
            return Err(Error::FoldedMissingCount {
                line: line_number,
                text: line.to_string(),
            });
        };
        let count = count.parse::<u64>().map_err(|source| Error::FoldedInvalidCount {
            line: line_number,
            count: count.to_string(),
            source,
        })?;
        let frames: Vec<String> = stack.trim_end().split(';').map(str::to_string).collect();
        if frames.iter().any(|f| f.is_empty()) {
            return Err(Error::FoldedEmptyFrame {
                line: line_number,
                text: line.to_string(),
            });
        }
        stacks.push((frames, count));
    }
    Ok(stacks)
}

/// Folded stack text → merged count, sorted by stack text, zero counts dropped. Shared with
/// the SVG exporter so the flame graph shows exactly what the folded file holds.
pub(crate) fn fold(profile: &Profile, root_labels: &[String]) -> BTreeMap<String, u64> {
    let mut stacks: BTreeMap<String, u64> = BTreeMap::new();
    for sample in &profile.samples {
        let stack = stack_text(sample, root_labels);
        let total = stacks.entry(stack).or_insert(0);
        *total = total.saturating_add(sample.count);
    }
    stacks.retain(|_, count| *count > 0);
    stacks
}

fn stack_text(sample: &StackSample, root_labels: &[String]) -> String {
    let mut frames: Vec<String> = root_labels
        .iter()
        .filter_map(|key| {
            let (_, value) = sample.labels.iter().find(|(k, _)| k == key)?;
            Some(if key == "pid" {
                format!("postgres-{}", sanitize(value))
            } else {
                sanitize(&format!("{key}={value}"))
            })
        })
        .collect();
    frames.extend(sample.frames.iter().map(display_name));
    if frames.is_empty() {
        return "[unknown]".to_string();
    }
    frames.join(";")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::*;
    use crate::ProfileMeta;

    fn folded(profile: &Profile, root_labels: &[&str]) -> String {
        let opts = FoldedOptions {
            root_labels: root_labels.iter().map(|s| s.to_string()).collect(),
        };
        let mut out = Vec::new();
        write_folded(profile, &opts, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn golden_without_root_labels() {
        let expected = "\
main;PostmasterMain;exec_simple_query;ExecProcNode;ExecProcNode;ExecScan 4
main;PostmasterMain;exec_simple_query;LockRelationOid 4
main;PostmasterMain;exec_simple_query;__libc_recv;tcp_recvmsg_[k] 2
main;PostmasterMain;exec_simple_query;_bt_getroot 5
";
        assert_eq!(folded(&small_profile(), &[]), expected);
    }

    #[test]
    fn golden_with_pid_root_label() {
        let expected = "\
postgres-42;main;PostmasterMain;exec_simple_query;LockRelationOid 4
postgres-42;main;PostmasterMain;exec_simple_query;_bt_getroot 5
postgres-43;main;PostmasterMain;exec_simple_query;ExecProcNode;ExecProcNode;ExecScan 4
postgres-43;main;PostmasterMain;exec_simple_query;__libc_recv;tcp_recvmsg_[k] 2
";
        assert_eq!(folded(&small_profile(), &["pid"]), expected);
    }

    #[test]
    fn root_labels_keep_their_order_and_skip_absent_keys() {
        let profile = Profile {
            meta: ProfileMeta::cpu(99, 0, 0),
            samples: vec![
                sample(
                    vec![user("f")],
                    &[("backend_type", "client backend"), ("pid", "7")],
                    1,
                ),
                sample(vec![user("f")], &[("pid", "7")], 2),
                sample(vec![user("g")], &[], 3),
            ],
        };
        let expected = "\
backend_type=client backend;postgres-7;f 1
g 3
postgres-7;f 2
";
        assert_eq!(folded(&profile, &["backend_type", "pid", "query_id"]), expected);
    }

    #[test]
    fn stacks_that_differ_only_by_labels_merge_without_root_labels() {
        let profile = Profile {
            meta: ProfileMeta::cpu(99, 0, 0),
            samples: vec![
                sample(vec![user("f")], &[("pid", "1")], 1),
                sample(vec![user("f")], &[("pid", "2")], 2),
                sample(vec![user("zero")], &[], 0),
            ],
        };
        assert_eq!(folded(&profile, &[]), "f 3\n");
        assert_eq!(folded(&profile, &["pid"]), "postgres-1;f 1\npostgres-2;f 2\n");
    }

    #[test]
    fn names_are_sanitized() {
        let profile = Profile {
            meta: ProfileMeta::cpu(99, 0, 0),
            samples: vec![
                sample(
                    vec![user("a;b"), user("line\nbreak"), user(""), kernel("k\tk")],
                    &[],
                    2,
                ),
                sample(vec![], &[], 1),
                sample(vec![user("f")], &[("pid", "1;2")], 1),
            ],
        };
        let text = folded(&profile, &["pid"]);
        assert_eq!(
            text,
            "[unknown] 1\na:b;line break;[unknown];k k_[k] 2\npostgres-1:2;f 1\n"
        );
        let parsed = parse_folded(&text).unwrap();
        assert_eq!(parsed[1].0, ["a:b", "line break", "[unknown]", "k k_[k]"]);
    }

    #[test]
    fn parse_round_trip() {
        let text = folded(&small_profile(), &["pid"]);
        let parsed = parse_folded(&text).unwrap();
        assert_eq!(parsed.len(), 4);
        assert_eq!(
            parsed[3],
            (
                [
                    "postgres-43",
                    "main",
                    "PostmasterMain",
                    "exec_simple_query",
                    "__libc_recv",
                    "tcp_recvmsg_[k]"
                ]
                .map(String::from)
                .to_vec(),
                2
            )
        );
        let rebuilt: String = parsed
            .iter()
            .map(|(frames, count)| format!("{} {count}\n", frames.join(";")))
            .collect();
        assert_eq!(rebuilt, text);
    }

    #[test]
    fn parse_accepts_spaces_in_names_comments_and_blank_lines() {
        let parsed = parse_folded("# comment\n\nmain;operator new 3\r\n").unwrap();
        assert_eq!(
            parsed,
            vec![(vec!["main".to_string(), "operator new".to_string()], 3)]
        );
    }

    #[test]
    fn parse_rejects_malformed_lines() {
        assert!(matches!(
            parse_folded("a;b 1\nno_count\n"),
            Err(Error::FoldedMissingCount { line: 2, ref text }) if text == "no_count"
        ));
        let error = parse_folded("a;b x1\n").unwrap_err();
        assert!(matches!(error, Error::FoldedInvalidCount { line: 1, ref count, .. } if count == "x1"));
        assert!(
            std::error::Error::source(&error).is_some(),
            "the ParseIntError is kept"
        );
        assert!(matches!(
            parse_folded("a;b -1\n"),
            Err(Error::FoldedInvalidCount { .. })
        ));
        assert!(matches!(
            parse_folded("a;;b 1\n"),
            Err(Error::FoldedEmptyFrame { line: 1, .. })
        ));
        assert!(matches!(
            parse_folded(";a 1\n"),
            Err(Error::FoldedEmptyFrame { .. })
        ));
    }

    #[test]
    fn write_errors_are_reported() {
        struct Broken;
        impl Write for Broken {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("disk full"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let error = write_folded(&small_profile(), &FoldedOptions::default(), &mut Broken).unwrap_err();
        assert!(matches!(error, Error::Write { format: "folded", .. }));
        assert_eq!(error.to_string(), "cannot write the folded output");
    }
}
