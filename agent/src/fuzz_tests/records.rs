//! The BPF ring buffer records (`bpf/include/pgscope.h`: samples, wait ends, long wait ends)
//! as the parsers in `bpf::abi` and the collection loop (`collect::Session::handle`, then the
//! aggregation and the exporters) take them: any byte string is a record or a counted
//! rejection, never a panic or a read past its end, and a record written with the C layout
//! (field by field, not through the Rust mirror) reads back as written.
//!
//! Seeds (`agent/tests/corpus/bpf_records/`) are records laid out as the BPF programs send
//! them, with the values of a Postgres 15 backend: on-CPU samples (with and without a user
//! stack, one with the largest stack), off-CPU samples (one pending, with the wait end that
//! completes it; one sampled, with a repeat of it), a long wait end, and rejected ones
//! (`bad-*`).

use std::cell::RefCell;
use std::collections::HashMap;

use proptest::prelude::*;
use proptest::test_runner::TestRunner;

use crate::bpf::abi::{
    LongWaitEnd, RecordError, SampleRecord, WaitEnd, WaitRepeat, KERNEL_FRAMES_MAX, SAMPLE_STACK_OFFSET,
    USER_STACK_MAX, WAIT_NS_MAX,
};
use crate::collect::instance::{InstanceContext, InstanceFacts, Scope};
use crate::collect::off_cpu::OffCpuMode;
use crate::collect::Session;
use crate::fuzzing::{self, Mutation};
use crate::postgres::instance_names::InstanceNames;
use exporters::{FoldedOptions, ProfileMeta};
use symbolizer::{Symbolizer, SymbolizerOptions};

/// `PGSCOPE_WAIT_END_MAGIC`, `PGSCOPE_LONG_WAIT_END_MAGIC` and `PGSCOPE_WAIT_REPEAT_MAGIC` of
/// the C header.
const WAIT_END_MAGIC: u64 = 0x646e_4574_6961_5750;
const LONG_WAIT_END_MAGIC: u64 = 0x646e_4574_6961_574c;
const WAIT_REPEAT_MAGIC: u64 = 0x7065_5274_6961_5753;
/// `offsetof(struct pgscope_sample, user_stack_len)`.
const STACK_LEN_AT: usize = 48;

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// What each parser must make of `bytes`, computed from the C layout alone.
fn check_parsers(bytes: &[u8]) {
    let wait_end = WaitEnd::parse(bytes);
    assert_eq!(
        wait_end.is_some(),
        bytes.len() == 32 && u64_at(bytes, 24) == WAIT_END_MAGIC && u64_at(bytes, 16) <= WAIT_NS_MAX,
        "wait end of {} bytes",
        bytes.len()
    );
    if let Some(end) = wait_end {
        assert_eq!((end.tgid, end.tid), (u32_at(bytes, 0), u32_at(bytes, 4)));
        assert_eq!(
            (end.start_ns, end.blocked_ns),
            (u64_at(bytes, 8), u64_at(bytes, 16))
        );
    }
    let long_end = LongWaitEnd::parse(bytes);
    assert_eq!(
        long_end.is_some(),
        bytes.len() == 64 && u64_at(bytes, 56) == LONG_WAIT_END_MAGIC && u64_at(bytes, 16) <= WAIT_NS_MAX,
        "long wait end of {} bytes",
        bytes.len()
    );
    if let Some(end) = long_end {
        assert_eq!(end.blocked_ns, u64_at(bytes, 16));
        assert_eq!(end.attr.query_id, u64_at(bytes, 24));
        assert_eq!(end.attr.off_cpu_class, u32_at(bytes, 52));
    }
    let repeat = WaitRepeat::parse(bytes);
    assert_eq!(
        repeat.is_some(),
        bytes.len() == 24 && u64_at(bytes, 16) == WAIT_REPEAT_MAGIC && u64_at(bytes, 8) <= WAIT_NS_MAX,
        "wait repeat of {} bytes",
        bytes.len()
    );
    if let Some(repeat) = repeat {
        assert_eq!((repeat.tgid, repeat.tid), (u32_at(bytes, 0), u32_at(bytes, 4)));
        assert_eq!(repeat.weight_ns, u64_at(bytes, 8));
    }
    match SampleRecord::parse(bytes) {
        Err(RecordError::Short(len)) => {
            assert_eq!(len, bytes.len());
            assert!(len < SAMPLE_STACK_OFFSET);
        }
        Err(RecordError::StackLength { claimed, carried }) => {
            assert_eq!(claimed, u64_at(bytes, STACK_LEN_AT));
            assert_eq!(carried, bytes.len() - SAMPLE_STACK_OFFSET);
            assert!(claimed > carried as u64 || claimed > USER_STACK_MAX as u64);
        }
        Err(RecordError::OffCpuTime(ns)) => {
            assert_eq!(ns, u64_at(bytes, 88));
            assert!(ns > WAIT_NS_MAX);
        }
        Ok(record) => {
            let claimed = u64_at(bytes, STACK_LEN_AT) as usize;
            assert!(claimed <= USER_STACK_MAX && SAMPLE_STACK_OFFSET + claimed <= bytes.len());
            assert_eq!(
                record.user_stack,
                &bytes[SAMPLE_STACK_OFFSET..SAMPLE_STACK_OFFSET + claimed]
            );
            let frames = (u32_at(bytes, 20) as usize).min(KERNEL_FRAMES_MAX);
            assert_eq!(record.kernel_stack().len(), frames);
            for (i, &frame) in record.kernel_stack().iter().enumerate() {
                assert_eq!(frame, u64_at(bytes, 120 + 8 * i));
            }
            assert_eq!(record.header.tgid, u32_at(bytes, 0));
            assert_eq!(record.header.off_cpu_ns, u64_at(bytes, 88));
            assert!(record.header.off_cpu_ns <= WAIT_NS_MAX);
            assert_eq!(record.header.statement_start, u64_at(bytes, 104));
            assert_eq!(record.header.trigger_oid, u32_at(bytes, 112));
            assert_eq!(record.header.trigger_constraint, u32_at(bytes, 116));
        }
    }
}

