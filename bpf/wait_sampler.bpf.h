// SPDX-License-Identifier: GPL-2.0
/*
 * Sampled off-CPU time: what a run of the wait sampler, once per profiling tick, does for one
 * thread of a target, and its maps. Two ways reach the threads: the kfunc passes visit the
 * targets' threads alone (wait_targets.bpf.c, Linux 6.7), task iterators every thread of the
 * host (wait_iter.bpf.c, Linux 5.18).
 *
 * A part of both BPF objects: agent/build.rs includes the parts of each in the order of its
 * list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h. The main object
 * creates every map defined here; the kfunc object shares them. Not compiled on its own.
 */

/*
 * A run samples the target threads that are not on a CPU: blocked (class from the syscall it
 * blocked in, as the exact tracer tells them) or runnable and waiting for a CPU (preempted). A
 * thread on a CPU is the perf-event sampler's. A sample weighs the tick (set by user space
 * before the run), so that on- and off-CPU samples add up to wall-clock time. Nothing runs on
 * context switches: the cost is threads × ticks. What is sampled is each thread as the run's
 * snapshot of it found it (snapshot_thread), a few microseconds into the run; the thread the
 * run displaced is the perf-event sampler's.
 *
 * What a sample carries is read from the thread's own memory with bpf_copy_from_user_task (the
 * passes run in pgscope's context, as sleepable programs): what pg_stat_activity shows, and the
 * user stack above the registers saved when it entered the kernel. A thread that has not run
 * since its last sample (its switch counts unchanged) is in the same wait with the same stack:
 * it costs a 24-byte repeat record and no read of its memory. A run has two passes: the first
 * decides each thread's sample, the second (run only when the first left it work) copies the
 * stacks. Idle waits (a backend waiting for its client between statements, a background
 * process in its main loop) and waits for the client inside a transaction are counted per
 * process and attribution, never with a stack.
 *
 * The thread's task is a pointer the verifier knows the type of: its fields (and those of the
 * structs it points to) are read with plain loads, faults caught, not a helper call each
 * (BPF_CORE_READ): ~660 ns per visit of an idle backend against ~740 ns (task iterators).
 */

/* Set by user space before each run. Index 0: the weight of this run's samples (ns). Index 1:
 * stacks sent per run at most (each is a copy of up to 16 KiB of a backend's stack: with
 * hundreds of backends waiting, and each having run since the last tick, this bounds a tick's
 * cost; threads over it are counted without a stack, marked so). Set by the passes of a run
 * (one run at a time): index 2, stacks sent in this run so far; index 3, the sampler thread's
 * wakeup and index 5 its CPU (start_run); index 4, threads the first pass left to the second
 * (user space runs it only then). Index 6, set by the sampler's thread under --off-cpu=both:
 * its thread id (0 otherwise). */
#define WAIT_CONFIG_SENT 2
#define WAIT_CONFIG_WOKEN 3
#define WAIT_CONFIG_PENDING 4
#define WAIT_CONFIG_CPU 5
#define WAIT_CONFIG_SAMPLER_TID 6
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 7);
	__type(key, __u32);
	__type(value, __u64);
} wait_sample_config SEC(".maps");

/* Waits sampled without stacks (idle and client waits), per process and attribution; the same
 * layout as the exact tracer's off_cpu_totals, so that user space reads both alike. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct pgscope_off_cpu_key);
	__type(value, struct pgscope_off_cpu_total);
} wait_sample_totals SEC(".maps");

/* Under --off-cpu=both: where the exact tracer had each target thread as each run reached it,
 * weighted like the run's samples (count_exact_at_run); the same layout again. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct pgscope_off_cpu_key);
	__type(value, struct pgscope_off_cpu_total);
} exact_at_runs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct pgscope_wait_sample_task);
} wait_sample_tasks SEC(".maps");

/* Its own record buffers: the iterator may sleep in a read, and other programs run meanwhile. */
PGSCOPE_RECORD_BUFFERS(wait_sample_scratch);
/* The kfunc passes' batch of status entries, read before the snapshots like the words' (in
 * wait_sample_scratch) and used by the visits after the early copies (bpf/wait_targets.bpf.c). */
PGSCOPE_RECORD_BUFFERS(wait_status_scratch);

/*
 * The stacks a run of the kfunc passes copies as soon as it knows the thread waits with one to
 * take (bpf/wait_targets.bpf.c, copy_stack_early), each kept in a slot until the thread's
 * attribution is read and the sample sent from it: a copy in the second pass came 35-50 us
 * after the thread's snapshot on the row-lock storm, and 1-2% of the threads ran in between,
 * their stacks lost with the wait. A run's slots are taken in turn; threads past them are
 * copied in the second pass.
 */
#define WAIT_EARLY_STACKS 8
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, WAIT_EARLY_STACKS);
	__type(key, __u32);
	__type(value, struct pgscope_sample);
} wait_early_stacks SEC(".maps");

/* The threads of targets a run of the kfunc passes visits after its walk (wait_targets.bpf.c),
 * and those its first pass left to the second. Defined here so that the main object
 * creates it and the kfunc object shares it, like every other map. */
#define WAIT_THREADS_MAX 16384
struct wait_thread_list {
	__u64 run;	    /* the run's number */
	__u32 count;	    /* threads the run's walk listed */
	__u32 pending;	    /* threads its first pass left to the second */
	__u32 active;	    /* threads active in the last run: visited first */
	__u32 next_active;  /* threads active in this run, so far */
	__u32 tids[WAIT_THREADS_MAX];
	__u32 pending_tids[WAIT_THREADS_MAX];
	/* Threads active in a run, by its parity: a run visits first those of the half the last
	 * run wrote (run & 1) and notes its own in the other. */
	__u32 active_tids[2][WAIT_THREADS_MAX];
	/* The run's batches (bpf/wait_targets.bpf.c): of wait-event words, and of the status
	 * entries' fields pg_stat_activity shows, the addresses each spans; the Postgres instance
	 * (its postmaster's pid) and a thread of it to read them through. */
	__u64 batch_start;
	__u64 batch_end;
	__u64 status_start;
	__u64 status_end;
	__u32 batch_postmaster;
	__u32 batch_tid;
	__u32 early_stacks; /* the run's early slots taken (wait_early_stacks) */
};

