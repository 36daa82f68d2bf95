// SPDX-License-Identifier: GPL-2.0
/*
 * Every BPF program of pgscope, in one object so that they share the target and layout maps.
 *
 * On-CPU sampling of Postgres processes: a perf-event program on the CPU clock of every CPU,
 * filtered to the processes in `targets`, that sends the kernel stack, the user registers and a
 * bounded copy of the user stack. User space unwinds the copy from .eh_frame, so stacks are right
 * through code built without frame pointers (glibc, RHEL-style Postgres builds).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "pgscope.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PGSCOPE_MAX_TARGETS);
	__type(key, __u32);  /* tgid */
	__type(value, __u8); /* enum pgscope_target_flags */
} targets SEC(".maps");

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

/* A sample is 17 KiB: too large for the 512-byte BPF stack, so it is built here. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pgscope_sample);
} scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PGSCOPE_CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

static __always_inline void count(__u32 counter)
{
	__u64 *value = bpf_map_lookup_elem(&counters, &counter);
	if (value)
		*value += 1;
}

/* Copies the user stack from sp upwards. mm->start_stack bounds the main thread's stack (every
 * Postgres process is single-threaded); bpf_probe_read_user cannot fault pages in and zero-fills
 * on failure, so on a fault fall back to the rest of sp's page, which the CPU just touched. */
static __always_inline __u64 copy_user_stack(struct pgscope_sample *s, struct task_struct *task)
{
	__u64 sp = s->user_sp;
	__u64 top = BPF_CORE_READ(task, mm, start_stack);
	__u64 len = PGSCOPE_USER_STACK_MAX;

	if (top > sp && top - sp < len)
		len = top - sp;
	if (len > PGSCOPE_USER_STACK_MAX)
		len = PGSCOPE_USER_STACK_MAX;
	if (len && bpf_probe_read_user(s->user_stack, len, (void *)sp) == 0)
		return len;

	count(PGSCOPE_CNT_USER_STACK_FAULT);
	len = 4096 - (sp & 4095);
	if (len > PGSCOPE_USER_STACK_MAX)
		len = PGSCOPE_USER_STACK_MAX;
	if (len && bpf_probe_read_user(s->user_stack, len, (void *)sp) == 0)
		return len;
	count(PGSCOPE_CNT_USER_STACK_LOST);
	return 0;
}

/* Return instances of in-flight uretprobes patched back per sample, a bounded loop (deeper nesting is rare:
 * one per probed function active in the thread). */
#define MAX_URETPROBE_FRAMES 8

/* A uretprobe replaces the return address of the probed call on the user stack with the
 * [uprobes] trampoline, which has no unwind information: stacks through a probed function in
 * flight would end there. The kernel keeps the original address and the stack slot it took it
 * from in task->utask->return_instances (innermost first); put them back into the copy. */
static __always_inline void restore_uretprobe_returns(struct pgscope_sample *s, struct task_struct *task, __u64 len)
{
	struct uprobe_task *utask = BPF_CORE_READ(task, utask);
	if (!utask)
		return;
	struct return_instance *ri = BPF_CORE_READ(utask, return_instances);

	for (int i = 0; i < MAX_URETPROBE_FRAMES && ri; i++) {
		__u64 slot = BPF_CORE_READ(ri, stack);
		__u64 original = BPF_CORE_READ(ri, orig_ret_vaddr);
		if (slot >= s->user_sp && slot + 8 <= s->user_sp + len) {
			__u64 offset = slot - s->user_sp;
			if (offset <= PGSCOPE_USER_STACK_MAX - 8)
				__builtin_memcpy(&s->user_stack[offset], &original, 8);
		}
		ri = BPF_CORE_READ(ri, next);
	}
}

#define STATUS_UNREADABLE ((__u64)-1)

/* MyBEEntry: the backend's PgBackendStatus; 0 for processes without one (the postmaster). */
static __always_inline __u64 status_entry(struct pgscope_pg_layout *layout)
{
	__u64 entry = 0;

	if (bpf_probe_read_user(&entry, 8, (void *)layout->my_be_entry) != 0)
		return STATUS_UNREADABLE;
	return entry;
}

