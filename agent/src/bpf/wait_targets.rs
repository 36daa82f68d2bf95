//! The wait sampler's passes over the targets' threads alone (`bpf/wait_targets.bpf.c`): a
//! sleepable syscall program that calls kfuncs, run each tick with `BPF_PROG_RUN` (both passes,
//! its samples' weight in its context), and one run when the sampler stops. aya 0.14 cannot
//! load kfunc calls, so they are a second object, loaded with libbpf, that creates no
//! map of its own: each of its maps is the main object's (aya's), handed over by descriptor
//! before the load. Kernels without the kfuncs (before Linux 6.7) refuse the object, and the
//! sampler runs its task iterators instead.

use std::ffi::OsStr;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use aya::Ebpf;
use libbpf_rs::{Object, ObjectBuilder, PrintLevel, ProgramInput};
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
        Ok(Self { object })
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
