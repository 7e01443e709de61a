//! The relay as an operator runs it: a config file, `outbox-relay setup`,
//! `outbox-relay run`, its `/metrics` endpoint.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::Settings;

/// One relay configuration (table, slot, publication, exchange).
pub struct RelayConfig {
    pub path: PathBuf,
    pub slot: String,
    pub http_port: u16,
    pub bin: String,
    pub log_dir: PathBuf,
    pub name: String,
}

impl RelayConfig {
    pub fn write(
        s: &Settings,
        name: &str,
        table: &str,
        slot: &str,
        publication: &str,
        exchange: &str,
    ) -> Result<RelayConfig> {
        Self::write_channels(s, name, table, slot, publication, exchange, 1)
    }

    /// As [`RelayConfig::write`], publishing on `channels` channels
    /// (`rabbitmq.channels`; left out when 1, so that a relay from before
    /// the setting existed can be measured).
    pub fn write_channels(
        s: &Settings,
        name: &str,
        table: &str,
        slot: &str,
        publication: &str,
        exchange: &str,
        channels: u32,
    ) -> Result<RelayConfig> {
        let outbox = format!("[outbox]\ntable = \"public.{table}\"\n");
        Self::write_outbox(s, name, &outbox, slot, publication, exchange, channels)
    }

    /// A table-less outbox: logical messages with `prefix`.
    pub fn write_messages(
        s: &Settings,
        name: &str,
        prefix: &str,
        slot: &str,
        publication: &str,
        exchange: &str,
    ) -> Result<RelayConfig> {
        let outbox = format!("[outbox]\nsource = \"message\"\nprefix = \"{prefix}\"\n");
        Self::write_outbox(s, name, &outbox, slot, publication, exchange, 1)
    }

    fn write_outbox(
        s: &Settings,
        name: &str,
        outbox: &str,
        slot: &str,
        publication: &str,
        exchange: &str,
        channels: u32,
    ) -> Result<RelayConfig> {
        let dir = Path::new(&s.out_dir).join("work");
        std::fs::create_dir_all(&dir)?;
        let http_port = crate::procs::free_port()?;
        let path = dir.join(format!("relay-{name}.toml"));
        let text = format!(
            r#"# written by relay-bench
[postgres]
url = "{pg}"
slot = "{slot}"
publication = "{publication}"

{outbox}
[rabbitmq]
url = "{amqp}"
exchange = "{exchange}"
routing_key = "{{aggregate_type}}.{{event_type}}"
window = {window}
{channels}
[http]
listen = "127.0.0.1:{http_port}"
"#,
            pg = s.pg_url,
            amqp = s.amqp_url,
            window = s.window,
            channels = if channels > 1 {
                format!("channels = {channels}\n")
            } else {
                String::new()
            },
        );
        std::fs::write(&path, text)?;
        Ok(RelayConfig {
            path,
            slot: slot.to_owned(),
            http_port,
            bin: s.relay_bin.clone(),
            log_dir: dir,
            name: name.to_owned(),
        })
    }

    fn cmd(&self, sub: &str) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg(sub).arg("--config").arg(&self.path);
        c.env("OUTBOX_RELAY_LOG", "info");
        c
    }

    /// `outbox-relay setup`: publication, slot, checkpoint table.
    pub fn setup(&self) -> Result<()> {
        let out = self
            .cmd("setup")
            .output()
            .with_context(|| format!("running {} setup", self.bin))?;
        if !out.status.success() {
            bail!(
                "outbox-relay setup failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// `outbox-relay run`, logging to `work/relay-<name>-<what>.log`.
    pub fn spawn(&self, what: &str) -> Result<Child> {
        let log = self.log_dir.join(format!("relay-{}-{what}.log", self.name));
        self.cmd("run")
            .stdin(Stdio::null())
            .stdout(Stdio::from(std::fs::File::create(
                log.with_extension("out"),
            )?))
            .stderr(Stdio::from(std::fs::File::create(&log)?))
            .spawn()
            .with_context(|| format!("starting {} run", self.bin))
    }

    pub fn log_tail(&self, what: &str) -> String {
        let log = self.log_dir.join(format!("relay-{}-{what}.log", self.name));
        let s = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    async fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.http_port, path).await
    }

    /// Prometheus text from `/metrics`.
    pub async fn metrics(&self) -> Result<String> {
        let (code, body) = self.get("/metrics").await?;
        if code != 200 {
            bail!("/metrics answered {code}");
        }
        Ok(body)
    }

    /// Waits until `/readyz` answers 200 (streaming, broker connected).
    pub async fn wait_ready(&self, child: &mut Child, timeout: Duration) -> Result<()> {
        let end = Instant::now() + timeout;
        loop {
            if let Ok((200, _)) = self.get("/readyz").await {
                return Ok(());
            }
            if let Some(s) = child.try_wait()? {
                bail!("relay exited ({s}) before it was ready");
            }
            if Instant::now() > end {
                bail!("relay not ready after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A value of metric `name` (first sample whose line starts with it).
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Minimal HTTP/1.1 GET on 127.0.0.1 (Connection: close).
pub async fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let code: u16 = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .context("no HTTP status")?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok::<_, anyhow::Error>((code, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .context("HTTP GET timed out")?
}
