/* SPDX-License-Identifier: Apache-2.0 OR GPL-2.0 */
/*
 * The one definition of everything that crosses between the BPF programs and the Rust agent.
 * The Rust side is generated from this header when the agent is built (bindgen, in
 * agent/build.rs); agent/src/bpf/abi.rs names it for Rust and fails to compile when an enum
 * gains a value it does not name, or the sample's fields move.
 */
#ifndef PGSCOPE_H
#define PGSCOPE_H

#ifndef __VMLINUX_H__
#include <stdint.h>
typedef uint8_t __u8;
typedef uint32_t __u32;
typedef int32_t __s32;
typedef uint64_t __u64;
#endif

/* Bytes of user stack copied per sample, from the stack pointer upwards. Measured on busy
 * backends: 96% of samples lie within 8 KiB of the stack top, >99.9% within 16 KiB; but the
 * regular-expression engine keeps its DFAs on the stack (regexec.c's smalldfa, ~12 KiB each),
 * and a regex-bound backend's stacks were whole in 52% of samples with a 16 KiB copy, 85% with
 * 64 KiB, 100% with 128 KiB. Only the bytes copied cross the ring buffer: a shallow stack
 * costs no more. */
#define PGSCOPE_USER_STACK_MAX 131072
/* Kernel frames kept per sample (bpf_get_stack's usual limit is 127). */
#define PGSCOPE_KERNEL_FRAMES_MAX 127
/* Processes the filter map can hold: every backend of every profiled instance. */
#define PGSCOPE_MAX_TARGETS 65536

/* Values in the `targets` map (a bit set). */
enum pgscope_target_flags {
	PGSCOPE_TARGET_PROFILE = 1,	  /* sample this process */
	PGSCOPE_TARGET_FOLLOW_FORKS = 2, /* children inherit this entry (postmaster → backends) */
	PGSCOPE_TARGET_OFF_CPU = 4,	  /* also measure the time it spends off CPU */
};

/* Per-CPU counters, indexed by this enum: samples seen and every reason a sample was lost or
 * degraded. A profiler that silently loses samples is lying, so each reason is exported. */
enum pgscope_counter {
	PGSCOPE_CNT_SAMPLES = 0,	     /* perf events that hit a target process */
	PGSCOPE_CNT_SENT = 1,		     /* samples written to the ring buffer */
	PGSCOPE_CNT_RINGBUF_FULL = 2,	     /* lost: ring buffer full (user space too slow) */
	PGSCOPE_CNT_USER_STACK_FAULT = 3,    /* degraded: full stack copy faulted, kept one page */
	PGSCOPE_CNT_USER_STACK_LOST = 4,     /* degraded: no user stack bytes could be read */
	PGSCOPE_CNT_KERNEL_STACK_FAULT = 5,  /* degraded: bpf_get_stack for the kernel failed */
	PGSCOPE_CNT_NO_SCRATCH = 6,	     /* lost: per-CPU scratch buffer unavailable */
	PGSCOPE_CNT_FORKS_FOLLOWED = 7,	     /* children added to the target map */
	PGSCOPE_CNT_TARGETS_FULL = 8,	     /* lost: a child could not be added, map full */
	PGSCOPE_CNT_ATTRIBUTION_FAULT = 9,   /* degraded: backend state unreadable at sample time */
	PGSCOPE_CNT_PROBE_NO_ENTRY = 10,     /* lost: a return without its recorded entry */
	PGSCOPE_CNT_PROBE_MAP_FULL = 11,     /* lost: a per-call statistic had no map room */
	PGSCOPE_CNT_OFF_CPU_STACKS = 12,     /* off-CPU waits sent with their stacks */
	PGSCOPE_CNT_OFF_CPU_MAP_FULL = 13,   /* lost: an off-CPU total had no map room */
	PGSCOPE_CNT_WAIT_SAMPLES = 14,	     /* sampled off CPU: threads sent with their stacks */
	PGSCOPE_CNT_WAIT_REPEATS = 15,	     /* sampled off CPU: still in the wait last sent */
	PGSCOPE_CNT_WAIT_NO_STACK = 16,	     /* sampled off CPU: idle or client waits, counted only */
	PGSCOPE_CNT_WAIT_SKIPPED = 17,	     /* sampled off CPU: target threads found running */
	PGSCOPE_CNT_WAIT_OVER_BUDGET = 18,   /* degraded: sampled off CPU without a stack, over the tick's budget */
	PGSCOPE_CNT_WAIT_RAN_BEFORE_STACK = 19, /* degraded: sampled off CPU without a stack, it ran before the copy */
	PGSCOPE_CNT_WAIT_THREADS_OVER = 20,   /* lost: a target thread the wait sampler's list had no room for */
	PGSCOPE_CNT_WAIT_EVENT_UNKNOWN = 21,  /* degraded: sampled off CPU, it ran before its wait event was read */
	PGSCOPE_CNT_WAIT_STACK_AFTER_RUN = 22, /* sampled off CPU: its stack copied after it ran, back in the same wait */
	PGSCOPE_CNT_TRIGGER_PROBE_HITS = 23,  /* traps of the trigger probes, by any process: their cost */
	PGSCOPE_CNT_TRIGGER_NESTING_OVER = 24, /* a trigger call nested deeper than a thread's trigger stack */
	PGSCOPE_CNT_MAX = 25,
};

