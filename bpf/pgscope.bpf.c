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

/* Reads what pg_stat_activity shows for a backend, from its own memory. Each read is one
 * bpf_probe_read_user of a word: globals and the shared-memory status entry are resident in any
 * running backend. A fault leaves the field out (its flag unset) and is counted.
 *
 * With `task` (the thread's off-CPU record, whose attribution `a` is; switches happen tens of
 * thousands of times a second) what does not change once set is read once per thread: backend
 * type, database, and the addresses of the status entry and of the wait-event word. That
 * leaves three reads per switch (state, queryid, wait event). Zero values are not kept: a
 * backend still starting has not set them yet. */
#define PG_WAIT_CLIENT_READ 0x06000000 /* WAIT_EVENT_CLIENT_READ, stable since PG 10 */
#define PG_WAIT_CLASS_MASK 0xFF000000
#define PG_WAIT_ACTIVITY 0x05000000    /* a background process idle in its main loop */
#define PG_STATE_IDLE 1		       /* STATE_IDLE of BackendState */

/* The fast path of read_attribution for a thread whose unchanging fields and addresses are all
 * known: the words that change, no map lookup, and for a latch wait that turns out idle only
 * what tells it is (a backend between statements switches once per statement: the idle wait
 * is the common case, and its queryid is not used). False when something is not known yet. */
static __always_inline bool read_cached_attribution(struct pgscope_attribution *a,
						    struct pgscope_off_cpu_task *task, bool latch)
{
	__u32 known = PGSCOPE_ATTR_BACKEND_TYPE | PGSCOPE_ATTR_DATABASE;

	if (!task->status_entry || !task->wait_event_ptr || !task->st_state_offset ||
	    (a->flags & known) != known || !a->backend_type || !a->database_id)
		return false;
	__u32 flags = known;
	a->query_id = 0;
	a->wait_event_info = 0;
	a->backend_state = 0;
	a->off_cpu_class = PGSCOPE_OFF_CPU_NONE;
	if (bpf_probe_read_user(&a->wait_event_info, 4, (void *)task->wait_event_ptr) == 0)
		flags |= PGSCOPE_ATTR_WAIT_EVENT;
	bool main_loop = (a->wait_event_info & PG_WAIT_CLASS_MASK) == PG_WAIT_ACTIVITY;
	if (latch && main_loop && (flags & PGSCOPE_ATTR_WAIT_EVENT)) {
		a->flags = flags;
		return true;
	}
	if (bpf_probe_read_user(&a->backend_state, 4, (void *)(task->status_entry + task->st_state_offset)) == 0) {
		bool idle = latch && a->wait_event_info == PG_WAIT_CLIENT_READ && a->backend_state == PG_STATE_IDLE;
		if (idle || !task->st_query_id_offset ||
		    bpf_probe_read_user(&a->query_id, 8, (void *)(task->status_entry + task->st_query_id_offset)) == 0)
			flags |= PGSCOPE_ATTR_STATUS;
	}
	if (flags != (known | PGSCOPE_ATTR_STATUS | PGSCOPE_ATTR_WAIT_EVENT))
		count(PGSCOPE_CNT_ATTRIBUTION_FAULT);
	a->flags = flags;
	return true;
}

static __always_inline void read_attribution(struct pgscope_attribution *a, __u32 tgid,
					     struct pgscope_off_cpu_task *task, bool latch)
{
	if (task && read_cached_attribution(a, task, latch))
		return;
	struct pgscope_pg_layout *layout = bpf_map_lookup_elem(&pg_layouts, &tgid);
	__u32 kept = task ? a->flags : 0;
	__u32 flags = 0;
	int faults = 0;

	a->query_id = 0;
	a->wait_event_info = 0;
	a->backend_state = 0;
	a->off_cpu_class = PGSCOPE_OFF_CPU_NONE;
	if (!(kept & PGSCOPE_ATTR_BACKEND_TYPE) || !a->backend_type)
		a->backend_type = 0;
	if (!(kept & PGSCOPE_ATTR_DATABASE) || !a->database_id)
		a->database_id = 0;
	if (!layout) {
		a->flags = 0;
		return;
	}

	if (a->backend_type) {
		flags |= PGSCOPE_ATTR_BACKEND_TYPE;
	} else if (layout->my_backend_type) {
		if (bpf_probe_read_user(&a->backend_type, 4, (void *)layout->my_backend_type) == 0)
			flags |= PGSCOPE_ATTR_BACKEND_TYPE;
		else
			faults++;
	}
	if (a->database_id) {
		flags |= PGSCOPE_ATTR_DATABASE;
	} else if (layout->my_database_id) {
		if (bpf_probe_read_user(&a->database_id, 4, (void *)layout->my_database_id) == 0)
			flags |= PGSCOPE_ATTR_DATABASE;
		else
			faults++;
	}

