//! Child processes: waiting, signals, CPU time and peak RSS from /proc.

use std::process::{Child, ExitStatus};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Waits for `child` at most `d`; kills it after that.
pub fn wait_timeout(child: &mut Child, d: Duration) -> Result<ExitStatus> {
    let end = Instant::now() + d;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            bail!("process {} still running after {d:?}; killed", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Async flavour of [`wait_timeout`], for use on the runtime.
pub async fn wait_timeout_async(child: &mut Child, d: Duration) -> Result<ExitStatus> {
    let end = Instant::now() + d;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            bail!("process {} still running after {d:?}; killed", child.id());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

/// SIGTERM, then wait (SIGKILL after `grace`).
pub async fn terminate(child: &mut Child, grace: Duration) -> Result<ExitStatus> {
    signal(child.id(), "TERM");
    wait_timeout_async(child, grace).await
}

fn clk_tck() -> f64 {
    static TCK: OnceLock<f64> = OnceLock::new();
    *TCK.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// utime + stime of process `pid` (all its threads), in seconds.
pub fn cpu_seconds(pid: &str) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name may hold spaces: fields count from the last ')'.
    let rest = &stat[stat.rfind(')').context("malformed stat")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime is field 14, stime 15.
    let utime: f64 = f.get(11).context("no utime")?.parse()?;
    let stime: f64 = f.get(12).context("no stime")?.parse()?;
    Ok((utime + stime) / clk_tck())
}

/// `VmHWM` (peak resident set size) of process `pid`, in bytes.
pub fn peak_rss_bytes(pid: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .context("no VmHWM")?;
    Ok(kb * 1024)
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Output of a command, or None when it cannot run.
pub fn command_output(prog: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(prog).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