/* Postgres functions that can be probed (uprobe + uretprobe); the value is the attach cookie. */
enum pgscope_function {
	PGSCOPE_FN_PGSS_STORE = 0,
	PGSCOPE_FN_S_LOCK = 1,
	PGSCOPE_FN_LOCK_RELATION_OID = 2,
	PGSCOPE_FN_GET_CACHED_PLAN = 3,
	PGSCOPE_FN_PORTAL_START = 4,
	PGSCOPE_FN_VAC_UPDATE_DATFROZENXID = 5,
	PGSCOPE_FN_BT_GETROOT = 6,
	PGSCOPE_FN_MAX = 7,
};

/* Ids of probed functions: enum pgscope_function, then the functions probed by name
 * (`--probes SubTransGetParent`), numbered by user space from PGSCOPE_FN_MAX. The per-function
 * arrays (function_hits) hold this many; an exiting thread's in-flight calls are looked up under
 * each (bpf/processes.bpf.c), so it stays small. */
#define PGSCOPE_FN_IDS 32

/* Slots of the per-attachment maps (function_gates, probe_args): the upper half of a function
 * probe's attach cookie names its slot; slot 0 means none (ungated, reads no argument). */
#define PGSCOPE_PROBE_SLOTS 1024

/* Integer-class argument registers a probe can read: x86-64 passes the first six integer and
 * pointer arguments in rdi, rsi, rdx, rcx, r8, r9 (PT_REGS_PARM1..6); floating-point ones go
 * to xmm registers and do not count. */
#define PGSCOPE_ARG_REGISTERS 6

/* Where the values a function probe reads are among the probed function's arguments, per
 * attachment (slot in probe_args): 1..PGSCOPE_ARG_REGISTERS names the integer-class argument,
 * 0 that the value is not read. Signatures change between Postgres majors, so user space fills
 * it from the instance's major's table (agent/src/postgres/) rather than the program assuming
 * one layout. */
struct pgscope_probe_args {
	__u8 relid;	/* LockRelationOid: Oid relid */
	__u8 lockmode;	/* LockRelationOid: LOCKMODE lockmode */
	__u8 query_id;	/* pgss_store: uint64 queryId */
	__u8 pgss_kind; /* pgss_store: pgssStoreKind kind */
	__u8 spin_file; /* s_lock: const char *file */
	__u8 spin_line; /* s_lock: int line */
	__u8 spin_func; /* s_lock: const char *func */
	__u8 _pad;
};

_Static_assert(sizeof(struct pgscope_probe_args) == 8, "read by agent/src/bpf/abi.rs");

/* Buckets of the per-function latency histogram: bucket i counts calls of [2^i, 2^(i+1)) ns,
 * bucket 0 also [0, 1) ns; the last bucket holds everything longer (2^39 ns ≈ 9 min). */
#define PGSCOPE_HIST_BUCKETS 40

