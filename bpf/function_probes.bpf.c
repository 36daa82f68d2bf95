// SPDX-License-Identifier: GPL-2.0
/*
 * Function probes (uprobe + uretprobe on chosen Postgres functions) and the empty pair
 * `pgscope calibrate` measures the floor cost with.
 *
 * A part of the one BPF object: agent/build.rs includes the parts in the order of its
 * BPF_PARTS list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h, so that
 * every program shares the maps. Not compiled on its own.
 */

/*
 * Function probes: uprobe + uretprobe on a handful of Postgres functions (the seven of enum
 * pgscope_function, and any others the user names), the attach cookie naming the function
 * (lower half: its id, below PGSCOPE_FN_IDS) and the attachment's slot (upper half: its gate and where
 * its arguments are, which depends on the Postgres major). Calls, time and a log2 latency
 * histogram are aggregated per CPU per (backend, queryid, function) in the kernel: no event per
 * call crosses to user space.
 */

struct call_entry {
	__u64 start_ns;
	__u64 query_id;
	__u32 detail; /* see PGSCOPE_CALL_DETAIL_SHIFT; s_lock: the call site's line */
	__u32 _pad;
	__u64 file; /* s_lock only: the call site's __FILE__ and __func__ */
	__u64 func;
	__u64 traps_at_entry; /* the thread's probe_traps after this call's entry trap */
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

/* Probe traps (function-probe entries and returns) taken by each thread of a target, ever: a
 * call's nested traps are the difference between its return and its entry. LRU bounds it
 * without user space; slots of exiting threads are removed in on_process_exit. An evicted
 * slot restarts at 0, which a call in flight sees as fewer traps than at its entry (counted
 * as none). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32); /* tid */
	__type(value, __u64);
} probe_traps SEC(".maps");

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
	__uint(max_entries, PGSCOPE_PROBE_SLOTS);
	__type(key, __u32);
	__type(value, __u32);
} function_gates SEC(".maps");

/* Per attachment, like function_gates: which arguments hold the values the entry program reads,
 * written by user space before it attaches. Slot 0 stays zero: nothing is read. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PGSCOPE_PROBE_SLOTS);
	__type(key, __u32);
	__type(value, struct pgscope_probe_args);
} probe_args SEC(".maps");

/* Entries per function, for the duty cycle's hit-rate measurement (user space reads deltas). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PGSCOPE_FN_IDS);
	__type(key, __u32);
	__type(value, __u64);
} function_hits SEC(".maps");

/* Entries per function by processes that are not targets. A uprobe is set on the file, so every
 * process mapping it (other instances of the same binary, tools linking the library) traps too:
 * the overhead budget counts these traps alongside the targets'. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PGSCOPE_FN_IDS);
	__type(key, __u32);
	__type(value, __u64);
} foreign_function_hits SEC(".maps");

/* Counts one probe trap of thread `tid`; returns the thread's count before it. Only the thread
 * itself writes its slot, and one thread runs one probe program at a time. */
static __always_inline __u64 count_trap(__u32 tid)
{
	__u64 one = 1, *traps = bpf_map_lookup_elem(&probe_traps, &tid);

	if (traps) {
		__u64 before = *traps;
		*traps = before + 1;
		return before;
	}
	bpf_map_update_elem(&probe_traps, &tid, &one, BPF_ANY);
	return 0;
}

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

/* Notes that thread `tid` is storing statement `query_id` in pg_stat_statements, with the start
 * of the statement its status shows now (see pgss_storing). */
static __always_inline void note_pgss_storing(__u32 tid, __u32 tgid, __u64 query_id)
{
	struct pgscope_pg_layout *layout = bpf_map_lookup_elem(&pg_layouts, &tgid);
	struct pgss_storing storing = { .query_id = query_id };

	if (!query_id || !layout || !layout->my_be_entry || !layout->st_activity_start_offset)
		return;
	__u64 entry = status_entry(layout);
	if (!entry || entry == STATUS_UNREADABLE ||
	    bpf_probe_read_user(&storing.statement_start, 8,
				(void *)(entry + layout->st_activity_start_offset)) != 0 ||
	    !storing.statement_start)
		return;
	bpf_map_update_elem(&pgss_storing, &tid, &storing, BPF_ANY);
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

/* libbpf 1.1 stops at PT_REGS_PARM5; x86-64 passes the sixth integer argument in r9. */
#ifndef PT_REGS_PARM6
#define PT_REGS_PARM6(x) (((const struct pt_regs *)(x))->r9)
#endif

/* Integer-class argument `position` (1-based, see struct pgscope_probe_args) of the probed
 * call; 0 when the position is 0 (not read). The registers are loaded first and the index picks
 * among the values: a switch over the loads could be merged by the compiler into one load at a
 * computed context offset, which the verifier refuses. */
static __always_inline __u64 probe_arg(struct pt_regs *ctx, __u8 position)
{
	__u64 regs[PGSCOPE_ARG_REGISTERS] = {
		PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
		PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx),
	};

	if (position == 0 || position > PGSCOPE_ARG_REGISTERS)
		return 0;
	return regs[position - 1];
}

