//! Per-process state: its mappings, the modules placed at their load addresses, and a framehop
//! unwinder over them. Everything heavy is shared through the [`ModuleCache`].

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use framehop::x86_64::UnwinderX86_64;
use framehop::{ExplicitModuleSectionInfo, Module, Unwinder};

use crate::cache::{FileSource, ModuleCache};
use crate::elf::Bytes;
use crate::maps::{MapEntry, MapPath};
use crate::module::ModuleData;
use crate::Location;

/// framehop stamps its rule cache with a process-wide 16-bit generation that advances with
/// every `add_module`; once it wraps, a stale rule could match again. Counting our calls lets
/// the owner of a cache replace it long before that (see [`modules_added`]).
static MODULES_ADDED: AtomicU64 = AtomicU64::new(0);

/// How many framehop modules were added in this process so far.
pub(crate) fn modules_added() -> u64 {
    MODULES_ADDED.load(Ordering::Relaxed)
}

/// A module placed in one process.
pub(crate) struct PlacedModule {
    pub avma: Range<u64>,
    /// `avma - svma` for addresses in this module.
    pub bias: u64,
    pub module: Arc<ModuleData>,
}

pub(crate) struct ProcessState {
    pub maps: Vec<MapEntry>,
    /// Sorted by start, non-overlapping.
    pub modules: Vec<PlacedModule>,
    pub unwinder: UnwinderX86_64<Bytes>,
    pub loaded_at: Instant,
    /// How long after `loaded_at` an unknown address may have the maps read again: short after
    /// a read that found new mappings, doubled after each that found none (see
    /// [`ProcessState::next_refresh_after`]).
    pub refresh_after: Duration,
}

/// The first wait before maps are read again for an unknown address, and the longest.
pub(crate) const REFRESH_AFTER_MIN: Duration = Duration::from_millis(10);
pub(crate) const REFRESH_AFTER_MAX: Duration = Duration::from_secs(1);

impl ProcessState {
    pub fn new(mut maps: Vec<MapEntry>, source: &FileSource, cache: &mut ModuleCache) -> Self {
        // The kernel lists mappings in address order; saved or hand-made lists may not.
        maps.sort_by_key(|m| m.start);
        let mut modules = place_modules(&maps, source, cache);
        modules.sort_by_key(|m| m.avma.start);
        // framehop finds modules by binary search on the start: ranges must not overlap.
        for i in 1..modules.len() {
            let next_start = modules[i].avma.start;
            let prev = &mut modules[i - 1].avma;
            if prev.end > next_start {
                tracing::debug!(start = prev.start, next_start, "clipping overlapping module");
                prev.end = next_start;
            }
        }
        modules.retain(|m| !m.avma.is_empty());

        let mut unwinder = UnwinderX86_64::new();
        for placed in &modules {
            if let Some(module) = framehop_module(placed) {
                unwinder.add_module(module);
                MODULES_ADDED.fetch_add(1, Ordering::Relaxed);
            }
        }
        ProcessState {
            maps,
            modules,
            unwinder,
            loaded_at: Instant::now(),
            refresh_after: REFRESH_AFTER_MIN,
        }
    }

    /// The wait before the next re-read, after one that found the mappings `changed` or not.
    /// A backend maps a library when it first needs it (a procedural language, an extension),
    /// and its samples there are unknown until the maps are read again: at once, not a second
    /// later (a second of each new connection's PL/pgSQL samples was lost without its stack).
    /// An address no mapping will ever hold (a corrupt stack) backs the reads off to one a
    /// second.
    pub fn next_refresh_after(previous: Duration, changed: bool) -> Duration {
        if changed {
            REFRESH_AFTER_MIN
        } else {
            (previous * 2).min(REFRESH_AFTER_MAX)
        }
    }

    pub fn mapping_for(&self, avma: u64) -> Option<&MapEntry> {
        let i = self.maps.partition_point(|m| m.start <= avma);
        self.maps[..i].last().filter(|m| avma < m.end)
    }

