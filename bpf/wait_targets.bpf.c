// SPDX-License-Identifier: GPL-2.0
/*
 * The wait sampler's passes visiting the targets' threads alone: user space runs them each
 * tick with BPF_PROG_RUN (sleepable syscall programs, in its sampler thread's context, as the
 * task iterators run). The first walks the host's threads, settles there those that need no
 * read of their memory (on a CPU, or not run since their last sample: an idle backend), and
 * visits the others after the walk (wait_sampler.bpf.h); the threads active in the last run are
 * visited, and their stacks copied, before it. Its cost is a walk step per thread of
 * the host and a visit per target thread that ran since the last tick. The task iterators
 * (wait_iter.bpf.c) visit every thread of the host with a sleepable program, and reached the
 * eviction storm's backends 80-160 us after the run's instant, long enough for a few of them to
 * have changed wait.
 *
 * Needs kfuncs (bpf_task_from_pid, the open-coded task iterator: Linux 6.7), which aya cannot
 * load: this is the second BPF object, loaded with libbpf, sharing every map of the main one
 * (agent/src/bpf/wait_targets.rs). Without them the iterators run instead.
 *
 * agent/build.rs includes the parts in the order of its KFUNC_PARTS list into a single unit,
 * after vmlinux.h, libbpf's headers and pgscope.h. Not compiled on its own.
 */

extern struct task_struct *bpf_task_from_pid(s32 pid) __ksym;
extern void bpf_task_release(struct task_struct *p) __ksym;
extern int bpf_iter_task_new(struct bpf_iter_task *it, struct task_struct *task, unsigned int flags) __ksym;
extern struct task_struct *bpf_iter_task_next(struct bpf_iter_task *it) __ksym;
extern void bpf_iter_task_destroy(struct bpf_iter_task *it) __ksym;
extern void bpf_rcu_read_lock(void) __ksym;
extern void bpf_rcu_read_unlock(void) __ksym;

/* enum bpf_iter_task_type (include/linux/bpf.h; not in vmlinux.h before Linux 6.7). */
#define TASK_ITER_ALL_THREADS 1

struct list_ctx {
	struct wait_thread_list *list;
	struct shared_copy words;  /* the run's batch of wait-event words, when read */
	struct shared_copy status; /* and of status entries */
	__u32 copied;		   /* pending threads whose stacks are copied already */
};

/* Notes a thread active in this run (visited, or on a CPU): the next run visits it first. */
static __always_inline void note_active(struct wait_thread_list *list, __u32 tid)
{
	__u32 n = list->next_active;
	if (n >= WAIT_THREADS_MAX)
		return;
	list->active_tids[(list->run + 1) & 1][n & (WAIT_THREADS_MAX - 1)] = tid;
	list->next_active = n + 1;
}

/*
 * The walk's work for one thread of the host: for a thread of a process in `targets` flagged
 * for profiling, what needs no read of its memory. A thread on a CPU is skipped (the perf-event
 * sampler's), one that has not run since its last sample repeats it (an idle backend costs this
 * and no more). The others are listed for their visit, which may sleep in reads of their memory
 * and so cannot run inside the walk (RCU). A thread over the list's room is counted, its waits
 * unsampled.
 *
 * Not inlined, on purpose: the verifier explores an open-coded iterator's loop until the states
 * at its head repeat, and with this body inlined every path through it reached the head in a
 * state of its own. target_waits then took 849k of the verifier's 1M instructions and 2-5 s
 * to load, at every start of pgscope; called, each path returns to one state, and it takes 79k.
 */
