//! A plaintext HTTP/2 connection to one `host:port`, driven from the
//! caller's task.
//!
//! A call opens its stream, queues its headers and its whole body (one
//! message, already encoded) and reads the response on the task that made
//! it; only the connection's own task touches the socket, and it writes
//! everything queued since it last ran in one write (see [`crate::cork`]):
//! the calls of concurrent queries to one service share their writes. No
//! task is spawned and no channel is crossed per call (a hyper client
//! connection hands each request to the connection task over a channel,
//! spawns a task for its response and writes the body separately; tonic's
//! `Channel` adds a buffer task).
//!
//! The connection is made on the first call and made again once it has
//! closed (the name is resolved at each connect, so behind a ClusterIP
//! Service a new connection may reach another pod). It is kept alive with
//! PINGs every 20 s and closed when one is not answered within 10 s. A
//! failure to connect is reported as [`tonic::ConnectError`], and a request
//! the connection could not take as [`NotWritten`], so that [`super::call`]
//! knows that nothing was sent.

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
use tokio::net::TcpStream;
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
    /// The open connection's sender, and whether the connection has ended.
    open: std::sync::Mutex<Option<(SendRequest<Bytes>, Arc<AtomicBool>)>>,
    /// Held while connecting, so that concurrent calls make one connection.
    connecting: tokio::sync::Mutex<()>,
}

impl Direct {
    /// A connection to `authority` (`host:port`), made on the first call.
    pub(crate) fn new(authority: &str, connect_timeout: Duration) -> Result<Arc<Direct>, String> {
        let authority = authority.parse().map_err(|e: http::uri::InvalidUri| e.to_string())?;
        Ok(Arc::new(Direct {
            authority,
            connect_timeout,
            open: std::sync::Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
        }))
    }

    /// The open connection's sender, if it is still open.
    fn current(&self) -> Option<SendRequest<Bytes>> {
        let open = crate::sync::lock(&self.open);
        open.as_ref().filter(|(_, ended)| !ended.load(Ordering::Acquire)).map(|(s, _)| s.clone())
    }

    /// A sender: the open connection's, or a new one's.
    async fn sender(&self) -> Result<SendRequest<Bytes>, BoxError> {
        if let Some(s) = self.current() {
            return Ok(s);
        }
        let _connecting = self.connecting.lock().await;
        // Another call may have connected meanwhile.
        if let Some(s) = self.current() {
            return Ok(s);
        }
        let connect = async {
            let stream = TcpStream::connect(self.authority.as_str()).await?;
            stream.set_nodelay(true)?;
            Ok::<_, std::io::Error>(stream)
        };
        let not_connected = |e: BoxError| -> BoxError { tonic::ConnectError(e).into() };
        let stream = match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(not_connected(e.into())),
            Err(_) => {
                let e = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out");
                return Err(not_connected(e.into()));
            }
        };
        let (io, drain) = crate::cork::cork(stream);
        let (sender, mut connection) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .enable_push(false)
            .handshake::<_, Bytes>(io)
            .await
            .map_err(|e| not_connected(e.into()))?;
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
            // What each poll of the connection wrote leaves in one write.
            let run = std::future::poll_fn(|cx| {
                let polled = Pin::new(&mut connection).poll(cx);
                drain.poll(cx);
                polled
            });
            tokio::select! {
                _ = run => {}
                () = keepalive => {}
            }
            ended_by_task.store(true, Ordering::Release);
        });
        *crate::sync::lock(&self.open) = Some((sender.clone(), ended));
        Ok(sender)
    }

    /// Stops using the open connection (it is going away): the next call
    /// makes a new one. Calls in flight on it finish on it.
    pub(crate) fn forget(&self) {
        *crate::sync::lock(&self.open) = None;
    }

    /// Sends one request (its URI a path; its body the whole message) on
    /// the connection.
    pub(crate) async fn send(&self, request: http::Request<Bytes>) -> Result<http::Response<Body>, BoxError> {
        let (mut parts, body) = request.into_parts();
        let mut uri = parts.uri.into_parts();
        uri.scheme = Some(http::uri::Scheme::HTTP);
        uri.authority = Some(self.authority.clone());
        parts.uri = http::Uri::from_parts(uri)?;
        let request = http::Request::from_parts(parts, ());
        let sender = self.sender().await?;
        // Waits while the connection is at the service's stream limit.
        let mut sender = sender.ready().await.map_err(NotWritten)?;
        let empty = body.is_empty();
        let (response, mut stream) = sender.send_request(request, empty).map_err(NotWritten)?;
        // Queued with the headers; the connection writes both at once.
        let sent = if empty { Ok(()) } else { stream.send_data(body, true) };
        // On a multi-threaded runtime the connection may already have
        // written the headers and taken the service's answer, sent without
        // reading the body (a router's UNIMPLEMENTED closes the stream):
        // then that answer is the call's, not the refused body.
        let response = match (response.await, sent) {
            (Ok(response), _) => response,
            (Err(_), Err(refused)) => return Err(refused.into()),
            (Err(e), Ok(())) => return Err(e.into()),
        };
        Ok(response.map(|recv| Body::new(Received { recv, data_done: false })))
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
