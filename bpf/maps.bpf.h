// SPDX-License-Identifier: GPL-2.0
/*
 * The maps every program family shares (targets, layouts, the record ring buffer and its
 * scratch, counters, off-CPU task state), and the counter helper.
 *
 * A part of the one BPF object: agent/build.rs includes the parts in the order of its
 * BPF_PARTS list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h, so that
 * every program shares the maps. Not compiled on its own.
 */

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PGSCOPE_MAX_TARGETS);
	__type(key, __u32);  /* tgid */
	__type(value, __u8); /* enum pgscope_target_flags */
} targets SEC(".maps");

/* Whether process `tgid` is profiled: in `targets`, flagged for it (not only followed). */
static __always_inline bool profiled(__u32 tgid)
{
	__u8 *flags = bpf_map_lookup_elem(&targets, &tgid);
	return flags && (*flags & PGSCOPE_TARGET_PROFILE);
}

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 8 << 20);
} samples SEC(".maps");

/* Attribution layout per process: set by user space for processes it found, inherited on fork. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PGSCOPE_MAX_TARGETS);
	__type(key, __u32); /* tgid */
	__type(value, struct pgscope_pg_layout);
} pg_layouts SEC(".maps");

/* A record buffer: a sample (its PGSCOPE_USER_STACK_MAX bytes of user stack and more) is too
 * large for the 512-byte BPF stack and for a per-CPU map's value (32 KiB at most), so each
 * buffer is an array with one entry per possible CPU
 * (the loader sets max_entries), taken by the running CPU: BPF programs run with migration
 * disabled, as they would use a per-CPU map's slot. */
#define PGSCOPE_RECORD_BUFFERS(name)                                                                       \
	struct {                                                                                           \
		__uint(type, BPF_MAP_TYPE_ARRAY);                                                          \
		__uint(max_entries, 1);                                                                    \
		__type(key, __u32);                                                                        \
		__type(value, struct pgscope_sample);                                                      \
	} name SEC(".maps")

/* This CPU's buffer of `buffers`, one of the PGSCOPE_RECORD_BUFFERS maps. */
static __always_inline struct pgscope_sample *this_cpu_buffer(void *buffers)
{
	__u32 cpu = bpf_get_smp_processor_id();
	return bpf_map_lookup_elem(buffers, &cpu);
}

/* The on-CPU sampler's. */
PGSCOPE_RECORD_BUFFERS(scratch);

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PGSCOPE_CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/* Off-CPU state per thread (see the off-CPU programs at the end). Task storage lives in the
 * task itself: reaching it from sched_switch's task pointers costs no hash lookup, which on
 * every context switch of the host is most of what off-CPU profiling costs. */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct pgscope_off_cpu_task);
} off_cpu_tasks SEC(".maps");

/* Index 0: bumped by user space whenever it adds or removes a target: a thread's cached
 * `measured` is decided again. (Forks need no bump: a child's storage starts fresh; a target
 * that execs drops its storage in on_process_exec.) User space is its only writer. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} targets_generation SEC(".maps");

/* The statement pg_stat_statements is storing, by thread, while pgss_store's text-only store
 * (made from post_parse_analyze) runs with its probe attached: its queryId argument, and the statement's start as the backend's status showed it at
 * the call. Before parse analysis reports the queryid, the status reads 0, yet pgss_store's
 * first store of a new statement (where its evictions happen) is that statement's work: an
 * on-CPU sample of the same statement inside the call takes the queryid from here. The start
 * keeps a slot left by a missed return (probe detached mid-call) from naming a later
 * statement. Written and removed by the function probes, dropped at thread exit. */
struct pgss_storing {
	__u64 query_id;
	__u64 statement_start;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32); /* tid */
	__type(value, struct pgss_storing);
} pgss_storing SEC(".maps");

/* The triggers each thread runs (see pgscope_trigger_stack): written by the trigger probes,
 * read by on-CPU samples, dropped at thread exit. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32); /* tid */
	__type(value, struct pgscope_trigger_stack);
} trigger_stacks SEC(".maps");

static __always_inline void count(__u32 counter)
{
	__u64 *value = bpf_map_lookup_elem(&counters, &counter);
	if (value)
		*value += 1;
}

/* Adds `ns` over `waits` waits to `key`'s row of a per-CPU hash map of off-CPU totals
 * (off_cpu_totals, wait_sample_totals, exact_at_runs: one layout); a full map is counted. */
static __always_inline void add_to_totals(void *totals, struct pgscope_off_cpu_key *key, __u64 ns, __u64 waits)
{
	struct pgscope_off_cpu_total *total = bpf_map_lookup_elem(totals, key);

	if (total) {
		total->ns += ns;
		total->waits += waits;
		return;
	}
	struct pgscope_off_cpu_total first = { .ns = ns, .waits = waits };
	if (bpf_map_update_elem(totals, key, &first, BPF_NOEXIST) != 0)
		count(PGSCOPE_CNT_OFF_CPU_MAP_FULL);
}