static __noinline int walk_thread(struct wait_thread_list *list, struct task_struct *thread, __u64 weight)
{
	__u32 tgid = thread->tgid;
	if (!profiled(tgid))
		return 0;
	struct pgscope_wait_sample_task *state = bpf_task_storage_get(&wait_sample_tasks, thread, 0, 0);
	/* Snapshotted before the walk, as active in the last run. */
	if (state && state->visited_run == list->run)
		return 0;
	if (!thread->exit_state)
		count_exact_at_run(thread, tgid, weight);
	if (thread->exit_state || thread->on_cpu) {
		count(PGSCOPE_CNT_WAIT_SKIPPED);
		if (thread->on_cpu)
			note_active(list, thread->pid);
		return 0;
	}
	/* Not run since its last sample (an idle backend): repeated, after a look at its switch
	 * count alone. Else its snapshot; a thread never sampled has no storage yet, its visit
	 * takes it. */
	if (state) {
		state->snapshot_switches = thread->nvcsw + thread->nivcsw + 1;
		if (repeat_unchanged(thread, tgid, state, weight, true))
			return 0;
		snapshot_thread(thread, state, list->run);
	}
	__u32 n = list->count;
	if (n >= WAIT_THREADS_MAX) {
		count(PGSCOPE_CNT_WAIT_THREADS_OVER);
		return 0;
	}
	list->tids[n & (WAIT_THREADS_MAX - 1)] = thread->pid;
	list->count = n + 1;
	return 0;
}

/*
 * Walks the host's threads with the open-coded task iterator (walk_thread for each). Not a walk
 * of `targets` (bpf_for_each_map_elem): that visits each of its 65536 buckets, over a
 * millisecond, every tick.
 */
static __always_inline void walk_target_threads(struct wait_thread_list *list, __u64 weight)
{
	struct bpf_iter_task threads;
	struct task_struct *thread;

	/* The count is kept in the map value, not a register: the verifier then sees the loop's
	 * states converge. */
	list->count = 0;
	bpf_rcu_read_lock();
	bpf_iter_task_new(&threads, NULL, TASK_ITER_ALL_THREADS);
	while ((thread = bpf_iter_task_next(&threads)))
		walk_thread(list, thread, weight);
	bpf_iter_task_destroy(&threads);
	bpf_rcu_read_unlock();
}

/* Visits a thread in the first pass, and notes what the run must: a thread active in it (not
 * found unchanged since its last sample) is visited first in the next run, one with a stack to
 * copy goes to the second pass. */
static __always_inline void visit_thread(struct wait_thread_list *list, struct task_struct *task, __u32 tid,
					 const struct shared_copy *status)
{
	enum wait_visit visit = visit_waiting_thread(task, task->tgid, list->run, status);
	if (visit != WAIT_VISIT_REPEATED)
		note_active(list, tid);
	if (visit == WAIT_VISIT_PENDING) {
		__u32 n = list->pending;
		if (n < WAIT_THREADS_MAX) {
			list->pending_tids[n & (WAIT_THREADS_MAX - 1)] = tid;
			list->pending = n + 1;
			return;
		}
		/* No room for its stack: counted without one, and said so. */
		count(PGSCOPE_CNT_WAIT_THREADS_OVER);
		struct pgscope_wait_sample_task *state = bpf_task_storage_get(&wait_sample_tasks, task, 0, 0);
		__u32 zero = 0;
		__u64 *weight_ns = bpf_map_lookup_elem(&wait_sample_config, &zero);
		if (state && weight_ns) {
			state->attr.flags |= PGSCOPE_ATTR_STACK_NOT_SAMPLED;
			state->kind = PGSCOPE_WAIT_SAMPLE_NONE;
			count_sampled(task->tgid, &state->attr, *weight_ns);
		}
	}
}

/*
 * The wait-event words of the threads off their CPU at their snapshots are read in one batch: each
 * is in the backend's PGPROC, in the shared memory the postmaster mapped before forking it, at
 * the same address in every process of the instance, and a busy instance's PGPROCs are mostly
 * adjacent. One read of another process's memory took 2-5 us here (most of it finding the
 * pages, not copying): read one by one, the eviction storm's 16 backends' words were read up to
 * 80 us after their snapshots, about 1.4 of them a tick run since, their word then guessed
 * (0.4 with the batch, read ~8 us after).
 * So are the fields of their status entries a visit reads (state, queryid), side by side in
 * the instance's BackendStatusArray: two reads a visit were a good part of a run (81 us of BPF
 * time a run on the storm, 62 with them batched), and a run is time a backend loses its CPU to
 * the sampler (one holding a lock makes the others wait that much longer; the exact tracer
 * counts it, the samples, taken before, cannot).
 * A batch spans the threads of one instance (the first met; the others' are read one by one), up
 * to the size of the scratch buffer; those past it are read one by one.
 */