    pub fn module_for(&self, avma: u64) -> Option<&PlacedModule> {
        let i = self.modules.partition_point(|m| m.avma.start <= avma);
        self.modules[..i].last().filter(|m| avma < m.avma.end)
    }

    /// Whether `avma` lies in executable memory (a module or anonymous JIT code).
    pub fn is_code(&self, avma: u64) -> bool {
        self.mapping_for(avma).is_some_and(|m| m.perms.exec)
    }

    /// The location of a lookup address (already minus 1 for return addresses).
    pub fn location(&self, lookup_avma: u64) -> Location {
        match self.module_for(lookup_avma) {
            Some(placed) => Location::InModule {
                module: placed.module.id.clone(),
                addr: lookup_avma.wrapping_sub(placed.bias),
            },
            None => Location::Unmapped { addr: lookup_avma },
        }
    }
}

/// Group the executable file mappings (and the vDSO) by file and place each module.
fn place_modules(maps: &[MapEntry], source: &FileSource, cache: &mut ModuleCache) -> Vec<PlacedModule> {
    let mut placed: Vec<PlacedModule> = Vec::new();
    for (i, entry) in maps.iter().enumerate() {
        let is_module = match &entry.path {
            MapPath::File { .. } => true,
            MapPath::Pseudo(name) => name == "[vdso]",
            MapPath::Anonymous => false,
        };
        // One module per file, found through its first executable mapping.
        if !is_module || !entry.perms.exec {
            continue;
        }
        let same_file = |m: &&MapEntry| m.path == entry.path && m.inode == entry.inode && m.dev == entry.dev;
        if maps[..i].iter().filter(same_file).any(|m| m.perms.exec) {
            continue;
        }
        let module = cache.for_mapping(entry, source);
        let bias = match &module.elf {
            Some(elf) => match elf.bias_for_mapping(entry.start, entry.offset, true) {
                Some(bias) => bias,
                None => {
                    tracing::debug!(module = %module.path.display(), "mapping matches no load segment");
                    continue;
                }
            },
            // Without the file, name addresses by file offset.
            None => entry.start.wrapping_sub(entry.offset),
        };
        // The module spans all mappings of the file that agree with this placement.
        let start = maps[..=i]
            .iter()
            .rev()
            .take_while(|m| m.path == entry.path && m.inode == entry.inode)
            .last()
            .map_or(entry.start, |m| m.start);
        let end = maps[i..]
            .iter()
            .take_while(|m| m.path == entry.path && m.inode == entry.inode)
            .last()
            .map_or(entry.end, |m| m.end);
        placed.push(PlacedModule {
            avma: start..end,
            bias,
            module,
        });
    }
    placed
}

fn framehop_module(placed: &PlacedModule) -> Option<Module<Bytes>> {
    let elf = placed.module.elf.as_ref()?;
    let svma = |s: &Option<crate::elf::Section>| s.as_ref().map(|s| s.svma.clone());
    let info = ExplicitModuleSectionInfo {
        // ELF addresses in unwind info are stated addresses; framehop's relative addresses
        // are then exactly svma, and base_avma is the load bias.
        base_svma: 0,
        text_svma: svma(&elf.text),
        eh_frame_svma: svma(&elf.eh_frame),
        eh_frame: elf.section_bytes(&elf.eh_frame),
        eh_frame_hdr_svma: svma(&elf.eh_frame_hdr),
        eh_frame_hdr: elf.section_bytes(&elf.eh_frame_hdr),
        got_svma: svma(&elf.got),
        ..ExplicitModuleSectionInfo::default()
    };
    Some(Module::new(
        placed.module.path.display().to_string(),
        placed.avma.clone(),
        placed.bias,
        info,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_are_read_again_soon_after_a_change_and_back_off_while_nothing_changes() {
        let mut wait = REFRESH_AFTER_MIN;
        let mut waits = Vec::new();
        for _ in 0..9 {
            wait = ProcessState::next_refresh_after(wait, false);
            waits.push(wait.as_millis());
        }
        assert_eq!(waits, [20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        assert_eq!(ProcessState::next_refresh_after(wait, true), REFRESH_AFTER_MIN);
    }
}