	__u64 entry = task ? task->status_entry : 0;
	if (!entry && layout->my_be_entry) {
		entry = status_entry(layout);
		if (entry == STATUS_UNREADABLE) {
			faults++;
			entry = 0;
		} else if (task) {
			task->status_entry = entry;
		}
	}
	if (entry) {
		if (bpf_probe_read_user(&a->backend_state, 4, (void *)(entry + layout->st_state_offset)) == 0 &&
		    read_query_id(layout, entry, &a->query_id) == 0)
			flags |= PGSCOPE_ATTR_STATUS;
		else
			faults++;
	}

	__u64 wait_ptr = task ? task->wait_event_ptr : 0;
	if (!wait_ptr && layout->my_wait_event_info) {
		if (bpf_probe_read_user(&wait_ptr, 8, (void *)layout->my_wait_event_info) != 0)
			wait_ptr = 0;
		/* With a status entry the backend has its PGPROC: my_wait_event_info points into it
		 * for the rest of the backend's life. */
		else if (task && entry)
			task->wait_event_ptr = wait_ptr;
		if (!wait_ptr)
			faults++;
	}
	if (wait_ptr) {
		if (bpf_probe_read_user(&a->wait_event_info, 4, (void *)wait_ptr) == 0)
			flags |= PGSCOPE_ATTR_WAIT_EVENT;
		else
			faults++;
	}
	a->flags = flags;
	if (faults)
		count(PGSCOPE_CNT_ATTRIBUTION_FAULT);
	if (task && task->status_entry && task->wait_event_ptr) {
		task->st_state_offset = layout->st_state_offset;
		task->st_query_id_offset = layout->st_query_id_offset;
	}
}

/* Fills in the current task's identity, kernel stack, user registers and user stack copy, and
 * sends the record (false: the ring buffer was full). The attribution fields are the caller's. */
static __always_inline bool send_stacks(void *ctx, struct pgscope_sample *s, __u64 pid_tgid, bool kernel)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);

	s->tgid = pid_tgid >> 32;
	s->tid = (__u32)pid_tgid;
	s->time_ns = bpf_ktime_get_ns();
	s->cpu = bpf_get_smp_processor_id();
	/* pt_regs of the task are its user registers even when the sample hit in the kernel. */
	s->user_ip = BPF_CORE_READ(regs, ip);
	s->user_sp = BPF_CORE_READ(regs, sp);
	s->user_bp = BPF_CORE_READ(regs, bp);

	long kernel_bytes = 0;
	if (kernel) {
		kernel_bytes = bpf_get_stack(ctx, s->kernel_stack, sizeof(s->kernel_stack), 0);
		if (kernel_bytes < 0) {
			count(PGSCOPE_CNT_KERNEL_STACK_FAULT);
			kernel_bytes = 0;
		}
	}
	s->kernel_frames = kernel_bytes / 8;

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
	if (bpf_ringbuf_output(&samples, s, size, 0)) {
		count(PGSCOPE_CNT_RINGBUF_FULL);
		return false;
	}
	count(PGSCOPE_CNT_SENT);
	return true;
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

	read_attribution(&s->attr, tgid, NULL, false);
	s->off_cpu_ns = 0;
	s->off_cpu_syscall = 0;
	s->off_cpu_flags = 0;
	send_stacks(ctx, s, pid_tgid, true);
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
	/* Its off-CPU state is decided again at its next switch (no longer a target). */
	bpf_task_storage_delete(&off_cpu_tasks, bpf_get_current_task_btf());
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