static __always_inline void extend_span(__u64 *start, __u64 *end, __u64 from, __u64 to)
{
	if (!*end || from < *start)
		*start = from;
	if (!*end || to > *end)
		*end = to;
}

static __always_inline void join_batch(struct wait_thread_list *list, struct task_struct *task,
				       struct pgscope_wait_sample_task *state, __u32 tid)
{
	/* On a CPU: its word is not read in the batch; nor is its status entry, which is read in
	 * its visit, if it has one. */
	if (task->on_cpu)
		return;
	__u32 postmaster = BPF_CORE_READ(task, real_parent, tgid);
	if (!list->batch_tid) {
		list->batch_tid = tid;
		list->batch_postmaster = postmaster;
	} else if (postmaster != list->batch_postmaster) {
		return;
	}
	__u64 entry = state->status_entry;
	__u32 tgid = task->tgid;
	struct pgscope_pg_layout *layout = entry ? bpf_map_lookup_elem(&pg_layouts, &tgid) : NULL;
	if (layout) {
		__u32 first = layout->st_state_offset, last = layout->st_query_id_offset;
		if (last < first)
			last = first;
		extend_span(&list->status_start, &list->status_end, entry + first, entry + last + 8);
	}
	__u64 word = state->wait_event_ptr;
	if (!word)
		return;
	extend_span(&list->batch_start, &list->batch_end, word, word + 4);
}

/* Reads `start`..`end` of the batch's instance into `buffer`, up to its size; the bytes read. */
static __always_inline __u32 read_span(struct wait_thread_list *list, __u64 start, __u64 end, __u8 *buffer)
{
	if (!list->batch_tid || end <= start)
		return 0;
	struct task_struct *task = bpf_task_from_pid(list->batch_tid);
	if (!task)
		return 0;
	__u32 read = 0;
	/* Exited since its snapshot, and its pid taken by a thread of another process. */
	if (BPF_CORE_READ(task, real_parent, tgid) == list->batch_postmaster) {
		__u64 span = end - start;
		__u32 size = span > PGSCOPE_USER_STACK_MAX ? PGSCOPE_USER_STACK_MAX : span;
		if (size && bpf_copy_from_user_task(buffer, size, (void *)start, task, 0) == 0)
			read = size;
	}
	bpf_task_release(task);
	return read;
}

/*
 * Copies the stack of a thread off its CPU at its snapshot into the run's next early slot,
 * with the registers it entered the kernel with and the returns uretprobes replaced; kept
 * when the thread did not run before the copy ended (else the copy may be of a later wait, and
 * the second pass tries again). 1 when kept. Not inlined, like take_batched, its caller.
 */
static __noinline int copy_stack_early(struct task_struct *task, struct pgscope_wait_sample_task *state,
				       struct wait_thread_list *list)
{
	__u32 slot = list->early_stacks;
	if (slot >= WAIT_EARLY_STACKS)
		return 0;
	struct pgscope_sample *s = bpf_map_lookup_elem(&wait_early_stacks, &slot);
	if (!s)
		return 0;
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	s->user_ip = regs->ip;
	s->user_sp = regs->sp;
	s->user_bp = regs->bp;
	__u64 len = copy_task_stack(s, task);
	if (!len || ran_since_snapshot(task, state))
		return 0;
	s->user_stack_len = len;
	restore_uretprobe_returns(s, task, len);
	state->snapshot_flags |= PGSCOPE_WAIT_SNAPSHOT_STACK | (slot << PGSCOPE_WAIT_SNAPSHOT_SLOT_SHIFT);
	list->early_stacks = slot + 1;
	return 1;
}

/* Whether a thread's snapshot found it off its CPU in a wait it ran into since its last sample
 * (not one the visit repeats). */
static __always_inline bool snapshot_waits_anew(struct pgscope_wait_sample_task *state)
{
	return !(state->snapshot_flags & PGSCOPE_WAIT_SNAPSHOT_ON_CPU) && state->snapshot_switches != state->switches;
}

/* Whether the batches read before a thread's snapshot hold what it showed at it: it was off
 * its CPU then and has not run since (its switch count at the mark is the snapshot's). */
