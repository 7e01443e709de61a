//! Connecting to a host name that resolves to several addresses: each
//! address in turn, each within a deadline of its own, as libpq does.
//!
//! `TcpStream::connect((name, port))` tries the addresses one after the
//! other too, but each waits for the kernel's own connect timeout (about
//! two minutes), and the caller's one deadline around the whole call ends
//! on the first: an address that drops connection attempts (an instance
//! gone but still in DNS, a firewall that drops rather than refuses, an
//! IPv6 route to nowhere) would hide every address after it for as long as
//! the name resolves that way.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;

/// Connects to the first address of `host` that answers within `each`
/// (the lookup too has `each`). Fails with the last address's error (a
/// timeout, a refusal).
pub(crate) async fn connect(host: &str, port: u16, each: Duration) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = tokio::time::timeout(each, tokio::net::lookup_host((host, port)))
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("resolving {host} timed out after {each:?}"),
            )
        })??
        .collect();
    connect_any(&addrs, each).await
}

/// Connects to the first of `addrs` that answers within `each`.
async fn connect_any(addrs: &[SocketAddr], each: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address");
    for addr in addrs {
        match tokio::time::timeout(each, TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => return Ok(tcp),
            Ok(Err(e)) => last = e,
            Err(_) => {
                last = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("connecting to {addr} timed out after {each:?}"),
                );
            }
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An address that drops connection attempts: a listener that never
    /// accepts, its queue full (Linux drops a SYN then, and the connect
    /// waits for the kernel's timeout).
    fn black_hole() -> (socket2::Socket, std::net::TcpStream, SocketAddr) {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        s.listen(0).unwrap();
        let addr = s.local_addr().unwrap().as_socket().unwrap();
        // Fills the queue (a backlog of 0 holds one).
        let filler = std::net::TcpStream::connect(addr).unwrap();
        (s, filler, addr)
    }

    #[tokio::test]
    async fn an_address_that_drops_attempts_does_not_hide_the_next() {
        let (_hole, _filler, dead) = black_hole();
        // The dead address does hang a plain connect.
        let plain = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(dead)).await;
        assert!(plain.is_err(), "the black hole answered: {plain:?}");

        let live = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let good = live.local_addr().unwrap();
        let tcp = connect_any(&[dead, good], Duration::from_millis(500))
            .await
            .expect("the second address");
        assert_eq!(tcp.peer_addr().unwrap(), good);

        let e = connect_any(&[dead], Duration::from_millis(200))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains(&dead.to_string()), "{e}");
    }
}