/* Per attachment of a function probe (the upper half of its cookie; 0: ungated): 1 while user
 * space counts the probe as attached. Returns are not counted while it is 0. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} function_gates SEC(".maps");

/* Entries per function, for the duty cycle's hit-rate measurement (user space reads deltas). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PGSCOPE_FN_MAX);
	__type(key, __u32);
	__type(value, __u64);
} function_hits SEC(".maps");

/* Entries per function by processes that are not targets. A uprobe is set on the file, so every
 * process mapping it (other instances of the same binary, tools linking the library) traps too:
 * the overhead budget counts these traps alongside the targets'. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PGSCOPE_FN_MAX);
	__type(key, __u32);
	__type(value, __u64);
} foreign_function_hits SEC(".maps");

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
	__u32 function = (__u32)bpf_get_attach_cookie(ctx);
	__u64 *hits;

	if (!flags || !(*flags & PGSCOPE_TARGET_PROFILE)) {
		hits = bpf_map_lookup_elem(&foreign_function_hits, &function);
		if (hits)
			*hits += 1;
		return 0;
	}
	hits = bpf_map_lookup_elem(&function_hits, &function);
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
	__u64 cookie = bpf_get_attach_cookie(ctx);
	__u32 function = (__u32)cookie;
	__u32 gate = cookie >> 32;
	__u64 key = (pid_tgid << 32) | function;
	struct call_entry *entry = bpf_map_lookup_elem(&calls_in_flight, &key);

	if (!entry) {
		/* Not a target, or its entry came before the probe was attached. */
		if (bpf_map_lookup_elem(&targets, &tgid))
			count(PGSCOPE_CNT_PROBE_NO_ENTRY);
		return 0;
	}
	if (gate) {
		__u32 *open = bpf_map_lookup_elem(&function_gates, &gate);
		if (!open || !*open) {
			/* Being detached: user space counts this time as detached already. */
			bpf_map_delete_elem(&calls_in_flight, &key);
			return 0;
		}
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

/*
 * Off-CPU time of Postgres processes, from sched_switch alone. When a target task is switched
 * out (the tracepoint runs in its context) the time, the reason and what pg_stat_activity shows
 * — the wait event in force — are kept in its task storage (not per CPU: it may resume
 * elsewhere). A wait in a blocking syscall that is not idle has its stacks taken right then,
 * rate-limited per CPU: a blocked task's stacks do not change, and no later hook runs in the
 * task's own context except sys_exit, which would run for every syscall on the host. When the
 * task is switched back in the blocked time is known: a wait with its stacks sent gets an end
 * record (or, shorter than the threshold, tells user space to drop them); every other wait —
 * short, preempted, idle, or over the stack rate — adds to exact per-(process, attribution)
 * totals, except one that lasted a second or more: it is sent whole (pgscope_long_wait_end).
 * No kprobe is needed (not every kernel has them); the kernel side of a stack is the syscall.
 */

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct pgscope_off_cpu_key);
	__type(value, struct pgscope_off_cpu_total);
} off_cpu_totals SEC(".maps");

/* Set by user space. Index 0: waits at least this long (ns) keep their stacks. Index 1: stacks
 * taken per second per CPU at most (0: none). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
} off_cpu_config SEC(".maps");

/* Its own record buffer: the on-CPU sampler's could be in use on this CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pgscope_sample);
} off_cpu_scratch SEC(".maps");

/* Per CPU: the stack rate limit's credit (ns of allowance) and when it was last topped up. */
struct stack_credit {
	__u64 credit_ns;
	__u64 last_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct stack_credit);
} off_cpu_stack_credit SEC(".maps");

/* Task states (include/linux/sched.h; #defines, so not in vmlinux.h). */
#define TASK_RUNNING_STATE 0x0000
#define TASK_UNINTERRUPTIBLE_STATE 0x0002
#define TASK_DEAD_STATE 0x0080

/* x86-64 syscall numbers that block for the reasons the classes name. */
static __always_inline __u32 class_of_syscall(long nr, unsigned int state)
{
	switch (nr) {
	case 202: /* futex */
	case 449: /* futex_waitv */
		return PGSCOPE_OFF_CPU_FUTEX;
	case 7:	  /* poll */
	case 23:  /* select */
	case 232: /* epoll_wait */
	case 270: /* pselect6 */
	case 271: /* ppoll */
	case 281: /* epoll_pwait */
	case 441: /* epoll_pwait2 */
		return PGSCOPE_OFF_CPU_LATCH;
	case 0:	  /* read */
	case 1:	  /* write */
	case 17:  /* pread64 */
	case 18:  /* pwrite64 */
	case 19:  /* readv */
	case 20:  /* writev */
	case 74:  /* fsync */
	case 75:  /* fdatasync */
	case 277: /* sync_file_range */
	case 295: /* preadv */
	case 296: /* pwritev */
	case 327: /* preadv2 */
	case 328: /* pwritev2 */
		return PGSCOPE_OFF_CPU_IO;
	}
	/* Uninterruptible sleep outside those (page faults on file mappings, …) is I/O too. */
	return (state & TASK_UNINTERRUPTIBLE_STATE) ? PGSCOPE_OFF_CPU_IO : PGSCOPE_OFF_CPU_OTHER;
}