/* pgscope_call_key.function holds the function in its low byte and a detail above it: for
 * pgss_store, its pgssStoreKind + 2 (1 = PGSS_INVALID: text only, 2 = plan, 3 = exec); 0 elsewhere. */
#define PGSCOPE_CALL_DETAIL_SHIFT 8

/* Per (backend, queryid, function) call statistics, aggregated per CPU in the kernel. */
struct pgscope_call_key {
	__u32 tgid;
	__u32 function; /* enum pgscope_function | detail << PGSCOPE_CALL_DETAIL_SHIFT */
	__u64 query_id; /* st_query_id at entry; 0 when none */
};

struct pgscope_call_stats {
	__u64 calls;
	__u64 total_ns; /* entry to return, the traps of nested probed calls included */
	__u64 max_ns;
	/* Probe traps (entries and returns of any function probe) taken by the same thread between
	 * the calls' entries and returns: each cost a trap's time that total_ns counts as the
	 * function's own. User space takes them out with the calibrated cost of a hit. */
	__u64 nested_traps;
	__u64 hist[PGSCOPE_HIST_BUCKETS];
};

/* LockRelationOid(relid, lockmode) calls per (backend, queryid, relation, mode). */
struct pgscope_relation_lock_key {
	__u32 tgid;
	__u32 relid;
	__u64 query_id;
	__u32 lockmode;
	__u32 _pad;
};

/* s_lock(lock, file, line, func) calls per (backend, queryid, call site): which spinlock
 * acquisition spins. file and func point to string literals in the caller's file (the
 * postgres executable or an extension library); user space reads them from the process. */
struct pgscope_spin_site_key {
	__u32 tgid;
	__u32 line;
	__u64 query_id;
	__u64 file; /* const char *, address in process tgid */
	__u64 func; /* const char *, address in process tgid */
};

struct pgscope_spin_site_stats {
	__u64 calls;
	__u64 total_ns; /* time spent in s_lock: spinning and sleeping until the lock was taken */
	__u64 max_ns;
};

_Static_assert(sizeof(struct pgscope_call_key) == 16, "read by agent/src/bpf/abi.rs");
_Static_assert(sizeof(struct pgscope_call_stats) == 32 + 8 * PGSCOPE_HIST_BUCKETS, "read by agent/src/bpf/abi.rs");
_Static_assert(sizeof(struct pgscope_relation_lock_key) == 24, "read by agent/src/bpf/abi.rs");
_Static_assert(sizeof(struct pgscope_spin_site_key) == 32, "read by agent/src/bpf/abi.rs");
_Static_assert(sizeof(struct pgscope_spin_site_stats) == 24, "read by agent/src/bpf/abi.rs");

/* Where one Postgres process keeps the state pg_stat_activity shows, so that a sample can read
 * it from the backend's own memory at no per-statement cost. Addresses are of the exported
 * globals in that process; offsets are of fields of PgBackendStatus for its major version. A
 * zero address means "not available" (e.g. an older major without my_wait_event_info). */
struct pgscope_pg_layout {
	__u64 my_be_entry;	  /* &MyBEEntry: PgBackendStatus * */
	__u64 my_wait_event_info; /* &my_wait_event_info: uint32 * (PG14+) */
	__u64 my_backend_type;	  /* &MyBackendType: BackendType (int) */
	__u64 my_database_id;	  /* &MyDatabaseId: Oid */
	__u32 st_state_offset;	  /* offsetof(PgBackendStatus, st_state) */
	__u32 st_query_id_offset; /* offsetof(PgBackendStatus, st_query_id), PG14+ */
	/* Values whose numbers differ between majors, for telling a backend idle between
	 * statements: STATE_IDLE (18 puts STATE_STARTING before it) and WAIT_EVENT_CLIENT_READ
	 * (generated in alphabetical order from 17 on). Never 0. */
	__u32 state_idle;
	__u32 wait_client_read;
	/* offsetof(PgBackendStatus, st_activity_start_timestamp): when the statement (or the
	 * protocol message) began, the same before and after its queryid is known. */
	__u32 st_activity_start_offset;
	/* Which trigger a thread runs (bpf/triggers.bpf.c): T_TriggerData, the NodeTag of the
	 * `context` a trigger function is called with (0: triggers are not read in this major),
	 * and offsetof(FunctionCallInfoBaseData, context), offsetof(TriggerData, tg_trigger),
	 * offsetof(Trigger, tgoid) and offsetof(Trigger, tgconstraint). */
	__u32 trigger_data_tag;
	__u8 fcinfo_context_offset;
	__u8 tg_trigger_offset;
	__u8 tgoid_offset;
	__u8 tgconstraint_offset;
	__u32 _pad;
};

