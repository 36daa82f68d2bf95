//! The Rust side of `bpf/include/pgscope.h`, the one definition of what crosses between the
//! BPF programs and the agent. Its structs, enums and constants are generated from the header
//! when the agent is built (bindgen, in `agent/build.rs`), so they cannot drift from it; this
//! module gives them Rust names, adds the record parsers, and checks at compile time the two
//! things kept by hand: the Rust enums' variants (one per value of the C enum, in order) and
//! the flattened sample header (every field at the generated struct's offset).

use std::mem::{offset_of, size_of};

/// What bindgen generated from the header.
#[allow(dead_code, non_camel_case_types, non_upper_case_globals, clippy::all)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/pgscope_abi.rs"));
}

use generated as c;

pub const USER_STACK_MAX: usize = c::PGSCOPE_USER_STACK_MAX as usize;
pub const KERNEL_FRAMES_MAX: usize = c::PGSCOPE_KERNEL_FRAMES_MAX as usize;
const SAMPLE_HEADER_SIZE: usize = c::PGSCOPE_SAMPLE_HEADER_SIZE as usize;
/// Offset of the user stack bytes in a sample record.
pub const SAMPLE_STACK_OFFSET: usize = c::PGSCOPE_SAMPLE_STACK_OFFSET as usize;

/// `enum pgscope_target_flags`.
pub const TARGET_PROFILE: u8 = c::pgscope_target_flags::PGSCOPE_TARGET_PROFILE as u8;
pub const TARGET_FOLLOW_FORKS: u8 = c::pgscope_target_flags::PGSCOPE_TARGET_FOLLOW_FORKS as u8;
pub const TARGET_OFF_CPU: u8 = c::pgscope_target_flags::PGSCOPE_TARGET_OFF_CPU as u8;

/// The `u32` values of an array of fieldless `repr(u32)` enum variants, in a const context.
macro_rules! values_of {
    ($all:expr) => {{
        let mut values = [0; $all.len()];
        let mut i = 0;
        while i < values.len() {
            values[i] = $all[i] as u32;
            i += 1;
        }
        values
    }};
}

/// Whether `values` are exactly 0, 1, …, `max` - 1: a Rust enum's variants list every value of
/// its C enum, in order, so that a value added to the header fails the build until it is named.
const fn covers_every_value(values: &[u32], max: u32) -> bool {
    if values.len() != max as usize {
        return false;
    }
    let mut i = 0;
    while i < values.len() {
        if values[i] != i as u32 {
            return false;
        }
        i += 1;
    }
    true
}

/// `enum pgscope_counter`, in the header's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Counter {
    Samples = c::pgscope_counter::PGSCOPE_CNT_SAMPLES,
    Sent = c::pgscope_counter::PGSCOPE_CNT_SENT,
    RingbufFull = c::pgscope_counter::PGSCOPE_CNT_RINGBUF_FULL,
    UserStackFault = c::pgscope_counter::PGSCOPE_CNT_USER_STACK_FAULT,
    UserStackLost = c::pgscope_counter::PGSCOPE_CNT_USER_STACK_LOST,
    KernelStackFault = c::pgscope_counter::PGSCOPE_CNT_KERNEL_STACK_FAULT,
    NoScratch = c::pgscope_counter::PGSCOPE_CNT_NO_SCRATCH,
    ForksFollowed = c::pgscope_counter::PGSCOPE_CNT_FORKS_FOLLOWED,
    TargetsFull = c::pgscope_counter::PGSCOPE_CNT_TARGETS_FULL,
    AttributionFault = c::pgscope_counter::PGSCOPE_CNT_ATTRIBUTION_FAULT,
    ProbeNoEntry = c::pgscope_counter::PGSCOPE_CNT_PROBE_NO_ENTRY,
    ProbeMapFull = c::pgscope_counter::PGSCOPE_CNT_PROBE_MAP_FULL,
    OffCpuStacks = c::pgscope_counter::PGSCOPE_CNT_OFF_CPU_STACKS,
    OffCpuMapFull = c::pgscope_counter::PGSCOPE_CNT_OFF_CPU_MAP_FULL,
    WaitSamples = c::pgscope_counter::PGSCOPE_CNT_WAIT_SAMPLES,
    WaitRepeats = c::pgscope_counter::PGSCOPE_CNT_WAIT_REPEATS,
    WaitNoStack = c::pgscope_counter::PGSCOPE_CNT_WAIT_NO_STACK,
    WaitSkipped = c::pgscope_counter::PGSCOPE_CNT_WAIT_SKIPPED,
    WaitOverBudget = c::pgscope_counter::PGSCOPE_CNT_WAIT_OVER_BUDGET,
    WaitRanBeforeStack = c::pgscope_counter::PGSCOPE_CNT_WAIT_RAN_BEFORE_STACK,
    WaitThreadsOver = c::pgscope_counter::PGSCOPE_CNT_WAIT_THREADS_OVER,
    WaitEventUnknown = c::pgscope_counter::PGSCOPE_CNT_WAIT_EVENT_UNKNOWN,
    WaitStackAfterRun = c::pgscope_counter::PGSCOPE_CNT_WAIT_STACK_AFTER_RUN,
    TriggerProbeHits = c::pgscope_counter::PGSCOPE_CNT_TRIGGER_PROBE_HITS,
    TriggerNestingOver = c::pgscope_counter::PGSCOPE_CNT_TRIGGER_NESTING_OVER,
}

const _: () = assert!(covers_every_value(
    &Counter::ALL_VALUES,
    c::pgscope_counter::PGSCOPE_CNT_MAX
));