static __always_inline long read_query_id(struct pgscope_pg_layout *layout, __u64 entry, __u64 *query_id)
{
	if (!layout->st_query_id_offset)
		return 0;
	return bpf_probe_read_user(query_id, 8, (void *)(entry + layout->st_query_id_offset));
}

/* Reads what pg_stat_activity shows for the sampled backend, from the backend's own memory.
 * Each read is one bpf_probe_read_user of a word: globals and the shared-memory status entry are
 * resident in any running backend. A fault leaves the field out (its flag unset) and is counted. */
static __always_inline void read_attribution(struct pgscope_sample *s, __u32 tgid)
{
	struct pgscope_pg_layout *layout = bpf_map_lookup_elem(&pg_layouts, &tgid);
	__u32 flags = 0;
	int faults = 0;

	s->query_id = 0;
	s->wait_event_info = 0;
	s->backend_type = 0;
	s->database_id = 0;
	s->backend_state = 0;
	s->attribution = 0;
	if (!layout)
		return;

	if (layout->my_backend_type) {
		if (bpf_probe_read_user(&s->backend_type, 4, (void *)layout->my_backend_type) == 0)
			flags |= PGSCOPE_ATTR_BACKEND_TYPE;
		else
			faults++;
	}
	if (layout->my_database_id) {
		if (bpf_probe_read_user(&s->database_id, 4, (void *)layout->my_database_id) == 0)
			flags |= PGSCOPE_ATTR_DATABASE;
		else
			faults++;
	}
	if (layout->my_be_entry) {
		__u64 entry = status_entry(layout);
		if (entry == STATUS_UNREADABLE) {
			faults++;
		} else if (entry) {
			if (bpf_probe_read_user(&s->backend_state, 4, (void *)(entry + layout->st_state_offset)) == 0 &&
			    read_query_id(layout, entry, &s->query_id) == 0)
				flags |= PGSCOPE_ATTR_STATUS;
			else
				faults++;
		}
	}
	if (layout->my_wait_event_info) {
		__u64 wait_ptr = 0;
		if (bpf_probe_read_user(&wait_ptr, 8, (void *)layout->my_wait_event_info) == 0 && wait_ptr &&
		    bpf_probe_read_user(&s->wait_event_info, 4, (void *)wait_ptr) == 0)
			flags |= PGSCOPE_ATTR_WAIT_EVENT;
		else
			faults++;
	}
	s->attribution = flags;
	if (faults)
		count(PGSCOPE_CNT_ATTRIBUTION_FAULT);
}

SEC("perf_event")
int on_cpu_sample(struct bpf_perf_event_data *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	__u8 *flags = bpf_map_lookup_elem(&targets, &tgid);

	if (!flags || !(*flags & PGSCOPE_TARGET_PROFILE))
		return 0;
	count(PGSCOPE_CNT_SAMPLES);

	__u32 zero = 0;
	struct pgscope_sample *s = bpf_map_lookup_elem(&scratch, &zero);
	if (!s) {
		count(PGSCOPE_CNT_NO_SCRATCH);
		return 0;
	}

	struct task_struct *task = bpf_get_current_task_btf();
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);

	s->tgid = tgid;
	s->tid = (__u32)pid_tgid;
	s->time_ns = bpf_ktime_get_ns();
	s->cpu = bpf_get_smp_processor_id();
	/* pt_regs of the task are its user registers even when the sample hit in the kernel. */
	s->user_ip = BPF_CORE_READ(regs, ip);
	s->user_sp = BPF_CORE_READ(regs, sp);
	s->user_bp = BPF_CORE_READ(regs, bp);

	long kernel_bytes = bpf_get_stack(ctx, s->kernel_stack, sizeof(s->kernel_stack), 0);
	if (kernel_bytes < 0) {
		count(PGSCOPE_CNT_KERNEL_STACK_FAULT);
		kernel_bytes = 0;
	}
	s->kernel_frames = kernel_bytes / 8;

	read_attribution(s, tgid);

	/* A thread trapped on a uprobe breakpoint is sampled with its ip one byte past the int3 at
	 * the probed function's entry, where the unwind tables describe a prologue that has not run:
	 * unwind from the breakpoint address itself. Only on the kernel path, where the byte before
	 * ip is the trap instruction and not part of a longer one. */
	if (s->kernel_frames > 0) {
		__u8 opcode = 0;
		if (bpf_probe_read_user(&opcode, 1, (void *)(s->user_ip - 1)) == 0 && opcode == 0xCC)
			s->user_ip -= 1;
	}

	__u64 len = copy_user_stack(s, task);
	s->user_stack_len = len;
	restore_uretprobe_returns(s, task, len);

	__u64 size = PGSCOPE_SAMPLE_STACK_OFFSET + len;
	if (size > sizeof(*s))
		size = sizeof(*s);
	if (bpf_ringbuf_output(&samples, s, size, 0))
		count(PGSCOPE_CNT_RINGBUF_FULL);
	else
		count(PGSCOPE_CNT_SENT);
	return 0;
}

