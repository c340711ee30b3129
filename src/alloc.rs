//! The allocator of every binary built from this crate (the bridge, the load generator's
//! bridge, tests): jemalloc, tuned for many mostly idle connections.
//!
//! The JSON of each message is parsed into and built from many small allocations, and
//! jemalloc serves them faster than glibc's malloc: the relay moves more messages per
//! second on the same load (BENCHMARKS.md). Its defaults keep more memory per idle
//! connection than glibc's (four arenas per CPU, freed pages kept for ten seconds), so
//! it runs with two arenas and a background thread that returns freed pages to the OS
//! within a second, which keeps what an idle connection costs down (BENCHMARKS.md, *Idle
//! connections*). Two arenas suit the 2-core hosts the bridge is sized for; on
//! a larger host with many busy connections, more arenas cut contention between worker
//! threads: `_RJEM_MALLOC_CONF=narenas:8` (or any option here) overrides at start.
//!
//! Built with `--features system-alloc`, the binaries use the system's malloc instead, so
//! that heap profilers that hook it (heaptrack) see every allocation.

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// A C string pointer jemalloc reads once at start.
#[repr(transparent)]
pub struct MallocConf(*const std::ffi::c_char);

// SAFETY: it points at a `'static` string that nothing writes.
unsafe impl Sync for MallocConf {}

/// jemalloc's compiled-in options (its `malloc_conf`; the embedded build prefixes its
/// symbols with `_rjem_`).
// SAFETY: jemalloc declares this symbol as `const char *` and only reads it.
#[unsafe(export_name = "_rjem_malloc_conf")]
#[used]
pub static MALLOC_CONF: MallocConf =
    MallocConf(c"narenas:2,background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr());
