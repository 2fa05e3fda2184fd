//! What the benchmark binaries share: their peer processes, and the CPU
//! time a process has spent.

use std::{collections::BTreeMap, process::Child, sync::Mutex, time::Duration};

/// A child process, killed (and reaped) when dropped.
pub struct Killed(pub Child);

impl Killed {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// CPU time of a process so far, all its threads, in nanoseconds
/// (`/proc/PID/task/TID/schedstat`). `/proc/PID/stat` counts 10 ms ticks,
/// which at a thousand queries a row moved one hook's share by up to 20 µs.
/// A thread that has exited keeps the time last read for it.
pub fn cpu(pid: u32) -> Duration {
    static SEEN: Mutex<BTreeMap<(u32, u32), u64>> = Mutex::new(BTreeMap::new());
    let mut seen = SEEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
            continue;
        };
        let schedstat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        if let Some(ns) = schedstat.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()) {
            seen.insert((pid, tid), ns);
        }
    }
    Duration::from_nanos(seen.range((pid, 0)..=(pid, u32::MAX)).map(|(_, ns)| ns).sum())
}