/// A session with one instance rooted at this test process, decoding attribution as
/// Postgres 15: records naming this process are unwound against its own mappings.
/// A session shared by the cases of a run (unwinding needs this process's modules parsed,
/// which takes long), renewed after a failed case: a case that panicked left its stacks in it,
/// and shrinking must not blame the next case for them.
struct Shared {
    session: Session,
    clean: bool,
}

impl Shared {
    fn new() -> RefCell<Self> {
        RefCell::new(Self {
            session: session(),
            clean: true,
        })
    }

    fn collect(cell: &RefCell<Self>, records: &[Vec<u8>], repeat: usize) {
        let mut shared = cell.borrow_mut();
        if !shared.clean {
            shared.session = session();
        }
        shared.clean = false;
        collect(&mut shared.session, records, repeat);
        shared.clean = true;
    }
}

fn session() -> Session {
    let mut session = Session::new(
        Symbolizer::new(SymbolizerOptions::default()),
        // Both: every kind of off-CPU record has its path.
        OffCpuMode::Both,
        None,
        None,
    );
    session.add_instance(InstanceContext {
        root: std::process::id(),
        scope: Scope::Instance,
        version: Some(&crate::postgres::v15::TABLE),
        names: InstanceNames::default(),
        facts: InstanceFacts::default(),
    });
    session
}

/// Hands `records` to the session, `repeat` times each (equal keys add up), then turns what
/// was counted into profiles and encodes them as the agent and `trace` do.
fn collect(session: &mut Session, records: &[Vec<u8>], repeat: usize) {
    let before = session.malformed;
    let mut rejected = 0;
    for record in records {
        let is_end = WaitEnd::parse(record).is_some()
            || LongWaitEnd::parse(record).is_some()
            || WaitRepeat::parse(record).is_some();
        if !is_end && SampleRecord::parse(record).is_err() {
            rejected += repeat as u64;
        }
        for _ in 0..repeat {
            session.handle(record);
        }
    }
    assert_eq!(
        session.malformed - before,
        rejected,
        "every rejected record is counted"
    );
    let (taken, symbolizer) = session.take_stacks();
    for (_, stacks) in taken {
        for (aggregator, meta) in [
            (&stacks.on_cpu, ProfileMeta::cpu(99, 0, 1)),
            (&stacks.off_cpu, ProfileMeta::off_cpu(0, 1)),
            (&stacks.off_cpu_exact, ProfileMeta::off_cpu(0, 1)),
        ] {
            let (databases, triggers) = (HashMap::new(), HashMap::new());
            let names = crate::postgres::attribution::LabelNames {
                databases: &databases,
                triggers: &triggers,
            };
            let profile = aggregator.to_profile(symbolizer, None, meta, names);
            let _ = profile.total_count();
            // Found by this harness: weights of corrupt records added past u64 (a panic in
            // debug builds) or past pprof's int64 (the whole profile refused).
            exporters::encode_pprof_gzip(&profile).expect("pprof of parsed records");
            let mut folded = Vec::new();
            let opts = FoldedOptions {
                root_labels: vec!["pid".into(), "queryid".into()],
            };
            exporters::write_folded(&profile, &opts, &mut folded).expect("folded stacks");
        }
    }
}