impl Counter {
    pub const ALL: [Counter; 25] = [
        Counter::Samples,
        Counter::Sent,
        Counter::RingbufFull,
        Counter::UserStackFault,
        Counter::UserStackLost,
        Counter::KernelStackFault,
        Counter::NoScratch,
        Counter::ForksFollowed,
        Counter::TargetsFull,
        Counter::AttributionFault,
        Counter::ProbeNoEntry,
        Counter::ProbeMapFull,
        Counter::OffCpuStacks,
        Counter::OffCpuMapFull,
        Counter::WaitSamples,
        Counter::WaitRepeats,
        Counter::WaitNoStack,
        Counter::WaitSkipped,
        Counter::WaitOverBudget,
        Counter::WaitRanBeforeStack,
        Counter::WaitThreadsOver,
        Counter::WaitEventUnknown,
        Counter::WaitStackAfterRun,
        Counter::TriggerProbeHits,
        Counter::TriggerNestingOver,
    ];

    /// The values of [`Self::ALL`], for the check against the header.
    const ALL_VALUES: [u32; Self::ALL.len()] = values_of!(Self::ALL);

    /// Name used in progress lines and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Counter::Samples => "samples",
            Counter::Sent => "sent",
            Counter::RingbufFull => "lost_ringbuf_full",
            Counter::UserStackFault => "user_stack_partial",
            Counter::UserStackLost => "user_stack_lost",
            Counter::KernelStackFault => "kernel_stack_lost",
            Counter::NoScratch => "lost_no_scratch",
            Counter::ForksFollowed => "forks_followed",
            Counter::TargetsFull => "lost_targets_full",
            Counter::AttributionFault => "attribution_unreadable",
            Counter::ProbeNoEntry => "probe_return_without_entry",
            Counter::ProbeMapFull => "lost_probe_map_full",
            Counter::OffCpuStacks => "off_cpu_stacks",
            Counter::OffCpuMapFull => "lost_off_cpu_map_full",
            Counter::WaitSamples => "wait_samples",
            Counter::WaitRepeats => "wait_sample_repeats",
            Counter::WaitNoStack => "wait_samples_without_stack",
            Counter::WaitSkipped => "wait_sample_threads_on_cpu",
            Counter::WaitOverBudget => "wait_sample_stack_over_budget",
            Counter::WaitRanBeforeStack => "wait_sample_ran_before_stack",
            Counter::WaitThreadsOver => "lost_wait_sample_threads_over",
            Counter::WaitEventUnknown => "wait_sample_event_guessed",
            Counter::WaitStackAfterRun => "wait_sample_stack_after_run",
            Counter::TriggerProbeHits => "trigger_probe_hits",
            Counter::TriggerNestingOver => "trigger_nesting_over",
        }
    }
}

/// `struct pgscope_sample` up to (excluding) the user stack bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SampleHeader {
    pub tgid: u32,
    pub tid: u32,
    pub time_ns: u64,
    pub cpu: u32,
    pub kernel_frames: u32,
    pub user_ip: u64,
    pub user_sp: u64,
    pub user_bp: u64,
    pub user_stack_len: u64,
    pub query_id: u64,
    pub wait_event_info: u32,
    pub backend_type: u32,
    pub database_id: u32,
    pub backend_state: u32,
    pub attribution: u32,
    /// `enum pgscope_off_cpu_class`: 0 for on-CPU samples.
    pub off_cpu_class: u32,
    /// Off-CPU records: nanoseconds the process was off CPU.
    pub off_cpu_ns: u64,
    /// Off-CPU records: the x86-64 number of the syscall it blocked in.
    pub off_cpu_syscall: u32,
    /// `enum pgscope_off_cpu_flags`.
    pub off_cpu_flags: u32,
    /// On-CPU samples of a backend: its statement's `st_activity_start_timestamp`; else 0.
    pub statement_start: u64,
    /// On-CPU samples of a backend in a trigger of its statement: the innermost trigger's
    /// `pg_trigger.oid` and `pg_constraint.oid` (0 if none); else both 0.
    pub trigger_oid: u32,
    pub trigger_constraint: u32,
    pub kernel_stack: [u64; KERNEL_FRAMES_MAX],
}

/// Every field of [`SampleHeader`] where `struct pgscope_sample` has it (the attribution's
/// fields are flattened into the header).
macro_rules! at_sample_offset {
    ($($field:ident),* ; $($flat:ident = $attr:ident),*) => {
        $(const _: () = assert!(offset_of!(SampleHeader, $field) == offset_of!(c::pgscope_sample, $field));)*
        $(const _: () = assert!(
            offset_of!(SampleHeader, $flat)
                == offset_of!(c::pgscope_sample, attr) + offset_of!(c::pgscope_attribution, $attr)
        );)*
    };
}

at_sample_offset!(
    tgid, tid, time_ns, cpu, kernel_frames, user_ip, user_sp, user_bp, user_stack_len,
    off_cpu_ns, off_cpu_syscall, off_cpu_flags, statement_start, trigger_oid, trigger_constraint,
    kernel_stack;
    query_id = query_id, wait_event_info = wait_event_info, backend_type = backend_type,
    database_id = database_id, backend_state = backend_state, attribution = flags,
    off_cpu_class = off_cpu_class
);
const _: () = assert!(offset_of!(SampleHeader, kernel_stack) == SAMPLE_HEADER_SIZE);
const _: () = assert!(offset_of!(c::pgscope_sample, user_stack) == SAMPLE_STACK_OFFSET);

