//! A connection's write side, corked: what HTTP/2 writes during one poll of
//! the connection's task is gathered and sent in one write at the end of
//! that poll.
//!
//! h2 writes each DATA frame of more than 256 bytes on its own (it chains
//! the payload rather than copy it, and flushes before the next frame), so
//! a connection carrying many concurrent calls made one `writev` per call:
//! on loopback each costs the kernel's whole send and receive path, about
//! a fifth of Lattice's CPU under load. Gathered, the requests that callers
//! queued while the connection's task waited to run leave in one write, and
//! the service reads them in one too.
//!
//! Large writes are not copied: from [`PASS_THROUGH`] bytes on, what is
//! gathered is written first and the large write goes to the socket as it
//! is, so a large message costs no more memory than before. Nothing waits longer than the poll that wrote it: [`Drain::poll`]
//! runs right after each poll of the connection, and at most
//! [`GATHER_LIMIT`] bytes are held before they are written anyway.

use std::{
    io::{self, IoSlice},
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll, ready},
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{
        TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
};

/// Writes of at least this many bytes are not copied into the gathered
/// bytes: a large message's DATA frames (16 KiB, HTTP/2's default frame
/// size) go out as h2 wrote them, without a copy and without a buffer of
/// their size held per connection.
pub(crate) const PASS_THROUGH: usize = 16 * 1024;

/// The most bytes gathered before they are written without waiting for the
/// end of the poll (and the most a connection's buffer keeps between polls).
pub(crate) const GATHER_LIMIT: usize = 64 * 1024;

/// The IO handed to h2: reads go to the socket, writes are gathered.
#[derive(Debug)]
pub(crate) struct Corked {
    read: OwnedReadHalf,
    out: Arc<Mutex<Out>>,
}

/// Writes what a [`Corked`] gathered; polled by the connection's task after
/// each poll of the connection.
#[derive(Debug)]
pub(crate) struct Drain {
    out: Arc<Mutex<Out>>,
}

/// The write half and what waits to be written on it.
#[derive(Debug)]
struct Out {
    half: OwnedWriteHalf,
    gathered: Vec<u8>,
    /// A write of the gathered bytes failed: the next write reports it (so
    /// that h2 fails the connection's calls as for any broken socket).
    failed: Option<io::ErrorKind>,
}

/// Splits `stream` into the IO for h2 and its drain.
pub(crate) fn cork(stream: TcpStream) -> (Corked, Drain) {
    let (read, half) = stream.into_split();
    let out = Arc::new(Mutex::new(Out { half, gathered: Vec::new(), failed: None }));
    (Corked { read, out: out.clone() }, Drain { out })
}

/// Only the connection's task takes the lock (h2 writes, then the drain),
/// so it is never contended; nothing can panic while it is held, and a
/// poisoned lock still holds consistent bytes.
fn lock(out: &Mutex<Out>) -> MutexGuard<'_, Out> {
    out.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Out {
    /// Writes the gathered bytes; pending while the socket is full (the
    /// task is woken when it can take more).
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.gathered.is_empty() {
            let n = ready!(Pin::new(&mut self.half).poll_write(cx, &self.gathered))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            if n == self.gathered.len() {
                self.gathered.clear();
            } else {
                self.gathered.drain(..n);
            }
        }
        // A burst of large writes leaves no large buffer behind.
        if self.gathered.capacity() > GATHER_LIMIT {
            self.gathered = Vec::new();
        }
        Poll::Ready(Ok(()))
    }

    fn check(&self) -> io::Result<()> {
        match self.failed {
            Some(kind) => Err(kind.into()),
            None => Ok(()),
        }
    }
}

impl Drain {
    /// Writes what the last poll of the connection gathered. A failure is
    /// kept for the connection's next write, and the task is polled again
    /// so that it finds it.
    pub(crate) fn poll(&self, cx: &mut Context<'_>) {
        let mut out = lock(&self.out);
        if out.failed.is_some() {
            return;
        }
        if let Poll::Ready(Err(e)) = out.poll_drain(cx) {
            out.failed = Some(e.kind());
            out.gathered = Vec::new();
            cx.waker().wake_by_ref();
        }
    }
}

impl AsyncRead for Corked {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.read).poll_read(cx, buf)
    }
}

impl AsyncWrite for Corked {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut out = lock(&self.out);
        out.check()?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total >= PASS_THROUGH || out.gathered.len() + total > GATHER_LIMIT {
            // What came first goes first.
            ready!(out.poll_drain(cx))?;
        }
        if total >= PASS_THROUGH {
            return Pin::new(&mut out.half).poll_write_vectored(cx, bufs);
        }
        for b in bufs {
            out.gathered.extend_from_slice(b);
        }
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Nothing to do here: the gathered bytes are written at the end of
    /// the poll ([`Drain::poll`]), which is what this would have done.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        lock(&self.out).check().into()
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut out = lock(&self.out);
        out.check()?;
        ready!(out.poll_drain(cx))?;
        Pin::new(&mut out.half).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::{future::poll_fn, time::Duration};

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    use super::*;

    async fn pair() -> (Corked, Drain, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (io, drain) = cork(client.unwrap());
        (io, drain, accepted.unwrap().0)
    }

    /// Reads what has arrived within a short wait (the writes under test are
    /// on loopback: what was written is there by then).
    async fn arrived(peer: &mut TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        let mut chunk = vec![0; 1 << 20];
        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(50), peer.read(&mut chunk)).await {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
        got
    }

    /// Small writes wait for the drain, and then all of them arrive in order.
    #[tokio::test]
    async fn small_writes_leave_at_the_drain_in_order() {
        let (mut io, drain, mut peer) = pair().await;
        for i in 0..10u8 {
            io.write_all(&[i; 300]).await.unwrap();
        }
        io.flush().await.unwrap();
        assert!(arrived(&mut peer).await.is_empty(), "nothing is written before the drain");
        poll_fn(|cx| {
            drain.poll(cx);
            Poll::Ready(())
        })
        .await;
        let got = arrived(&mut peer).await;
        let expected: Vec<u8> = (0..10u8).flat_map(|i| [i; 300]).collect();
        assert_eq!(got, expected);
    }

    /// A large write is not held: it follows what was gathered before it.
    #[tokio::test]
    async fn a_large_write_goes_out_after_what_came_before_it() {
        let (mut io, _drain, mut peer) = pair().await;
        io.write_all(b"first").await.unwrap();
        let large = vec![7u8; PASS_THROUGH];
        io.write_all(&large).await.unwrap();
        let got = arrived(&mut peer).await;
        assert_eq!(&got[..5], b"first");
        assert_eq!(got.len(), 5 + PASS_THROUGH);
    }

    /// Gathering stops at the limit: the bytes go out without a drain.
    #[tokio::test]
    async fn gathered_bytes_beyond_the_limit_are_written() {
        let (mut io, _drain, mut peer) = pair().await;
        let chunk = vec![1u8; 1000];
        let mut written = 0;
        while written <= GATHER_LIMIT {
            io.write_all(&chunk).await.unwrap();
            written += chunk.len();
        }
        assert!(arrived(&mut peer).await.len() >= GATHER_LIMIT - chunk.len());
    }

    /// Shutting the connection down writes what was gathered first.
    #[tokio::test]
    async fn shutdown_drains_first() {
        let (mut io, _drain, mut peer) = pair().await;
        io.write_all(b"goodbye").await.unwrap();
        io.shutdown().await.unwrap();
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"goodbye");
    }
}
