//! Rust mirror of `bpf/include/pgscope.h`. Every size and offset is asserted at compile time
//! against the same numbers the header asserts with `_Static_assert`.

use std::mem::{offset_of, size_of};

pub const USER_STACK_MAX: usize = 16384;
pub const KERNEL_FRAMES_MAX: usize = 127;
const SAMPLE_HEADER_SIZE: usize = 104;
/// Offset of the user stack bytes in a sample record.
pub const SAMPLE_STACK_OFFSET: usize = SAMPLE_HEADER_SIZE + 8 * KERNEL_FRAMES_MAX;

/// `enum pgscope_target_flags`.
pub const TARGET_PROFILE: u8 = 1;
pub const TARGET_FOLLOW_FORKS: u8 = 2;
pub const TARGET_OFF_CPU: u8 = 4;

/// `enum pgscope_counter`, in the header's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Counter {
    Samples = 0,
    Sent = 1,
    RingbufFull = 2,
    UserStackFault = 3,
    UserStackLost = 4,
    KernelStackFault = 5,
    NoScratch = 6,
    ForksFollowed = 7,
    TargetsFull = 8,
    AttributionFault = 9,
    ProbeNoEntry = 10,
    ProbeMapFull = 11,
    OffCpuStacks = 12,
    OffCpuMapFull = 13,
}

impl Counter {
    pub const ALL: [Counter; 14] = [
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
    ];

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
    pub kernel_stack: [u64; KERNEL_FRAMES_MAX],
}

const _: () = assert!(offset_of!(SampleHeader, kernel_stack) == SAMPLE_HEADER_SIZE);
const _: () = assert!(offset_of!(SampleHeader, user_stack_len) == 48);
const _: () = assert!(offset_of!(SampleHeader, query_id) == 56);
const _: () = assert!(offset_of!(SampleHeader, attribution) == 80);
const _: () = assert!(offset_of!(SampleHeader, off_cpu_ns) == 88);

/// `enum pgscope_off_cpu_class`: why a process was off CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum OffCpuClass {
    Futex = 1,
    Latch = 2,
    Io = 3,
    Preempted = 4,
    Other = 5,
    Idle = 6,
}

impl OffCpuClass {
    pub fn from_raw(value: u32) -> Option<OffCpuClass> {
        Some(match value {
            1 => OffCpuClass::Futex,
            2 => OffCpuClass::Latch,
            3 => OffCpuClass::Io,
            4 => OffCpuClass::Preempted,
            5 => OffCpuClass::Other,
            6 => OffCpuClass::Idle,
            _ => return None,
        })
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
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RawAttribution {
    pub query_id: u64,
    pub wait_event_info: u32,
    pub backend_type: u32,
    pub database_id: u32,
    pub backend_state: u32,
    pub flags: u32,
    pub off_cpu_class: u32,
}

/// `struct pgscope_off_cpu_key`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OffCpuKey {
    pub tgid: u32,
    pub _pad: u32,
    pub attr: RawAttribution,
}

/// `struct pgscope_off_cpu_total`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuTotal {
    pub ns: u64,
    pub waits: u64,
}

/// `struct pgscope_off_cpu_task`: one traced thread's off-CPU state.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuTask {
    /// When it was switched out (`bpf_ktime_get_ns`, CLOCK_MONOTONIC); 0 while it runs.
    pub start_ns: u64,
    /// `start_ns` of the wait whose stacks were sent when it began, else 0.
    pub stack_start_ns: u64,
    pub syscall: u32,
    pub tgid: u32,
    pub attr: RawAttribution,
    pub status_entry: u64,
    pub wait_event_ptr: u64,
    pub generation: u32,
    /// 1: a target measured off CPU (the storage is kept for every thread that switches).
    pub measured: u32,
    pub st_state_offset: u32,
    pub st_query_id_offset: u32,
}

const _: () = assert!(size_of::<OffCpuTask>() == 88);

/// `enum pgscope_off_cpu_flags`: the record's stacks were taken when the wait began; its
/// blocked time follows in a [`WaitEnd`].
pub const OFF_CPU_PENDING: u32 = 1;