/// `enum pgscope_off_cpu_class`: why a process was off CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum OffCpuClass {
    Futex = c::pgscope_off_cpu_class::PGSCOPE_OFF_CPU_FUTEX,
    Latch = c::pgscope_off_cpu_class::PGSCOPE_OFF_CPU_LATCH,
    Io = c::pgscope_off_cpu_class::PGSCOPE_OFF_CPU_IO,
    Preempted = c::pgscope_off_cpu_class::PGSCOPE_OFF_CPU_PREEMPTED,
    Other = c::pgscope_off_cpu_class::PGSCOPE_OFF_CPU_OTHER,
    Idle = c::pgscope_off_cpu_class::PGSCOPE_OFF_CPU_IDLE,
}

// PGSCOPE_OFF_CPU_NONE (0, an on-CPU sample) and then one variant per class.
const _: () = assert!(covers_every_value(
    &[
        c::pgscope_off_cpu_class::PGSCOPE_OFF_CPU_NONE,
        OffCpuClass::Futex as u32,
        OffCpuClass::Latch as u32,
        OffCpuClass::Io as u32,
        OffCpuClass::Preempted as u32,
        OffCpuClass::Other as u32,
        OffCpuClass::Idle as u32,
    ],
    c::pgscope_off_cpu_class::PGSCOPE_OFF_CPU_CLASS_MAX
));

impl OffCpuClass {
    const ALL: [OffCpuClass; 6] = [
        OffCpuClass::Futex,
        OffCpuClass::Latch,
        OffCpuClass::Io,
        OffCpuClass::Preempted,
        OffCpuClass::Other,
        OffCpuClass::Idle,
    ];

    pub fn from_raw(value: u32) -> Option<OffCpuClass> {
        Self::ALL.into_iter().find(|class| *class as u32 == value)
    }

    /// The `off_cpu` label value.
    pub fn name(self) -> &'static str {
        match self {
            OffCpuClass::Futex => "futex",
            OffCpuClass::Latch => "latch",
            OffCpuClass::Io => "io",
            OffCpuClass::Preempted => "preempted",
            OffCpuClass::Other => "other",
            OffCpuClass::Idle => "idle",
        }
    }
}

/// `struct pgscope_attribution`: what pg_stat_activity showed for a process at one instant.
pub type RawAttribution = c::pgscope_attribution;
/// `struct pgscope_off_cpu_key`.
pub type OffCpuKey = c::pgscope_off_cpu_key;
/// `struct pgscope_off_cpu_total`.
pub type OffCpuTotal = c::pgscope_off_cpu_total;
/// `struct pgscope_off_cpu_task`: one traced thread's off-CPU state (`start_ns` 0 while it
/// runs; `measured` 1 for a target measured off CPU).
pub type OffCpuTask = c::pgscope_off_cpu_task;

/// `enum pgscope_off_cpu_flags`: the record's stacks were taken when the wait began; its
/// blocked time follows in a [`WaitEnd`].
pub const OFF_CPU_PENDING: u32 = c::pgscope_off_cpu_flags::PGSCOPE_OFF_CPU_PENDING;

/// `enum pgscope_off_cpu_flags`: a wait sample of the sampled off-CPU profile (`off_cpu_ns`
/// is its tick's weight).
pub const OFF_CPU_SAMPLED: u32 = c::pgscope_off_cpu_flags::PGSCOPE_OFF_CPU_SAMPLED;

/// `struct pgscope_wait_run`: the context of a run of the wait sampler's first kfunc pass.
pub type WaitRun = c::pgscope_wait_run;

/// `struct pgscope_wait_repeat`: a thread still in the wait of its last sample with stacks.
pub type WaitRepeat = c::pgscope_wait_repeat;

const WAIT_REPEAT_MAGIC: u64 = c::PGSCOPE_WAIT_REPEAT_MAGIC;

impl WaitRepeat {
    /// A ring buffer record that is a repeat of a thread's last wait sample.
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        record_of::<Self>(bytes)
            .filter(|repeat| repeat.magic == WAIT_REPEAT_MAGIC && repeat.weight_ns <= WAIT_NS_MAX)
    }
}

/// The longest time off CPU one record can carry: 2^56 ns, about 2.3 years. pgscope measures a
/// wait from when it began watching the thread, so no real record comes near; a larger value
/// is a corrupt record, rejected (and counted) where it is parsed. Bounding each record keeps
/// what adds many of them up (a stack's total, pprof's merge of equal stacks) far below the
/// int64 that pprof and Pyroscope hold: 128 records at the bound make 2^63.
pub const WAIT_NS_MAX: u64 = 1 << 56;

/// `struct pgscope_wait_end`: the end of a wait sent with [`OFF_CPU_PENDING`] (`blocked_ns` 0:
/// shorter than the threshold, counted in the totals: drop the stacks).
pub type WaitEnd = c::pgscope_wait_end;

const WAIT_END_MAGIC: u64 = c::PGSCOPE_WAIT_END_MAGIC;