static __always_inline void add_off_cpu_total(__u32 tgid, struct pgscope_attribution *attr, __u64 ns)
{
	struct pgscope_off_cpu_key key = {
		.tgid = tgid,
		.attr = *attr,
	};
	struct pgscope_off_cpu_total *total = bpf_map_lookup_elem(&off_cpu_totals, &key);

	if (total) {
		total->ns += ns;
		total->waits += 1;
		return;
	}
	struct pgscope_off_cpu_total first = { .ns = ns, .waits = 1 };
	if (bpf_map_update_elem(&off_cpu_totals, &key, &first, BPF_NOEXIST) != 0)
		count(PGSCOPE_CNT_OFF_CPU_MAP_FULL);
}

static __always_inline __u64 off_cpu_setting(__u32 index)
{
	__u64 *value = bpf_map_lookup_elem(&off_cpu_config, &index);
	return value ? *value : 0;
}

/* Whether this CPU may take one more off-CPU stack now: a token bucket of `rate` per second
 * with a tenth of a second's worth of burst. */
static __always_inline bool stack_allowed(__u64 now)
{
	__u64 rate = off_cpu_setting(1);
	__u32 zero = 0;
	struct stack_credit *credit = bpf_map_lookup_elem(&off_cpu_stack_credit, &zero);

	if (!rate || !credit)
		return false;
	__u64 cost = 1000000000ULL / rate;
	__u64 cap = 100000000ULL > cost ? 100000000ULL : cost;
	credit->credit_ns += now - credit->last_ns;
	credit->last_ns = now;
	if (credit->credit_ns > cap)
		credit->credit_ns = cap;
	if (credit->credit_ns < cost)
		return false;
	credit->credit_ns -= cost;
	return true;
}

/* Sends prev's stacks now, as the start of a wait whose blocked time follows. */
static __always_inline void send_wait_start(void *ctx, struct pgscope_off_cpu_task *task)
{
	__u32 zero = 0;
	struct pgscope_sample *s = bpf_map_lookup_elem(&off_cpu_scratch, &zero);

	if (!s) {
		count(PGSCOPE_CNT_NO_SCRATCH);
		return;
	}
	s->attr = task->attr;
	s->off_cpu_ns = 0;
	s->off_cpu_syscall = task->syscall;
	s->off_cpu_flags = PGSCOPE_OFF_CPU_PENDING;
	if (send_stacks(ctx, s, bpf_get_current_pid_tgid(), false)) {
		task->start_ns = s->time_ns;
		task->stack_start_ns = s->time_ns;
		count(PGSCOPE_CNT_OFF_CPU_STACKS);
	}
}

/* The task storage of a thread that is a measured target, deciding it again when the target
 * set changed since. */
