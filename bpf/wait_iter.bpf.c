// SPDX-License-Identifier: GPL-2.0
/*
 * The wait sampler's passes as task iterators: each run visits every thread of the host, and
 * samples the threads of targets (wait_sampler.bpf.h). The way on kernels without the kfuncs
 * that visit the targets alone (wait_targets.bpf.c, Linux 6.7): sleepable task iterators need
 * Linux 5.18.
 *
 * A part of the main BPF object: agent/build.rs includes the parts in the order of its
 * BPF_PARTS list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h, so that
 * every program shares the maps. Not compiled on its own.
 */

SEC("iter.s/task")
int sample_waits(struct bpf_iter__task *ctx)
{
	struct task_struct *task = ctx->task;

	if (ctx->meta->seq_num == 0)
		start_run();
	/* Past the last thread: the run's records wake the consumer once. */
	if (!task) {
		wake_consumer();
		return 0;
	}
	__u32 tgid = task->tgid;
	if (!profiled(tgid))
		return 0;
	visit_waiting_thread(task, tgid, 0, NULL);
	return 0;
}

SEC("iter.s/task")
int sample_wait_stacks(struct bpf_iter__task *ctx)
{
	struct task_struct *task = ctx->task;

	if (ctx->meta->seq_num == 0)
		start_stack_pass();
	if (!task)
		wake_consumer();
	else if (copy_waiting_stack(task) < 0)
		count(PGSCOPE_CNT_NO_SCRATCH);
	return 0;
}
