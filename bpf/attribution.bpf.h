// SPDX-License-Identifier: GPL-2.0
/*
 * Attribution readers: what pg_stat_activity shows for a backend (queryid, backend type, state,
 * wait event), read from its own memory through the layout user space set for it.
 *
 * A part of the one BPF object: agent/build.rs includes the parts in the order of its
 * BPF_PARTS list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h, so that
 * every program shares the maps. Not compiled on its own.
 */

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
#define PG_WAIT_CLASS_MASK 0xFF000000
#define PG_WAIT_ACTIVITY 0x05000000 /* a background process idle in its main loop (14-18) */
#define PG_WAIT_CLIENT 0x06000000   /* the class of waits for the client (14-18) */

/* A backend waiting for its client between statements: pg_stat_activity's idle, ClientRead,
 * with the numbers of the backend's major (task's copies of its layout's). */
static __always_inline bool idle_for_client(const struct pgscope_off_cpu_task *task, __u32 wait_event_info,
					    __u32 backend_state)
{
	return task->state_idle && backend_state == task->state_idle && wait_event_info == task->wait_client_read;
}

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
		bool idle = latch && idle_for_client(task, a->wait_event_info, a->backend_state);
		if (idle || !task->st_query_id_offset ||
		    bpf_probe_read_user(&a->query_id, 8, (void *)(task->status_entry + task->st_query_id_offset)) == 0)
			flags |= PGSCOPE_ATTR_STATUS;
	}
	if (flags != (known | PGSCOPE_ATTR_STATUS | PGSCOPE_ATTR_WAIT_EVENT))
		count(PGSCOPE_CNT_ATTRIBUTION_FAULT);
	a->flags = flags;
	return true;
}

/* With `statement_start` (on-CPU samples), the backend's st_activity_start_timestamp is read
 * too, from the status entry already found (left as it is when unknown). */
static __always_inline void read_attribution(struct pgscope_attribution *a, __u32 tgid,
					     struct pgscope_off_cpu_task *task, bool latch,
					     __u64 *statement_start)
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
	if (task) {
		task->state_idle = layout->state_idle;
		task->wait_client_read = layout->wait_client_read;
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
		if (statement_start && layout->st_activity_start_offset &&
		    bpf_probe_read_user(statement_start, 8,
					(void *)(entry + layout->st_activity_start_offset)) != 0)
			*statement_start = 0;
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