/* Backends, parallel workers and auxiliary processes are forked by the postmaster: a child of a
 * followed process is profiled from its first instruction, with no /proc rescan. */
SEC("tracepoint/sched/sched_process_fork")
int on_fork(struct trace_event_raw_sched_process_fork *ctx)
{
	__u32 parent = bpf_get_current_pid_tgid() >> 32;
	__u8 *flags = bpf_map_lookup_elem(&targets, &parent);

	if (!flags || !(*flags & PGSCOPE_TARGET_FOLLOW_FORKS))
		return 0;
	__u32 child = BPF_CORE_READ(ctx, child_pid);
	__u8 value = *flags;
	if (bpf_map_update_elem(&targets, &child, &value, BPF_NOEXIST) == 0)
		count(PGSCOPE_CNT_FORKS_FOLLOWED);
	else if (!bpf_map_lookup_elem(&targets, &child))
		count(PGSCOPE_CNT_TARGETS_FULL);

	/* A forked child runs the same executable at the same addresses (no exec). */
	struct pgscope_pg_layout *layout = bpf_map_lookup_elem(&pg_layouts, &parent);
	if (layout)
		bpf_map_update_elem(&pg_layouts, &child, layout, BPF_ANY);
	return 0;
}

/* Postgres forks shells for archive_command and friends: after exec the process is no longer
 * Postgres, and the inherited layout would point into another program. */
SEC("tracepoint/sched/sched_process_exec")
int on_process_exec(void *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;

	bpf_map_delete_elem(&targets, &tgid);
	bpf_map_delete_elem(&pg_layouts, &tgid);
	return 0;
}

/*
 * Function probes: uprobe + uretprobe on a handful of Postgres functions, the attach cookie
 * naming the function. Calls, time and a log2 latency histogram are aggregated per CPU per
 * (backend, queryid, function) in the kernel: no event per call crosses to user space.
 */

struct call_entry {
	__u64 start_ns;
	__u64 query_id;
	__u32 detail; /* see PGSCOPE_CALL_DETAIL_SHIFT; s_lock: the call site's line */
	__u32 _pad;
	__u64 file; /* s_lock only: the call site's __FILE__ and __func__ */
	__u64 func;
};

/* In-flight calls by (thread, function). A nested call of the same function in the same thread
 * (rare: planning a query from inside GetCachedPlan) overwrites the outer entry. A return missed
 * (probe detached mid-call) leaves one stale slot per thread and function, which the thread's
 * next call overwrites; slots of exiting threads are removed in on_process_exit. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64); /* tid << 32 | function */
	__type(value, struct call_entry);
} calls_in_flight SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct pgscope_call_key);
	__type(value, struct pgscope_call_stats);
} call_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct pgscope_relation_lock_key);
	__type(value, __u64);
} relation_locks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct pgscope_spin_site_key);
	__type(value, struct pgscope_spin_site_stats);
} spin_sites SEC(".maps");

