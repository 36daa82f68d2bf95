//! The descriptor of an aya map whatever its kind, for what aya does not do itself: handing the
//! map to the libbpf object (wait_targets.rs), batch lookups (batch_keys.rs).

use std::os::fd::{AsFd, BorrowedFd};

use aya::maps::{Map, MapData};

/// The descriptor of one of aya's maps, whatever its kind.
pub(super) fn map_fd(map: &Map) -> BorrowedFd<'_> {
    map_data(map).fd().as_fd()
}

fn map_data(map: &Map) -> &MapData {
    match map {
        Map::Array(data)
        | Map::ArrayOfMaps(data)
        | Map::BloomFilter(data)
        | Map::CgroupArray(data)
        | Map::CgroupStorage(data)
        | Map::CgrpStorage(data)
        | Map::CpuMap(data)
        | Map::DevMap(data)
        | Map::DevMapHash(data)
        | Map::HashMap(data)
        | Map::HashOfMaps(data)
        | Map::InodeStorage(data)
        | Map::LpmTrie(data)
        | Map::LruHashMap(data)
        | Map::PerCpuArray(data)
        | Map::PerCpuCgroupStorage(data)
        | Map::PerCpuHashMap(data)
        | Map::PerCpuLruHashMap(data)
        | Map::PerfEventArray(data)
        | Map::ProgramArray(data)
        | Map::Queue(data)
        | Map::ReusePortSockArray(data)
        | Map::RingBuf(data)
        | Map::SockHash(data)
        | Map::SockMap(data)
        | Map::SkStorage(data)
        | Map::Stack(data)
        | Map::StackTraceMap(data)
        | Map::Unsupported(data)
        | Map::XskMap(data) => data,
    }
}