/// A ring buffer record of exactly `T`'s size, copied out; records of other kinds are told
/// apart by their size.
fn record_of<T: aya::Pod>(bytes: &[u8]) -> Option<T> {
    // SAFETY: the length matches, Pod types are plain old data valid for any bytes, and
    // read_unaligned does not require the record to be aligned.
    (bytes.len() == size_of::<T>()).then(|| unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

impl WaitEnd {
    /// A ring buffer record that is a wait's end (samples are far longer).
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        record_of::<Self>(bytes).filter(|end| end.magic == WAIT_END_MAGIC && end.blocked_ns <= WAIT_NS_MAX)
    }
}
/// `struct pgscope_long_wait_end`: a wait without stacks that lasted at least
/// [`OFF_CPU_LONG_NS`], sent whole instead of added to the totals.
pub type LongWaitEnd = c::pgscope_long_wait_end;

const LONG_WAIT_END_MAGIC: u64 = c::PGSCOPE_LONG_WAIT_END_MAGIC;

/// `PGSCOPE_OFF_CPU_LONG_NS`: waits at least this long end in a [`LongWaitEnd`] (or a
/// [`WaitEnd`] when their stacks were sent), never only in the totals.
pub const OFF_CPU_LONG_NS: u64 = c::PGSCOPE_OFF_CPU_LONG_NS as u64;

impl LongWaitEnd {
    /// A ring buffer record that is a long wait's end (samples are far longer, wait ends
    /// shorter).
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        record_of::<Self>(bytes)
            .filter(|end| end.magic == LONG_WAIT_END_MAGIC && end.blocked_ns <= WAIT_NS_MAX)
    }
}

// SAFETY: bindgen's structs are repr(C) plain old data (integers and arrays of them), and the
// header asserts each size, with explicit `_pad` fields where C would pad.
unsafe impl aya::Pod for OffCpuKey {}
unsafe impl aya::Pod for OffCpuTotal {}
unsafe impl aya::Pod for OffCpuTask {}
unsafe impl aya::Pod for WaitEnd {}
unsafe impl aya::Pod for LongWaitEnd {}
unsafe impl aya::Pod for WaitRepeat {}
const _: () = assert!(size_of::<SampleHeader>() == SAMPLE_STACK_OFFSET);

impl SampleHeader {
    /// A header carrying only a process and an attribution (for time measured without a
    /// stack), so that it decodes like any sample.
    pub fn with_attribution(tgid: u32, attr: &RawAttribution) -> Self {
        SampleHeader {
            tgid,
            tid: tgid,
            time_ns: 0,
            cpu: 0,
            kernel_frames: 0,
            user_ip: 0,
            user_sp: 0,
            user_bp: 0,
            user_stack_len: 0,
            query_id: attr.query_id,
            wait_event_info: attr.wait_event_info,
            backend_type: attr.backend_type,
            database_id: attr.database_id,
            backend_state: attr.backend_state,
            attribution: attr.flags,
            off_cpu_class: attr.off_cpu_class,
            off_cpu_ns: 0,
            off_cpu_syscall: 0,
            off_cpu_flags: 0,
            statement_start: 0,
            trigger_oid: 0,
            trigger_constraint: 0,
            kernel_stack: [0; KERNEL_FRAMES_MAX],
        }
    }
}

/// `enum pgscope_attribution_flags`.
pub const ATTR_BACKEND_TYPE: u32 = c::pgscope_attribution_flags::PGSCOPE_ATTR_BACKEND_TYPE;
pub const ATTR_DATABASE: u32 = c::pgscope_attribution_flags::PGSCOPE_ATTR_DATABASE;
pub const ATTR_STATUS: u32 = c::pgscope_attribution_flags::PGSCOPE_ATTR_STATUS;
pub const ATTR_WAIT_EVENT: u32 = c::pgscope_attribution_flags::PGSCOPE_ATTR_WAIT_EVENT;
/// Off-CPU totals: long enough for a stack, but the stack rate limit left it without one.
pub const ATTR_STACK_NOT_SAMPLED: u32 = c::pgscope_attribution_flags::PGSCOPE_ATTR_STACK_NOT_SAMPLED;

/// `struct pgscope_trigger_stack`: the triggers one thread runs (only cleared from user space).
pub type TriggerStack = c::pgscope_trigger_stack;

// SAFETY: a repr(C) struct of integers, its size asserted by the header.
unsafe impl aya::Pod for TriggerStack {}

/// `struct pgscope_pg_layout`: where one Postgres process keeps its pg_stat_activity state.
pub type PgLayout = c::pgscope_pg_layout;

// SAFETY: see the off-CPU structs above.
unsafe impl aya::Pod for PgLayout {}

/// A sample record as read from the ring buffer: the header and the copied user stack.
pub struct SampleRecord<'a> {
    pub header: SampleHeader,
    pub user_stack: &'a [u8],
}

/// Why a ring buffer record could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("sample record of {0} bytes is shorter than its {SAMPLE_STACK_OFFSET}-byte header")]
    Short(usize),
    #[error("sample record claims {claimed} stack bytes but carries {carried}")]
    StackLength { claimed: u64, carried: usize },
    #[error("sample record claims {0} ns off CPU, more than a record can carry ({WAIT_NS_MAX})")]
    OffCpuTime(u64),
}