/* Entries per function, for the duty cycle's hit-rate measurement (user space reads deltas). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PGSCOPE_FN_MAX);
	__type(key, __u32);
	__type(value, __u64);
} function_hits SEC(".maps");

static __always_inline __u64 current_query_id(__u32 tgid)
{
	struct pgscope_pg_layout *layout = bpf_map_lookup_elem(&pg_layouts, &tgid);
	__u64 query_id = 0;

	if (!layout || !layout->my_be_entry)
		return 0;
	__u64 entry = status_entry(layout);
	if (entry && entry != STATUS_UNREADABLE)
		read_query_id(layout, entry, &query_id);
	return query_id;
}

/* floor(log2(v)) for v > 0, without loops (the verifier prefers straight code). */
static __always_inline __u32 log2_u64(__u64 v)
{
	__u32 r = 0;

	if (v >> 32) { v >>= 32; r += 32; }
	if (v >> 16) { v >>= 16; r += 16; }
	if (v >> 8) { v >>= 8; r += 8; }
	if (v >> 4) { v >>= 4; r += 4; }
	if (v >> 2) { v >>= 2; r += 2; }
	if (v >> 1) { r += 1; }
	return r;
}

static __always_inline void count_relation_lock(struct pt_regs *ctx, __u32 tgid, __u64 query_id)
{
	struct pgscope_relation_lock_key key = {
		.tgid = tgid,
		.relid = (__u32)PT_REGS_PARM1(ctx),
		.query_id = query_id,
		.lockmode = (__u32)PT_REGS_PARM2(ctx),
	};
	__u64 one = 1, *value = bpf_map_lookup_elem(&relation_locks, &key);

	if (value)
		*value += 1;
	else if (bpf_map_update_elem(&relation_locks, &key, &one, BPF_NOEXIST) != 0)
		count(PGSCOPE_CNT_PROBE_MAP_FULL);
}

static __always_inline void count_spin_site(__u32 tgid, struct call_entry *entry, __u64 elapsed)
{
	struct pgscope_spin_site_key key = {
		.tgid = tgid,
		.line = entry->detail,
		.query_id = entry->query_id,
		.file = entry->file,
		.func = entry->func,
	};
	struct pgscope_spin_site_stats *stats = bpf_map_lookup_elem(&spin_sites, &key);

	if (!stats) {
		struct pgscope_spin_site_stats first = { .calls = 1, .total_ns = elapsed, .max_ns = elapsed };
		if (bpf_map_update_elem(&spin_sites, &key, &first, BPF_NOEXIST) != 0)
			count(PGSCOPE_CNT_PROBE_MAP_FULL);
		return;
	}
	stats->calls += 1;
	stats->total_ns += elapsed;
	if (elapsed > stats->max_ns)
		stats->max_ns = elapsed;
}

SEC("uprobe")
int on_function_entry(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	__u8 *flags = bpf_map_lookup_elem(&targets, &tgid);

	if (!flags || !(*flags & PGSCOPE_TARGET_PROFILE))
		return 0;
	__u32 function = (__u32)bpf_get_attach_cookie(ctx);
	__u64 *hits = bpf_map_lookup_elem(&function_hits, &function);
	if (hits)
		*hits += 1;
	struct call_entry entry = {};

	if (function == PGSCOPE_FN_PGSS_STORE) {
		/* pgss_store(query, queryId, location, len, kind, …): the queryid it stores is the
		 * statement's own (also for nested statements), the kind tells text/plan/exec apart.
		 * PG14-17 (PG18 changes the queryid's type, not its register). */
		entry.query_id = PT_REGS_PARM2(ctx);
		entry.detail = (__u32)((int)PT_REGS_PARM5(ctx) + 2) & 0xff;
	} else {
		entry.query_id = current_query_id(tgid);
	}
	if (function == PGSCOPE_FN_LOCK_RELATION_OID)
		count_relation_lock(ctx, tgid, entry.query_id);
	if (function == PGSCOPE_FN_S_LOCK) {
		/* s_lock(lock, file, line, func): only the pointers are kept; reading the strings
		 * here would cost every spin. The site goes in the return's key, not the call key,
		 * so that s_lock's own statistics stay one row per queryid. */
		entry.file = PT_REGS_PARM2(ctx);
		entry.detail = (__u32)PT_REGS_PARM3(ctx);
		entry.func = PT_REGS_PARM4(ctx);
	}
	__u64 key = (pid_tgid << 32) | function;
	entry.start_ns = bpf_ktime_get_ns();
	if (bpf_map_update_elem(&calls_in_flight, &key, &entry, BPF_ANY) != 0)
		count(PGSCOPE_CNT_PROBE_MAP_FULL);
	return 0;
}

