//! An HTTP/2 connection to one `host:port`, plaintext or TLS, driven from
//! the caller's task: the one transport of hook and tool calls and of their
//! health checks.
//!
//! A call opens its stream, queues its headers and its whole body (one
//! message, already encoded) and reads the response on the task that made
//! it; only the connection's own task touches the socket, and it writes
//! everything queued since it last ran in one write (see `lattice_net`):
//! the calls of concurrent queries to one service share their writes. No
//! task is spawned and no channel is crossed per call (a hyper client
//! connection hands each request to the connection task over a channel,
//! spawns a task for its response and writes the body separately; tonic's
//! `Channel` adds a buffer task).
//!
//! The connection is made on the first call and made again once it has
//! closed or gone away (the name is resolved at each connect, so behind a
//! ClusterIP Service a new connection may reach another pod); over TLS each
//! connection uses the certificates current when it is made (see
//! [`super::tls`]). It is kept alive with PINGs every 20 s and closed when
//! one is not answered within 10 s. A reply's header list is limited to
//! [`MAX_HEADER_LIST`]. A failure to connect (TCP or the TLS handshake) is
//! reported as [`tonic::ConnectError`], and a request the connection could
//! not take as [`NotWritten`], so that [`super::call`] knows that nothing
//! was sent. The health checks of an address (see [`super::pool`]) use the
//! same connection as its calls: what they find is what calls would.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use h2::{RecvStream, client::SendRequest};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};
use tonic::{
    body::Body,
    codegen::{Bytes, http},
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Flow-control windows: large enough that a message of a few MiB is not
/// held back by WINDOW_UPDATE round trips (hyper's client defaults).
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;
const KEEPALIVE_EVERY: Duration = Duration::from_secs(20);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The most bytes of header list a reply may carry (its headers, and its
/// trailers): what hyper's client allows by default, and twice the 8 KiB
/// gRPC's own implementations accept by default. A reply over it fails the
/// call (RST_STREAM), the same over plaintext and TLS.
pub(crate) const MAX_HEADER_LIST: u32 = 16 * 1024;

/// A request the connection did not take: it was closed or closing, so the
/// request was never written.
#[derive(Debug, thiserror::Error)]
#[error("the connection could not take the request: {0}")]
pub(crate) struct NotWritten(#[source] pub h2::Error);

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Direct {
    /// `host:port`.
    authority: http::uri::Authority,
    connect_timeout: Duration,
    /// TLS: the handshake of each new connection; else plaintext.
    tls: Option<super::tls::Connect>,
    /// Whether the connection's writes are gathered (see `lattice_net`).
    gather_writes: bool,
    /// The open connection.
    open: std::sync::Mutex<Option<Open>>,
    /// Held while connecting, so that concurrent calls make one connection.
    connecting: tokio::sync::Mutex<()>,
}

/// One connection: its sender, and whether it has ended (set by its task).
/// The flag is the connection's identity too: a call forgets the
/// connection it used, never a newer one.
#[derive(Debug, Clone)]
struct Open {
    sender: SendRequest<Bytes>,
    ended: Arc<AtomicBool>,
}

impl Open {
    fn is(&self, other: &Open) -> bool {
        Arc::ptr_eq(&self.ended, &other.ended)
    }
}

impl Direct {
    /// A connection to `authority` (`host:port`), made on the first call;
    /// over TLS when `tls` is set.
    pub(crate) fn new(
        authority: &str,
        connect_timeout: Duration,
        tls: Option<super::tls::Connect>,
        gather_writes: bool,
    ) -> Result<Arc<Direct>, String> {
        let authority = authority.parse().map_err(|e: http::uri::InvalidUri| e.to_string())?;
        Ok(Arc::new(Direct {
            authority,
            connect_timeout,
            tls,
            gather_writes,
            open: std::sync::Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
        }))
    }

    /// The open connection, if it is still open.
    fn current(&self) -> Option<Open> {
        let open = crate::sync::lock(&self.open);
        open.as_ref().filter(|o| !o.ended.load(Ordering::Acquire)).cloned()
    }

    /// The open connection, or a new one made within `connect_timeout`.
    async fn connection(&self, connect_timeout: Duration) -> Result<Open, BoxError> {
        if let Some(open) = self.current() {
            return Ok(open);
        }
        let _connecting = self.connecting.lock().await;
        // Another call may have connected meanwhile.
        if let Some(open) = self.current() {
            return Ok(open);
        }
        let not_connected = |e: BoxError| -> BoxError { tonic::ConnectError(e).into() };
        let connect = async {
            let tcp = TcpStream::connect(self.authority.as_str()).await.map_err(|e| not_connected(e.into()))?;
            tcp.set_nodelay(true).map_err(|e| not_connected(e.into()))?;
            let gather = self.gather_writes;
            match &self.tls {
                None => start(tcp, gather).await,
                Some(tls) => start(tls.handshake(tcp).await.map_err(|e| not_connected(e.into()))?, gather).await,
            }
            .map_err(|e| not_connected(e.into()))
        };
        let open = match tokio::time::timeout(connect_timeout, connect).await {
            Ok(open) => open?,
            Err(_) => {
                let e = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out");
                return Err(not_connected(e.into()));
            }
        };
        *crate::sync::lock(&self.open) = Some(open.clone());
        Ok(open)
    }

    /// Stops using `used` if it is still the open connection (it is going
    /// away): the next call makes a new one. Calls in flight on it finish
    /// on it.
    fn forget(&self, used: &Open) {
        let mut open = crate::sync::lock(&self.open);
        if open.as_ref().is_some_and(|o| o.is(used)) {
            *open = None;
        }
    }

    /// Sends one request (its URI a path; its body the whole message) on
    /// the connection.
    pub(crate) async fn send(&self, request: http::Request<Bytes>) -> Result<http::Response<Body>, BoxError> {
        self.send_within(request, self.connect_timeout).await
    }

    /// [`Direct::send`], connecting (if it must) within `connect_timeout`.
    pub(crate) async fn send_within(
        &self,
        request: http::Request<Bytes>,
        connect_timeout: Duration,
    ) -> Result<http::Response<Body>, BoxError> {
        let (mut parts, body) = request.into_parts();
        let mut uri = parts.uri.into_parts();
        uri.scheme = Some(if self.tls.is_some() { http::uri::Scheme::HTTPS } else { http::uri::Scheme::HTTP });
        uri.authority = Some(self.authority.clone());
        parts.uri = http::Uri::from_parts(uri)?;
        let request = http::Request::from_parts(parts, ());
        let open = self.connection(connect_timeout.min(self.connect_timeout)).await?;
        let sent = exchange(open.sender.clone(), request, body).await;
        // A connection going away takes no new request: the next call
        // connects again.
        if let Err(e) = &sent
            && matches!(
                super::call::NotSent::of(e.as_ref()),
                Some(super::call::NotSent::GoAway | super::call::NotSent::Closed)
            )
        {
            self.forget(&open);
        }
        sent
    }
}

/// Starts an HTTP/2 connection over `io`, its writes gathered or not, and
/// its task.
async fn start<S>(io: S, gather: bool) -> Result<Open, h2::Error>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if gather {
        let (io, drain) = lattice_net::cork(io);
        // What each poll of the connection wrote leaves in one write.
        return drive(io, move |cx| drain.poll(cx)).await;
    }
    drive(io, |_| {}).await
}

/// The HTTP/2 handshake over `io`, and the connection's task, which calls
/// `after_poll` after each poll of the connection.
async fn drive<S>(
    io: S,
    mut after_poll: impl FnMut(&mut std::task::Context<'_>) + Send + 'static,
) -> Result<Open, h2::Error>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, mut connection) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_header_list_size(MAX_HEADER_LIST)
        .enable_push(false)
        .handshake::<_, Bytes>(io)
        .await?;
    let mut ping = connection.ping_pong();
    let ended = Arc::new(AtomicBool::new(false));
    let ended_by_task = ended.clone();
    tokio::spawn(async move {
        // Ends when the connection closes (its errors reach the calls)
        // or stops answering PINGs (dropping it closes the socket).
        let keepalive = async {
            let Some(ping) = ping.as_mut() else { return std::future::pending().await };
            loop {
                tokio::time::sleep(KEEPALIVE_EVERY).await;
                match tokio::time::timeout(KEEPALIVE_TIMEOUT, ping.ping(h2::Ping::opaque())).await {
                    Ok(Ok(_)) => {}
                    _ => return,
                }
            }
        };
        let run = std::future::poll_fn(|cx| {
            let polled = Pin::new(&mut connection).poll(cx);
            after_poll(cx);
            polled
        });
        tokio::select! {
            _ = run => {}
            () = keepalive => {}
        }
        ended_by_task.store(true, Ordering::Release);
    });
    Ok(Open { sender, ended })
}

/// One request and its response on a connection.
async fn exchange(
    sender: SendRequest<Bytes>,
    request: http::Request<()>,
    body: Bytes,
) -> Result<http::Response<Body>, BoxError> {
    // Waits while the connection is at the service's stream limit.
    let mut sender = sender.ready().await.map_err(NotWritten)?;
    let empty = body.is_empty();
    let (response, mut stream) = sender.send_request(request, empty).map_err(NotWritten)?;
    // Queued with the headers; the connection writes both at once.
    let sent = if empty { Ok(()) } else { stream.send_data(body, true) };
    let response = answer(response.await, sent)?;
    Ok(response.map(|recv| Body::new(Received { recv, data_done: false })))
}

/// The outcome of a request from its response and from queueing its body.
/// On a multi-threaded runtime the connection may already have written the
/// headers and taken the service's answer before the body was queued: an
/// answer sent without reading the body (a router's UNIMPLEMENTED closes
/// the stream) is the call's; and when the stream failed, the stream's own
/// error (the service's REFUSED_STREAM or GOAWAY, which say the request was
/// not processed) is the call's, not the local refusal to queue the body
/// that followed from it.
fn answer<T>(response: Result<T, h2::Error>, sent: Result<(), h2::Error>) -> Result<T, h2::Error> {
    match (response, sent) {
        (Ok(response), _) => Ok(response),
        (Err(e), _) if e.is_remote() || e.is_go_away() || e.is_io() => Err(e),
        (Err(e), Ok(())) => Err(e),
        (Err(_), Err(refused)) => Err(refused),
    }
}

/// A response body read on the caller's task: DATA frames (their window
/// given back as they are read), then the trailers.
#[derive(Debug)]
struct Received {
    recv: RecvStream,
    data_done: bool,
}

impl HttpBody for Received {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if !this.data_done {
            match this.recv.poll_data(cx) {
                Poll::Ready(Some(Ok(data))) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => this.data_done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
        match this.recv.poll_trailers(cx) {
            Poll::Ready(Ok(Some(trailers))) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::call::NotSent;

    /// A loopback HTTP/2 server that refuses every stream (RST_STREAM
    /// REFUSED_STREAM) as soon as its headers arrive.
    async fn refusing() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(mut connection) = h2::server::handshake(tcp).await else { return };
                    while let Some(Ok((_, mut respond))) = connection.accept().await {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                    }
                });
            }
        });
        addr
    }

    /// The service refused the stream before the call queued its body:
    /// the call fails as refused (never received, so retried), not with
    /// the local error of queueing a body on a closed stream.
    #[tokio::test]
    async fn a_refused_stream_is_the_calls_error_when_its_body_came_too_late() {
        let direct = Direct::new(&refusing().await.to_string(), Duration::from_secs(5), None, true).unwrap();
        let open = direct.connection(Duration::from_secs(5)).await.unwrap();
        let mut sender = open.sender.ready().await.unwrap();
        let request = http::Request::post("http://service/x.Y/Z").body(()).unwrap();
        let (response, mut stream) = sender.send_request(request, false).unwrap();
        // The refusal arrives first; then the body can't be queued.
        let response = response.await;
        let sent = stream.send_data(Bytes::from_static(b"message"), true);
        assert!(response.is_err() && sent.is_err(), "{response:?} {sent:?}");
        assert_eq!(NotSent::of(sent.as_ref().unwrap_err()), None, "the local error alone says nothing of the service");
        let error = answer(response, sent).unwrap_err();
        assert_eq!(NotSent::of(&error), Some(NotSent::Refused), "{error:?}");
    }

    /// A late failure on a connection that was already replaced leaves
    /// the new one in use.
    #[tokio::test]
    async fn a_late_failure_forgets_only_its_own_connection() {
        let direct = Direct::new(&refusing().await.to_string(), Duration::from_secs(5), None, true).unwrap();
        let old = direct.connection(Duration::from_secs(5)).await.unwrap();
        direct.forget(&old);
        let new = direct.connection(Duration::from_secs(5)).await.unwrap();
        assert!(!new.is(&old), "a new connection was made");
        direct.forget(&old);
        assert!(direct.current().is_some_and(|c| c.is(&new)), "the new connection is still the one in use");
        direct.forget(&new);
        assert!(direct.current().is_none());
    }
}
