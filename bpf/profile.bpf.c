// SPDX-License-Identifier: GPL-2.0
/*
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
		__u64 entry = 0;
		if (bpf_probe_read_user(&entry, 8, (void *)layout->my_be_entry) != 0) {
			faults++;
		} else if (entry) {
			/* Postmaster and some auxiliary processes have no status entry (NULL). */
			if (bpf_probe_read_user(&s->backend_state, 4, (void *)(entry + layout->st_state_offset)) == 0 &&
			    (!layout->st_query_id_offset ||
			     bpf_probe_read_user(&s->query_id, 8, (void *)(entry + layout->st_query_id_offset)) == 0))
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

	__u64 len = copy_user_stack(s, task);
	s->user_stack_len = len;

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

/* Keep the filter map to live processes: a recycled PID must not be profiled by accident. */
SEC("tracepoint/sched/sched_process_exit")
int on_process_exit(void *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;

	if ((__u32)pid_tgid == tgid) {
		bpf_map_delete_elem(&targets, &tgid);
		bpf_map_delete_elem(&pg_layouts, &tgid);
	}
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