static __always_inline bool snapshot_batched(struct pgscope_wait_sample_task *state)
{
	return state->batch_switches && state->batch_switches == (__u32)state->snapshot_switches &&
	       !(state->snapshot_flags & PGSCOPE_WAIT_SNAPSHOT_ON_CPU);
}

/* Whether a thread's wait, by the word it showed at its snapshot, is one sampled with a stack:
 * not its client's, not a background process's main loop (waits_for_work), and either one
 * Postgres reports or one it was just woken from (runnable in a syscall, not on a CPU yet: it
 * runs within microseconds, and 17% of these lost their stack to the second pass on the
 * row-lock storm, when 1% of the others did). */
static __always_inline bool snapshot_needs_stack(struct pgscope_wait_sample_task *state)
{
	__u32 word = state->snapshot_wait_event, class = word & PG_WAIT_CLASS_MASK;
	bool woken = state->snapshot_task_state == TASK_RUNNING_STATE && state->snapshot_syscall >= 0;
	return snapshot_waits_anew(state) && (state->snapshot_flags & PGSCOPE_WAIT_SNAPSHOT_WORD) &&
	       (word || woken) && class != PG_WAIT_CLIENT && class != PG_WAIT_ACTIVITY;
}

/* bpf_loop over the threads active in the last run, first of all: their switch counts, and
 * what the run's batches span. A busy backend changes state every few tens of microseconds,
 * and the walk takes ~165 ns per thread of the host (on this VM, ~50 us before it reaches
 * Postgres' threads, the newest): the run's perturbation (the thread it displaced may hold a
 * lock the others then queue on) would have grown by then. Marked, so that the walk leaves
 * them alone. Since the last run a thread's process may have left the targets (exec), or the
 * thread exited and another took its pid: checked again. */
static long mark_active(__u64 index, struct list_ctx *ctx)
{
	struct wait_thread_list *list = ctx->list;
	__u32 tid = list->active_tids[list->run & 1][index & (WAIT_THREADS_MAX - 1)];
	struct task_struct *task = bpf_task_from_pid(tid);
	if (!task)
		return 0;
	struct pgscope_wait_sample_task *state =
		profiled(task->tgid) ? bpf_task_storage_get(&wait_sample_tasks, task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE)
				     : NULL;
	if (state) {
		state->visited_run = list->run;
		state->batch_switches = task->on_cpu ? 0 : (__u32)(task->nvcsw + task->nivcsw + 1);
		join_batch(list, task, state, tid);
	}
	bpf_task_release(task);
	return 0;
}

/* The `index`th thread active in the last run (a reference the caller releases; NULL when
 * gone) and, when this run marked it, its state. */
static __always_inline struct task_struct *snapshotted_active(struct wait_thread_list *list, __u64 index,
							      struct pgscope_wait_sample_task **state)
{
	__u32 tid = list->active_tids[list->run & 1][index & (WAIT_THREADS_MAX - 1)];
	struct task_struct *task = bpf_task_from_pid(tid);
	*state = NULL;
	if (!task)
		return NULL;
	struct pgscope_wait_sample_task *found = bpf_task_storage_get(&wait_sample_tasks, task, 0, 0);
	if (found && found->visited_run == list->run)
		*state = found;
	return task;
}

/*
 * Right after a thread's snapshot. Not run since the batches were read, what they hold of it is
 * what it showed at its snapshot, its word and its status entry (state, queryid) alike: its word
 * is taken, and its stack copied now when it waits with one (snapshot_needs_stack). The stack goes
 * with the status its visit takes from the batch, whatever the thread does after the copy. 1
 * when the stack was copied. Not inlined: inlined in the loop, these branches doubled the
 * verifier's work on target_waits (484k instructions).
 */
static __noinline int take_batched(struct task_struct *task, struct pgscope_wait_sample_task *state,
				   struct wait_thread_list *list, const struct shared_copy *words)
{
	if (!snapshot_batched(state))
		return 0;
	if (take_from_copy(&state->snapshot_wait_event, 4, state->wait_event_ptr, words))
		state->snapshot_flags |= PGSCOPE_WAIT_SNAPSHOT_WORD;
	return snapshot_needs_stack(state) ? copy_stack_early(task, state, list) : 0;
}

