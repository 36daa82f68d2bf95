//! The wait sampler's passes over the targets' threads alone (`bpf/wait_targets.bpf.c`): a
//! sleepable syscall program that calls kfuncs, run each tick with `BPF_PROG_RUN` (both passes,
//! its samples' weight in its context), and one run when the sampler stops. aya 0.14 cannot
//! load kfunc calls, so they are a second object, loaded with libbpf, that creates no
//! map of its own: each of its maps is the main object's (aya's), handed over by descriptor
//! before the load. Kernels without the kfuncs (before Linux 6.7) refuse the object, and the
//! sampler runs its task iterators instead.

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use aya::Ebpf;
use libbpf_rs::query::{ProgInfoIter, ProgInfoQueryOptions};
use libbpf_rs::{Object, ObjectBuilder, PrintLevel, Program, ProgramInput};
use tracing::debug;

use super::abi::WaitRun;

static KFUNC_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pgscope-kfunc.bpf.o"));

/// A run: the first pass decides each thread's sample, the second copies the stacks of the
/// threads the first left to it.
const RUN: &str = "target_waits";
/// Run once when the sampler stops: adds the idle ticks deferred in threads' storage to their
/// totals.
const FLUSH: &str = "target_waits_flush";

/// The kfunc object, loaded, its maps the main object's.
pub struct TargetPasses {
    object: Object,
}

impl TargetPasses {
    /// Loads the kfunc object against `main`'s maps. An error says why the kernel refused it
    /// (libbpf's own messages go to the debug log).
    pub fn load(main: &Ebpf) -> Result<Self> {
        libbpf_rs::set_print(Some((PrintLevel::Debug, log_libbpf)));
        let mut open = ObjectBuilder::default()
            .open_memory(KFUNC_OBJECT)
            .context("opening the kfunc BPF object")?;
        for mut map in open.maps_mut() {
            let name = map.name().to_string_lossy().into_owned();
            let shared = main
                .map(&name)
                .ok_or_else(|| anyhow!("the kfunc BPF object's map `{name}` is not the main object's"))?;
            map.reuse_fd(super::map_fd::map_fd(shared))
                .with_context(|| format!("sharing the map `{name}` with the kfunc BPF object"))?;
        }
        let object = open.load().context(
            "the kernel refused the kfunc BPF object (bpf_task_from_pid and task iterators need Linux 6.7)",
        )?;
        for name in [RUN, FLUSH] {
            if !object.progs().any(|program| program.name() == OsStr::new(name)) {
                return Err(anyhow!("the kfunc BPF object has no program `{name}`"));
            }
        }
        let passes = Self { object };
        for (name, instructions) in passes.verified_instructions() {
            debug!("the verifier processed {instructions} instructions of `{name}`");
        }
        Ok(passes)
    }

    /// How many instructions the verifier processed to accept each program (its limit is a
    /// million): what loading costs, at every start of pgscope, and how near a kernel whose
    /// verifier prunes less would come to refusing it. Programs the kernel does not say it of
    /// (before Linux 5.16) are left out.
    pub fn verified_instructions(&self) -> Vec<(String, u32)> {
        let ids: Vec<(String, u32)> = self
            .object
            .progs()
            .filter_map(|program| {
                let id = Program::id_from_fd(program.as_fd()).ok()?;
                Some((program.name().to_string_lossy().into_owned(), id))
            })
            .collect();
        ProgInfoIter::with_query_opts(ProgInfoQueryOptions::default())
            .filter(|info| info.verified_insns > 0)
            .filter_map(|info| {
                let (name, _) = ids.iter().find(|(_, id)| *id == info.id)?;
                Some((name.clone(), info.verified_insns))
            })
            .collect()
    }

    /// Runs both passes over every thread of the targets, its samples weighing `weight`.
    pub fn run(&self, weight: Duration) -> Result<()> {
        // `struct pgscope_wait_run`, as the program reads it: one native-endian u64.
        const _: () = assert!(std::mem::size_of::<WaitRun>() == 8);
        let mut context = (weight.as_nanos() as u64).to_ne_bytes();
        self.run_with(RUN, Some(&mut context))
    }

    /// Adds every thread's deferred idle ticks to its total: run when the sampler stops, so
    /// that the totals read after hold them all.
    pub fn flush(&self) -> Result<()> {
        self.run_with(FLUSH, None)
    }

    /// Runs the program `name` with `context` as its context.
    fn run_with(&self, name: &str, context: Option<&mut [u8]>) -> Result<()> {
        let program = self
            .object
            .progs_mut()
            .find(|program| program.name() == OsStr::new(name))
            .ok_or_else(|| anyhow!("the kfunc BPF object has no program `{name}`"))?;
        let input = ProgramInput {
            context_in: context,
            ..ProgramInput::default()
        };
        program
            .test_run(input)
            .with_context(|| format!("running `{name}`"))?;
        Ok(())
    }
}

fn log_libbpf(level: PrintLevel, message: String) {
    let message = message.trim_end();
    match level {
        PrintLevel::Warn => debug!(target: "pgscope::libbpf", "warning: {message}"),
        _ => debug!(target: "pgscope::libbpf", "{message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::OnCpuProbes;

    /// Half the verifier's limit. With the walk's body inlined in its iterator loop,
    /// `target_waits` took 848762 instructions and 2-5 s to load on one 6.18 kernel; called,
    /// 79436. The same code took over the million on 6.18.44 (refused, E2BIG), where its
    /// attribution reads are now three called functions with their flags in memory: 339495
    /// there (413471 with the stacks copied at the snapshots and the status batch read before
    /// them, the exact tracer's state and the batches' use in called functions). Kernels prune differently; half the limit leaves either room, and a path that
    /// multiplies the states again fails here before it fails on a user's kernel.
    const MOST_VERIFIED_INSTRUCTIONS: u32 = 500_000;

    /// Needs root and a kernel with the kfuncs (Linux 6.7), as the sampler does; fails, never
    /// skips, without them.
    #[test]
    fn the_verifier_accepts_each_pass_well_within_its_limit() -> Result<()> {
        let main = OnCpuProbes::load()?;
        let passes = TargetPasses::load(&main.ebpf)?;
        let verified = passes.verified_instructions();
        for name in [RUN, FLUSH] {
            let (_, instructions) =
                verified
                    .iter()
                    .find(|(program, _)| program == name)
                    .ok_or_else(|| {
                        anyhow!("the kernel did not say how many instructions it verified of `{name}`")
                    })?;
            assert!(
                *instructions <= MOST_VERIFIED_INSTRUCTIONS,
                "the verifier processed {instructions} instructions of `{name}`, over {MOST_VERIFIED_INSTRUCTIONS}: \
                 a path that multiplies the verifier's states (an inlined body in an iterator loop?)"
            );
        }
        Ok(())
    }
}