static __always_inline struct pgscope_off_cpu_task *measured_task(struct task_struct *prev)
{
	struct pgscope_off_cpu_task *task =
		bpf_task_storage_get(&off_cpu_tasks, prev, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	__u32 zero = 0;
	__u32 *generation = bpf_map_lookup_elem(&targets_generation, &zero);

	if (!task || !generation)
		return NULL;
	/* Generation 0 is never current: a fresh storage is always decided. */
	if (task->generation != *generation + 1) {
		__u32 tgid = BPF_CORE_READ(prev, tgid);
		__u8 *flags = bpf_map_lookup_elem(&targets, &tgid);
		task->measured = flags && (*flags & PGSCOPE_TARGET_OFF_CPU);
		task->tgid = tgid;
		task->generation = *generation + 1;
		if (!task->measured)
			task->start_ns = 0;
	}
	return task->measured ? task : NULL;
}

/* prev is switched out, in its own context: remember when, why and in which wait, and take its
 * stacks now if the wait may be long. */
static __always_inline void switch_out(void *ctx, struct task_struct *prev, bool preempt, unsigned int prev_state)
{
	/* An exiting task's last switch: it never comes back. */
	if (prev_state & TASK_DEAD_STATE)
		return;
	struct pgscope_off_cpu_task *task = measured_task(prev);
	if (!task)
		return;
	/* A BTF pointer: a direct load, no probe-read helper. */
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(prev);
	long syscall = regs->orig_ax;
	__u32 class = (preempt || prev_state == TASK_RUNNING_STATE) ? PGSCOPE_OFF_CPU_PREEMPTED
								     : class_of_syscall(syscall, prev_state);

	read_attribution(&task->attr, task->tgid, task, class == PGSCOPE_OFF_CPU_LATCH);
	task->attr.off_cpu_class = class;
	/* Waiting for work, not in it: a backend between statements (pg_stat_activity's idle,
	 * ClientRead), a background process in its main loop (wait events of class Activity). */
	bool waits_for_client = task->attr.wait_event_info == PG_WAIT_CLIENT_READ &&
				task->attr.backend_state == PG_STATE_IDLE && (task->attr.flags & PGSCOPE_ATTR_STATUS);
	bool main_loop = (task->attr.wait_event_info & PG_WAIT_CLASS_MASK) == PG_WAIT_ACTIVITY;
	if (task->attr.off_cpu_class == PGSCOPE_OFF_CPU_LATCH && (waits_for_client || main_loop))
		task->attr.off_cpu_class = PGSCOPE_OFF_CPU_IDLE;
	task->syscall = syscall < 0 ? (__u32)-1 : (__u32)syscall;
	task->stack_start_ns = 0;
	__u64 now = bpf_ktime_get_ns();
	task->start_ns = now;

	/* Only waits inside a syscall get a stack; idle waits and preemptions never do, nor waits
	 * for the client inside a transaction: their stack is always the same read from the
	 * socket, and under a busy transactional workload they would take the stack rate from
	 * the lock and I/O waits that need it. */
	class = task->attr.off_cpu_class;
	bool client_wait = (task->attr.wait_event_info & PG_WAIT_CLASS_MASK) == (PG_WAIT_CLIENT_READ & PG_WAIT_CLASS_MASK);
	if (syscall < 0 || class == PGSCOPE_OFF_CPU_IDLE || class == PGSCOPE_OFF_CPU_PREEMPTED || client_wait)
		return;
	if (stack_allowed(now))
		send_wait_start(ctx, task);
	/* Over the rate (or the ring buffer full): if it turns out long, it is counted as a wait
	 * that should have had a stack (switch_in drops the mark for a short one). */
	if (!task->stack_start_ns)
		task->attr.flags |= PGSCOPE_ATTR_STACK_NOT_SAMPLED;
}

/* next is switched in (still in prev's context): its blocked time is known now. */
static __always_inline void switch_in(struct task_struct *next)
{
	struct pgscope_off_cpu_task *task = bpf_task_storage_get(&off_cpu_tasks, next, 0, 0);

	if (!task || !task->start_ns)
		return;
	__u64 now = bpf_ktime_get_ns();
	__u64 blocked = now > task->start_ns ? now - task->start_ns : 0;
	__u64 min_stack_ns = off_cpu_setting(0);
	bool stack_sent = task->stack_start_ns && task->stack_start_ns == task->start_ns;
	__u64 start_ns = task->start_ns;
	task->start_ns = 0;
	task->stack_start_ns = 0;

	bool long_wait = blocked >= min_stack_ns;
	if (stack_sent) {
		struct pgscope_wait_end end = {
			.tgid = task->tgid,
			.tid = next->pid,
			.start_ns = start_ns,
			.blocked_ns = long_wait ? blocked : 0,
			.magic = PGSCOPE_WAIT_END_MAGIC,
		};
		if (bpf_ringbuf_output(&samples, &end, sizeof(end), 0) == 0) {
			if (!long_wait)
				add_off_cpu_total(task->tgid, &task->attr, blocked);
			return;
		}
		/* The time is not lost with the record: it goes to the totals. */
		count(PGSCOPE_CNT_RINGBUF_FULL);
	}
	if (!long_wait)
		task->attr.flags &= ~PGSCOPE_ATTR_STACK_NOT_SAMPLED;
	if (blocked >= PGSCOPE_OFF_CPU_LONG_NS) {
		struct pgscope_long_wait_end end = {
			.tgid = task->tgid,
			.tid = next->pid,
			.start_ns = start_ns,
			.blocked_ns = blocked,
			.attr = task->attr,
			.magic = PGSCOPE_LONG_WAIT_END_MAGIC,
		};
		if (bpf_ringbuf_output(&samples, &end, sizeof(end), 0) == 0)
			return;
		/* The time is not lost with the record: it goes to the totals. */
		count(PGSCOPE_CNT_RINGBUF_FULL);
	}
	add_off_cpu_total(task->tgid, &task->attr, blocked);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(on_switch, bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	switch_out(ctx, prev, preempt, prev_state);
	switch_in(next);
	return 0;
}