/*
 * bpf_loop over the threads active in the last run, after the batch of their words: their
 * snapshots. A thread that has not run since the batch was read (its switch count then and now
 * the same, off its CPU) shows the word read there. One waiting with a stack to take, by that
 * word (or woken from such a wait, not on a CPU yet), has its stack copied at once: the nearer the copy to the
 * snapshot, the fewer threads run in between and leave their waits with their stacks (on the
 * row-lock storm, 8 clients on 3 rows: 1.6-2.8% of the samples that sought a stack lost it with
 * every copy in the second pass, 1.1% with the copies after every snapshot and word, 0.25-0.6%
 * with each copy beside its snapshot).
 */
static long snapshot_active(__u64 index, struct list_ctx *ctx)
{
	struct wait_thread_list *list = ctx->list;
	struct pgscope_wait_sample_task *state;
	struct task_struct *task = snapshotted_active(list, index, &state);
	if (!task)
		return 0;
	if (state) {
		/* The run's look at the thread, beside its snapshot: the exact tracer's state then
		 * is the snapshot's. */
		count_exact_at_run(task, task->tgid, wait_config(0));
		snapshot_thread(task, state, list->run);
		take_batched(task, state, list, &ctx->words);
	}
	bpf_task_release(task);
	return 0;
}

/* bpf_loop over the threads active in the last run, after their snapshots: the wait-event
 * words the batch could not give (the thread ran since the mark, or is of another instance),
 * read one by one, before the walk. */
static long read_active_words(__u64 index, struct list_ctx *ctx)
{
	struct wait_thread_list *list = ctx->list;
	struct pgscope_wait_sample_task *state;
	struct task_struct *task = snapshotted_active(list, index, &state);
	if (!task)
		return 0;
	if (state && !(state->snapshot_flags & PGSCOPE_WAIT_SNAPSHOT_WORD))
		read_snapshot_word(task, state);
	bpf_task_release(task);
	return 0;
}

/* bpf_loop over the threads active in the last run, after the walk: their visits. */
static long visit_active(__u64 index, struct list_ctx *ctx)
{
	struct wait_thread_list *list = ctx->list;
	struct pgscope_wait_sample_task *state;
	struct task_struct *task = snapshotted_active(list, index, &state);
	if (!task)
		return 0;
	/* The status batch was read before the snapshots: of a thread that ran in between, it
	 * holds an earlier statement's; its visit reads the entry itself. */
	if (state)
		visit_thread(list, task, task->pid, snapshot_batched(state) ? &ctx->status : NULL);
	bpf_task_release(task);
	return 0;
}

/* bpf_loop over the threads the walk listed (checked there): the rest of the first pass's
 * visits. One gone since is not sampled. */
static long visit_listed(__u64 index, struct list_ctx *ctx)
{
	struct wait_thread_list *list = ctx->list;
	__u32 tid = list->tids[index & (WAIT_THREADS_MAX - 1)];
	struct task_struct *task = bpf_task_from_pid(tid);
	if (!task)
		return 0;
	visit_thread(list, task, tid, &ctx->status);
	bpf_task_release(task);
	return 0;
}

/* bpf_loop over the threads the first pass left since the last copy: their stacks' copy. */
static long copy_listed(__u64 index, struct list_ctx *ctx)
{
	__u64 at = ctx->copied + index;
	struct task_struct *task = bpf_task_from_pid(ctx->list->pending_tids[at & (WAIT_THREADS_MAX - 1)]);
	if (!task)
		return 0;
	if (copy_waiting_stack(task) < 0)
		count(PGSCOPE_CNT_NO_SCRATCH);
	bpf_task_release(task);
	return 0;
}

static __always_inline struct wait_thread_list *thread_list(void)
{
	__u32 zero = 0;
	struct wait_thread_list *list = bpf_map_lookup_elem(&wait_sample_threads, &zero);
	if (!list)
		count(PGSCOPE_CNT_NO_SCRATCH);
	return list;
}

