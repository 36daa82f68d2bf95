// SPDX-License-Identifier: GPL-2.0
/*
 * Off-CPU time from sched_switch: how it is measured is said below.
 *
 * A part of the one BPF object: agent/build.rs includes the parts in the order of its
 * BPF_PARTS list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h, so that
 * every program shares the maps. Not compiled on its own.
 */

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

/* Its own record buffers: the on-CPU sampler's could be in use on this CPU. */
PGSCOPE_RECORD_BUFFERS(off_cpu_scratch);

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

static __always_inline void add_off_cpu_total(__u32 tgid, struct pgscope_attribution *attr, __u64 ns)
{
	struct pgscope_off_cpu_key key = {
		.tgid = tgid,
		.attr = *attr,
	};
	add_to_totals(&off_cpu_totals, &key, ns, 1);
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
	struct pgscope_sample *s = this_cpu_buffer(&off_cpu_scratch);

	if (!s) {
		count(PGSCOPE_CNT_NO_SCRATCH);
		return;
	}
	s->attr = task->attr;
	s->off_cpu_ns = 0;
	s->off_cpu_syscall = task->syscall;
	s->off_cpu_flags = PGSCOPE_OFF_CPU_PENDING;
	s->statement_start = 0;
	s->trigger_oid = 0;
	s->trigger_constraint = 0;
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
static __always_inline void switch_out(void *ctx, struct task_struct *prev, struct task_struct *next, bool preempt,
				       unsigned int prev_state)
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

	read_attribution(&task->attr, task->tgid, task, class == PGSCOPE_OFF_CPU_LATCH, NULL);
	task->attr.off_cpu_class = class;
	/* Waiting for work, not in it: a backend between statements (pg_stat_activity's idle,
	 * ClientRead), a background process in its main loop (wait events of class Activity). */
	bool waits_for_client = (task->attr.flags & PGSCOPE_ATTR_STATUS) &&
				idle_for_client(task, task->attr.wait_event_info, task->attr.backend_state);
	bool main_loop = (task->attr.wait_event_info & PG_WAIT_CLASS_MASK) == PG_WAIT_ACTIVITY;
	if (task->attr.off_cpu_class == PGSCOPE_OFF_CPU_LATCH && (waits_for_client || main_loop))
		task->attr.off_cpu_class = PGSCOPE_OFF_CPU_IDLE;
	task->syscall = syscall < 0 ? (__u32)-1 : (__u32)syscall;
	task->stack_start_ns = 0;
	/* Under --off-cpu=both: the wait sampler's runs tell their own doing from the waits they
	 * sample (count_exact_at_run). */
	__u64 sampler = wait_config(WAIT_CONFIG_SAMPLER_TID);
	task->displaced = sampler && next->pid == sampler;
	__u64 now = bpf_ktime_get_ns();
	task->start_ns = now;

	/* Only waits inside a syscall get a stack; idle waits and preemptions never do, nor waits
	 * for the client inside a transaction: their stack is always the same read from the
	 * socket, and under a busy transactional workload they would take the stack rate from
	 * the lock and I/O waits that need it. */
	class = task->attr.off_cpu_class;
	bool client_wait = (task->attr.wait_event_info & PG_WAIT_CLASS_MASK) == PG_WAIT_CLIENT;
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
	switch_out(ctx, prev, next, preempt, prev_state);
	switch_in(next);
	return 0;
}
