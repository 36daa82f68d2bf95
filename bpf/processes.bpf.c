// SPDX-License-Identifier: GPL-2.0
/*
 * Process tracking: forks of followed processes become targets, exec and exit leave.
 *
 * A part of the one BPF object: agent/build.rs includes the parts in the order of its
 * BPF_PARTS list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h, so that
 * every program shares the maps. Not compiled on its own.
 */

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
	if (bpf_map_update_elem(&targets, &child, &value, BPF_NOEXIST) == 0) {
		count(PGSCOPE_CNT_FORKS_FOLLOWED);
	} else if (!bpf_map_lookup_elem(&targets, &child)) {
		/* Not a target: no layout either (only a target's exit removes one). */
		count(PGSCOPE_CNT_TARGETS_FULL);
		return 0;
	}

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

/* Keep the filter map to live processes: a recycled PID must not be profiled by accident; and
 * drop the in-flight call slots of every exiting thread of a target. */
SEC("tracepoint/sched/sched_process_exit")
int on_process_exit(void *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;

	if (!bpf_map_lookup_elem(&targets, &tgid))
		return 0;
	for (__u32 function = 0; function < PGSCOPE_FN_IDS; function++) {
		__u64 key = (pid_tgid << 32) | function;
		bpf_map_delete_elem(&calls_in_flight, &key);
	}
	__u32 tid = (__u32)pid_tgid;
	/* Its storage goes with it: the idle ticks the wait sampler deferred there go to its total. */
	struct pgscope_wait_sample_task *waits =
		bpf_task_storage_get(&wait_sample_tasks, bpf_get_current_task_btf(), 0, 0);
	if (waits)
		flush_deferred(waits, tgid);
	bpf_map_delete_elem(&probe_traps, &tid);
	bpf_map_delete_elem(&pgss_storing, &tid);
	bpf_map_delete_elem(&trigger_stacks, &tid);
	if ((__u32)pid_tgid == tgid) {
		bpf_map_delete_elem(&targets, &tgid);
		bpf_map_delete_elem(&pg_layouts, &tgid);
	}
	return 0;
}
