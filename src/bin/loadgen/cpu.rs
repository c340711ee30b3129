//! CPU time over a run, per delivered message: the server's, by thread, and the load
//! generator's own. With the machine's core count they say how much CPU a message may
//! cost for a rate to be reachable at all (BENCHMARKS.md, *The CPU budget*). Read from
//! /proc (Linux only), in the kernel's fixed 100 Hz user ticks.

use std::collections::BTreeMap;

use serde::Serialize;

const USER_HZ: f64 = 100.0;

/// A process's or thread's CPU time: in its own code, and in the kernel on its behalf
/// (socket and file I/O, wake-ups).
#[derive(Clone, Copy, Debug, Default)]
struct CpuSeconds {
    user: f64,
    system: f64,
}

impl CpuSeconds {
    /// From a `/proc/…/stat` line: utime and stime, fields 14 and 15.
    fn parse(stat: &str) -> Option<CpuSeconds> {
        // The command name may hold spaces and parentheses: the fields start after its
        // last ')', at field 3.
        let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
        let mut seconds = || Some(fields.next()?.parse::<u64>().ok()? as f64 / USER_HZ);
        Some(CpuSeconds {
            user: seconds()?,
            system: seconds()?,
        })
    }

    fn read(path: &str) -> Option<CpuSeconds> {
        CpuSeconds::parse(&std::fs::read_to_string(path).ok()?)
    }

    /// The time spent since `before`.
    fn since(self, before: CpuSeconds) -> CpuSeconds {
        CpuSeconds {
            user: self.user - before.user,
            system: self.system - before.system,
        }
    }
}

impl std::ops::AddAssign for CpuSeconds {
    fn add_assign(&mut self, other: CpuSeconds) {
        self.user += other.user;
        self.system += other.system;
    }
}

/// CPU per delivered message, in µs.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CpuPerMessage {
    /// User and system time together.
    pub all_us: f64,
    /// Of `all_us`, the time in the kernel.
    pub system_us: f64,
}

/// A server thread's (or same-named threads') CPU per delivered message.
#[derive(Debug, Serialize)]
pub struct ThreadCpu {
    pub name: String,
    #[serde(flatten)]
    pub cpu: CpuPerMessage,
}

/// What a run's messages cost in CPU.
#[derive(Debug, Default)]
pub struct Measured {
    /// The server process's, when it runs in a process of its own.
    pub server: Option<CpuPerMessage>,
    /// The server's by thread name (threads of one name summed, e.g. a runtime's workers),
    /// largest first. A thread that ended before the run's end is missing (it may have
    /// shared its name with a runtime's workers: tokio's blocking threads do).
    pub server_threads: Vec<ThreadCpu>,
    /// This process's: the load's clients, and whatever else runs in it (the raw relay, a
    /// bridge started in process).
    pub load_generator: Option<CpuPerMessage>,
}

/// CPU times at a run's start, to be subtracted at its end.
pub struct Meter {
    server: Option<u32>,
    server_before: Option<CpuSeconds>,
    threads_before: BTreeMap<u32, Thread>,
    own_before: Option<CpuSeconds>,
}

impl Meter {
    /// Starts measuring this process and, when given, the server process `server`.
    pub fn start(server: Option<u32>) -> Meter {
        Meter {
            server,
            server_before: server.and_then(process),
            threads_before: server.map(threads).unwrap_or_default(),
            own_before: process(std::process::id()),
        }
    }

