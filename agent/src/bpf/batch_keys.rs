//! The keys of a BPF hash map in a few `bpf(2)` calls (`BPF_MAP_LOOKUP_BATCH`, Linux 5.6)
//! rather than one per key: aya has no batch operations, and the agent lists its targets (an
//! instance's postmaster and every backend, a thousand on a busy host) every second. One
//! `BPF_MAP_GET_NEXT_KEY` per key cost a tenth of an idle agent's CPU with 1000 backends.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `BPF_MAP_LOOKUP_BATCH` (enum bpf_cmd, include/uapi/linux/bpf.h).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Elements asked for per call; a hash bucket holding more than that is answered with ENOSPC,
/// and the call is made again with twice as many.
const FIRST_BATCH: usize = 1024;

/// The `union bpf_attr` member of the batch commands.
#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Every key of the hash map `map`, whose values are `value_size` bytes. `Ok(None)` when the
/// kernel has no batch lookup for it (before Linux 5.6): the caller lists the keys one by one.
/// Keys added or removed meanwhile may or may not be listed, as with one call per key.
pub fn hash_keys<K: Copy + Default>(map: BorrowedFd<'_>, value_size: usize) -> io::Result<Option<Vec<K>>> {
    hash_keys_in_batches(map, value_size, FIRST_BATCH)
}

fn hash_keys_in_batches<K: Copy + Default>(
    map: BorrowedFd<'_>,
    value_size: usize,
    first_batch: usize,
) -> io::Result<Option<Vec<K>>> {
    let mut keys = Vec::new();
    let mut batch = first_batch.max(1);
    // The position token of hash maps: a bucket index (u32), opaque to user space; none before
    // the first call.
    let mut position: Option<u32> = None;
    loop {
        let mut chunk = vec![K::default(); batch];
        let mut values = vec![0u8; batch * value_size.max(1)];
        let mut next: u32 = 0;
        let mut attr = BatchAttr {
            in_batch: position.as_ref().map_or(0, |p| p as *const u32 as u64),
            out_batch: &mut next as *mut u32 as u64,
            keys: chunk.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: batch as u32,
            map_fd: map.as_raw_fd() as u32,
            elem_flags: 0,
            flags: 0,
        };
        // SAFETY: attr points at a position token, a key buffer of `batch` keys and a value
        // buffer of `batch` values of the map's sizes (K is the map's key type), all alive for
        // the duration of the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &mut attr as *mut BatchAttr,
                size_of::<BatchAttr>(),
            )
        };
        let error = (rc < 0).then(io::Error::last_os_error);
        match error.as_ref().and_then(io::Error::raw_os_error) {
            None | Some(libc::ENOENT) => {
                // ENOENT: the last batch, its count still valid.
                keys.extend_from_slice(&chunk[..(attr.count as usize).min(batch)]);
                if error.is_some() {
                    return Ok(Some(keys));
                }
                position = Some(next);
            }
            // A bucket larger than the batch: the same position again, with room for it.
            Some(libc::ENOSPC) if batch < 1 << 20 => batch *= 2,
            Some(libc::EINVAL) | Some(libc::ENOTSUP) | Some(libc::EOPNOTSUPP) if position.is_none() => {
                return Ok(None)
            }
            _ => return Err(error.unwrap_or_else(|| io::Error::other("bpf(BPF_MAP_LOOKUP_BATCH) failed"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    use super::super::task_storage::ElemAttr;
    use super::*;

    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    const BPF_MAP_TYPE_HASH: u32 = 1;

    /// The `union bpf_attr` member of BPF_MAP_CREATE, up to the map's name; the kernel reads
    /// the rest as zeros.
    #[repr(C)]
    #[derive(Default)]
    struct CreateAttr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
        inner_map_fd: u32,
        numa_node: u32,
        map_name: [u8; 16],
    }

    fn bpf<A>(cmd: libc::c_long, attr: &mut A) -> io::Result<libc::c_long> {
        // SAFETY: attr is a valid bpf_attr member for `cmd`, alive for the call.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut A, size_of::<A>()) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    }

    /// A hash map of u32 keys and u8 values, the targets map's types, holding `keys`.
    fn hash_map_with(keys: &[u32]) -> OwnedFd {
        let mut create = CreateAttr {
            map_type: BPF_MAP_TYPE_HASH,
            key_size: 4,
            value_size: 1,
            max_entries: 65536,
            ..Default::default()
        };
        let fd = bpf(BPF_MAP_CREATE, &mut create)
            .expect("creating a BPF hash map (the agent's tests run as root, with BPF)");
        // SAFETY: BPF_MAP_CREATE returned a new descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        for key in keys {
            let value = 1u8;
            let mut update = ElemAttr {
                map_fd: fd.as_raw_fd() as u32,
                _pad: 0,
                key: key as *const u32 as u64,
                value: &value as *const u8 as u64,
                flags: 0,
            };
            bpf(BPF_MAP_UPDATE_ELEM, &mut update).expect("adding a key");
        }
        fd
    }

    #[test]
    fn every_key_is_listed_once_whatever_the_batch() {
        let keys: Vec<u32> = (0..3000u32).map(|i| i.wrapping_mul(2_654_435_761) >> 8).collect();
        let map = hash_map_with(&keys);
        let expected: BTreeSet<u32> = keys.iter().copied().collect();
        // 1: almost every bucket holding more than one key is answered with ENOSPC first.
        for batch in [1, 7, FIRST_BATCH, 65536] {
            let listed = hash_keys_in_batches::<u32>(map.as_fd(), 1, batch)
                .expect("batch lookup")
                .expect("this kernel has batch lookups");
            assert_eq!(
                listed.len(),
                expected.len(),
                "batch of {batch}: a key listed twice or missed"
            );
            assert_eq!(
                listed.into_iter().collect::<BTreeSet<_>>(),
                expected,
                "batch of {batch}"
            );
        }
    }

    #[test]
    fn an_empty_map_has_no_keys() {
        let map = hash_map_with(&[]);
        let listed = hash_keys::<u32>(map.as_fd(), 1).expect("batch lookup");
        assert_eq!(listed, Some(Vec::new()));
    }
}
