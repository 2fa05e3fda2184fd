//! A plaintext HTTP/2 connection to one `host:port`, called without a
//! buffer task: a call's request goes from the caller's task straight to
//! the connection's task (tonic's `Channel` puts a buffer task in between:
//! one more thread hand-off per call on a multi-threaded runtime).
//!
//! The connection is made on the first call and made again once it has
//! closed (the name is resolved at each connect, so behind a ClusterIP
//! Service a new connection may reach another pod). A failure to connect is
//! reported as [`tonic::ConnectError`], so that [`super::call`] knows that
//! nothing was sent.

use std::{sync::Arc, time::Duration};

use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tonic::{body::Body, codegen::http};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Direct {
    /// `host:port`.
    authority: http::uri::Authority,
    connect_timeout: Duration,
    /// The open connection's sender, if any.
    open: std::sync::Mutex<Option<SendRequest<Body>>>,
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

    /// The open connection's sender, if it can take a request.
    async fn current(&self) -> Option<SendRequest<Body>> {
        let open = self.open.lock().ok()?.as_ref().filter(|s| !s.is_closed()).cloned();
        let mut sender = open?;
        sender.ready().await.ok()?;
        Some(sender)
    }

    /// A sender ready for a request: the open connection's, or a new one's.
    async fn sender(&self) -> Result<SendRequest<Body>, BoxError> {
        if let Some(s) = self.current().await {
            return Ok(s);
        }
        let _connecting = self.connecting.lock().await;
        // Another call may have connected meanwhile.
        if let Some(s) = self.current().await {
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
        let (mut sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(Duration::from_secs(20))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| not_connected(e.into()))?;
        tokio::spawn(async move {
            // Ends when the connection closes; its errors reach the calls.
            let _ = connection.await;
        });
        sender.ready().await.map_err(|e| not_connected(e.into()))?;
        if let Ok(mut open) = self.open.lock() {
            *open = Some(sender.clone());
        }
        Ok(sender)
    }

    /// Stops using the open connection (it is going away): the next call
    /// makes a new one. Calls in flight on it finish on it.
    pub(crate) fn forget(&self) {
        if let Ok(mut open) = self.open.lock() {
            *open = None;
        }
    }

    /// Sends one request (its URI a path) on the connection.
    pub(crate) async fn send(&self, mut request: http::Request<Body>) -> Result<http::Response<Body>, BoxError> {
        let mut parts = request.uri().clone().into_parts();
        parts.scheme = Some(http::uri::Scheme::HTTP);
        parts.authority = Some(self.authority.clone());
        *request.uri_mut() = http::Uri::from_parts(parts)?;
        let mut sender = self.sender().await?;
        let response = sender.send_request(request).await?;
        Ok(response.map(Body::new))
    }
}
