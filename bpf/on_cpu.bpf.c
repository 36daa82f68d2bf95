// SPDX-License-Identifier: GPL-2.0
/*
 * On-CPU sampling: a perf-event program on the CPU clock of every CPU, filtered to the
 * processes in `targets`.
 *
 * A part of the one BPF object: agent/build.rs includes the parts in the order of its
 * BPF_PARTS list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h, so that
 * every program shares the maps. Not compiled on its own.
 */

/* The trigger the thread runs for the sample's statement, innermost first: a frame left by a
 * call that never ended (an error's longjmp out of the trigger) is of an earlier statement. */
static __always_inline void innermost_trigger(__u32 tid, struct pgscope_sample *s)
{
	s->trigger_oid = 0;
	s->trigger_constraint = 0;
	struct pgscope_trigger_stack *stack = bpf_map_lookup_elem(&trigger_stacks, &tid);
	if (!stack || !s->statement_start)
		return;
	for (int i = PGSCOPE_TRIGGER_NESTING_MAX - 1; i >= 0; i--) {
		if ((__u32)i >= stack->depth || stack->frames[i].statement_start != s->statement_start)
			continue;
		s->trigger_oid = stack->frames[i].trigger_oid;
		s->trigger_constraint = stack->frames[i].constraint_oid;
		return;
	}
}

SEC("perf_event")
int on_cpu_sample(struct bpf_perf_event_data *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	if (!profiled(tgid))
		return 0;
	count(PGSCOPE_CNT_SAMPLES);

	struct pgscope_sample *s = this_cpu_buffer(&scratch);
	if (!s) {
		count(PGSCOPE_CNT_NO_SCRATCH);
		return 0;
	}

	s->statement_start = 0;
	read_attribution(&s->attr, tgid, NULL, false, &s->statement_start);
	if ((s->attr.flags & PGSCOPE_ATTR_STATUS) && !s->attr.query_id && s->statement_start) {
		/* Before parse analysis reports it: pgss_store's argument, when it is storing this
		 * very statement (see pgss_storing). */
		__u32 tid = (__u32)pid_tgid;
		struct pgss_storing *storing = bpf_map_lookup_elem(&pgss_storing, &tid);

		if (storing && storing->statement_start == s->statement_start)
			s->attr.query_id = storing->query_id;
	}
	innermost_trigger((__u32)pid_tgid, s);
	s->off_cpu_ns = 0;
	s->off_cpu_syscall = 0;
	s->off_cpu_flags = 0;
	send_stacks(ctx, s, pid_tgid, true);
	return 0;
}