/* A run's copy of a span of an instance's shared memory, the same at every address in each of
 * its processes: `read` bytes from `start` (none without `bytes`). */
struct shared_copy {
	const __u8 *bytes;
	__u64 start;
	__u32 read;
};

/* Takes the 4 or 8 bytes at `address` from the copy; false when it does not hold them. Not
 * inlined: its bounds checks, inlined at each of its calls, were branches the verifier walked
 * in every combination (target_waits: 414k instructions inlined, 339k called, Linux 6.18.44). */
static __noinline bool take_from_copy(void *dst, __u32 size, __u64 address, const struct shared_copy *copy)
{
	if (!copy || !copy->bytes || address < copy->start || address - copy->start + size > copy->read)
		return false;
	__u64 offset = address - copy->start;
	if (offset > PGSCOPE_USER_STACK_MAX - 8)
		return false;
	if (size == 8)
		__builtin_memcpy(dst, copy->bytes + offset, 8);
	else
		__builtin_memcpy(dst, copy->bytes + offset, 4);
	return true;
}

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct wait_thread_list);
} wait_sample_threads SEC(".maps");

/* One word of the thread's memory; false when it cannot be read. */
static __always_inline bool read_task_word(void *dst, __u32 size, __u64 address, struct task_struct *task)
{
	return address && bpf_copy_from_user_task(dst, size, (void *)address, task, 0) == 0;
}

/*
 * The parts of read_task_attribution. Each notes what it read in the flags in the thread's
 * storage, not in a register, returns 1 when a read faulted (else 0), and is not inlined: with
 * the flags and a count of faults in registers through one inlined function, every combination
 * of its reads' outcomes was a state of its own to the verifier, and on Linux 6.18.44 it gave
 * up on target_waits at its million instructions (E2BIG), leaving the sampler to the task
 * iterators. Called, each part's paths end in one state.
 */

/* What does not change once set: backend type, database, the address of the status entry.
 * Read until known (a backend still starting has not set them yet; 0 read is 0 shown, as the
 * on-CPU sampler shows it), then kept. */
static __noinline int read_task_identity(struct pgscope_wait_sample_task *state, struct task_struct *task,
					 struct pgscope_pg_layout *layout)
{
	struct pgscope_attribution *a = &state->attr;
	int faulted = 0;

	if (a->backend_type || read_task_word(&a->backend_type, 4, layout->my_backend_type, task))
		a->flags |= PGSCOPE_ATTR_BACKEND_TYPE;
	else if (layout->my_backend_type)
		faulted = 1;
	if (a->database_id || read_task_word(&a->database_id, 4, layout->my_database_id, task))
		a->flags |= PGSCOPE_ATTR_DATABASE;
	else if (layout->my_database_id)
		faulted = 1;
	if (!state->status_entry && layout->my_be_entry &&
	    !read_task_word(&state->status_entry, 8, layout->my_be_entry, task))
		faulted = 1;
	return faulted;
}

/* The status entry's state and queryid, from the run's batch when it holds them. */
static __noinline int read_task_status(struct pgscope_wait_sample_task *state, struct task_struct *task,
				       struct pgscope_pg_layout *layout, const struct shared_copy *status)
{
	struct pgscope_attribution *a = &state->attr;
	__u64 entry = state->status_entry;

	if (!entry)
		return 0;
	__u64 state_at = entry + layout->st_state_offset, query_id_at = entry + layout->st_query_id_offset;
	if ((take_from_copy(&a->backend_state, 4, state_at, status) ||
	     read_task_word(&a->backend_state, 4, state_at, task)) &&
	    (!layout->st_query_id_offset || take_from_copy(&a->query_id, 8, query_id_at, status) ||
	     read_task_word(&a->query_id, 8, query_id_at, task))) {
		a->flags |= PGSCOPE_ATTR_STATUS;
		return 0;
	}
	return 1;
}

/* The wait-event word: the run's snapshot's when it read it; the address it is at is read once
 * (with a status entry the backend has its PGPROC, and the word stays where it is). */
static __noinline int read_task_wait_word(struct pgscope_wait_sample_task *state, struct task_struct *task,
					  struct pgscope_pg_layout *layout)
{
	struct pgscope_attribution *a = &state->attr;
	int faulted = 0;

	if (!state->wait_event_ptr && layout->my_wait_event_info) {
		__u64 pointer = 0;
		if (!read_task_word(&pointer, 8, layout->my_wait_event_info, task))
			faulted = 1;
		else if (state->status_entry)
			state->wait_event_ptr = pointer;
		else if (read_task_word(&a->wait_event_info, 4, pointer, task))
			a->flags |= PGSCOPE_ATTR_WAIT_EVENT;
	}
	if (state->snapshot_flags & PGSCOPE_WAIT_SNAPSHOT_WORD) {
		a->wait_event_info = state->snapshot_wait_event;
		a->flags |= PGSCOPE_ATTR_WAIT_EVENT;
	} else if (state->wait_event_ptr) {
		if (read_task_word(&a->wait_event_info, 4, state->wait_event_ptr, task))
			a->flags |= PGSCOPE_ATTR_WAIT_EVENT;
		else
			faulted = 1;
	}
	return faulted;
}

