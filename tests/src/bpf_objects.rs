//! What a profiler leaves in the kernel: the BPF programs, maps and links a process holds (read
//! from its file descriptors), whether they are still loaded after it exited, tracefs probe
//! events it created, and the breakpoint a uprobe writes into every process that maps the
//! probed file.

use std::collections::BTreeSet;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use object::{Object, ObjectSegment, ObjectSymbol};

use crate::process::run_checked;

/// BPF objects by kernel ID. IDs are allocated cyclically up to 2^31, so an ID that is gone
/// is not handed to another object within a test run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BpfIds {
    pub progs: BTreeSet<u32>,
    pub maps: BTreeSet<u32>,
    pub links: BTreeSet<u32>,
}

impl BpfIds {
    pub fn is_empty(&self) -> bool {
        self.progs.is_empty() && self.maps.is_empty() && self.links.is_empty()
    }

    /// The IDs of `self` that are also in `other`.
    pub fn intersection(&self, other: &BpfIds) -> BpfIds {
        BpfIds {
            progs: self.progs.intersection(&other.progs).copied().collect(),
            maps: self.maps.intersection(&other.maps).copied().collect(),
            links: self.links.intersection(&other.links).copied().collect(),
        }
    }
}

/// The BPF programs, maps and links `pid` holds a file descriptor of, from
/// `/proc/<pid>/fdinfo` (`prog_id:`, `map_id:`, `link_id:` lines).
pub fn held_by(pid: u32) -> Result<BpfIds> {
    let dir = format!("/proc/{pid}/fd");
    let mut ids = BpfIds::default();
    for entry in fs::read_dir(&dir).with_context(|| format!("cannot list `{dir}`"))? {
        let fd = entry?.file_name();
        let Ok(target) = fs::read_link(format!("{dir}/{}", fd.to_string_lossy())) else {
            continue; // closed meanwhile
        };
        let target = target.to_string_lossy().into_owned();
        if !target.starts_with("anon_inode:bpf") {
            continue;
        }
        let Ok(info) = fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.to_string_lossy())) else {
            continue;
        };
        for line in info.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let Ok(id) = value.trim().parse::<u32>() else {
                continue;
            };
            match key {
                "prog_id" => ids.progs.insert(id),
                "map_id" => ids.maps.insert(id),
                "link_id" => ids.links.insert(id),
                _ => false,
            };
        }
    }
    Ok(ids)
}

/// Every BPF program, map and link loaded in the kernel now (`bpftool`).
pub fn loaded() -> Result<BpfIds> {
    Ok(BpfIds {
        progs: bpftool_ids("prog")?,
        maps: bpftool_ids("map")?,
        links: bpftool_ids("link")?,
    })
}

fn bpftool_ids(kind: &str) -> Result<BTreeSet<u32>> {
    let out = run_checked(
        Command::new("bpftool").args(["--json", kind, "show"]),
        Duration::from_secs(30),
    )
    .with_context(|| format!("`bpftool --json {kind} show` failed: install bpftool (Debian: bpftool)"))?;
    let list: serde_json::Value = serde_json::from_str(out.trim())
        .with_context(|| format!("`bpftool --json {kind} show` printed no JSON: {out}"))?;
    let Some(items) = list.as_array() else {
        bail!("`bpftool --json {kind} show` printed no list: {out}");
    };
    Ok(items
        .iter()
        .filter_map(|item| item.get("id")?.as_u64())
        .map(|id| id as u32)
        .collect())
}

/// Lines of the tracefs `uprobe_events` file that mention `needle` (aya names the probe
/// events it creates without the uprobe PMU `aya_<pid>_…`).
pub fn uprobe_events_with(needle: &str) -> Result<Vec<String>> {
    let path = [
        "/sys/kernel/tracing/uprobe_events",
        "/sys/kernel/debug/tracing/uprobe_events",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .context("no uprobe_events file: mount tracefs on /sys/kernel/tracing")?;
    let text = fs::read_to_string(path).with_context(|| format!("cannot read `{path}`"))?;
    Ok(text
        .lines()
        .filter(|line| line.contains(needle))
        .map(str::to_string)
        .collect())
}

/// Where a function of an executable starts: the offset in the file and the byte there.
#[derive(Clone, Copy, Debug)]
pub struct FunctionEntry {
    pub file_offset: u64,
    pub byte: u8,
}

/// Finds `symbol` (static or dynamic) in the ELF file `binary`.
pub fn function_entry(binary: &Path, symbol: &str) -> Result<FunctionEntry> {
    let data = fs::read(binary).with_context(|| format!("cannot read `{}`", binary.display()))?;
    let file = object::File::parse(data.as_slice())
        .with_context(|| format!("`{}` is not an ELF file", binary.display()))?;
    let address = file
        .symbols()
        .chain(file.dynamic_symbols())
        .find(|s| s.name() == Ok(symbol))
        .map(|s| s.address())
        .with_context(|| format!("`{}` has no symbol `{symbol}`", binary.display()))?;
    let file_offset = file
        .segments()
        .find_map(|segment| {
            let (offset, size) = segment.file_range();
            let start = segment.address();
            (start..start + size)
                .contains(&address)
                .then(|| address - start + offset)
        })
        .with_context(|| format!("`{symbol}` is in no loadable segment of `{}`", binary.display()))?;
    let byte = *data
        .get(file_offset as usize)
        .with_context(|| format!("`{symbol}` lies past the end of `{}`", binary.display()))?;
    Ok(FunctionEntry { file_offset, byte })
}

/// The byte at `file_offset` of `binary` as process `pid` sees it in memory: the file's own
/// byte, or 0xCC (int3) while a uprobe is set there.
pub fn byte_in_process(pid: u32, binary: &Path, file_offset: u64) -> Result<u8> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))
        .with_context(|| format!("cannot read the maps of process {pid}"))?;
    let wanted = binary.to_string_lossy();
    let address = maps
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (range, offset, path) = (fields.first()?, fields.get(2)?, fields.get(5)?);
            if *path != wanted {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            let start = u64::from_str_radix(start, 16).ok()?;
            let end = u64::from_str_radix(end, 16).ok()?;
            let offset = u64::from_str_radix(offset, 16).ok()?;
            (offset..offset + (end - start))
                .contains(&file_offset)
                .then(|| start + file_offset - offset)
        })
        .with_context(|| format!("process {pid} does not map offset {file_offset:#x} of `{wanted}`"))?;
    let mut mem = fs::File::open(format!("/proc/{pid}/mem"))
        .with_context(|| format!("cannot open the memory of process {pid}"))?;
    mem.seek(SeekFrom::Start(address))?;
    let mut byte = [0u8; 1];
    mem.read_exact(&mut byte)
        .with_context(|| format!("cannot read process {pid} at {address:#x}"))?;
    Ok(byte[0])
}