impl<'a> SampleRecord<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Self, RecordError> {
        if bytes.len() < SAMPLE_STACK_OFFSET {
            return Err(RecordError::Short(bytes.len()));
        }
        // SAFETY: the length was checked above, SampleHeader is plain old data (repr(C), only
        // integers) and read_unaligned does not require the ring buffer record to be aligned.
        let header: SampleHeader = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<SampleHeader>()) };
        let carried = bytes.len() - SAMPLE_STACK_OFFSET;
        let claimed = header.user_stack_len;
        if claimed > carried as u64 || claimed > USER_STACK_MAX as u64 {
            return Err(RecordError::StackLength { claimed, carried });
        }
        if header.off_cpu_ns > WAIT_NS_MAX {
            return Err(RecordError::OffCpuTime(header.off_cpu_ns));
        }
        let user_stack = &bytes[SAMPLE_STACK_OFFSET..SAMPLE_STACK_OFFSET + claimed as usize];
        Ok(Self { header, user_stack })
    }

    /// Kernel frames, leaf first.
    pub fn kernel_stack(&self) -> &[u64] {
        let n = (self.header.kernel_frames as usize).min(KERNEL_FRAMES_MAX);
        &self.header.kernel_stack[..n]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_short_and_inconsistent_records() {
        assert!(matches!(
            SampleRecord::parse(&[0u8; 10]),
            Err(RecordError::Short(10))
        ));
        let mut bytes = vec![0u8; SAMPLE_STACK_OFFSET + 8];
        bytes[48..56].copy_from_slice(&16u64.to_ne_bytes());
        assert!(matches!(
            SampleRecord::parse(&bytes),
            Err(RecordError::StackLength {
                claimed: 16,
                carried: 8
            })
        ));
    }

    #[test]
    fn tells_wait_ends_from_samples() {
        let end = WaitEnd {
            tgid: 7,
            tid: 8,
            start_ns: 100,
            blocked_ns: 5000,
            magic: WAIT_END_MAGIC,
        };
        // SAFETY: WaitEnd is repr(C) plain old data of 32 bytes.
        let bytes: [u8; 32] = unsafe { std::mem::transmute(end) };
        assert_eq!(WaitEnd::parse(&bytes), Some(end));
        let mut wrong = bytes;
        wrong[31] ^= 1;
        assert_eq!(WaitEnd::parse(&wrong), None, "magic checked");
        assert_eq!(WaitEnd::parse(&[0u8; SAMPLE_STACK_OFFSET]), None);
    }

    #[test]
    fn rejects_records_claiming_more_time_off_cpu_than_one_can_carry() {
        let end = WaitEnd {
            tgid: 7,
            tid: 8,
            start_ns: 100,
            blocked_ns: WAIT_NS_MAX,
            magic: WAIT_END_MAGIC,
        };
        // SAFETY: WaitEnd is repr(C) plain old data of 32 bytes.
        let bytes: [u8; 32] = unsafe { std::mem::transmute(end) };
        assert_eq!(WaitEnd::parse(&bytes), Some(end), "the bound itself is kept");
        let corrupt = WaitEnd {
            blocked_ns: WAIT_NS_MAX + 1,
            ..end
        };
        // SAFETY: as above.
        let bytes: [u8; 32] = unsafe { std::mem::transmute(corrupt) };
        assert_eq!(WaitEnd::parse(&bytes), None);

        let mut sample = vec![0u8; SAMPLE_STACK_OFFSET];
        let at = offset_of!(SampleHeader, off_cpu_ns);
        sample[at..at + 8].copy_from_slice(&(u64::MAX - 1).to_ne_bytes());
        assert!(matches!(
            SampleRecord::parse(&sample),
            Err(RecordError::OffCpuTime(ns)) if ns == u64::MAX - 1
        ));
    }

    #[test]
    fn tells_long_wait_ends_from_wait_ends_and_samples() {
        let end = LongWaitEnd {
            tgid: 7,
            tid: 8,
            start_ns: 100,
            blocked_ns: 3_000_000_000,
            attr: RawAttribution {
                query_id: 42,
                ..RawAttribution::default()
            },
            magic: LONG_WAIT_END_MAGIC,
        };
        // SAFETY: LongWaitEnd is repr(C) plain old data of 64 bytes.
        let bytes: [u8; 64] = unsafe { std::mem::transmute(end) };
        assert_eq!(LongWaitEnd::parse(&bytes), Some(end));
        assert_eq!(WaitEnd::parse(&bytes), None);
        let mut wrong = bytes;
        wrong[63] ^= 1;
        assert_eq!(LongWaitEnd::parse(&wrong), None, "magic checked");
        assert_eq!(LongWaitEnd::parse(&[0u8; 32]), None);
    }

    #[test]
    fn decodes_header_and_stack() {
        let mut bytes = vec![0u8; SAMPLE_STACK_OFFSET + 16];
        bytes[0..4].copy_from_slice(&1234u32.to_ne_bytes());
        bytes[20..24].copy_from_slice(&2u32.to_ne_bytes());
        bytes[48..56].copy_from_slice(&16u64.to_ne_bytes());
        bytes[56..64].copy_from_slice(&0x1234u64.to_ne_bytes());
        bytes[SAMPLE_HEADER_SIZE..SAMPLE_HEADER_SIZE + 8]
            .copy_from_slice(&0xffff_ffff_8100_0000u64.to_ne_bytes());
        bytes[SAMPLE_STACK_OFFSET] = 0xab;
        let record = SampleRecord::parse(&bytes).expect("valid record");
        assert_eq!(record.header.tgid, 1234);
        assert_eq!(record.header.query_id, 0x1234);
        assert_eq!(record.kernel_stack(), &[0xffff_ffff_8100_0000, 0]);
        assert_eq!(record.user_stack.len(), 16);
        assert_eq!(record.user_stack[0], 0xab);
    }
}

/// `enum pgscope_function`, and the functions probed by name after it: the Postgres functions
/// pgscope probes. Its id ([`Function::id`]) is the attach cookie the BPF programs read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Function {
    PgssStore,
    SLock,
    LockRelationOid,
    GetCachedPlan,
    PortalStart,
    VacUpdateDatfrozenxid,
    BtGetroot,
    /// Any other function, named by the user (`--probes SubTransGetParent`): counted and
    /// timed like the seven, without reading its arguments.
    Named(NamedFunction),
}

/// A function probed by name: its place among those this process was asked for, each name
/// once ([`Function::named`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamedFunction(u8);