/* What pg_stat_activity shows for the thread: read_attribution's fields, from another task's
 * memory (the three parts above, in order: the wait word's address depends on whether the
 * status entry is known). Returns the process's layout (NULL: not known). */
static __always_inline struct pgscope_pg_layout *read_task_attribution(struct pgscope_wait_sample_task *state,
								       struct task_struct *task, __u32 tgid,
								       const struct shared_copy *status)
{
	struct pgscope_attribution *a = &state->attr;
	struct pgscope_pg_layout *layout = bpf_map_lookup_elem(&pg_layouts, &tgid);

	a->query_id = 0;
	a->wait_event_info = 0;
	a->backend_state = 0;
	a->off_cpu_class = PGSCOPE_OFF_CPU_NONE;
	a->flags = 0;
	if (!layout) {
		a->backend_type = 0;
		a->database_id = 0;
		return NULL;
	}
	int faulted = read_task_identity(state, task, layout);
	faulted += read_task_status(state, task, layout, status);
	faulted += read_task_wait_word(state, task, layout);
	if (faulted)
		count(PGSCOPE_CNT_ATTRIBUTION_FAULT);
	return layout;
}

/* Copies the thread's user stack from its saved sp upwards, bounded like copy_user_stack. */
static __always_inline __u64 copy_task_stack(struct pgscope_sample *s, struct task_struct *task)
{
	__u64 sp = s->user_sp;
	__u64 top = task->mm->start_stack;
	__u64 len = PGSCOPE_USER_STACK_MAX;

	if (top > sp && top - sp < len)
		len = top - sp;
	if (len > PGSCOPE_USER_STACK_MAX)
		len = PGSCOPE_USER_STACK_MAX;
	if (len && bpf_copy_from_user_task(s->user_stack, len, (void *)sp, task, 0) == 0)
		return len;
	count(PGSCOPE_CNT_USER_STACK_FAULT);
	len = 4096 - (sp & 4095);
	if (len > PGSCOPE_USER_STACK_MAX)
		len = PGSCOPE_USER_STACK_MAX;
	if (len && bpf_copy_from_user_task(s->user_stack, len, (void *)sp, task, 0) == 0)
		return len;
	count(PGSCOPE_CNT_USER_STACK_LOST);
	return 0;
}

/* Adds `ticks` ticks weighing `ns` in all to the wait counted without stacks under the thread's
 * attribution. */
static __always_inline void add_sampled_total(__u32 tgid, struct pgscope_attribution *attr, __u64 ns, __u32 ticks)
{
	struct pgscope_off_cpu_key key = {
		.tgid = tgid,
		.attr = *attr,
	};
	add_to_totals(&wait_sample_totals, &key, ns, ticks);
}

/* Counts one tick of the thread's wait without a stack, now. */
static __always_inline void count_sampled(__u32 tgid, struct pgscope_attribution *attr, __u64 weight)
{
	count(PGSCOPE_CNT_WAIT_NO_STACK);
	add_sampled_total(tgid, attr, weight, 1);
}

/*
 * The kfunc passes defer an idle thread's ticks in its task storage and add them to its total
 * every WAIT_DEFER_TICKS ticks: the hash map's update was most of an idle backend's cost at each
 * tick (~400 of ~700 ns, cold cache lines of the map's bucket, key and per-CPU value; measured
 * with 1000 held connections at 19 Hz). The ticks are added when the thread leaves the wait (its
 * next visit), when it exits (on_process_exit), and when the sampler stops (a last pass): the
 * totals user space reads lag by at most this many ticks, and lose none.
 */
#define WAIT_DEFER_TICKS 32

/* Adds the thread's deferred ticks to its total. */
static __always_inline void flush_deferred(struct pgscope_wait_sample_task *state, __u32 tgid)
{
	if (!state->deferred_ticks)
		return;
	add_sampled_total(tgid, &state->attr, state->deferred_ns, state->deferred_ticks);
	state->deferred_ns = 0;
	state->deferred_ticks = 0;
}

/*
 * The ring buffer's flags for a run's records. Each record sent with the default wakes the
 * consumer when it has caught up: an interrupt and a wakeup of pgscope's reader per record,
 * ~2 us of the run each on the row-lock storm (8 clients on 3 rows), during which the threads
 * whose stacks are still to be copied can leave their waits. A run's records wake it once, at
 * its end (wake_consumer); sooner only when the buffer holds more than a quarter of its size.
 */
#define WAIT_WAKEUP_BACKLOG (2 << 20)
static __always_inline __u64 wait_output_flags(void)
{
	return bpf_ringbuf_query(&samples, BPF_RB_AVAIL_DATA) > WAIT_WAKEUP_BACKLOG ? 0 : BPF_RB_NO_WAKEUP;
}

/* At a run's end: wakes the consumer for the records the run sent (a discarded reservation,
 * which the consumer skips). */
static __always_inline void wake_consumer(void)
{
	if (!bpf_ringbuf_query(&samples, BPF_RB_AVAIL_DATA))
		return;
	void *wake = bpf_ringbuf_reserve(&samples, 8, 0);
	if (wake)
		bpf_ringbuf_discard(wake, BPF_RB_FORCE_WAKEUP);
}

