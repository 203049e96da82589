//! Work that would hold an async worker thread for a while (compiling a
//! component, tokenizing megabytes): run where the worker's other tasks,
//! other tenants' handlers and streams among them, can move on meanwhile.

use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `f` here, after handing this worker's other tasks to another
/// thread when on a multi-threaded runtime (elsewhere, as a single-threaded
/// runtime or no runtime has no other thread to take them, `f` just runs).
pub fn aside<T>(f: impl FnOnce() -> T) -> T {
    let multi =
        Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if multi {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}
