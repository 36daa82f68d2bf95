// SPDX-License-Identifier: GPL-2.0
/*
 * Off-CPU classes: why a thread that is not on a CPU waits, told from its task state and the
 * syscall it blocked in. Shared by the exact tracer (off_cpu.bpf.c) and the wait sampler.
 *
 * A part of the BPF objects: agent/build.rs includes the parts of each object in the order of
 * its list into a single unit, after vmlinux.h, libbpf's headers and pgscope.h. Not compiled
 * on its own.
 */

/* Task states (include/linux/sched.h; #defines, so not in vmlinux.h). */
#define TASK_RUNNING_STATE 0x0000
#define TASK_UNINTERRUPTIBLE_STATE 0x0002
#define TASK_DEAD_STATE 0x0080

/* x86-64 syscall numbers that block for the reasons the classes name. */
static __always_inline __u32 class_of_syscall(long nr, unsigned int state)
{
	switch (nr) {
	case 202: /* futex */
	case 449: /* futex_waitv */
		return PGSCOPE_OFF_CPU_FUTEX;
	case 7:	  /* poll */
	case 23:  /* select */
	case 232: /* epoll_wait */
	case 270: /* pselect6 */
	case 271: /* ppoll */
	case 281: /* epoll_pwait */
	case 441: /* epoll_pwait2 */
		return PGSCOPE_OFF_CPU_LATCH;
	case 0:	  /* read */
	case 1:	  /* write */
	case 17:  /* pread64 */
	case 18:  /* pwrite64 */
	case 19:  /* readv */
	case 20:  /* writev */
	case 74:  /* fsync */
	case 75:  /* fdatasync */
	case 277: /* sync_file_range */
	case 295: /* preadv */
	case 296: /* pwritev */
	case 327: /* preadv2 */
	case 328: /* pwritev2 */
		return PGSCOPE_OFF_CPU_IO;
	}
	/* Uninterruptible sleep outside those (page faults on file mappings, …) is I/O too. */
	return (state & TASK_UNINTERRUPTIBLE_STATE) ? PGSCOPE_OFF_CPU_IO : PGSCOPE_OFF_CPU_OTHER;
}
