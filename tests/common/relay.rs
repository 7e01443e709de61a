//! The relay as a child process: signals, exit, log, peak memory, its HTTP endpoint.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// A running relay process.
pub struct Relay {
    pub child: Child,
    pub log: PathBuf,
    /// When it was started.
    pub started: Instant,
}

impl Relay {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `kill -9`.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits for exit; returns the exit status and stdout.
    pub fn sigterm(mut self) -> (std::process::ExitStatus, String) {
        signal(self.pid(), "TERM");
        let status = wait_timeout(&mut self.child, Duration::from_secs(30)).unwrap_or_else(|| {
            panic!(
                "relay did not exit after SIGTERM; log:\n{}",
                self.log_tail()
            )
        });
        let out = std::fs::read_to_string(self.log.with_extension("out")).unwrap_or_default();
        (status, out)
    }

    /// SIGTERM, and the relay must exit 0.
    pub fn stop_ok(self) {
        let (status, out) = self.sigterm();
        assert!(status.success(), "relay exited {status}: {out}");
    }

    /// Peak resident set size so far, in bytes (Linux `VmHWM`).
    pub fn peak_rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: u64 = status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .expect("VmHWM in /proc/PID/status");
        kb * 1024
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The log's last 40 lines that do not contain `noise`.
    pub fn log_but(&self, noise: &str) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().filter(|l| !l.contains(noise)).collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

pub fn wait_timeout(child: &mut Child, d: Duration) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

impl Relay {
    /// The whole log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (polling every 100 ms) until the log contains `needle`; false
    /// if `within` passes first.
    pub async fn wait_log(&self, needle: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while !self.log_text().contains(needle) {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        true
    }

    /// The bound address of the HTTP endpoint, from the log (the relay must
    /// log JSON: `OUTBOX_RELAY_LOG_FORMAT=json`); waits up to 30 s.
    pub async fn http_addr(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let addr = self.log_text().lines().find_map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                v["addr"].as_str().map(str::to_owned)
            });
            if let Some(a) = addr {
                return a;
            }
            assert!(
                Instant::now() < deadline,
                "no HTTP address in the relay's log:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Panics, with the log, if the process has exited.
    pub fn assert_running(&mut self, context: &str) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "relay exited ({status}) {context}; it should have reconnected; log:\n{}",
                self.log_tail()
            );
        }
    }
}

/// `GET path` over HTTP/1.0: the status code and the body.
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let code = buf.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = buf.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (code, body)
}

/// Value of the first sample in a `/metrics` scrape whose line starts with
/// `prefix`; 0 if there is none.
pub fn sample(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}