_Static_assert(sizeof(struct pgscope_pg_layout) == 64, "read by agent/src/bpf/abi.rs");

/* The triggers a thread is running, outermost first: each from the call of its function
 * (pgstat_init_function_usage, given the trigger data as its call's context) to the end of that
 * call (pgstat_end_function_usage with the same usage record). */
#define PGSCOPE_TRIGGER_NESTING_MAX 4

struct pgscope_trigger_frame {
	__u64 usage;		 /* the call's PgStat_FunctionCallUsage: on the caller's stack */
	__u64 statement_start; /* the backend's st_activity_start_timestamp at the call */
	__u32 trigger_oid;	 /* Trigger.tgoid: pg_trigger.oid */
	__u32 constraint_oid;	 /* Trigger.tgconstraint: pg_constraint.oid, 0 if none */
};

struct pgscope_trigger_stack {
	__u32 depth;
	__u32 _pad;
	struct pgscope_trigger_frame frames[PGSCOPE_TRIGGER_NESTING_MAX];
};

_Static_assert(sizeof(struct pgscope_trigger_stack) == 104, "read by agent/src/bpf/abi.rs");

/* Why a process was off CPU, from the scheduler's and the syscall's point of view. Postgres'
 * own view (the wait event in force) comes with it. */
enum pgscope_off_cpu_class {
	PGSCOPE_OFF_CPU_NONE = 0,	/* an on-CPU sample */
	PGSCOPE_OFF_CPU_FUTEX = 1,	/* futex: LWLocks (PGSemaphoreLock → sem_wait), glibc locks */
	PGSCOPE_OFF_CPU_LATCH = 2,	/* epoll/poll/select: latches, heavyweight locks, client I/O */
	PGSCOPE_OFF_CPU_IO = 3,		/* blocked in a file I/O syscall, or uninterruptible (D) */
	PGSCOPE_OFF_CPU_PREEMPTED = 4,	/* runnable but descheduled: run-queue delay */
	PGSCOPE_OFF_CPU_OTHER = 5,	/* any other blocking syscall (nanosleep, …) */
	PGSCOPE_OFF_CPU_IDLE = 6,	/* waiting for work: ClientRead while idle, Activity:* main loops */
	PGSCOPE_OFF_CPU_CLASS_MAX = 7,
};



/* Which attribution fields of a sample were read (a bit set). */
enum pgscope_attribution_flags {
	PGSCOPE_ATTR_BACKEND_TYPE = 1,
	PGSCOPE_ATTR_DATABASE = 2,
	PGSCOPE_ATTR_STATUS = 4,     /* st_state and st_query_id (the backend has a status entry) */
	PGSCOPE_ATTR_WAIT_EVENT = 8,
	/* Off-CPU totals: long enough for a stack, but the stack rate limit (exact) or the tick's
	 * stack budget (sampled) left it without. */
	PGSCOPE_ATTR_STACK_NOT_SAMPLED = 16,
};

/* What pg_stat_activity would show for a backend at one instant (see pgscope_pg_layout). */
struct pgscope_attribution {
	__u64 query_id;		/* st_query_id: pg_stat_statements.queryid, 0 when not computed yet */
	__u32 wait_event_info;	/* *my_wait_event_info: class in the top byte */
	__u32 backend_type;	/* MyBackendType */
	__u32 database_id;	/* MyDatabaseId */
	__u32 backend_state;	/* st_state */
	__u32 flags;		/* enum pgscope_attribution_flags: which fields were read */
	__u32 off_cpu_class;	/* enum pgscope_off_cpu_class */
};