    /// The CPU spent since `start`, per message of `delivered`.
    pub fn finish(self, delivered: u64) -> Measured {
        if delivered == 0 {
            return Measured::default();
        }
        let per_message = |spent: CpuSeconds| CpuPerMessage {
            all_us: (spent.user + spent.system) * 1e6 / delivered as f64,
            system_us: spent.system * 1e6 / delivered as f64,
        };
        // Each thread's own time since the start (from nothing for one started since),
        // then summed by name.
        let mut by_name = BTreeMap::<String, CpuSeconds>::new();
        for (tid, now) in self.server.map(threads).unwrap_or_default() {
            let before = self.threads_before.get(&tid).map(|t| t.cpu);
            *by_name.entry(now.name).or_default() += now.cpu.since(before.unwrap_or_default());
        }
        let mut server_threads: Vec<ThreadCpu> = by_name
            .into_iter()
            .map(|(name, spent)| ThreadCpu {
                name,
                cpu: per_message(spent),
            })
            .filter(|thread| thread.cpu.all_us > 0.0)
            .collect();
        server_threads.sort_by(|a, b| b.cpu.all_us.total_cmp(&a.cpu.all_us));
        Measured {
            server: self
                .server
                .and_then(process)
                .zip(self.server_before)
                .map(|(now, before)| per_message(now.since(before))),
            server_threads,
            load_generator: process(std::process::id())
                .zip(self.own_before)
                .map(|(now, before)| per_message(now.since(before))),
        }
    }
}

fn process(pid: u32) -> Option<CpuSeconds> {
    CpuSeconds::read(&format!("/proc/{pid}/stat"))
}

/// A thread's name and CPU time.
struct Thread {
    name: String,
    cpu: CpuSeconds,
}

/// `pid`'s threads by thread id. (By id, not name: a thread that ends must not take its
/// time out of others of its name.)
fn threads(pid: u32) -> BTreeMap<u32, Thread> {
    let mut by_tid = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return by_tid;
    };
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let path = task.path();
        let (Ok(name), Ok(stat)) = (
            std::fs::read_to_string(path.join("comm")),
            std::fs::read_to_string(path.join("stat")),
        ) else {
            continue; // the thread ended meanwhile
        };
        if let Some(cpu) = CpuSeconds::parse(&stat) {
            let name = name.trim_end().to_owned();
            by_tid.insert(tid, Thread { name, cpu });
        }
    }
    by_tid
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_the_command_name() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0";
        let cpu = CpuSeconds::parse(stat).unwrap();
        assert_eq!((cpu.user, cpu.system), (2.5, 0.75));
        assert!(CpuSeconds::parse("42 (x) S 1 2").is_none());
    }

    #[test]
    fn this_process_and_its_threads_are_measured() {
        let pid = std::process::id();
        let meter = Meter::start(Some(pid));
        // Spins until the kernel has counted three ticks of this thread's CPU: the
        // process's alone can get there on other tests' threads, which run meanwhile.
        let name: String = (std::thread::current().name().unwrap_or_default())
            .chars()
            .take(15)
            .collect();
        let mine = || -> f64 {
            (threads(pid).into_values())
                .filter(|thread| thread.name == name)
                .map(|thread| thread.cpu.user + thread.cpu.system)
                .sum()
        };
        let from = mine();
        let mut spin = 0u64;
        while mine() - from < 0.03 {
            for _ in 0..100_000 {
                spin = std::hint::black_box(spin + 1);
            }
        }
        let measured = meter.finish(1);
        // The kernel scales a process's and a thread's ticks to their runtimes apart,
        // so the process's total can trail one thread's by a tick (10 ms).
        let own = measured.load_generator.unwrap();
        assert!(own.all_us >= 20_000.0, "{own:?}");
        assert!(own.all_us >= own.system_us);
        let server = measured.server.unwrap();
        assert!(server.all_us >= 20_000.0, "{server:?}");
        // This test's thread is among them; their sum is the process's, within a tick
        // for each thread that ended meanwhile or was read at another moment.
        let threads: f64 = measured.server_threads.iter().map(|t| t.cpu.all_us).sum();
        assert!(threads >= 20_000.0, "{:?}", measured.server_threads);
        assert!(
            threads <= server.all_us + 1e5,
            "{threads} > {}",
            server.all_us
        );
    }
}