/// `PGSCOPE_FN_IDS`: ids of probed functions, the built-in seven's and then the named ones';
/// the per-function BPF arrays hold this many.
pub const FUNCTION_IDS: usize = c::PGSCOPE_FN_IDS as usize;

/// Functions that can be probed by name in one process, besides the seven.
pub const NAMED_FUNCTIONS_MAX: usize = FUNCTION_IDS - Function::ALL.len();

/// The names of the functions probed by name, by [`NamedFunction`] index. Leaked: at most
/// [`NAMED_FUNCTIONS_MAX`] short names for the life of the process, so that a `Function` stays
/// `Copy` and its name `&'static str` like the seven's.
static NAMED: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

const _: () = assert!(covers_every_value(
    &Function::ALL_VALUES,
    c::pgscope_function::PGSCOPE_FN_MAX
));
const _: () = assert!(FUNCTION_IDS > Function::ALL.len() && FUNCTION_IDS <= u8::MAX as usize);

/// Why a name cannot be probed.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FunctionNameError {
    #[error("`{0}` is not a C function name (letters, digits and `_`, not starting with a digit)")]
    NotAnIdentifier(String),
    #[error(
        "more than {NAMED_FUNCTIONS_MAX} functions probed by name: each costs two probe points and \
         a row per statement; probe fewer at a time"
    )]
    TooMany,
}

/// Longest function name accepted; C has no limit, but no Postgres function comes near.
const NAME_MAX: usize = 128;

impl Function {
    /// The seven functions pgscope knows the meaning of (findings, per-major signatures).
    pub const ALL: [Function; 7] = [
        Function::PgssStore,
        Function::SLock,
        Function::LockRelationOid,
        Function::GetCachedPlan,
        Function::PortalStart,
        Function::VacUpdateDatfrozenxid,
        Function::BtGetroot,
    ];

    /// The ids of [`Self::ALL`], for the check against the header.
    const ALL_VALUES: [u32; Self::ALL.len()] = {
        let mut values = [0; Self::ALL.len()];
        let mut i = 0;
        while i < values.len() {
            values[i] = Self::ALL[i].id();
            i += 1;
        }
        values
    };

    /// Its attach cookie and index in the per-function BPF arrays: `enum pgscope_function` for
    /// the seven, the ids after them for the named ones.
    pub const fn id(self) -> u32 {
        use c::pgscope_function as f;
        match self {
            Function::PgssStore => f::PGSCOPE_FN_PGSS_STORE,
            Function::SLock => f::PGSCOPE_FN_S_LOCK,
            Function::LockRelationOid => f::PGSCOPE_FN_LOCK_RELATION_OID,
            Function::GetCachedPlan => f::PGSCOPE_FN_GET_CACHED_PLAN,
            Function::PortalStart => f::PGSCOPE_FN_PORTAL_START,
            Function::VacUpdateDatfrozenxid => f::PGSCOPE_FN_VAC_UPDATE_DATFROZENXID,
            Function::BtGetroot => f::PGSCOPE_FN_BT_GETROOT,
            Function::Named(NamedFunction(index)) => f::PGSCOPE_FN_MAX + index as u32,
        }
    }

    /// The C function name, as given to `--probes`.
    pub fn name(self) -> &'static str {
        match self {
            Function::PgssStore => "pgss_store",
            Function::SLock => "s_lock",
            Function::LockRelationOid => "LockRelationOid",
            Function::GetCachedPlan => "GetCachedPlan",
            Function::PortalStart => "PortalStart",
            Function::VacUpdateDatfrozenxid => "vac_update_datfrozenxid",
            Function::BtGetroot => "_bt_getroot",
            Function::Named(NamedFunction(index)) => named_names()
                .get(usize::from(index))
                .copied()
                .unwrap_or("(unknown function)"),
        }
    }

    /// The function called `name`: one of the seven, or a function probed by name (given its
    /// id the first time it is named).
    pub fn named(name: &str) -> Result<Function, FunctionNameError> {
        if let Some(known) = Function::ALL.into_iter().find(|f| f.name() == name) {
            return Ok(known);
        }
        let mut chars = name.chars();
        let identifier = name.len() <= NAME_MAX
            && chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !identifier {
            return Err(FunctionNameError::NotAnIdentifier(name.to_string()));
        }
        let mut names = named_names();
        let index = match names.iter().position(|n| *n == name) {
            Some(index) => index,
            None if names.len() < NAMED_FUNCTIONS_MAX => {
                names.push(Box::leak(name.to_string().into_boxed_str()));
                names.len() - 1
            }
            None => return Err(FunctionNameError::TooMany),
        };
        // Below NAMED_FUNCTIONS_MAX, which fits a u8 (asserted above).
        Ok(Function::Named(NamedFunction(index as u8)))
    }

    /// Whether the function was named by the user rather than one of the seven.
    pub fn is_named(self) -> bool {
        matches!(self, Function::Named(_))
    }

    pub fn from_cookie(value: u32) -> Option<Function> {
        if let Some(known) = Function::ALL.into_iter().find(|f| f.id() == value) {
            return Some(known);
        }
        let index = value.checked_sub(c::pgscope_function::PGSCOPE_FN_MAX)?;
        (usize::try_from(index).ok()? < named_names().len())
            .then_some(Function::Named(NamedFunction(index as u8)))
    }
}

/// The names given so far; a poisoned lock only means another thread panicked mid-push.
fn named_names() -> std::sync::MutexGuard<'static, Vec<&'static str>> {
    NAMED.lock().unwrap_or_else(|e| e.into_inner())
}