/* Fills in what a sample of the thread carries besides its user registers and stack. */
static __always_inline void fill_wait_sample(struct pgscope_sample *s, struct pgscope_wait_sample_task *state,
					     __u32 tgid, __u32 tid, __u64 weight)
{
	s->tgid = tgid;
	s->tid = tid;
	s->time_ns = bpf_ktime_get_ns();
	s->cpu = bpf_get_smp_processor_id();
	s->kernel_frames = 0;
	s->attr = state->attr;
	s->off_cpu_ns = weight;
	/* Its syscall at the snapshot: an early stack's (send_wait_sample sets a later copy's). */
	s->off_cpu_syscall = state->snapshot_syscall < 0 ? (__u32)-1 : (__u32)state->snapshot_syscall;
	s->off_cpu_flags = PGSCOPE_OFF_CPU_SAMPLED;
	s->statement_start = 0;
	s->trigger_oid = 0;
	s->trigger_constraint = 0;
}

/*
 * Sends the thread's sample with its user stack: the one copied into its early slot at its
 * snapshot's wait (copy_stack_early: its registers and returns restored there), or one copied
 * now. True when it went out.
 */
static __always_inline bool send_wait_sample(struct pgscope_wait_sample_task *state, struct task_struct *task,
					     __u32 tgid, __u64 weight)
{
	bool early = state->snapshot_flags & PGSCOPE_WAIT_SNAPSHOT_STACK;
	__u32 slot = (state->snapshot_flags >> PGSCOPE_WAIT_SNAPSHOT_SLOT_SHIFT) & 0xff;
	struct pgscope_sample *s =
		early ? bpf_map_lookup_elem(&wait_early_stacks, &slot) : this_cpu_buffer(&wait_sample_scratch);

	if (!s) {
		count(PGSCOPE_CNT_NO_SCRATCH);
		return false;
	}
	fill_wait_sample(s, state, tgid, task->pid, weight);
	if (!early) {
		struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
		s->user_ip = regs->ip;
		s->user_sp = regs->sp;
		s->user_bp = regs->bp;
		/* A thread found back in its wait (back_in_sampled_wait) is in another syscall of
		 * the same kind, maybe: the one its stack is copied in. */
		s->off_cpu_syscall = regs->orig_ax < 0 ? (__u32)-1 : (__u32)regs->orig_ax;
		__u64 len = copy_task_stack(s, task);
		s->user_stack_len = len;
		restore_uretprobe_returns(s, task, len);
	}
	if (!output_copied_sample(s, s->user_stack_len, wait_output_flags()))
		return false;
	count(PGSCOPE_CNT_WAIT_SAMPLES);
	return true;
}

/* Whether the wait Postgres reports is one for work: an idle backend's read from its client, a
 * background process's main loop. */
static __always_inline bool waits_for_work(struct pgscope_attribution *a, struct pgscope_pg_layout *layout)
{
	bool waits_for_client = layout && (a->flags & PGSCOPE_ATTR_STATUS) && layout->state_idle &&
				a->backend_state == layout->state_idle &&
				a->wait_event_info == layout->wait_client_read;
	return waits_for_client || (a->wait_event_info & PG_WAIT_CLASS_MASK) == PG_WAIT_ACTIVITY;
}

/* The off-CPU class of a thread that is not on a CPU, and whether it is waiting for work. */
static __always_inline __u32 sampled_class(struct pgscope_wait_sample_task *state, struct pgscope_pg_layout *layout,
					   unsigned int task_state, long syscall)
{
	struct pgscope_attribution *a = &state->attr;
	/* Runnable in a wait Postgres reports, inside a syscall: woken, not on a CPU yet. The
	 * exact tracer counts that run-queue delay in the wait it ends, classed as the wait was
	 * when it blocked; so does this. Runnable otherwise: preempted. */
	bool woken = task_state == TASK_RUNNING_STATE && a->wait_event_info && syscall >= 0;
	__u32 class = task_state == TASK_RUNNING_STATE && !woken ? PGSCOPE_OFF_CPU_PREEMPTED
								  : class_of_syscall(syscall, task_state);
	/* Without a status entry or a wait event, waiting in poll/select: the postmaster's loop. */
	bool no_status_loop = !(a->flags & PGSCOPE_ATTR_STATUS) && !a->wait_event_info &&
			      class == PGSCOPE_OFF_CPU_LATCH;
	if (waits_for_work(a, layout) || no_status_loop)
		return PGSCOPE_OFF_CPU_IDLE;
	return class;
}

static __always_inline void set_wait_config(__u32 index, __u64 value)
{
	__u64 *slot = bpf_map_lookup_elem(&wait_sample_config, &index);
	if (slot)
		*slot = value;
}

/* The run queue the thread is on, or was last on. */
static __always_inline struct rq *rq_of(struct task_struct *task)
{
	if (!bpf_core_field_exists(task->se.cfs_rq))
		return NULL;
	struct cfs_rq *cfs_rq = task->se.cfs_rq;
	return cfs_rq ? cfs_rq->rq : NULL;
}

/* task_struct before Linux 5.16, whose thread_info had no cpu (x86). */
struct task_struct___cpu_in_task {
	unsigned int cpu;
} __attribute__((preserve_access_index));

/* The CPU the thread runs on, or last ran on. */
static __always_inline __u32 cpu_of(struct task_struct *task)
{
	if (bpf_core_field_exists(task->thread_info.cpu))
		return BPF_CORE_READ(task, thread_info.cpu);
	struct task_struct___cpu_in_task *old = (void *)task;
	return BPF_CORE_READ(old, cpu);
}

/*
 * At a run's first object: no stacks sent yet; the sampler thread's wakeup (its
 * sched_info.last_arrival, in the run queues' clock, sched_clock: stamped when its timer woke
 * it, as the wakeup takes the CPU from the thread running there and the scheduler skips the
 * clock update at that switch) and its CPU, which tell the thread the run displaced. 0 without
 * CONFIG_SCHED_INFO, and then that thread is not told.
 */