/* Off-CPU time of waits too short for a stack (below the configured threshold) or without one
 * (idle client waits), per process and attribution at the time it blocked: totals stay exact. */
struct pgscope_off_cpu_key {
	__u32 tgid;
	__u32 _pad;
	struct pgscope_attribution attr;
};

struct pgscope_off_cpu_total {
	__u64 ns;
	__u64 waits;
};

_Static_assert(sizeof(struct pgscope_off_cpu_key) == 40, "read by agent/src/bpf/abi.rs");
_Static_assert(sizeof(struct pgscope_off_cpu_total) == 16, "read by agent/src/bpf/abi.rs");

/* A thread's off-CPU state (task storage off_cpu_tasks): kept for every thread that switches,
 * so that telling a Postgres thread from any other costs no map lookup; user space reads the
 * waits still open through a pidfd. */
struct pgscope_off_cpu_task {
	__u64 start_ns;	  /* when it was switched out (bpf_ktime_get_ns); 0 while it runs */
	__u64 stack_start_ns; /* start_ns of the wait whose stack was sent at switch-out, else 0 */
	__u32 syscall;	  /* the blocking syscall's number */
	__u32 tgid;
	struct pgscope_attribution attr;
	/* Addresses that do not change once set, read once per thread rather than at every
	 * switch: the backend's PgBackendStatus entry and its wait-event word. 0 until known. */
	__u64 status_entry;
	__u64 wait_event_ptr;
	__u32 generation; /* the targets' generation `measured` was decided at */
	__u32 measured;	  /* 1: a target flagged PGSCOPE_TARGET_OFF_CPU */
	/* The layout's offsets, copied once the addresses above are known: then a switch reads
	 * the three changing words with no map lookup. 0 until then. */
	__u32 st_state_offset;
	__u32 st_query_id_offset;
	/* The layout's state_idle and wait_client_read, copied at the first read with the layout;
	 * 0 until then (no state or wait event is 0 and idle). */
	__u32 state_idle;
	__u32 wait_client_read;
	/* Under --off-cpu=both: 1 when the current wait began as the wait sampler's thread took
	 * the CPU (the run's own doing, left out of the exact state at its instants,
	 * bpf/wait_sampler.bpf.h). */
	__u32 displaced;
	__u32 _pad;
};

_Static_assert(sizeof(struct pgscope_off_cpu_task) == 104, "read by agent/src/bpf/abi.rs");

/* The end of an off-CPU wait whose stacks were sent when it began (a sample record with
 * PGSCOPE_OFF_CPU_PENDING): told apart from samples by its size. */
struct pgscope_wait_end {
	__u32 tgid;
	__u32 tid;
	__u64 start_ns;	  /* the pending record's time_ns */
	__u64 blocked_ns; /* 0: shorter than the threshold, counted in the totals: drop the stack */
	__u64 magic;	  /* PGSCOPE_WAIT_END_MAGIC */
};

#define PGSCOPE_WAIT_END_MAGIC 0x646e457469615750ULL /* "PWaitEnd" */

_Static_assert(sizeof(struct pgscope_wait_end) == 32, "read by agent/src/bpf/abi.rs");

/* The end of a wait without stacks that lasted at least PGSCOPE_OFF_CPU_LONG_NS: sent whole
 * rather than added to the totals, so that user space, which may have shipped parts of it
 * while it was open (the agent does at every upload, so that a backend blocked for minutes
 * shows in every interval), knows which wait ended and ships only the rest. Long waits are
 * rare (at most one a second per thread), so this costs the hot path nothing. Told apart from
 * samples and pgscope_wait_end by its size. */
struct pgscope_long_wait_end {
	__u32 tgid;
	__u32 tid;
	__u64 start_ns; /* pgscope_off_cpu_task.start_ns of the wait */
	__u64 blocked_ns;
	struct pgscope_attribution attr;
	__u64 magic; /* PGSCOPE_LONG_WAIT_END_MAGIC */
};

