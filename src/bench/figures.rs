//! The figures a bench run prints and saves, and what they are measured with: medians of
//! repeated passes, percentiles, and the CPU time and memory of processes from `/proc`.

use std::time::Duration;

use anyhow::Context;
use serde_json::json;

/// Linux reports `utime`/`stime` in `/proc/<pid>/stat` in USER_HZ, 100 on every architecture
/// the ABI fixes it for (x86, arm64).
pub(super) const USER_HZ: f64 = 100.0;

/// The figures of one run: printed as a Markdown table, written as JSON with `--json`.
#[derive(Default)]
pub(super) struct Figures {
    pub(super) rows: Vec<(String, String)>,
    pub(super) json: Vec<serde_json::Value>,
}

impl Figures {
    /// A figure with text only (no number to compare).
    pub(super) fn note(&mut self, label: impl Into<String>, text: impl Into<String>) {
        self.rows.push((label.into(), text.into()));
    }

    /// A measured figure: `samples` of one quantity in `unit`; the table shows the median and
    /// the spread, then `detail`.
    pub(super) fn add(
        &mut self,
        key: &str,
        label: impl Into<String>,
        unit: &str,
        samples: &[f64],
        detail: &str,
    ) {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = median(&sorted);
        let (min, max) = (sorted[0], sorted[sorted.len() - 1]);
        let spread = if sorted.len() > 1 {
            format!(" ({} to {}, {} runs)", num(min), num(max), sorted.len())
        } else {
            String::new()
        };
        let sep = if detail.is_empty() { "" } else { "; " };
        self.rows.push((
            label.into(),
            format!("{} {unit}{spread}{sep}{detail}", num(median)),
        ));
        self.json.push(json!({
            "key": key, "unit": unit, "median": median, "min": min, "max": max,
            "samples": samples, "detail": detail,
        }));
    }
}

pub(super) fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Three significant figures at most, no exponent.
pub(super) fn num(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The processes being measured and their CPU time at the start of the current phase.
pub(super) struct Processes {
    pub(super) pids: Vec<(String, u32)>,
    pub(super) cpu_at_phase_start: Vec<f64>,
}

impl Processes {
    pub(super) fn new(pids: Vec<(String, u32)>) -> anyhow::Result<Self> {
        let cpu_at_phase_start = pids
            .iter()
            .map(|(_, pid)| cpu_seconds(*pid))
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            pids,
            cpu_at_phase_start,
        })
    }

    /// Records each process's CPU seconds since the previous call as figures of `phase`.
    pub(super) fn phase_done(&mut self, phase: &str, figures: &mut Figures) -> anyhow::Result<()> {
        for (i, (name, pid)) in self.pids.iter().enumerate() {
            let now = cpu_seconds(*pid)?;
            let used = now - self.cpu_at_phase_start[i];
            self.cpu_at_phase_start[i] = now;
            figures.add(
                &format!("cpu_seconds.{phase}.{name}"),
                format!("CPU of {name} during {phase}"),
                "s",
                &[used],
                "",
            );
        }
        Ok(())
    }

    pub(super) fn peaks(&self, figures: &mut Figures) -> anyhow::Result<()> {
        for (name, pid) in &self.pids {
            let (rss, hwm) = memory_of(&pid.to_string())?;
            figures.add(
                &format!("peak_rss_mib.{name}"),
                format!("peak RSS of {name} (VmHWM)"),
                "MiB",
                &[hwm as f64 / MIB],
                &format!("{:.0} MiB at the end", rss as f64 / MIB),
            );
        }
        Ok(())
    }
}

pub(super) const MIB: f64 = 1024.0 * 1024.0;

/// User plus system CPU time of a process (all its threads, live and exited), in seconds.
pub(super) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat (is process {pid} running?)"))?;
    // The command name (field 2) may hold spaces; the fields after its closing parenthesis are
    // fixed: state is field 3, utime field 14, stime field 15.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .with_context(|| format!("cannot parse /proc/{pid}/stat"))?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("cannot parse /proc/{pid}/stat"))
    };
    Ok((ticks(11)? + ticks(12)?) / USER_HZ)
}

/// The 1-minute load average, as a record of how busy the machine was.
pub(super) fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// The p-th percentile (0..=100) of sorted samples.
pub(super) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub(super) fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `VmRSS` and `VmHWM` of this process, in bytes.
pub(crate) fn memory() -> anyhow::Result<(u64, u64)> {
    memory_of("self")
}

/// `VmRSS` and `VmHWM` of `/proc/<pid>`, in bytes.
pub(super) fn memory_of(pid: &str) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status (memory figures need Linux)"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("{name} missing from /proc/{pid}/status"))?;
        let kb: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("cannot parse {line:?}"))?;
        Ok(kb * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

pub(super) fn mb(bytes: u64) -> String {
    format!("{:.0} MB", bytes as f64 / 1e6)
}