static __always_inline void start_run(void)
{
	struct task_struct *self = (struct task_struct *)bpf_get_current_task();
	__u64 woken = 0;
	if (bpf_core_field_exists(self->sched_info.last_arrival))
		woken = BPF_CORE_READ(self, sched_info.last_arrival);
	set_wait_config(WAIT_CONFIG_PENDING, 0);
	set_wait_config(WAIT_CONFIG_WOKEN, woken);
	set_wait_config(WAIT_CONFIG_CPU, bpf_get_smp_processor_id());
}

static __always_inline __u64 wait_config(__u32 index)
{
	__u64 *slot = bpf_map_lookup_elem(&wait_sample_config, &index);
	return slot ? *slot : 0;
}

/*
 * Under --off-cpu=both: adds a run's weight to where the exact tracer has the thread as the run
 * reaches it (its task storage, off_cpu.bpf.c), so that the samples can be judged against the
 * exact state at their own instants, not only against its time average. That average also
 * holds what the runs themselves do to the database (a run takes its CPU from the backend
 * there, and one holding a lock makes the others queue) and where the runs fall, neither of
 * which a sample can see, and how much they weigh is the machine's (docs/architecture.md).
 * A wait begun as the sampler's thread took the CPU is the run's own doing: the thread was
 * running at the run's instant (the sampler leaves it to the perf-event sampler too). Called
 * once per target thread and run, beside its snapshot. 1 when counted. Not inlined: inlined
 * beside the early copy of a stack, its branches multiplied the verifier's states (target_waits:
 * 519k instructions, 286k called; Linux 6.18.44).
 */
static __noinline int count_exact_at_run(struct task_struct *task, __u32 tgid, __u64 weight)
{
	if (!wait_config(WAIT_CONFIG_SAMPLER_TID))
		return 0;
	struct pgscope_off_cpu_task *exact = bpf_task_storage_get(&off_cpu_tasks, task, 0, 0);
	if (!exact || !exact->measured || !exact->start_ns || exact->displaced)
		return 0;
	struct pgscope_off_cpu_key key = { .tgid = tgid, .attr = exact->attr };
	/* Not what the tracer counts by: whether a stack was taken. */
	key.attr.flags &= ~PGSCOPE_ATTR_STACK_NOT_SAMPLED;
	add_to_totals(&exact_at_runs, &key, weight, 1);
	return 1;
}

/*
 * Whether the thread was running at `at` (a time of the run queues' clock) and left its CPU
 * since. When a thread leaves its CPU the scheduler stamps it (se.exec_start) in its run
 * queue's task clock, which lags the run queue's clock by that CPU's interrupt and steal time:
 * the stamp is moved into it by the lag now (through the thread's CFS run queue, which needs
 * group scheduling; without, nothing is told). A thread migrated while asleep has its stamp
 * zeroed: it left before. A thread that started running after `at` (sched_info.last_arrival)
 * was off its CPU then.
 */
static __always_inline bool left_cpu_since(struct task_struct *task, __u64 at)
{
	__u64 left = task->se.exec_start;
	if (!at || !left || !bpf_core_field_exists(task->sched_info.last_arrival))
		return false;
	struct rq *rq = rq_of(task);
	if (!rq)
		return false;
	__u64 clock = rq->clock, clock_task = rq->clock_task;
	if (left + (clock > clock_task ? clock - clock_task : 0) < at)
		return false;
	return task->sched_info.last_arrival < at;
}

/*
 * Whether the thread is the one the run displaced: on the sampler's CPU, and running there when
 * the sampler's timer woke it. On a CPU then, it is the perf-event sampler's; the wait the run
 * finds it in is the run's own doing (counted, with the threads that then queued behind it,
 * such a thread made the storm's sampled off-CPU total 2.7-3.4 times the exact tracer's). So is
 * a wait it blocked in of itself in between: without full preemption the run gets the CPU at
 * the thread's next preemption point, and blocking is one, so that a thread about to block was
 * found blocked rather than running. Left in its wait, with the runs shortened (status entries
 * read in one batch) it put the storm's lock time at 1.14 of the exact tracer's in a 40 s run;
 * left out, 0.996 and 1.015 (60 s), 1.046 (200 s), and the time outside wait events at 0.84-0.88
 * rather than 0.75-0.85.
 */
static __always_inline bool displaced_by_run(struct task_struct *task)
{
	return cpu_of(task) == wait_config(WAIT_CONFIG_CPU) && left_cpu_since(task, wait_config(WAIT_CONFIG_WOKEN));
}

/*
 * The run's snapshot of a thread: where it is as the run reaches it, from its kernel state
 * (whether on a CPU, switch count, syscall, state), read with plain loads. That moment is the
 * thread's sampling instant: its wait-event word, read later (read_snapshot_word), is kept only
 * when the thread has not run in between. The kfunc passes take the snapshots of the threads
 * active in the last run first, about 0.5 us each, and read their words after, in one batch
 * (bpf/wait_targets.bpf.c).
 *
 * Why not one instant for every thread, the sampler's wakeup: on a kernel without full
 * preemption the woken sampler gets its CPU only when the thread there reaches a preemption
 * point, 23-40 us later on the pg_stat_statements eviction storm, and its visits then took 2-5
 * us a thread (reads of another process's memory): 1-2 of the storm's 16 backends a tick ran
 * between the wakeup and their visit, and what each showed at the wakeup was gone. Skipped as
 * running, or sampled in a wait begun since, they made the lock's sampled time 0.83-1.11 of the
 * exact tracer's as the visits were slower or faster (0.83 on a slower machine, and here with
 * one more read per visit). A thread's own instant needs no such guess: the run starts at a
 * time set by the timer and by the displaced thread alone (left out, displaced_by_run), and a
 * thread's snapshot comes a few microseconds after it.
 */