/// `PGSCOPE_PROBE_SLOTS`: slots of the per-attachment maps (`function_gates`, `probe_args`);
/// slot 0 means none.
pub const PROBE_SLOTS: u32 = c::PGSCOPE_PROBE_SLOTS;

/// `PGSCOPE_ARG_REGISTERS`: the integer-class arguments a probe can read (x86-64 passes the
/// first six in registers).
pub const ARG_REGISTERS: u8 = c::PGSCOPE_ARG_REGISTERS as u8;

/// `struct pgscope_probe_args`: where the values an attachment's entry program reads are among
/// the probed function's arguments (1-based integer-class position; 0: not read).
pub type ProbeArgs = c::pgscope_probe_args;

// SAFETY: a repr(C) struct of bytes, its size asserted by the header.
unsafe impl aya::Pod for ProbeArgs {}

/// A value the entry program reads from a probed call's arguments: one field of [`ProbeArgs`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgField {
    RelId,
    LockMode,
    QueryId,
    PgssKind,
    SpinFile,
    SpinLine,
    SpinFunc,
}

// Every field of the struct but its `_pad` is named: a field added to the header fails the
// build until it is.
const _: () = assert!(size_of::<ProbeArgs>() == ArgField::ALL.len() + 1);

impl ArgField {
    pub const ALL: [ArgField; 7] = [
        ArgField::RelId,
        ArgField::LockMode,
        ArgField::QueryId,
        ArgField::PgssKind,
        ArgField::SpinFile,
        ArgField::SpinLine,
        ArgField::SpinFunc,
    ];

    /// The parameter's name in the Postgres source, as the per-major tables' prototypes name it.
    pub fn parameter(self) -> &'static str {
        match self {
            ArgField::RelId => "relid",
            ArgField::LockMode => "lockmode",
            ArgField::QueryId => "queryId",
            ArgField::PgssKind => "kind",
            ArgField::SpinFile => "file",
            ArgField::SpinLine => "line",
            ArgField::SpinFunc => "func",
        }
    }

    /// Its byte in [`ProbeArgs`].
    pub fn position_in(self, args: &mut ProbeArgs) -> &mut u8 {
        match self {
            ArgField::RelId => &mut args.relid,
            ArgField::LockMode => &mut args.lockmode,
            ArgField::QueryId => &mut args.query_id,
            ArgField::PgssKind => &mut args.pgss_kind,
            ArgField::SpinFile => &mut args.spin_file,
            ArgField::SpinLine => &mut args.spin_line,
            ArgField::SpinFunc => &mut args.spin_func,
        }
    }
}

impl Function {
    /// The argument values the entry program reads for this function
    /// (`bpf/function_probes.bpf.c`); the others read none.
    pub fn argument_fields(self) -> &'static [ArgField] {
        match self {
            Function::PgssStore => &[ArgField::QueryId, ArgField::PgssKind],
            Function::SLock => &[ArgField::SpinFile, ArgField::SpinLine, ArgField::SpinFunc],
            Function::LockRelationOid => &[ArgField::RelId, ArgField::LockMode],
            Function::GetCachedPlan
            | Function::PortalStart
            | Function::VacUpdateDatfrozenxid
            | Function::BtGetroot
            | Function::Named(_) => &[],
        }
    }
}

/// `PGSCOPE_CALL_DETAIL_SHIFT`: `CallKey::function` holds the function in its low byte and a
/// detail above it (for pgss_store its pgssStoreKind + 2: 1 text only, 2 plan, 3 exec).
const CALL_DETAIL_SHIFT: u32 = c::PGSCOPE_CALL_DETAIL_SHIFT;

/// A probed function with the detail its call key records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProbedCall {
    pub function: Function,
    /// pgss_store's `pgssStoreKind` + 2; 0 for other functions.
    pub detail: u32,
}

impl ProbedCall {
    pub fn from_key(key: &CallKey) -> Option<ProbedCall> {
        let function = Function::from_cookie(key.function & ((1 << CALL_DETAIL_SHIFT) - 1))?;
        Some(ProbedCall {
            function,
            detail: key.function >> CALL_DETAIL_SHIFT,
        })
    }

    /// The function's name, with pgss_store's kind: `pgss_store(exec)`, `pgss_store(plan)`,
    /// `pgss_store(text)` (the normalized-text-only call made at parse analysis).
    pub fn label(&self) -> String {
        match (self.function, self.detail) {
            (Function::PgssStore, 1) => "pgss_store(text)".into(),
            (Function::PgssStore, 2) => "pgss_store(plan)".into(),
            (Function::PgssStore, 3) => "pgss_store(exec)".into(),
            (Function::PgssStore, detail) => format!("pgss_store(kind {})", detail as i64 - 2),
            (function, _) => function.name().into(),
        }
    }
}

/// Buckets of `struct pgscope_call_stats.hist`: bucket i counts calls of [2^i, 2^(i+1)) ns.
pub const HIST_BUCKETS: usize = c::PGSCOPE_HIST_BUCKETS as usize;

/// `struct pgscope_call_key`.
pub type CallKey = c::pgscope_call_key;
/// `struct pgscope_call_stats`.
pub type CallStats = c::pgscope_call_stats;

impl CallStats {
    /// Adds another CPU's (or key's) statistics.
    pub fn merge(&mut self, other: &CallStats) {
        self.calls += other.calls;
        self.total_ns += other.total_ns;
        self.nested_traps += other.nested_traps;
        self.max_ns = self.max_ns.max(other.max_ns);
        for (mine, theirs) in self.hist.iter_mut().zip(other.hist) {
            *mine += theirs;
        }
    }

