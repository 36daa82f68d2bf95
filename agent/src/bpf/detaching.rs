//! Detaching on a thread of its own. Closing a uprobe's or a perf event's link waits for the
//! kernel's grace periods (0.1 to 0.2 s a link on 6.18), most of it asleep: time in which the
//! caller has other work (a trace's start, its symbolization at the end).

use std::thread::JoinHandle;

use tracing::warn;

/// Whatever it was given (links, or a whole loaded object) being dropped on a thread of its
/// own. Dropping this waits for that thread, so nothing stays attached past its owner.
pub struct Detaching(Option<JoinHandle<()>>);

impl Detaching {
    /// Starts dropping `attached` on a new thread; without a thread, drops it here.
    pub fn start<T: Send + 'static>(attached: T) -> Self {
        let spawned = std::thread::Builder::new()
            .name("pgscope-detach".to_owned())
            .spawn(move || drop(attached));
        match spawned {
            Ok(thread) => Self(Some(thread)),
            Err(error) => {
                // The closure, and `attached` with it, was dropped by the failed spawn.
                warn!("detached in place, without a thread of its own: {error}");
                Self(None)
            }
        }
    }
}

impl Drop for Detaching {
    fn drop(&mut self) {
        if let Some(thread) = self.0.take() {
            if thread.join().is_err() {
                warn!("the thread detaching pgscope's programs panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Detaching;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Sets its flag when dropped, as a link detaches.
    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            std::thread::sleep(std::time::Duration::from_millis(20));
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn dropping_the_guard_waits_until_what_it_holds_is_dropped() {
        let dropped = Arc::new(AtomicBool::new(false));
        let detaching = Detaching::start(Flag(Arc::clone(&dropped)));
        drop(detaching);
        assert!(dropped.load(Ordering::SeqCst));
    }
}