static __always_inline void snapshot_thread(struct task_struct *task, struct pgscope_wait_sample_task *state, __u64 run)
{
	__u32 flags = 0;
	__u64 switches = task->nvcsw + task->nivcsw + 1;
	state->snapshot_run = run;
	/* The displaced thread has switched since its last sample (it was running). */
	if (task->on_cpu || (switches != state->switches && displaced_by_run(task)))
		flags |= PGSCOPE_WAIT_SNAPSHOT_ON_CPU;
	state->snapshot_switches = switches;
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	long syscall = regs->orig_ax;
	state->snapshot_syscall = syscall < 0 ? -1 : (__s32)syscall;
	state->snapshot_task_state = task->__state;
	state->snapshot_flags = flags;
}

/* Whether the thread ran since its snapshot: what its memory, kernel state and stack show now
 * are of a later wait. */
static __always_inline bool ran_since_snapshot(struct task_struct *task, struct pgscope_wait_sample_task *state)
{
	return task->on_cpu || task->nvcsw + task->nivcsw + 1 != state->snapshot_switches;
}

/* Reads the wait-event word of a thread off its CPU at its snapshot, kept when the thread has not
 * run since (checked after the read): the word it showed then (only the thread writes it). May
 * sleep. */
static __always_inline void read_snapshot_word(struct task_struct *task, struct pgscope_wait_sample_task *state)
{
	if (state->snapshot_flags & PGSCOPE_WAIT_SNAPSHOT_ON_CPU || !state->wait_event_ptr)
		return;
	if (read_task_word(&state->snapshot_wait_event, 4, state->wait_event_ptr, task) &&
	    !ran_since_snapshot(task, state))
		state->snapshot_flags |= PGSCOPE_WAIT_SNAPSHOT_WORD;
}

/* The wait class (futex, latch, io; 0 for any other) of a syscall a thread is blocked in. */
static __always_inline __u32 wait_class_of(long syscall, unsigned int task_state)
{
	if (syscall < 0)
		return 0;
	__u32 class = class_of_syscall(syscall, task_state);
	return class >= PGSCOPE_OFF_CPU_FUTEX && class <= PGSCOPE_OFF_CPU_IO ? class : 0;
}

/* The class of syscall a snapshot found the thread in (0: none of futex, latch, io). */
static __always_inline __u32 snapshot_word_class(struct pgscope_wait_sample_task *state)
{
	return wait_class_of(state->snapshot_syscall, state->snapshot_task_state);
}

/* The thread's slot in class_words for a wait class (NULL for none). */
static __always_inline __u32 *class_word(struct pgscope_wait_sample_task *state, __u32 class)
{
	__u32 index = class - PGSCOPE_OFF_CPU_FUTEX;
	return index < 3 ? &state->class_words[index] : NULL;
}

/* Remembers the word a visit knows the thread showed at its snapshot, by the class of the
 * syscall it was in then. */
static __always_inline void remember_word(struct pgscope_wait_sample_task *state)
{
	__u32 *word = class_word(state, snapshot_word_class(state));
	if (word && (state->attr.flags & PGSCOPE_ATTR_WAIT_EVENT))
		*word = state->attr.wait_event_info;
}

/*
 * The wait-event word of a thread off its CPU at its snapshot (its kernel state known from it)
 * that ran before its word was read (0.4-0.7 of the eviction storm's 16 backends a tick, more on
 * a slower machine): the word it last showed at a snapshot in the same kind of syscall (futex,
 * latch, io); none when it has shown none there, or was preempted outside a syscall (Postgres
 * reports its waits around the syscalls that wait). Postgres' futex waits are its semaphores
 * (LWLocks, group updates); its latch waits are the client's and the latch's. Not the word of
 * its last sample, nor the one it shows now: that sample was most often of another kind (a
 * preemption, the client), and a thread that has just run is most often running again or back
 * in its client's wait: on the storm that put 3.2 s of epoll waits in 200 s under no wait event
 * and 0.45 s of futex waits under Client:ClientRead, where the exact tracer had 0.09 and none
 * (docs/architecture.md). Counted, so that the summary says how many were guessed.
 */
static __always_inline void guess_wait_event(struct pgscope_wait_sample_task *state)
{
	struct pgscope_attribution *a = &state->attr;
	count(PGSCOPE_CNT_WAIT_EVENT_UNKNOWN);
	__u32 *word = class_word(state, snapshot_word_class(state));
	a->wait_event_info = word ? *word : 0;
}

/* What a run's first pass left to the second for a thread. */
enum wait_visit {
	WAIT_VISIT_DONE = 0,	 /* decided: skipped (on a CPU) or counted without a stack */
	WAIT_VISIT_PENDING = 1,	 /* waits with a stack to copy: the second pass sends it */
	WAIT_VISIT_REPEATED = 2, /* not run since its last sample, which was repeated */
};

/*
 * A thread that has not run since its last sample (its switch counts unchanged) is in the same
 * wait with the same stack: its last sample is repeated, counted again without a stack or sent
 * as a 24-byte repeat record, with no read of its memory. True when done so; false when the
 * thread needs its visit. Sleeps in nothing (the kfunc passes call it under RCU).
 */