/* A run, in one program: the last run's active threads snapshotted, visited and their stacks
 * copied; then the walk, the visits of the threads it listed and their copies. Its weight
 * comes in its context: a map update from user space each tick cost 13 us here, and running the
 * copies as a program of their own another syscall (about 12 us, with a map read of 5 to tell
 * whether it had work); syscalls of the sampler's thread, at real-time priority, are time a
 * backend on its CPU cannot run, against 62 us for the first pass itself. And a thread that
 * runs between its visit and its stack's copy has left the wait (its stack is lost): the
 * nearer the copy, the fewer. */
SEC("syscall")
int target_waits(struct pgscope_wait_run *args)
{
	__u32 zero = 0;
	set_wait_config(zero, args->weight_ns);
	start_run();
	struct wait_thread_list *list = thread_list();
	if (!list)
		return 0;
	__u64 *weight_ns = bpf_map_lookup_elem(&wait_sample_config, &zero);
	if (!weight_ns)
		return 0;
	list->run += 1;
	list->pending = 0;
	list->next_active = 0;
	list->batch_tid = 0;
	list->early_stacks = 0;
	list->batch_end = 0;
	list->status_end = 0;
	struct list_ctx ctx = { .list = list };
	bpf_loop(list->active, mark_active, &ctx, 0);
	/* Both batches are read before the snapshots: the words into the scratch record's stack
	 * buffer (until the words are taken; the second pass copies stacks into it after), the
	 * status entries into a buffer of their own (until the visits). */
	struct pgscope_sample *scratch = this_cpu_buffer(&wait_sample_scratch);
	if (scratch) {
		ctx.words.bytes = scratch->user_stack;
		ctx.words.start = list->batch_start;
		ctx.words.read = read_span(list, list->batch_start, list->batch_end, scratch->user_stack);
	}
	struct pgscope_sample *status = this_cpu_buffer(&wait_status_scratch);
	if (status) {
		ctx.status.bytes = status->user_stack;
		ctx.status.start = list->status_start;
		ctx.status.read = read_span(list, list->status_start, list->status_end, status->user_stack);
	}
	bpf_loop(list->active, snapshot_active, &ctx, 0);
	bpf_loop(list->active, read_active_words, &ctx, 0);
	ctx.words.read = 0;
	/* The threads active in the last run (a busy instance's backends) are visited and their
	 * stacks copied before the walk of the host's threads: a thread that runs between its
	 * snapshot and its copy has left the wait, and its stack is lost. On a row-lock storm (8
	 * clients on 3 rows) 1.7% of the off-CPU samples that sought a stack lost it with the walk
	 * (~50 us on this VM, ~0.5 ms on a host of 1000 threads) between. */
	bpf_loop(list->active, visit_active, &ctx, 0);
	start_stack_pass();
	ctx.copied = 0;
	bpf_loop(list->pending, copy_listed, &ctx, 0);
	ctx.copied = list->pending;
	/* The status entries' batch is of the last run's active threads, read before their
	 * snapshots: the walk's threads read theirs one by one. */
	ctx.status.read = 0;
	walk_target_threads(list, *weight_ns);
	bpf_loop(list->count, visit_listed, &ctx, 0);
	/* The next run reads the half this one wrote. */
	list->active = list->next_active;
	if (list->pending > ctx.copied)
		bpf_loop(list->pending - ctx.copied, copy_listed, &ctx, 0);
	wake_consumer();
	return 0;
}

/* Run once when the sampler stops: adds every thread's deferred ticks to its total, so that
 * the totals user space reads last hold them all. */
SEC("syscall")
int target_waits_flush(void *unused)
{
	struct bpf_iter_task threads;
	struct task_struct *thread;

	bpf_rcu_read_lock();
	bpf_iter_task_new(&threads, NULL, TASK_ITER_ALL_THREADS);
	while ((thread = bpf_iter_task_next(&threads))) {
		__u32 tgid = thread->tgid;
		if (!bpf_map_lookup_elem(&targets, &tgid))
			continue;
		struct pgscope_wait_sample_task *state = bpf_task_storage_get(&wait_sample_tasks, thread, 0, 0);
		if (state)
			flush_deferred(state, tgid);
	}
	bpf_iter_task_destroy(&threads);
	bpf_rcu_read_unlock();
	return 0;
}
