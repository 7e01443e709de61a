//! A TCP proxy between the relay and one server, which the nemesis
//! turns against the connections going through it: stalled (bytes held,
//! sockets open), cut (closed), half-closed (the relay reads end-of-file
//! while its writes still go through).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub struct Proxy {
    pub addr: SocketAddr,
    stalled: watch::Sender<bool>,
    /// Per connection: cancelled to cut it, and to half-close it.
    conns: Arc<Mutex<Vec<(CancellationToken, CancellationToken)>>>,
    stop: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stalled, stalled_rx) = watch::channel(false);
        let conns: Arc<Mutex<Vec<(CancellationToken, CancellationToken)>>> = Arc::default();
        let stop = CancellationToken::new();
        let (list, stopped) = (Arc::clone(&conns), stop.clone());
        tokio::spawn(async move {
            loop {
                let (client, _) = tokio::select! {
                    () = stopped.cancelled() => return,
                    r = listener.accept() => match r { Ok(a) => a, Err(_) => continue },
                };
                let (cut, half) = (CancellationToken::new(), CancellationToken::new());
                {
                    let mut l = list.lock().unwrap();
                    l.retain(|(c, _)| !c.is_cancelled());
                    l.push((cut.clone(), half.clone()));
                }
                let stalled = stalled_rx.clone();
                let stopped = stopped.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = pump(cr, sw, stalled.clone(), None);
                    let down = pump(sr, cw, stalled, Some(half));
                    tokio::select! {
                        () = cut.cancelled() => {}
                        () = stopped.cancelled() => {}
                        _ = async { tokio::join!(up, down) } => {}
                    }
                    cut.cancel();
                });
            }
        });
        Proxy {
            addr,
            stalled,
            conns,
            stop,
        }
    }

    pub fn stall(&self, on: bool) {
        self.stalled.send_replace(on);
    }

    pub fn cut(&self) {
        for (c, _) in self.conns.lock().unwrap().drain(..) {
            c.cancel();
        }
    }

    pub fn half_close(&self) {
        for (_, h) in self.conns.lock().unwrap().iter() {
            h.cancel();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Copies `from` to `to`, holding bytes while stalled; `half` (on the
/// way to the relay) shuts `to` and stops copying, `from` left open.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
    half: Option<CancellationToken>,
) {
    let half = half.unwrap_or_default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        while *stalled.borrow_and_update() {
            tokio::select! {
                () = half.cancelled() => break,
                r = stalled.changed() => if r.is_err() { return },
            }
        }
        let n = tokio::select! {
            () = half.cancelled() => {
                // The other direction goes on until the relay closes.
                let _ = to.shutdown().await;
                return;
            }
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => { let _ = to.shutdown().await; return } Ok(n) => n },
        };
        // Bytes read before a stall still go: the stall holds what comes next.
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