static __always_inline bool repeat_unchanged(struct task_struct *task, __u32 tgid,
					     struct pgscope_wait_sample_task *state, __u64 weight, bool defer)
{
	if (state->snapshot_switches != state->switches)
		return false;
	if (state->kind == PGSCOPE_WAIT_SAMPLE_NO_STACK) {
		if (!defer) {
			count_sampled(tgid, &state->attr, weight);
			return true;
		}
		count(PGSCOPE_CNT_WAIT_NO_STACK);
		state->deferred_ns += weight;
		if (++state->deferred_ticks >= WAIT_DEFER_TICKS)
			flush_deferred(state, tgid);
		return true;
	}
	if (state->kind != PGSCOPE_WAIT_SAMPLE_STACKS)
		return false;
	struct pgscope_wait_repeat repeat = {
		.tgid = tgid,
		.tid = task->pid,
		.weight_ns = weight,
		.magic = PGSCOPE_WAIT_REPEAT_MAGIC,
	};
	if (bpf_ringbuf_output(&samples, &repeat, sizeof(repeat), wait_output_flags()) == 0) {
		count(PGSCOPE_CNT_WAIT_REPEATS);
		return true;
	}
	count(PGSCOPE_CNT_RINGBUF_FULL);
	/* The tick's time is not lost with the record: it is counted without a stack, and the next
	 * tick sends the whole sample again. */
	state->attr.flags |= PGSCOPE_ATTR_STACK_NOT_SAMPLED;
	count_sampled(tgid, &state->attr, weight);
	state->kind = PGSCOPE_WAIT_SAMPLE_NONE;
	return true;
}

/*
 * A run's first pass, for one thread of a target (`tgid` is its process): decides its sample
 * from its snapshot (taken now when the run has none of it: `run` 0, the task iterators). A thread on a CPU is the perf-event sampler's; an idle or client wait is
 * counted without a stack; a thread that has not run since its last sample repeats it; any
 * other wait is left to the second pass for its stack.
 */