#define PGSCOPE_LONG_WAIT_END_MAGIC 0x646e45746961574cULL /* "LWaitEnd" */
#define PGSCOPE_OFF_CPU_LONG_NS 1000000000ULL

_Static_assert(sizeof(struct pgscope_long_wait_end) == 64, "read by agent/src/bpf/abi.rs");

/* pgscope_sample.off_cpu_flags */
enum pgscope_off_cpu_flags {
	/* Stacks taken when the wait began; its blocked time follows in a pgscope_wait_end. */
	PGSCOPE_OFF_CPU_PENDING = 1,
	/* A wait sample (the sampled off-CPU profile): off_cpu_ns is one tick's weight. */
	PGSCOPE_OFF_CPU_SAMPLED = 2,
};

/* Sampled off CPU: a thread found, at this tick, in the very wait of the last sample sent for it
 * with stacks (it has not run since: same stacks, same attribution), weighing weight_ns more.
 * Told apart from the other records by its size. */
struct pgscope_wait_repeat {
	__u32 tgid;
	__u32 tid;
	__u64 weight_ns;
	__u64 magic; /* PGSCOPE_WAIT_REPEAT_MAGIC */
};

#define PGSCOPE_WAIT_REPEAT_MAGIC 0x7065527469615753ULL /* "SWaitRep" */

_Static_assert(sizeof(struct pgscope_wait_repeat) == 24, "read by agent/src/bpf/abi.rs");

/* Sampled off CPU: what user space hands a run of the kfunc passes' first program (its
 * BPF_PROG_RUN context), rather than a map update a tick. */
struct pgscope_wait_run {
	__u64 weight_ns; /* this run's samples' weight */
};

_Static_assert(sizeof(struct pgscope_wait_run) == 8, "written by agent/src/bpf/wait_targets.rs");

/* Sampled off CPU: a thread's state between ticks (task storage wait_sample_tasks). */
struct pgscope_wait_sample_task {
	/* nvcsw + nivcsw + 1 at the last sample (0: never sampled): unchanged, the thread has not
	 * run since, and nothing it shows has changed. */
	__u64 switches;
	/* What the last sample was: enum pgscope_wait_sample_kind. */
	__u32 kind;
	/* Ticks of a wait counted without stacks not yet added to its total, and their weight:
	 * the kfunc passes add an idle thread's ticks to the hash map of totals every few ticks,
	 * not at each (bpf/wait_sampler.bpf.h). */
	__u32 deferred_ticks;
	__u64 deferred_ns;
	/* The attribution of the last sample (the key of a wait counted without stacks). */
	struct pgscope_attribution attr;
	/* Addresses that do not change once set (see pgscope_off_cpu_task). 0 until known. */
	__u64 status_entry;
	__u64 wait_event_ptr;
	/* The kfunc passes' run that last visited it before their walk (bpf/wait_targets.bpf.c). */
	__u64 visited_run;
	/* The thread as a run's snapshot found it, its sampling instant (bpf/wait_sampler.bpf.h):
	 * the run (0: taken at the visit), its switch count (nvcsw + nivcsw + 1), its wait-event word
	 * (when read), its syscall and state, and enum pgscope_wait_snapshot_flag. */
	__u64 snapshot_run;
	__u64 snapshot_switches;
	__u32 snapshot_wait_event;
	__u32 snapshot_flags;
	__s32 snapshot_syscall;
	__u32 snapshot_task_state;
	/* Its switch count (low half) as a run of the kfunc passes found it off its CPU before it
	 * read its threads' wait-event words and status entries (0: on a CPU then): unchanged at
	 * the snapshot, what was read is the snapshot's (bpf/wait_targets.bpf.c). */
	__u32 batch_switches;
	/* The last wait-event word it showed at one of its snapshots, by the class of the syscall
	 * it was in (enum pgscope_off_cpu_class: futex, latch, io, at 0-2): what a guess takes
	 * (bpf/wait_sampler.bpf.h, guess_wait_event). */
	__u32 class_words[3];
};

_Static_assert(sizeof(struct pgscope_wait_sample_task) == 128, "task storage: its size is the kernel's allocation per thread");