    /// Upper bound in ns of the histogram bucket holding quantile `q` (0..=1) of the calls.
    pub fn quantile_upper_ns(&self, q: f64) -> Option<u64> {
        let total: u64 = self.hist.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (bucket, &n) in self.hist.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(1u64 << (bucket + 1));
            }
        }
        Some(1u64 << HIST_BUCKETS)
    }
}

/// `struct pgscope_relation_lock_key`.
pub type RelationLockKey = c::pgscope_relation_lock_key;
/// `struct pgscope_spin_site_key`: an `s_lock` call site in one backend under one queryid
/// (`file` and `func`: addresses of its `__FILE__` and `__func__` strings in process `tgid`).
pub type SpinSiteKey = c::pgscope_spin_site_key;
/// `struct pgscope_spin_site_stats`.
pub type SpinSiteStats = c::pgscope_spin_site_stats;

impl SpinSiteStats {
    pub fn merge(&mut self, other: &SpinSiteStats) {
        self.calls += other.calls;
        self.total_ns += other.total_ns;
        self.max_ns = self.max_ns.max(other.max_ns);
    }
}

// SAFETY: see the off-CPU structs above (RelationLockKey's tail is its explicit `_pad`).
unsafe impl aya::Pod for CallKey {}
unsafe impl aya::Pod for CallStats {}
unsafe impl aya::Pod for RelationLockKey {}
unsafe impl aya::Pod for SpinSiteKey {}
unsafe impl aya::Pod for SpinSiteStats {}

#[cfg(test)]
mod call_stats_tests {
    use super::*;

    #[test]
    fn quantiles_come_from_histogram_buckets() {
        let mut stats = CallStats::default();
        stats.hist[10] = 90; // [1024, 2048) ns
        stats.hist[20] = 10; // [1 ms, 2 ms)
        assert_eq!(stats.quantile_upper_ns(0.5), Some(2048));
        assert_eq!(stats.quantile_upper_ns(0.9), Some(2048));
        assert_eq!(stats.quantile_upper_ns(0.99), Some(1 << 21));
        assert_eq!(CallStats::default().quantile_upper_ns(0.5), None);
    }

    #[test]
    fn call_keys_carry_pgss_store_kinds() {
        let key = |function| CallKey {
            tgid: 1,
            function,
            query_id: 0,
        };
        let exec = ProbedCall::from_key(&key(3 << 8)).expect("pgss_store");
        assert_eq!(exec.label(), "pgss_store(exec)");
        let plan = ProbedCall::from_key(&key(2 << 8)).expect("pgss_store");
        assert_eq!(plan.label(), "pgss_store(plan)");
        let lock = ProbedCall::from_key(&key(Function::LockRelationOid.id())).expect("known");
        assert_eq!(lock.label(), "LockRelationOid");
        assert!(ProbedCall::from_key(&key(99)).is_none());
    }

    #[test]
    fn merge_adds_and_keeps_max() {
        let mut a = CallStats {
            calls: 2,
            total_ns: 10,
            max_ns: 7,
            nested_traps: 4,
            ..Default::default()
        };
        let b = CallStats {
            calls: 3,
            total_ns: 5,
            max_ns: 4,
            nested_traps: 6,
            ..Default::default()
        };
        a.merge(&b);
        assert_eq!((a.calls, a.total_ns, a.max_ns, a.nested_traps), (5, 15, 7, 10));
    }
}

#[cfg(test)]
mod named_function_tests {
    use super::*;

    /// One test for the registry: it is the process's, and unit tests run in parallel. The
    /// seven keep their ids; a name is given one id, the same each time it is named, and read
    /// back from its cookie; names that are not C identifiers, and more than the room, are
    /// refused.
    #[test]
    fn functions_are_named_once_and_known_by_their_cookie() {
        for function in Function::ALL {
            assert_eq!(Function::named(function.name()), Ok(function));
            assert_eq!(Function::from_cookie(function.id()), Some(function));
        }
        let sleep = Function::named("pg_sleep").expect("an identifier");
        assert!(sleep.is_named());
        assert_eq!(sleep.name(), "pg_sleep");
        assert!(sleep.id() >= c::pgscope_function::PGSCOPE_FN_MAX && (sleep.id() as usize) < FUNCTION_IDS);
        assert_eq!(Function::named("pg_sleep"), Ok(sleep));
        assert_eq!(Function::from_cookie(sleep.id()), Some(sleep));
        let other = Function::named("_SubTransGetParent2").expect("an identifier");
        assert_ne!(other.id(), sleep.id());
        for bad in [
            "",
            "9lives",
            "pg sleep",
            "pg_sleep;",
            "ünïcode",
            &"x".repeat(NAME_MAX + 1),
        ] {
            assert!(
                matches!(Function::named(bad), Err(FunctionNameError::NotAnIdentifier(_))),
                "{bad:?} accepted"
            );
        }
        assert_eq!(Function::from_cookie(FUNCTION_IDS as u32), None);
        // Other tests may name `pg_sleep` too (and only it): fill what room is left.
        let mut filled = 0;
        while Function::named(&format!("filler_{filled}")).is_ok() {
            filled += 1;
        }
        assert_eq!(named_names().len(), NAMED_FUNCTIONS_MAX);
        assert_eq!(Function::named("one_too_many"), Err(FunctionNameError::TooMany));
        // Names already given still are, and the last id is the last name's.
        assert_eq!(Function::named("pg_sleep"), Ok(sleep));
        let last = format!("filler_{}", filled - 1);
        assert_eq!(
            Function::from_cookie((FUNCTION_IDS - 1) as u32).map(Function::name),
            Some(last.as_str())
        );
    }
}