static __always_inline enum wait_visit visit_waiting_thread(struct task_struct *task, __u32 tgid, __u64 run,
							    const struct shared_copy *status)
{
	/* Exiting: gone before the next tick. */
	if (task->exit_state) {
		count(PGSCOPE_CNT_WAIT_SKIPPED);
		return WAIT_VISIT_DONE;
	}
	__u32 zero = 0;
	__u64 *weight_ns = bpf_map_lookup_elem(&wait_sample_config, &zero);
	/* The task iterators' visit is the run's look at the thread (the kfunc passes look at it
	 * in their walk or first loop). */
	if (!run && weight_ns)
		count_exact_at_run(task, tgid, *weight_ns);
	struct pgscope_wait_sample_task *state = bpf_task_storage_get(&wait_sample_tasks, task, 0, 0);
	bool snapped = run && state && state->snapshot_run == run;
	if (!snapped) {
		/* On a CPU: nothing else to read (no storage made). */
		if (task->on_cpu) {
			count(PGSCOPE_CNT_WAIT_SKIPPED);
			return WAIT_VISIT_DONE;
		}
		state = bpf_task_storage_get(&wait_sample_tasks, task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	}
	if (!state || !weight_ns) {
		count(PGSCOPE_CNT_NO_SCRATCH);
		return WAIT_VISIT_DONE;
	}
	__u64 weight = *weight_ns;
	if (!snapped) {
		snapshot_thread(task, state, 0);
		read_snapshot_word(task, state);
	}
	__u32 snapshot = state->snapshot_flags;
	if (snapshot & PGSCOPE_WAIT_SNAPSHOT_ON_CPU) {
		count(PGSCOPE_CNT_WAIT_SKIPPED);
		return WAIT_VISIT_DONE;
	}
	/* Not switched out since its last sample: in that wait at its snapshot (if it got its CPU
	 * since, it got it after). */
	if (repeat_unchanged(task, tgid, state, weight, false))
		return WAIT_VISIT_REPEATED;
	/* It left the wait its deferred ticks are of: they go to that wait's total. */
	flush_deferred(state, tgid);
	struct pgscope_pg_layout *layout = read_task_attribution(state, task, tgid, status);
	state->switches = state->snapshot_switches;
	bool ran = ran_since_snapshot(task, state);
	/* Read at its snapshot, or since but before it ran again: the word it showed then. */
	if (!ran || (snapshot & PGSCOPE_WAIT_SNAPSHOT_WORD))
		remember_word(state);
	else
		guess_wait_event(state);
	__u32 class = sampled_class(state, layout, state->snapshot_task_state, state->snapshot_syscall);
	state->attr.off_cpu_class = class;

	/* Waiting for work, or for the client inside a transaction (whose stack is always the
	 * same read from the socket): counted, without a stack. Not the queryid of a finished
	 * statement: it would only split the idle total. */
	bool client_wait = (state->attr.wait_event_info & PG_WAIT_CLASS_MASK) == PG_WAIT_CLIENT;
	if (class == PGSCOPE_OFF_CPU_IDLE || client_wait) {
		if (class == PGSCOPE_OFF_CPU_IDLE)
			state->attr.query_id = 0;
		state->kind = PGSCOPE_WAIT_SAMPLE_NO_STACK;
		count_sampled(tgid, &state->attr, weight);
		return WAIT_VISIT_DONE;
	}
	/* Its stack is copied by the run's second pass: a copy takes most of a visit, and with it
	 * here the threads visited after would be seen that much later. One that ran since its
	 * snapshot has left the wait the snapshot saw, and its stack with it: the second pass
	 * counts it without (state->switches, the snapshot's, differs from its count). */
	state->kind = PGSCOPE_WAIT_SAMPLE_PENDING;
	__u32 pending_index = WAIT_CONFIG_PENDING;
	__u64 *pending = bpf_map_lookup_elem(&wait_sample_config, &pending_index);
	if (pending)
		*pending += 1;
	return WAIT_VISIT_PENDING;
}

/*
 * Whether a thread that ran between its snapshot and the copy of its stack is off its CPU again
 * in the wait its sample is of: the same kind of syscall, the wait-event word and statement the
 * sample has, with no run while these were read. Its stack then is one it waits in with the
 * attribution the sample reports, in all but the instance of the wait: a row-lock waiter woken
 * by a commit and queued again behind the next holder. (A word guessed because the thread ran
 * before it was read is held to the same: the stack then agrees with the guess.) On a row-lock
 * storm (8 clients on 3 rows) 1.5-2.5% of the off-CPU samples that sought a stack ran before it
 * could be copied; of those, about half are on a CPU at the copy, and lost. Sets `*switches` to
 * the count the copy is of. May sleep (reads the thread's memory).
 */
static __always_inline bool back_in_sampled_wait(struct task_struct *task, struct pgscope_wait_sample_task *state,
						 __u64 *switches)
{
	struct pgscope_attribution *a = &state->attr;
	if (task->on_cpu || !(a->flags & PGSCOPE_ATTR_WAIT_EVENT) || !state->wait_event_ptr)
		return false;
	__u32 class = snapshot_word_class(state);
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	__u64 before = task->nvcsw + task->nivcsw + 1;
	if (!class || wait_class_of(regs->orig_ax, task->__state) != class)
		return false;
	__u32 tgid = task->tgid;
	struct pgscope_pg_layout *layout = bpf_map_lookup_elem(&pg_layouts, &tgid);
	__u32 word = 0;
	__u64 query_id = 0;
	if (!layout || !read_task_word(&word, 4, state->wait_event_ptr, task) || word != a->wait_event_info)
		return false;
	if (layout->st_query_id_offset &&
	    (!state->status_entry ||
	     !read_task_word(&query_id, 8, state->status_entry + layout->st_query_id_offset, task) ||
	     query_id != a->query_id))
		return false;
	if (task->on_cpu || task->nvcsw + task->nivcsw + 1 != before)
		return false;
	*switches = before;
	return true;
}

/* At a run's second pass's start: no stacks sent yet. */
static __always_inline void start_stack_pass(void)
{
	set_wait_config(WAIT_CONFIG_SENT, 0);
}

/* Whether the thread ran since the wait its pending sample is of: its snapshot's, or the
 * wait it was found back in (back_in_sampled_wait). */
static __always_inline bool ran_since_sampled_wait(struct task_struct *task,
						   struct pgscope_wait_sample_task *state)
{
	return task->on_cpu || task->nvcsw + task->nivcsw + 1 != state->switches;
}

/*
 * A run's second pass, for one thread: sends it with the attribution the first pass read and
 * the user stack it is still blocked in. A thread that ran in between has left that wait, and
 * its stack with it: it is counted in the wait the first pass saw, without a stack, marked so.
 * -1 when the run's configuration could not be read (the caller counts it).
 *
 * Not inlined, so that its paths end in one state for the bpf_loop callbacks that call it (as
 * walk_thread; see read_task_attribution for the kernel where that mattered).
 */
static __noinline int copy_waiting_stack(struct task_struct *task)
{
	struct pgscope_wait_sample_task *state = bpf_task_storage_get(&wait_sample_tasks, task, 0, 0);
	if (!state || state->kind != PGSCOPE_WAIT_SAMPLE_PENDING)
		return 0;
	__u32 zero = 0, budget_index = 1, sent_index = WAIT_CONFIG_SENT;
	__u64 *weight_ns = bpf_map_lookup_elem(&wait_sample_config, &zero);
	__u64 *budget = bpf_map_lookup_elem(&wait_sample_config, &budget_index);
	__u64 *sent = bpf_map_lookup_elem(&wait_sample_config, &sent_index);
	__u32 tgid = task->tgid;
	if (!weight_ns || !budget || !sent) {
		state->kind = PGSCOPE_WAIT_SAMPLE_NONE;
		return -1;
	}

	/* Copied at its snapshot's wait, before it ran (copy_stack_early): what it did since does
	 * not matter. */
	bool early = state->snapshot_flags & PGSCOPE_WAIT_SNAPSHOT_STACK;
	__u64 now_switches = 0;
	if (!early && ran_since_sampled_wait(task, state) && back_in_sampled_wait(task, state, &now_switches)) {
		/* The sample repeated next is of the wait the stack is copied in. */
		state->switches = now_switches;
		count(PGSCOPE_CNT_WAIT_STACK_AFTER_RUN);
	}
	/* Read again, not remembered: a thread that ran since it was found back in its wait
	 * leaves no stack of that wait either. */
	if (!early && ran_since_sampled_wait(task, state)) {
		count(PGSCOPE_CNT_WAIT_RAN_BEFORE_STACK);
		state->attr.flags |= PGSCOPE_ATTR_STACK_NOT_SAMPLED;
		state->kind = PGSCOPE_WAIT_SAMPLE_NONE;
		count_sampled(tgid, &state->attr, *weight_ns);
		return 0;
	}
	if (*sent >= *budget) {
		/* The time is not lost with the stack: it is counted, marked as left without. */
		count(PGSCOPE_CNT_WAIT_OVER_BUDGET);
		state->attr.flags |= PGSCOPE_ATTR_STACK_NOT_SAMPLED;
		state->kind = PGSCOPE_WAIT_SAMPLE_NO_STACK;
		count_sampled(tgid, &state->attr, *weight_ns);
		return 0;
	}
	if (send_wait_sample(state, task, tgid, *weight_ns)) {
		*sent += 1;
		state->kind = PGSCOPE_WAIT_SAMPLE_STACKS;
	} else {
		/* Not sent (the ring buffer full: user space behind): the time is not lost with the
		 * stack, as the exact tracer keeps it. A storm traced beside a build lost 19% of its
		 * sampled wait time with 5328 records. */
		state->attr.flags |= PGSCOPE_ATTR_STACK_NOT_SAMPLED;
		count_sampled(tgid, &state->attr, *weight_ns);
		state->kind = PGSCOPE_WAIT_SAMPLE_NONE;
	}
	return 0;
}