/* pgscope_wait_sample_task.snapshot_flags */
enum pgscope_wait_snapshot_flag {
	PGSCOPE_WAIT_SNAPSHOT_ON_CPU = 1, /* on a CPU, or displaced by the run: the perf-event sampler's */
	PGSCOPE_WAIT_SNAPSHOT_WORD = 2,	  /* snapshot_wait_event was read before the thread ran again */
	PGSCOPE_WAIT_SNAPSHOT_STACK = 4,  /* its stack was copied before it ran again, into the run's early
					     slot (snapshot_flags >> PGSCOPE_WAIT_SNAPSHOT_SLOT_SHIFT) */
};
#define PGSCOPE_WAIT_SNAPSHOT_SLOT_SHIFT 8

/* pgscope_wait_sample_task.kind */
enum pgscope_wait_sample_kind {
	PGSCOPE_WAIT_SAMPLE_NONE = 0,	  /* nothing to repeat */
	PGSCOPE_WAIT_SAMPLE_STACKS = 1,	  /* sent with stacks: repeat with a pgscope_wait_repeat */
	PGSCOPE_WAIT_SAMPLE_NO_STACK = 2, /* counted without stacks: add to the same total */
	PGSCOPE_WAIT_SAMPLE_PENDING = 3,  /* seen waiting by a run's first pass: its second copies the stack */
};

/* One on-CPU sample, or one off-CPU wait (off_cpu_class != 0) with its blocked time; an off-CPU
 * record's attribution is the one in force when the process blocked, its stacks are those it
 * blocked in (a blocked task's stacks do not change; they are taken when it resumes). Only the
 * used prefix of user_stack is sent through the ring buffer: the record length is
 * offsetof(user_stack) + user_stack_len. */
struct pgscope_sample {
	__u32 tgid;		/* process (backend) id */
	__u32 tid;
	__u64 time_ns;		/* bpf_ktime_get_ns() */
	__u32 cpu;
	__u32 kernel_frames;	/* valid entries in kernel_stack */
	__u64 user_ip;		/* user registers at sample time (the syscall entry when in kernel) */
	__u64 user_sp;
	__u64 user_bp;
	__u64 user_stack_len;	/* bytes valid in user_stack, copied from user_sp upwards */
	struct pgscope_attribution attr;
	__u64 off_cpu_ns;	/* off-CPU records: how long the process was off CPU */
	__u32 off_cpu_syscall;	/* off-CPU records: the syscall it blocked in (x86-64 number) */
	__u32 off_cpu_flags;	/* enum pgscope_off_cpu_flags */
	/* On-CPU samples of a backend: its statement's st_activity_start_timestamp, so that user
	 * space can give a sample taken before the queryid was reported (parsing, analysis) the
	 * queryid the same statement reports later; else 0. */
	__u64 statement_start;
	/* On-CPU samples of a backend running a trigger of its statement: the innermost one's
	 * pg_trigger.oid and pg_constraint.oid (0 if none); else both 0. */
	__u32 trigger_oid;
	__u32 trigger_constraint;
	__u64 kernel_stack[PGSCOPE_KERNEL_FRAMES_MAX]; /* leaf first */
	__u8 user_stack[PGSCOPE_USER_STACK_MAX];
};

#define PGSCOPE_SAMPLE_HEADER_SIZE 120
#define PGSCOPE_SAMPLE_STACK_OFFSET (PGSCOPE_SAMPLE_HEADER_SIZE + 8 * PGSCOPE_KERNEL_FRAMES_MAX)

_Static_assert(__builtin_offsetof(struct pgscope_sample, kernel_stack) == PGSCOPE_SAMPLE_HEADER_SIZE,
	       "read by agent/src/bpf/abi.rs");
_Static_assert(__builtin_offsetof(struct pgscope_sample, user_stack) == PGSCOPE_SAMPLE_STACK_OFFSET,
	       "read by agent/src/bpf/abi.rs");
_Static_assert(sizeof(struct pgscope_sample) == PGSCOPE_SAMPLE_STACK_OFFSET + PGSCOPE_USER_STACK_MAX,
	       "read by agent/src/bpf/abi.rs");

#endif /* PGSCOPE_H */