SEC("uretprobe")
int on_function_return(struct pt_regs *ctx)
{
	__u64 now = bpf_ktime_get_ns();
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	__u32 function = (__u32)bpf_get_attach_cookie(ctx);
	__u64 key = (pid_tgid << 32) | function;
	struct call_entry *entry = bpf_map_lookup_elem(&calls_in_flight, &key);

	if (!entry) {
		/* Not a target, or its entry came before the probe was attached. */
		if (bpf_map_lookup_elem(&targets, &tgid))
			count(PGSCOPE_CNT_PROBE_NO_ENTRY);
		return 0;
	}
	__u64 elapsed = now - entry->start_ns;
	__u32 detail = function == PGSCOPE_FN_S_LOCK ? 0 : entry->detail;
	struct pgscope_call_key stats_key = {
		.tgid = tgid,
		.function = function | (detail << PGSCOPE_CALL_DETAIL_SHIFT),
		.query_id = entry->query_id,
	};
	if (function == PGSCOPE_FN_S_LOCK)
		count_spin_site(tgid, entry, elapsed);
	bpf_map_delete_elem(&calls_in_flight, &key);

	struct pgscope_call_stats *stats = bpf_map_lookup_elem(&call_stats, &stats_key);
	if (!stats) {
		struct pgscope_call_stats zero = {};
		if (bpf_map_update_elem(&call_stats, &stats_key, &zero, BPF_NOEXIST) != 0 &&
		    !bpf_map_lookup_elem(&call_stats, &stats_key)) {
			count(PGSCOPE_CNT_PROBE_MAP_FULL);
			return 0;
		}
		stats = bpf_map_lookup_elem(&call_stats, &stats_key);
		if (!stats)
			return 0;
	}
	__u32 bucket = elapsed ? log2_u64(elapsed) : 0;
	if (bucket >= PGSCOPE_HIST_BUCKETS)
		bucket = PGSCOPE_HIST_BUCKETS - 1;
	stats->calls += 1;
	stats->total_ns += elapsed;
	if (elapsed > stats->max_ns)
		stats->max_ns = elapsed;
	stats->hist[bucket] += 1;
	return 0;
}

/* Keep the filter map to live processes: a recycled PID must not be profiled by accident; and
 * drop the in-flight call slots of every exiting thread of a target. */
SEC("tracepoint/sched/sched_process_exit")
int on_process_exit(void *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;

	if (!bpf_map_lookup_elem(&targets, &tgid))
		return 0;
	for (__u32 function = 0; function < PGSCOPE_FN_MAX; function++) {
		__u64 key = (pid_tgid << 32) | function;
		bpf_map_delete_elem(&calls_in_flight, &key);
	}
	if ((__u32)pid_tgid == tgid) {
		bpf_map_delete_elem(&targets, &tgid);
		bpf_map_delete_elem(&pg_layouts, &tgid);
	}
	return 0;
}

/* Do nothing: `pgscope calibrate` attaches them to measure the floor cost of a probed call (the
 * traps on entry and return), next to what the function probes above cost. */
SEC("uprobe")
int empty_entry(struct pt_regs *ctx)
{
	return 0;
}

SEC("uretprobe")
int empty_return(struct pt_regs *ctx)
{
	return 0;
}