/// `len` bytes from a seed (random content is cheap to make this way, a 17 KiB `Vec<u8>`
/// strategy is not).
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        // splitmix64
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Stack lengths a record may claim that sit on the parser's edges.
fn claimed_len(carried: usize) -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        Just(carried as u64),
        Just(carried as u64 + 1),
        Just(carried.saturating_sub(1) as u64),
        Just(USER_STACK_MAX as u64),
        Just(USER_STACK_MAX as u64 + 1),
        Just(u64::MAX),
        Just(1 << 63),
        Just(u64::from(u32::MAX) + 1),
        any::<u64>(),
    ]
}

/// Random records: any length (around the sizes of each kind most often), random content,
/// with a kind's magic or a chosen stack length written over it at times.
fn random_record() -> impl Strategy<Value = Vec<u8>> {
    let len = prop_oneof![
        0usize..80,
        Just(32usize),
        Just(64usize),
        SAMPLE_STACK_OFFSET - 8..SAMPLE_STACK_OFFSET + 64,
        SAMPLE_STACK_OFFSET..SAMPLE_STACK_OFFSET + USER_STACK_MAX + 64,
    ];
    (len, any::<u64>(), 0u8..4).prop_flat_map(|(len, seed, edit)| {
        let carried = len.saturating_sub(SAMPLE_STACK_OFFSET);
        (Just(noise(len, seed)), Just(edit), claimed_len(carried)).prop_map(|(mut bytes, edit, claimed)| {
            match edit {
                1 if bytes.len() == 32 => bytes[24..].copy_from_slice(&WAIT_END_MAGIC.to_le_bytes()),
                1 if bytes.len() == 64 => bytes[56..].copy_from_slice(&LONG_WAIT_END_MAGIC.to_le_bytes()),
                2 | 3 if bytes.len() >= STACK_LEN_AT + 8 => {
                    bytes[STACK_LEN_AT..STACK_LEN_AT + 8].copy_from_slice(&claimed.to_le_bytes())
                }
                _ => {}
            }
            bytes
        })
    })
}

