use super::*;
use crate::postgres::status_slots::{SlotGlobals, SlotIndex};

/// This process stands in for an instance: a status array of `backends` backend slots and 1
/// aux slot, 16-byte entries (changecount at 0, pid at 4), and the globals of a backend in
/// slot 2; slots 1 and 2 in use.
struct FakeInstance {
    array: Box<[[u32; 4]]>,
    _globals: [Box<u64>; 4],
    layout: CounterLayout,
}

impl FakeInstance {
    fn new() -> Self {
        Self::with_slots(3)
    }

    fn with_slots(backends: usize) -> Self {
        let mut array = vec![[0u32; 4]; backends + 1].into_boxed_slice();
        array[0] = [2, 101, 0, 0];
        array[1] = [4, 102, 0, 0];
        let my_be_entry = Box::new(array[1].as_ptr() as u64);
        let my_backend_id = Box::new(2u64);
        let max_backends = Box::new(backends as u64);
        let my_aux_proc_type = Box::new(u64::MAX);
        let address = |b: &u64| b as *const u64 as u64;
        let layout = CounterLayout {
            my_be_entry: address(&my_be_entry),
            slots: SlotGlobals {
                index: SlotIndex::BackendIdThenAuxType {
                    backend_id: address(&my_backend_id),
                    aux_proc_type: address(&my_aux_proc_type),
                },
                max_backends: address(&max_backends),
                aux_slots: 1,
            },
            entry_size: 16,
            st_changecount_offset: 0,
            st_procpid_offset: 4,
        };
        Self {
            array,
            _globals: [my_be_entry, my_backend_id, max_backends, my_aux_proc_type],
            layout,
        }
    }

    /// Writes slot `slot`: volatile, because the watch reads it through /proc/self/mem.
    fn write(&mut self, slot: usize, changecount: u32, pid: u32) {
        // SAFETY: the array is alive and only this thread touches it.
        unsafe {
            std::ptr::write_volatile(&mut self.array[slot][0], changecount);
            std::ptr::write_volatile(&mut self.array[slot][1], pid);
        }
    }
}

fn plan(watch: &mut StatusWatch) -> TickPlan {
    let plan = watch.plan();
    // Keep the fake array's reads ordered after the writes above.
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    plan
}

#[test]
fn lists_the_processes_whose_entry_changed_and_walks_when_it_cannot_compare() {
    let mut instance = FakeInstance::new();
    let list = WatchList::default();
    list.watch(std::process::id(), Some(instance.layout));
    let mut watch = StatusWatch::new(list.clone(), 16);

    let first = plan(&mut watch);
    assert!(
        first.walk,
        "the first read has nothing to compare with: {first:?}"
    );
    assert!(first.park);

    assert_eq!(
        plan(&mut watch),
        TickPlan {
            walk: false,
            park: true,
            woken: vec![]
        },
        "nothing changed"
    );

    instance.write(0, 4, 101); // a status write
    instance.write(2, 2, 103); // a new backend in a free slot
    let third = plan(&mut watch);
    assert_eq!(third.woken, vec![101, 103]);
    assert!(!third.walk);

    instance.write(1, 5, 102); // a write in progress
    assert_eq!(plan(&mut watch).woken, vec![102]);
    assert_eq!(
        plan(&mut watch).woken,
        vec![102],
        "still odd: still being written"
    );
}

#[test]
fn walks_every_few_ticks_and_when_too_many_woke() {
    let mut instance = FakeInstance::new();
    let list = WatchList::default();
    list.watch(std::process::id(), Some(instance.layout));
    let mut watch = StatusWatch::new(list, 1);
    for tick in 1..=WALK_EVERY {
        let plan = plan(&mut watch);
        assert_eq!(
            plan.walk,
            tick == 1 || tick == WALK_EVERY,
            "tick {tick}: {plan:?}"
        );
    }
    instance.write(0, 6, 101);
    instance.write(1, 6, 102);
    let crowded = plan(&mut watch);
    assert!(crowded.walk && crowded.woken.is_empty(), "{crowded:?}");
}

#[test]
fn an_instance_without_a_readable_array_allows_no_parking() {
    let list = WatchList::default();
    // Attribution without the globals that place a process in the array.
    list.watch(std::process::id(), None);
    let mut watch = StatusWatch::new(list.clone(), 16);
    for _ in 0..3 {
        let plan = plan(&mut watch);
        assert!(plan.walk && !plan.park, "{plan:?}");
    }
    list.unwatch(std::process::id());
    assert!(plan(&mut watch).park, "nothing left to watch");
}

#[test]
fn reads_as_far_as_the_backends_go_and_sees_one_start_past_them() {
    let backends = 300;
    let mut instance = FakeInstance::with_slots(backends);
    let list = WatchList::default();
    list.watch(std::process::id(), Some(instance.layout));
    let mut watch = StatusWatch::new(list, 16);
    assert!(plan(&mut watch).walk);
    let array = watch.arrays.values().flatten().next().expect("located");
    assert_eq!(
        array.last.as_ref().map(Vec::len),
        Some(backends + 1),
        "the first read is whole"
    );
    plan(&mut watch);
    let array = watch.arrays.values().flatten().next().expect("located");
    assert_eq!(
        array.last.as_ref().map(Vec::len),
        Some(2 + SLOTS_PAST_HIGHEST),
        "then as far past the highest slot in use"
    );
    // A backend starts in the highest slot read: seen, and the next read goes further.
    instance.write(1 + SLOTS_PAST_HIGHEST, 2, 150);
    assert_eq!(plan(&mut watch).woken, vec![150]);
    assert!(
        plan(&mut watch).woken.is_empty(),
        "slots read for the first time, empty"
    );
    let array = watch.arrays.values().flatten().next().expect("located");
    assert_eq!(
        array.last.as_ref().map(Vec::len),
        Some(2 + 2 * SLOTS_PAST_HIGHEST)
    );
}
