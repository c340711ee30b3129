//! The store's threads run below the runtime's.

/// Gives the calling thread (the writer's, the checkpointer's) a lower scheduling priority
/// than the runtime's: a delivery never waits for them (reads and other writes do, and
/// get a core as soon as the runtime's threads leave one), and on a busy machine their
/// bursts (a transaction of many messages, a checkpoint) should not hold a core that a
/// delivery is waiting for. Best effort: a failure changes nothing else.
#[cfg(target_os = "linux")]
pub(super) fn lower_priority() {
    /// Nice 10: about a tenth of a default thread's share of a contended core.
    const NICE: libc::c_int = 10;
    // SAFETY: gettid and setpriority take no pointers and act on the calling thread only.
    let set = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, NICE)
    };
    if set != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "store: cannot lower a thread's priority");
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn lower_priority() {}