/// Seeds mutated as a fuzzer would, with stack lengths and kernel frame counts set to edge
/// values at times (bit flips rarely reach those).
fn mutated_record(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let count = seeds.len();
    (
        0..count,
        proptest::collection::vec(fuzzing::mutation(), 0..4),
        proptest::option::of(claimed_len(USER_STACK_MAX)),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(
            move |(index, mutations, claimed, kernel_frames): (usize, Vec<Mutation>, _, _)| {
                let mut bytes = fuzzing::mutate(&seeds[index], &mutations);
                if let (Some(claimed), true) = (claimed, bytes.len() >= STACK_LEN_AT + 8) {
                    bytes[STACK_LEN_AT..STACK_LEN_AT + 8].copy_from_slice(&claimed.to_le_bytes());
                }
                if let (Some(frames), true) = (kernel_frames, bytes.len() >= 24) {
                    bytes[20..24].copy_from_slice(&frames.to_le_bytes());
                }
                bytes
            },
        )
}

fn seeds() -> Vec<(String, Vec<u8>)> {
    fuzzing::corpus("bpf_records")
        .into_iter()
        .map(|(path, bytes)| {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (name, bytes)
        })
        .collect()
}

/// Names a record for the session: this process (unwound against its own mappings), else
/// whatever the bytes say.
fn own_process(mut bytes: Vec<u8>, ours: bool) -> Vec<u8> {
    if ours && bytes.len() >= 4 {
        bytes[..4].copy_from_slice(&std::process::id().to_le_bytes());
    }
    bytes
}

#[test]
fn seed_records_parse_as_their_kind() {
    let mut session = session();
    for (name, bytes) in seeds() {
        check_parsers(&bytes);
        let kind = (
            WaitEnd::parse(&bytes).is_some(),
            LongWaitEnd::parse(&bytes).is_some(),
            WaitRepeat::parse(&bytes).is_some(),
            SampleRecord::parse(&bytes).is_ok(),
        );
        let expected = match name.split('-').next() {
            Some("sample") => (false, false, false, true),
            Some("wait") => (true, false, false, false),
            Some("long") => (false, true, false, false),
            Some("repeat") => (false, false, true, false),
            Some("bad") => (false, false, false, false),
            _ => panic!("seed `{name}` is named after no record kind"),
        };
        assert_eq!(kind, expected, "seed `{name}`");
        // Twice: the weights of equal keys add up.
        collect(&mut session, &[own_process(bytes, true)], 2);
    }
}

#[test]
fn random_bytes_are_a_record_or_a_counted_rejection() {
    let session = Shared::new();
    let strategy = (
        proptest::collection::vec(random_record(), 1..4),
        1usize..3,
        any::<bool>(),
    );
    run_records(&session, strategy, "random records");
}

#[test]
fn mutated_seed_records_are_a_record_or_a_counted_rejection() {
    let seeds: Vec<Vec<u8>> = seeds().into_iter().map(|(_, bytes)| bytes).collect();
    let session = Shared::new();
    // A pending wait and its end, an on-CPU sample twice: what hits the same keys.
    let strategy = (
        proptest::collection::vec(mutated_record(seeds), 1..6),
        1usize..3,
        any::<bool>(),
    );
    run_records(&session, strategy, "mutated records");
}

/// Runs batches of records (each given to our process or another, repeated) through every
/// parser and then one collecting session.
fn run_records(
    session: &std::cell::RefCell<Shared>,
    strategy: impl Strategy<Value = (Vec<Vec<u8>>, usize, bool)>,
    what: &str,
) {
    TestRunner::new(fuzzing::config(256))
        .run(&strategy, |(records, repeat, ours)| {
            let records: Vec<Vec<u8>> = records.into_iter().map(|r| own_process(r, ours)).collect();
            for record in &records {
                check_parsers(record);
            }
            Shared::collect(session, &records, repeat);
            Ok(())
        })
        .expect(what);
}

/// The fields of `struct pgscope_sample`, to be written in its C layout.
#[derive(Clone, Debug)]
struct SampleFields {
    ids: (u32, u32, u64, u32),
    kernel: Vec<u64>,
    regs: [u64; 3],
    stack: Vec<u8>,
    attr: (u64, u32, u32, u32, u32, u32, u32),
    off_cpu: (u64, u32, u32),
    statement_start: u64,
    trigger: (u32, u32),
}

impl SampleFields {
    /// The record as the BPF program sends it: header, every kernel slot, `stack` bytes.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let (tgid, tid, time_ns, cpu) = self.ids;
        out.extend(tgid.to_le_bytes());
        out.extend(tid.to_le_bytes());
        out.extend(time_ns.to_le_bytes());
        out.extend(cpu.to_le_bytes());
        out.extend((self.kernel.len() as u32).to_le_bytes());
        for reg in self.regs {
            out.extend(reg.to_le_bytes());
        }
        out.extend((self.stack.len() as u64).to_le_bytes());
        let (query_id, wait, backend_type, database, state, flags, class) = self.attr;
        out.extend(query_id.to_le_bytes());
        for field in [wait, backend_type, database, state, flags, class] {
            out.extend(field.to_le_bytes());
        }
        let (ns, syscall, off_flags) = self.off_cpu;
        out.extend(ns.to_le_bytes());
        out.extend(syscall.to_le_bytes());
        out.extend(off_flags.to_le_bytes());
        out.extend(self.statement_start.to_le_bytes());
        out.extend(self.trigger.0.to_le_bytes());
        out.extend(self.trigger.1.to_le_bytes());
        for slot in 0..KERNEL_FRAMES_MAX {
            out.extend(self.kernel.get(slot).copied().unwrap_or(0).to_le_bytes());
        }
        assert_eq!(out.len(), SAMPLE_STACK_OFFSET);
        out.extend(&self.stack);
        out
    }
}

