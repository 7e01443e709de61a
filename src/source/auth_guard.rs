//! `require_auth` on the SQL connection. tokio-postgres answers any
//! authentication request it can, so the relay reads the server's side of
//! the startup itself, below the driver: a stream wrapper that parses the
//! messages the server sends until authentication is over, and fails the
//! read that carries a request [`AuthPolicy`] refuses, before the driver
//! sees it (so nothing is sent in answer). Below TLS it watches the
//! cleartext startup (and steps aside once the server accepts TLS); above
//! TLS, a second one watches what the TLS stream carries.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, TlsConnect, TlsStream};

use crate::config::{AuthMethod, AuthPolicy};

/// The error a refused request fails the read with: the refusal, naming
/// the setting to change.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AuthRefused(pub String);

impl AuthRefused {
    /// The refusal inside a driver error, if that is what ended it.
    pub fn find<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a AuthRefused> {
        let mut cur = Some(e);
        while let Some(err) = cur {
            if let Some(r) = err.downcast_ref::<AuthRefused>() {
                return Some(r);
            }
            if let Some(r) = (err.downcast_ref::<io::Error>())
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<AuthRefused>())
            {
                return Some(r);
            }
            cur = err.source();
        }
        None
    }
}

const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing written yet: an SSLRequest, or the startup message.
    Start,
    /// An SSLRequest was sent: one byte answers it.
    SslAnswer,
    /// Reading the server's messages until authentication is over.
    Messages,
    /// Authentication is over, or TLS carries the rest: bytes pass.
    Done,
}

/// A stream whose server side is checked against an [`AuthPolicy`] until
/// authentication is over.
pub struct AuthGuard<S> {
    inner: S,
    policy: Arc<AuthPolicy>,
    state: State,
    /// The message header being read: tag, length, and for an
    /// authentication request its code (9 bytes).
    head: Vec<u8>,
    /// Bytes of the current message still to pass unread.
    skip: usize,
    /// A request was answered, so `AuthenticationOk` ends it.
    asked: bool,
}

impl<S> AuthGuard<S> {
    /// Below TLS: sees the SSLRequest, if any, and the cleartext startup.
    pub fn socket(inner: S, policy: Arc<AuthPolicy>) -> AuthGuard<S> {
        AuthGuard::new(inner, policy, State::Start)
    }

    fn new(inner: S, policy: Arc<AuthPolicy>, state: State) -> AuthGuard<S> {
        AuthGuard {
            inner,
            policy,
            state,
            head: Vec::with_capacity(9),
            skip: 0,
            asked: false,
        }
    }

    /// Reads what the server sent; an error when it asks for what the
    /// policy refuses.
    fn inspect(&mut self, mut data: &[u8]) -> Result<(), AuthRefused> {
        while !data.is_empty() {
            match self.state {
                State::Start | State::Done => return Ok(()),
                State::SslAnswer => {
                    // 'S': TLS from here on, watched above it.
                    self.state = if data[0] == b'S' {
                        State::Done
                    } else {
                        State::Messages
                    };
                    data = &data[1..];
                }
                State::Messages if self.skip > 0 => {
                    let n = self.skip.min(data.len());
                    self.skip -= n;
                    data = &data[n..];
                }
                State::Messages => {
                    let want = if self.head.len() >= 5 && self.head[0] == b'R' {
                        9
                    } else {
                        5
                    };
                    let n = (want - self.head.len()).min(data.len());
                    self.head.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.head.len() < want {
                        continue;
                    }
                    let len = u32::from_be_bytes(self.head[1..5].try_into().expect("4 bytes"));
                    if self.head[0] == b'R' && want == 5 {
                        continue;
                    }
                    let body = (len as usize).saturating_sub(4);
                    if self.head[0] == b'R' {
                        let code = u32::from_be_bytes(self.head[5..9].try_into().expect("4"));
                        self.request(code)?;
                        self.skip = body.saturating_sub(4);
                    } else {
                        self.skip = body;
                    }
                    self.head.clear();
                }
            }
        }
        Ok(())
    }

    fn request(&mut self, code: u32) -> Result<(), AuthRefused> {
        if code == 0 {
            // AuthenticationOk: with no request before it, the server
            // authenticated nothing.
            if !self.asked && !self.policy.allows(AuthMethod::None) {
                return Err(AuthRefused(self.policy.refusal(AuthMethod::None)));
            }
            self.state = State::Done;
            return Ok(());
        }
        if let Some(m) = AuthMethod::of_request(code) {
            if !self.policy.allows(m) {
                return Err(AuthRefused(self.policy.refusal(m)));
            }
            self.asked = true;
        }
        Ok(())
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthGuard<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r
            && this.state != State::Done
        {
            let new = buf.filled()[before..].to_vec();
            if let Err(refused) = this.inspect(&new) {
                buf.set_filled(before);
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    refused,
                )));
            }
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthGuard<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.state == State::Start && !buf.is_empty() {
            this.state = if buf.starts_with(&SSL_REQUEST) {
                State::SslAnswer
            } else {
                State::Messages
            };
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: TlsStream + Unpin> TlsStream for AuthGuard<S> {
    fn channel_binding(&self) -> ChannelBinding {
        self.inner.channel_binding()
    }
}

/// A TLS connector whose stream is guarded too (what TLS carries is the
/// startup the socket's guard can no longer read).
pub struct GuardedTls<T> {
    inner: T,
    policy: Arc<AuthPolicy>,
}

impl<T> GuardedTls<T> {
    /// Guards what `inner`'s streams carry.
    pub fn new(inner: T, policy: Arc<AuthPolicy>) -> GuardedTls<T> {
        GuardedTls { inner, policy }
    }
}

impl<S, T> TlsConnect<S> for GuardedTls<T>
where
    T: TlsConnect<S>,
    T::Future: Send + 'static,
    T::Stream: TlsStream + Unpin,
{
    type Stream = AuthGuard<T::Stream>;
    type Error = T::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Stream, T::Error>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        let policy = self.policy;
        let fut = self.inner.connect(stream);
        Box::pin(async move {
            let tls = fut.await?;
            Ok(AuthGuard::new(tls, policy, State::Messages))
        })
    }
}