/// `struct pgscope_wait_end`: the end of a wait sent with [`OFF_CPU_PENDING`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitEnd {
    pub tgid: u32,
    pub tid: u32,
    /// The pending record's `time_ns`.
    pub start_ns: u64,
    /// 0: shorter than the threshold, counted in the totals (drop the stacks).
    pub blocked_ns: u64,
    pub magic: u64,
}

const WAIT_END_MAGIC: u64 = 0x646e_4574_6961_5750;
const _: () = assert!(size_of::<WaitEnd>() == 32);

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
        record_of::<Self>(bytes).filter(|end| end.magic == WAIT_END_MAGIC)
    }
}
/// `struct pgscope_long_wait_end`: a wait without stacks that lasted at least
/// [`OFF_CPU_LONG_NS`], sent whole instead of added to the totals.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LongWaitEnd {
    pub tgid: u32,
    pub tid: u32,
    /// When it began: `OffCpuTask::start_ns` of the wait.
    pub start_ns: u64,
    pub blocked_ns: u64,
    pub attr: RawAttribution,
    pub magic: u64,
}

const LONG_WAIT_END_MAGIC: u64 = 0x646e_4574_6961_574c;
const _: () = assert!(size_of::<LongWaitEnd>() == 64);

/// `PGSCOPE_OFF_CPU_LONG_NS`: waits at least this long end in a [`LongWaitEnd`] (or a
/// [`WaitEnd`] when their stacks were sent), never only in the totals.
pub const OFF_CPU_LONG_NS: u64 = 1_000_000_000;

impl LongWaitEnd {
    /// A ring buffer record that is a long wait's end (samples are far longer, wait ends
    /// shorter).
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        record_of::<Self>(bytes).filter(|end| end.magic == LONG_WAIT_END_MAGIC)
    }
}

const _: () = assert!(size_of::<RawAttribution>() == 32);
const _: () = assert!(size_of::<OffCpuKey>() == 40);
const _: () = assert!(size_of::<OffCpuTotal>() == 16);

// SAFETY: both are repr(C) plain old data without padding (sizes asserted above).
unsafe impl aya::Pod for OffCpuKey {}
unsafe impl aya::Pod for OffCpuTotal {}
// SAFETY: repr(C) plain old data without padding (size asserted above).
unsafe impl aya::Pod for OffCpuTask {}
// SAFETY: repr(C) plain old data without padding (sizes asserted above: 4+4+8+8+8 and
// 4+4+8+8+32+8 bytes).
unsafe impl aya::Pod for WaitEnd {}
unsafe impl aya::Pod for LongWaitEnd {}
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
            kernel_stack: [0; KERNEL_FRAMES_MAX],
        }
    }
}

/// `enum pgscope_attribution_flags`.
pub const ATTR_BACKEND_TYPE: u32 = 1;
pub const ATTR_DATABASE: u32 = 2;
pub const ATTR_STATUS: u32 = 4;
pub const ATTR_WAIT_EVENT: u32 = 8;
/// Off-CPU totals: long enough for a stack, but the stack rate limit left it without one.
pub const ATTR_STACK_NOT_SAMPLED: u32 = 16;

/// `struct pgscope_pg_layout`: where one Postgres process keeps its pg_stat_activity state.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PgLayout {
    pub my_be_entry: u64,
    pub my_wait_event_info: u64,
    pub my_backend_type: u64,
    pub my_database_id: u64,
    pub st_state_offset: u32,
    pub st_query_id_offset: u32,
}

const _: () = assert!(size_of::<PgLayout>() == 40);
const _: () = assert!(offset_of!(PgLayout, st_state_offset) == 32);

// SAFETY: PgLayout is repr(C) plain old data with no padding (asserted size 40 = 4*8 + 2*4).
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

/// `enum pgscope_function`: the Postgres functions pgscope can probe. The value is the attach
/// cookie the BPF programs read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum Function {
    PgssStore = 0,
    SLock = 1,
    LockRelationOid = 2,
    GetCachedPlan = 3,
    PortalStart = 4,
    VacUpdateDatfrozenxid = 5,
    BtGetroot = 6,
}

