// SPDX-License-Identifier: GPL-2.0
/*
 * Stack capture shared by on-CPU samples and off-CPU wait starts: the kernel stack, the user
 * registers and a bounded copy of the user stack, unwound in user space from .eh_frame.
 *
 * A part of the one BPF object: agent/build.rs includes the parts in the order of its
 * BPF_PARTS list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h, so that
 * every program shares the maps. Not compiled on its own.
 */

/* Pages of a user stack copied one by one: the first, then up to this many whole ones, all
 * within PGSCOPE_USER_STACK_MAX (the first is at most a page). */
#define USER_STACK_PAGES_AFTER_FIRST (PGSCOPE_USER_STACK_MAX / 4096 - 1)

/*
 * The copy of `len` bytes from `sp` when the copy in one read faulted: it fails whole when any
 * page of the range cannot be read without a fault, which a sample cannot take (a page never
 * touched or not present; a regex-bound backend keeps large arrays on its stack). Copied page
 * by page, a page that faults is left zero (the read helper zeroes what it cannot read) and
 * the frames above it stay: their return addresses and saved registers are in pages that were
 * read. With the fallback to sp's page alone, a regex-bound backend lost the frames above the
 * engine in 44% of its samples in 1 of 8 runs (and in a CI run), in none of 26 runs after.
 * Only a fault of the first page (sp's) loses the stack; a fault of a later one is counted as
 * a partial copy, though the frames may all be there.
 */
static __always_inline __u64 copy_user_stack_by_page(struct pgscope_sample *s, __u64 sp, __u64 len)
{
	/* Within sp's page: one read. Else `first` stays 4096 - (sp & 4095), a range the verifier
	 * knows: clamped to `len` instead, its bound was lost on Linux 6.1 (it does not narrow a
	 * register compared with another), and the whole pages' reads past it were refused. */
	__u64 first = 4096 - (sp & 4095);
	if (len <= first) {
		if (len && bpf_probe_read_user(s->user_stack, len, (void *)sp) == 0)
			return len;
		count(PGSCOPE_CNT_USER_STACK_LOST);
		return 0;
	}
	if (bpf_probe_read_user(s->user_stack, first, (void *)sp) != 0) {
		count(PGSCOPE_CNT_USER_STACK_LOST);
		return 0;
	}
	bool faulted = false;
	for (__u32 page = 0; page < USER_STACK_PAGES_AFTER_FIRST; page++) {
		__u64 offset = first + (__u64)page * 4096;
		if (offset >= len)
			break;
		/* Whole pages past the first end within the buffer: first <= 4096. The last may
		 * read past `len` (beyond the stack's start, zero where unmapped); only `len` bytes
		 * are sent. The offset is opaque to the compiler from here: else it folds
		 * `- (sp & 4095)` into the buffer's address, a pointer with a negative variable
		 * offset that Linux 6.1's verifier refuses as unbounded. */
		barrier_var(offset);
		if (offset > PGSCOPE_USER_STACK_MAX - 4096)
			break;
		if (bpf_probe_read_user(&s->user_stack[offset], 4096, (void *)(sp + offset)) != 0)
			faulted = true;
	}
	if (faulted)
		count(PGSCOPE_CNT_USER_STACK_FAULT);
	return len;
}

/* Copies the user stack from sp upwards. mm->start_stack bounds the main thread's stack (every
 * Postgres process is single-threaded); bpf_probe_read_user cannot fault pages in and zero-fills
 * on failure, so on a fault the stack is copied page by page (copy_user_stack_by_page). */
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
	return copy_user_stack_by_page(s, sp, len);
}

/* Return instances of in-flight uretprobes patched back per sample, a bounded loop (deeper nesting is rare:
 * one per probed function active in the thread). */
#define MAX_URETPROBE_FRAMES 8

/* A uretprobe replaces the return address of the probed call on the user stack with the
 * [uprobes] trampoline, which has no unwind information: stacks through a probed function in
 * flight would end there. The kernel keeps the original address and the stack slot it took it
 * from in task->utask->return_instances (innermost first); put them back into the copy. */
