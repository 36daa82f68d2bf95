// SPDX-License-Identifier: GPL-2.0
/* An empty program on sched_switch, attached the way pgscope's off-CPU program is (tp_btf):
 * what every switch on the host pays for any switch-based off-CPU profiler, before it does
 * anything. bench/offcpu.sh measures pgbench under it beside pgscope's. */
#include <linux/types.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

SEC("tp_btf/sched_switch")
int switch_floor(__u64 *ctx)
{
	return 0;
}
