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
    Duration::from_nanos(schedstat(pid, 0))
}

/// The times a process's threads were switched in so far: each time one
/// of them went back to work after a sleep or a preemption.
pub fn switches(pid: u32) -> u64 {
    schedstat(pid, 2)
}

/// Field `field` of `/proc/PID/task/TID/schedstat`, summed over the
/// process's threads (those that have exited keep the value last read).
fn schedstat(pid: u32, field: usize) -> u64 {
    static SEEN: Mutex<BTreeMap<(u32, u32, usize), u64>> = Mutex::new(BTreeMap::new());
    let mut seen = SEEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
            continue;
        };
        let schedstat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        if let Some(value) = schedstat.split_whitespace().nth(field).and_then(|v| v.parse::<u64>().ok()) {
            seen.insert((pid, tid, field), value);
        }
    }
    seen.range((pid, 0, 0)..=(pid, u32::MAX, usize::MAX))
        .filter(|((_, _, f), _)| *f == field)
        .map(|(_, value)| value)
        .sum()
}

/// A process's CPU time so far in user space and in the kernel, in clock
/// ticks (`/proc/PID/stat`: coarse, for shares over many ticks).
pub fn ticks(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command's closing parenthesis; utime and stime
    // are the 14th and 15th of the line.
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = rest.split_whitespace().skip(11).take(2).filter_map(|v| v.parse().ok()).collect();
    match fields[..] {
        [user, system] => (user, system),
        _ => (0, 0),
    }
}

/// Core `core`'s time so far, idle and in all, in clock ticks
/// (`/proc/stat`; idle counts I/O wait too).
pub fn core_idle(core: usize) -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let name = format!("cpu{core}");
    let Some(line) = stat.lines().find(|l| l.split_whitespace().next() == Some(name.as_str())) else {
        return (0, 0);
    };
    let fields: Vec<u64> = line.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (idle, fields.iter().take(8).sum())
}