fn sample_fields() -> impl Strategy<Value = SampleFields> {
    (
        any::<(u32, u32, u64, u32)>(),
        proptest::collection::vec(any::<u64>(), 0..=KERNEL_FRAMES_MAX),
        any::<[u64; 3]>(),
        (0..=USER_STACK_MAX, any::<u64>()).prop_map(|(len, seed)| noise(len, seed)),
        any::<(u64, u32, u32, u32, u32, u32, u32)>(),
        // Within what one record can carry; past it, a record is rejected (check_parsers).
        (0..=WAIT_NS_MAX, any::<u32>(), any::<u32>()),
        any::<u64>(),
        any::<(u32, u32)>(),
    )
        .prop_map(
            |(ids, kernel, regs, stack, attr, off_cpu, statement_start, trigger)| SampleFields {
                ids,
                kernel,
                regs,
                stack,
                attr,
                off_cpu,
                statement_start,
                trigger,
            },
        )
}

#[test]
fn a_sample_in_the_c_layout_reads_back_as_written() {
    TestRunner::new(fuzzing::config(256))
        .run(&sample_fields(), |fields| {
            let bytes = fields.encode();
            let record = SampleRecord::parse(&bytes).expect("a well-formed sample");
            let h = record.header;
            prop_assert_eq!((h.tgid, h.tid, h.time_ns, h.cpu), fields.ids);
            prop_assert_eq!([h.user_ip, h.user_sp, h.user_bp], fields.regs);
            prop_assert_eq!(record.kernel_stack(), &fields.kernel[..]);
            prop_assert_eq!(record.user_stack, &fields.stack[..]);
            let attr = (
                h.query_id,
                h.wait_event_info,
                h.backend_type,
                h.database_id,
                h.backend_state,
                h.attribution,
                h.off_cpu_class,
            );
            prop_assert_eq!(attr, fields.attr);
            prop_assert_eq!((h.off_cpu_ns, h.off_cpu_syscall, h.off_cpu_flags), fields.off_cpu);
            prop_assert_eq!(h.statement_start, fields.statement_start);
            prop_assert_eq!((h.trigger_oid, h.trigger_constraint), fields.trigger);
            prop_assert!(WaitEnd::parse(&bytes).is_none() && LongWaitEnd::parse(&bytes).is_none());
            Ok(())
        })
        .expect("samples round-trip");
}

#[test]
fn wait_ends_in_the_c_layout_read_back_as_written() {
    let strategy = (
        (any::<u32>(), any::<u32>(), any::<u64>(), 0..=WAIT_NS_MAX),
        any::<(u64, [u32; 6])>(),
    );
    TestRunner::new(fuzzing::config(256))
        .run(&strategy, |((tgid, tid, start, blocked), (query_id, attr))| {
            let mut bytes = Vec::new();
            bytes.extend(tgid.to_le_bytes());
            bytes.extend(tid.to_le_bytes());
            bytes.extend(start.to_le_bytes());
            bytes.extend(blocked.to_le_bytes());
            let mut short = bytes.clone();
            short.extend(WAIT_END_MAGIC.to_le_bytes());
            let end = WaitEnd::parse(&short).expect("a wait end");
            prop_assert_eq!(
                (end.tgid, end.tid, end.start_ns, end.blocked_ns),
                (tgid, tid, start, blocked)
            );
            bytes.extend(query_id.to_le_bytes());
            for field in attr {
                bytes.extend(field.to_le_bytes());
            }
            bytes.extend(LONG_WAIT_END_MAGIC.to_le_bytes());
            let end = LongWaitEnd::parse(&bytes).expect("a long wait end");
            prop_assert_eq!(
                (end.tgid, end.tid, end.start_ns, end.blocked_ns),
                (tgid, tid, start, blocked)
            );
            let a = end.attr;
            prop_assert_eq!(
                (
                    a.query_id,
                    [
                        a.wait_event_info,
                        a.backend_type,
                        a.database_id,
                        a.backend_state,
                        a.flags,
                        a.off_cpu_class
                    ]
                ),
                (query_id, attr)
            );
            Ok(())
        })
        .expect("wait ends round-trip");
}