impl Function {
    pub const ALL: [Function; 7] = [
        Function::PgssStore,
        Function::SLock,
        Function::LockRelationOid,
        Function::GetCachedPlan,
        Function::PortalStart,
        Function::VacUpdateDatfrozenxid,
        Function::BtGetroot,
    ];

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
        }
    }

    pub fn from_cookie(value: u32) -> Option<Function> {
        Function::ALL.into_iter().find(|f| *f as u32 == value)
    }
}

/// `PGSCOPE_CALL_DETAIL_SHIFT`: `CallKey::function` holds the function in its low byte and a
/// detail above it (for pgss_store its pgssStoreKind + 2: 1 text only, 2 plan, 3 exec).
const CALL_DETAIL_SHIFT: u32 = 8;

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
pub const HIST_BUCKETS: usize = 40;

/// `struct pgscope_call_key`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallKey {
    pub tgid: u32,
    pub function: u32,
    pub query_id: u64,
}

/// `struct pgscope_call_stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallStats {
    pub calls: u64,
    pub total_ns: u64,
    pub max_ns: u64,
    pub hist: [u64; HIST_BUCKETS],
}

impl Default for CallStats {
    fn default() -> Self {
        Self {
            calls: 0,
            total_ns: 0,
            max_ns: 0,
            hist: [0; HIST_BUCKETS],
        }
    }
}

impl CallStats {
    /// Adds another CPU's (or key's) statistics.
    pub fn merge(&mut self, other: &CallStats) {
        self.calls += other.calls;
        self.total_ns += other.total_ns;
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
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RelationLockKey {
    pub tgid: u32,
    pub relid: u32,
    pub query_id: u64,
    pub lockmode: u32,
    pub _pad: u32,
}

/// `struct pgscope_spin_site_key`: an `s_lock` call site in one backend under one queryid.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SpinSiteKey {
    pub tgid: u32,
    pub line: u32,
    pub query_id: u64,
    /// Address of the call site's `__FILE__` string in process `tgid`.
    pub file: u64,
    /// Address of the call site's `__func__` string in process `tgid`.
    pub func: u64,
}

/// `struct pgscope_spin_site_stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpinSiteStats {
    pub calls: u64,
    pub total_ns: u64,
    pub max_ns: u64,
}

impl SpinSiteStats {
    pub fn merge(&mut self, other: &SpinSiteStats) {
        self.calls += other.calls;
        self.total_ns += other.total_ns;
        self.max_ns = self.max_ns.max(other.max_ns);
    }
}

const _: () = assert!(size_of::<CallKey>() == 16);
const _: () = assert!(size_of::<SpinSiteKey>() == 32);
const _: () = assert!(offset_of!(SpinSiteKey, func) == 24);
const _: () = assert!(size_of::<SpinSiteStats>() == 24);
const _: () = assert!(size_of::<CallStats>() == 24 + 8 * HIST_BUCKETS);
const _: () = assert!(size_of::<RelationLockKey>() == 24);
const _: () = assert!(offset_of!(RelationLockKey, lockmode) == 16);

// SAFETY: all five are repr(C) plain old data without padding (sizes asserted above; the
// explicit _pad field fills RelationLockKey's tail).
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
        let lock = ProbedCall::from_key(&key(Function::LockRelationOid as u32)).expect("known");
        assert_eq!(lock.label(), "LockRelationOid");
        assert!(ProbedCall::from_key(&key(99)).is_none());
    }

    #[test]
    fn merge_adds_and_keeps_max() {
        let mut a = CallStats {
            calls: 2,
            total_ns: 10,
            max_ns: 7,
            ..Default::default()
        };
        let b = CallStats {
            calls: 3,
            total_ns: 5,
            max_ns: 4,
            ..Default::default()
        };
        a.merge(&b);
        assert_eq!((a.calls, a.total_ns, a.max_ns), (5, 15, 7));
    }
}
