// SPDX-License-Identifier: GPL-2.0
/*
 * Which trigger each thread runs: two uprobes, on the entries of pgstat_init_function_usage and
 * pgstat_end_function_usage. Postgres calls the first before every trigger function with the
 * call's FunctionCallInfo, whose `context` is then the TriggerData, and the second after it with
 * the same usage record (ExecCallTriggerFunc, in every major since 14). Both are exported, so
 * they are found on stripped builds, and the probes only read the backend's memory.
 *
 * The same calls wrap set-returning and tracked function calls, whose context is no TriggerData:
 * those are skipped, at the cost of their traps, which user space counts against the probe
 * budget (PGSCOPE_CNT_TRIGGER_PROBE_HITS, by every process mapping the file).
 *
 * A part of the one BPF object: agent/build.rs includes the parts in the order of its
 * BPF_PARTS list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h, so that
 * every program shares the maps. Not compiled on its own.
 */

/* Drops the frames of calls at or below `usage` on the stack (the stack grows down): the call
 * that ends there, and calls nested in it that never ended (an error's longjmp). */
static __always_inline void end_trigger_calls(struct pgscope_trigger_stack *stack, __u64 usage)
{
	for (int i = PGSCOPE_TRIGGER_NESTING_MAX - 1; i >= 0; i--) {
		if ((__u32)i >= stack->depth)
			continue;
		if (stack->frames[i].usage > usage)
			return;
		stack->depth = i;
	}
}

/* The trigger a call is of: its TriggerData's tg_trigger, when `fcinfo->context` is one. */
static __always_inline bool read_trigger(struct pgscope_pg_layout *layout, __u64 fcinfo,
					 struct pgscope_trigger_frame *frame)
{
	__u64 context = 0, trigger = 0;
	__u32 tag = 0;

	if (bpf_probe_read_user(&context, 8, (void *)(fcinfo + layout->fcinfo_context_offset)) != 0 ||
	    !context || bpf_probe_read_user(&tag, 4, (void *)context) != 0 ||
	    tag != layout->trigger_data_tag)
		return false;
	if (bpf_probe_read_user(&trigger, 8, (void *)(context + layout->tg_trigger_offset)) != 0 || !trigger)
		return false;
	if (bpf_probe_read_user(&frame->trigger_oid, 4, (void *)(trigger + layout->tgoid_offset)) != 0 ||
	    bpf_probe_read_user(&frame->constraint_oid, 4, (void *)(trigger + layout->tgconstraint_offset)) != 0)
		return false;
	return frame->trigger_oid != 0;
}

/* Counts a trap of either probe, whoever takes it (their cost); true for a profiled process's,
 * which a function probe's call around it then has in its time (see probe_traps). */
static __always_inline bool trigger_probe_trap(__u32 tgid, __u32 tid)
{
	count(PGSCOPE_CNT_TRIGGER_PROBE_HITS);
	if (!profiled(tgid))
		return false;
	count_trap(tid);
	return true;
}

/* pgstat_init_function_usage(FunctionCallInfo fcinfo, PgStat_FunctionCallUsage *fcu) */
SEC("uprobe")
int on_function_usage_start(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;

	if (!trigger_probe_trap(tgid, tid))
		return 0;
	struct pgscope_pg_layout *layout = bpf_map_lookup_elem(&pg_layouts, &tgid);
	if (!layout || !layout->trigger_data_tag || !layout->my_be_entry || !layout->st_activity_start_offset)
		return 0;
	__u64 usage = PT_REGS_PARM2(ctx);
	struct pgscope_trigger_stack *stack = bpf_map_lookup_elem(&trigger_stacks, &tid);
	if (stack)
		end_trigger_calls(stack, usage);
	struct pgscope_trigger_frame frame = { .usage = usage };
	if (!read_trigger(layout, PT_REGS_PARM1(ctx), &frame))
		return 0;
	__u64 entry = status_entry(layout);
	if (!entry || entry == STATUS_UNREADABLE ||
	    bpf_probe_read_user(&frame.statement_start, 8, (void *)(entry + layout->st_activity_start_offset)) != 0)
		return 0;
	if (!stack) {
		struct pgscope_trigger_stack empty = {};
		bpf_map_update_elem(&trigger_stacks, &tid, &empty, BPF_NOEXIST);
		stack = bpf_map_lookup_elem(&trigger_stacks, &tid);
		if (!stack)
			return 0;
	}
	__u32 depth = stack->depth;
	if (depth >= PGSCOPE_TRIGGER_NESTING_MAX) {
		/* Deeper than kept: samples in it show the outermost triggers' names. */
		count(PGSCOPE_CNT_TRIGGER_NESTING_OVER);
		return 0;
	}
	stack->frames[depth] = frame;
	stack->depth = depth + 1;
	return 0;
}

/* pgstat_end_function_usage(PgStat_FunctionCallUsage *fcu, bool finalize) */
SEC("uprobe")
int on_function_usage_end(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;

	if (!trigger_probe_trap(tgid, tid))
		return 0;
	struct pgscope_trigger_stack *stack = bpf_map_lookup_elem(&trigger_stacks, &tid);
	if (stack)
		end_trigger_calls(stack, PT_REGS_PARM1(ctx));
	return 0;
}
