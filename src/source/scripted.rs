//! The scripted PostgreSQL server the connection tests run against: an
//! in-process TCP listener that answers the startup with a script, one per
//! test, and records what the client sent (to show what it never sent).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::config::{Config, PostgresConfig};

/// The server's end of one connection.
pub(super) struct PgPeer {
    s: TcpStream,
    buf: Vec<u8>,
    /// Every message the client sent after its startup message, by tag.
    pub(super) sent: Vec<(u8, Vec<u8>)>,
}

impl PgPeer {
    async fn read_more(&mut self) -> bool {
        // On the heap: an array this size would sit in every future that reads.
        let mut chunk = vec![0u8; 16384];
        match tokio::time::timeout(Duration::from_secs(10), self.s.read(&mut chunk)).await {
            Ok(Ok(0) | Err(_)) => false,
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
            Err(_) => panic!("the client sent nothing for 10 s"),
        }
    }

    async fn take(&mut self, n: usize) -> Option<Vec<u8>> {
        while self.buf.len() < n {
            if !self.read_more().await {
                return None;
            }
        }
        Some(self.buf.drain(..n).collect())
    }

    /// Reads the startup (declining TLS when asked for it); returns its
    /// parameters, `replication=database` among them for a replication
    /// connection.
    pub(super) async fn startup(&mut self) -> Vec<(String, String)> {
        loop {
            let len = self.take(4).await.expect("a startup packet");
            let len = u32::from_be_bytes(len.try_into().unwrap()) as usize;
            let body = self.take(len - 4).await.expect("a startup packet");
            if body[..4] == 80877103u32.to_be_bytes() {
                self.s.write_all(b"N").await.unwrap();
                continue;
            }
            let text = String::from_utf8_lossy(&body[4..]).into_owned();
            let parts: Vec<&str> = text.split('\0').collect();
            return (parts.chunks(2))
                .filter(|kv| kv.len() == 2 && !kv[0].is_empty())
                .map(|kv| (kv[0].to_owned(), kv[1].to_owned()))
                .collect();
        }
    }

    /// Sends a backend message.
    pub(super) async fn send(&mut self, tag: u8, payload: &[u8]) {
        let mut m = vec![tag];
        m.extend_from_slice(&(payload.len() as u32 + 4).to_be_bytes());
        m.extend_from_slice(payload);
        self.send_raw(&m).await;
    }

    /// Sends bytes as they are (a header announcing more than follows).
    pub(super) async fn send_raw(&mut self, bytes: &[u8]) {
        // The client may already have hung up.
        let _ = self.s.write_all(bytes).await;
    }

    /// An authentication request: `code` and its data.
    pub(super) async fn auth(&mut self, code: u32, data: &[u8]) {
        let mut p = code.to_be_bytes().to_vec();
        p.extend_from_slice(data);
        self.send(b'R', &p).await;
    }

    /// The client's next message, `None` once it hung up.
    pub(super) async fn message(&mut self) -> Option<(u8, Vec<u8>)> {
        let head = self.take(5).await?;
        let len = u32::from_be_bytes(head[1..5].try_into().unwrap()) as usize;
        let body = self.take(len - 4).await?;
        self.sent.push((head[0], body.clone()));
        Some((head[0], body))
    }

    /// Reads until the client hangs up; returns all it sent.
    pub(super) async fn until_closed(mut self) -> Vec<(u8, Vec<u8>)> {
        while self.message().await.is_some() {}
        self.sent
    }
}

/// A server on a free port running `script` for each connection, and the
/// `[postgres]` configuration that reaches it (`query` added to its URL),
/// validated as `run` would validate it. The handle yields what each
/// connection's script returned, in order.
pub(super) async fn pg_server<F, Fut, T>(
    query: &str,
    script: F,
) -> (PostgresConfig, tokio::task::JoinHandle<Vec<T>>)
where
    F: Fn(PgPeer) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T> + Send,
    T: Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let handle = tokio::spawn(async move {
        let mut out = Vec::new();
        while let Ok(Ok((s, _))) =
            tokio::time::timeout(Duration::from_secs(2), listener.accept()).await
        {
            let peer = PgPeer {
                s,
                buf: Vec::new(),
                sent: Vec::new(),
            };
            out.push(script(peer).await);
        }
        out
    });
    let toml = format!(
        "[postgres]\nurl = \"postgres://relay:{PASSWORD}@127.0.0.1:{port}/app?{query}\"\n\
         [outbox]\ntable = \"public.outbox\"\n\
         [rabbitmq]\nurl = \"amqp://127.0.0.1\"\nexchange = \"x\"\n"
    );
    let cfg = Config::from_toml(&toml, "scripted", Vec::new()).expect("a valid config");
    (cfg.postgres, handle)
}

/// The password the configuration of [`pg_server`] holds.
pub(super) const PASSWORD: &str = "Sup3rS3cretPw";
