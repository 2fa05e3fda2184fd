//! Hook and tool connections (Lattice is the client) whose writes are
//! gathered: what HTTP/2 writes during one poll of the connection's task
//! is sent in one write, right after that poll ([`Drain::poll`]). Lattice
//! runs the connection's task, so it knows when a poll ends.
//!
//! h2 writes each DATA frame of more than 256 bytes on its own (it chains
//! the payload rather than copy it, and flushes before the next frame), so
//! a connection carrying many concurrent calls made one `writev` per call:
//! on loopback each costs the kernel's whole send and receive path, about
//! a fifth of Lattice's CPU under load. Gathered, the messages that tasks
//! queued while the connection's task waited to run leave in one write, and
//! the other side reads them in one too. Large writes are not copied (see
//! [`WriteBuffer`]).

use std::{
    io::{self, IoSlice},
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll},
};

use crate::gather::WriteBuffer;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The IO handed to h2 for a hook or tool connection (TCP, or TLS over
/// it): reads go to the stream, writes are gathered until
/// [`Drain::poll`].
#[derive(Debug)]
pub struct Corked<S> {
    out: Arc<Mutex<Out<S>>>,
}

/// Writes what a [`Corked`] gathered; polled by the connection's task after
/// each poll of the connection.
#[derive(Debug)]
pub struct Drain<S> {
    out: Arc<Mutex<Out<S>>>,
}

/// The stream and what waits to be written on it.
#[derive(Debug)]
struct Out<S> {
    io: S,
    buffer: WriteBuffer,
}

/// The IO for h2 over `stream`, and its drain.
pub fn cork<S: AsyncRead + AsyncWrite + Unpin>(stream: S) -> (Corked<S>, Drain<S>) {
    let out = Arc::new(Mutex::new(Out { io: stream, buffer: WriteBuffer::default() }));
    (Corked { out: out.clone() }, Drain { out })
}

/// Only the connection's task takes the lock (h2 reads and writes, then
/// the drain), so it is never contended; nothing can panic while it is
/// held, and a poisoned lock still holds consistent bytes.
fn lock<S>(out: &Mutex<Out<S>>) -> MutexGuard<'_, Out<S>> {
    out.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<S: AsyncWrite + Unpin> Drain<S> {
    /// Writes what the last poll of the connection gathered. A failure is
    /// kept for the connection's next write, and the task is polled again
    /// so that it finds it.
    pub fn poll(&self, cx: &mut Context<'_>) {
        let out = &mut *lock(&self.out);
        if out.buffer.has_failed() {
            return;
        }
        // Then flushed: TLS keeps records the socket did not take yet, and
        // writes them only when flushed (TCP's flush does nothing).
        let drained = match out.buffer.poll_drain(&mut out.io, cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut out.io).poll_flush(cx),
            other => other,
        };
        if let Poll::Ready(Err(e)) = drained {
            out.buffer.fail(e.kind());
            cx.waker().wake_by_ref();
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Corked<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut lock(&self.out).io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Corked<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let out = &mut *lock(&self.out);
        out.buffer.poll_write(&mut out.io, cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Nothing to do here: the gathered bytes are written at the end of
    /// the poll ([`Drain::poll`]), which is what this would have done.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        lock(&self.out).buffer.check().into()
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let out = &mut *lock(&self.out);
        out.buffer.poll_shutdown(&mut out.io, cx)
    }
}

#[cfg(test)]
mod tests {
    use std::{future::poll_fn, time::Duration};

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
    };

    use crate::gather::{GATHER_LIMIT, PASS_THROUGH};

    use super::*;

    async fn pair() -> (Corked<TcpStream>, Drain<TcpStream>, TcpStream) {
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

    /// Counts how often it was woken.
    struct Wakes(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// On a listener connection, a flush of small writes wakes the task and
    /// leaves them; they are written by the first flush after the task's
    /// next poll has begun (with a read), together with what came since.
    #[tokio::test]
    async fn listener_writes_leave_on_the_next_poll_together() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(listener.local_addr().unwrap()), listener.accept());
        let (mut io, mut peer) = (crate::Events::new(accepted.unwrap().0), client.unwrap());
        let wakes = Arc::new(Wakes(Default::default()));
        let waker = std::task::Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let mut pinned = Pin::new(&mut io);
        let write = |io: &mut Pin<&mut crate::Events<TcpStream>>, cx: &mut Context<'_>, b: &[u8]| {
            assert!(matches!(io.as_mut().poll_write(cx, b), Poll::Ready(Ok(n)) if n == b.len()));
        };
        // One poll: two messages and a flush.
        write(&mut pinned, &mut cx, b"one ");
        write(&mut pinned, &mut cx, b"two ");
        assert!(matches!(pinned.as_mut().poll_flush(&mut cx), Poll::Ready(Ok(()))));
        assert_eq!(wakes.0.load(std::sync::atomic::Ordering::SeqCst), 1, "the task is polled again");
        // Another task queues a third before that poll.
        write(&mut pinned, &mut cx, b"three");
        assert!(matches!(pinned.as_mut().poll_flush(&mut cx), Poll::Ready(Ok(()))));
        assert_eq!(wakes.0.load(std::sync::atomic::Ordering::SeqCst), 1, "woken once");
        assert!(arrived(&mut peer).await.is_empty(), "nothing is written within the poll");
        // The next poll: h2 reads first, then flushes.
        let mut buf = [0u8; 16];
        let mut read = ReadBuf::new(&mut buf);
        assert!(pinned.as_mut().poll_read(&mut cx, &mut read).is_pending());
        assert!(matches!(pinned.as_mut().poll_flush(&mut cx), Poll::Ready(Ok(()))));
        assert_eq!(arrived(&mut peer).await, b"one two three");
    }

    /// Shutting a listener connection down writes what was gathered first.
    #[tokio::test]
    async fn listener_shutdown_drains_first() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(listener.local_addr().unwrap()), listener.accept());
        let (mut io, mut peer) = (crate::Events::new(accepted.unwrap().0), client.unwrap());
        io.write_all(b"last events").await.unwrap();
        io.flush().await.unwrap();
        io.shutdown().await.unwrap();
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"last events");
    }
}
