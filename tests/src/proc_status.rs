//! A process's memory figures from `/proc/<pid>/status` (Linux): what the tests and benchmarks
//! print and bound (`VmHWM`, the peak resident set; `VmRSS`, the current one).

/// The `key` line of `/proc/<pid>/status` in KiB (`VmHWM`, `VmRSS`, …); `None` when the process
/// or the line is gone.
pub fn kib(pid: u32, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// The same in MiB (0 when unknown: a figure to print, not to decide on).
pub fn mib(pid: u32, key: &str) -> u64 {
    kib(pid, key).map_or(0, |k| k / 1024)
}