static __always_inline void restore_uretprobe_returns(struct pgscope_sample *s, struct task_struct *task, __u64 len)
{
	struct uprobe_task *utask = BPF_CORE_READ(task, utask);
	if (!utask)
		return;
	struct return_instance *ri = BPF_CORE_READ(utask, return_instances);

	for (int i = 0; i < MAX_URETPROBE_FRAMES && ri; i++) {
		__u64 slot = BPF_CORE_READ(ri, stack);
		__u64 original = BPF_CORE_READ(ri, orig_ret_vaddr);
		if (slot >= s->user_sp && slot + 8 <= s->user_sp + len) {
			__u64 offset = slot - s->user_sp;
			if (offset <= PGSCOPE_USER_STACK_MAX - 8)
				__builtin_memcpy(&s->user_stack[offset], &original, 8);
		}
		ri = BPF_CORE_READ(ri, next);
	}
}

/* Sends a sample whose user stack copy holds `len` bytes, as they are; only the used prefix of
 * the stack crosses the ring buffer. False when the ring buffer was full (counted). */
static __always_inline bool output_copied_sample(struct pgscope_sample *s, __u64 len, __u64 flags)
{
	s->user_stack_len = len;
	__u64 size = PGSCOPE_SAMPLE_STACK_OFFSET + len;
	if (size > sizeof(*s))
		size = sizeof(*s);
	if (bpf_ringbuf_output(&samples, s, size, flags)) {
		count(PGSCOPE_CNT_RINGBUF_FULL);
		return false;
	}
	return true;
}

/* Sends a sample whose user stack copy holds `len` bytes, the return addresses uretprobes
 * replaced put back (the task's, now: it has not run since the copy). */
static __always_inline bool output_sample(struct pgscope_sample *s, struct task_struct *task, __u64 len,
					  __u64 flags)
{
	restore_uretprobe_returns(s, task, len);
	return output_copied_sample(s, len, flags);
}

/* Fills in the current task's identity, kernel stack, user registers and user stack copy, and
 * sends the record (false: the ring buffer was full). The attribution fields are the caller's. */
static __always_inline bool send_stacks(void *ctx, struct pgscope_sample *s, __u64 pid_tgid, bool kernel)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);

	s->tgid = pid_tgid >> 32;
	s->tid = (__u32)pid_tgid;
	s->time_ns = bpf_ktime_get_ns();
	s->cpu = bpf_get_smp_processor_id();
	/* pt_regs of the task are its user registers even when the sample hit in the kernel. */
	s->user_ip = BPF_CORE_READ(regs, ip);
	s->user_sp = BPF_CORE_READ(regs, sp);
	s->user_bp = BPF_CORE_READ(regs, bp);

	long kernel_bytes = 0;
	if (kernel) {
		kernel_bytes = bpf_get_stack(ctx, s->kernel_stack, sizeof(s->kernel_stack), 0);
		if (kernel_bytes < 0) {
			count(PGSCOPE_CNT_KERNEL_STACK_FAULT);
			kernel_bytes = 0;
		}
	}
	s->kernel_frames = kernel_bytes / 8;

	/* A thread trapped on a uprobe breakpoint is sampled with its ip one byte past the int3 at
	 * the probed function's entry, where the unwind tables describe a prologue that has not run:
	 * unwind from the breakpoint address itself. Only on the kernel path, where the byte before
	 * ip is the trap instruction and not part of a longer one. */
	if (s->kernel_frames > 0) {
		__u8 opcode = 0;
		if (bpf_probe_read_user(&opcode, 1, (void *)(s->user_ip - 1)) == 0 && opcode == 0xCC)
			s->user_ip -= 1;
	}

	if (!output_sample(s, task, copy_user_stack(s, task), 0))
		return false;
	count(PGSCOPE_CNT_SENT);
	return true;
}