static __always_inline void count_relation_lock(struct pt_regs *ctx, const struct pgscope_probe_args *args,
						__u32 tgid, __u64 query_id)
{
	struct pgscope_relation_lock_key key = {
		.tgid = tgid,
		.relid = (__u32)probe_arg(ctx, args->relid),
		.query_id = query_id,
		.lockmode = (__u32)probe_arg(ctx, args->lockmode),
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
	__u64 cookie = bpf_get_attach_cookie(ctx);
	__u32 function = (__u32)cookie;
	__u32 slot = cookie >> 32;
	__u64 *hits;

	if (!profiled(tgid)) {
		hits = bpf_map_lookup_elem(&foreign_function_hits, &function);
		if (hits)
			*hits += 1;
		return 0;
	}
	hits = bpf_map_lookup_elem(&function_hits, &function);
	if (hits)
		*hits += 1;
	struct call_entry entry = {};
	entry.traps_at_entry = count_trap((__u32)pid_tgid) + 1;
	/* Only the functions whose arguments are read look their positions up. User space
	 * attaches them only with a slot whose positions it filled. */
	struct pgscope_probe_args *args = NULL;

	if (function == PGSCOPE_FN_PGSS_STORE || function == PGSCOPE_FN_LOCK_RELATION_OID ||
	    function == PGSCOPE_FN_S_LOCK) {
		args = bpf_map_lookup_elem(&probe_args, &slot);
		if (!args)
			return 0;
	}

	if (function == PGSCOPE_FN_PGSS_STORE && args) {
		/* pgss_store's queryId and kind: the queryid it stores is the statement's own (also
		 * for nested statements), the kind tells text/plan/exec apart. */
		entry.query_id = probe_arg(ctx, args->query_id);
		int kind = (int)probe_arg(ctx, args->pgss_kind);

		entry.detail = (__u32)(kind + 2) & 0xff;
		/* Only the text-only store (PGSS_INVALID, from post_parse_analyze) runs before the
		 * queryid is reported; the plan and exec stores come after it. */
		if (kind == -1)
			note_pgss_storing((__u32)pid_tgid, tgid, entry.query_id);
	} else {
		entry.query_id = current_query_id(tgid);
	}
	if (function == PGSCOPE_FN_LOCK_RELATION_OID && args)
		count_relation_lock(ctx, args, tgid, entry.query_id);
	if (function == PGSCOPE_FN_S_LOCK && args) {
		/* s_lock's call site (file, line, func): only the pointers are kept; reading the
		 * strings here would cost every spin. The site goes in the return's key, not the
		 * call key, so that s_lock's own statistics stay one row per queryid. */
		entry.file = probe_arg(ctx, args->spin_file);
		entry.detail = (__u32)probe_arg(ctx, args->spin_line);
		entry.func = probe_arg(ctx, args->spin_func);
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
		/* Not a target, or its entry came before the probe was attached: a target's trap
		 * still lands inside the calls in flight around it. */
		if (bpf_map_lookup_elem(&targets, &tgid)) {
			count(PGSCOPE_CNT_PROBE_NO_ENTRY);
			count_trap((__u32)pid_tgid);
		}
		return 0;
	}
	__u64 traps = count_trap((__u32)pid_tgid);
	__u64 nested = traps > entry->traps_at_entry ? traps - entry->traps_at_entry : 0;
	if (function == PGSCOPE_FN_PGSS_STORE) {
		__u32 tid = (__u32)pid_tgid;

		bpf_map_delete_elem(&pgss_storing, &tid);
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
	stats->nested_traps += nested;
	if (elapsed > stats->max_ns)
		stats->max_ns = elapsed;
	stats->hist[bucket] += 1;
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
