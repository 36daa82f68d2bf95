//! Property tests over what the agent parses from outside itself: BPF ring buffer records,
//! Kubernetes pod JSON and cgroup lines, and the /proc and data-directory text it reads. Each
//! replays its seed corpus (`agent/tests/corpus/<parser>/`) first, then mutated seeds and random
//! input, a bounded number of cases (`PGSCOPE_FUZZ_CASES` raises it; see `crate::fuzzing`).

mod pods;
mod proc_text;
mod records;
