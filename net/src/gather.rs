//! Gathered writes: bytes that HTTP/2 writes one frame or flush at a time,
//! held and written to the socket together.
//!
//! On loopback each write costs the kernel's whole send path and wakes the
//! reader, so a connection that writes a call's frames in two or three
//! writes costs both sides more than the bytes do. Lattice gathers on its
//! hook, tool and API connections, and the hook SDK on the connections it
//! serves. [`WriteBuffer`] holds small writes and passes large ones
//! through; [`Gathered`] is a connection that writes them at the flushes a
//! [`WhenToWrite`] policy does not hold, and the policies are theirs.

use std::{
    io::{self, IoSlice},
    pin::Pin,
    task::{Context, Poll, ready},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Writes of at least this many bytes are not copied into the gathered
/// bytes: a large message's DATA frames (16 KiB, HTTP/2's default frame
/// size) go out as h2 wrote them, without a copy and without a buffer of
/// their size held per connection.
pub const PASS_THROUGH: usize = 16 * 1024;

/// The most bytes gathered before they are written without waiting (and
/// the most a connection's buffer keeps between writes).
pub const GATHER_LIMIT: usize = 64 * 1024;

/// Bytes waiting to be written, and a write of them that failed.
#[derive(Debug, Default)]
pub struct WriteBuffer {
    bytes: Vec<u8>,
    /// A write of the gathered bytes failed outside a write call: the next
    /// write reports it, so that h2 fails the connection's calls as for any
    /// broken socket.
    failed: Option<io::ErrorKind>,
}

impl WriteBuffer {
    /// Nothing waits to be written.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// A write of the gathered bytes failed, and was kept for the next
    /// write call.
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Drops what was gathered and keeps `kind` for the next write call.
    pub fn fail(&mut self, kind: io::ErrorKind) {
        *self = Self { bytes: Vec::new(), failed: Some(kind) };
    }

    /// The failure kept by [`fail`](Self::fail), if any.
    pub fn check(&self) -> io::Result<()> {
        match self.failed {
            Some(kind) => Err(kind.into()),
            None => Ok(()),
        }
    }

    /// Writes the gathered bytes to `w`; pending while the socket is full
    /// (the task is woken when it can take more).
    pub fn poll_drain<W: AsyncWrite + Unpin>(&mut self, w: &mut W, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.bytes.is_empty() {
            let n = ready!(Pin::new(&mut *w).poll_write(cx, &self.bytes))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            if n == self.bytes.len() {
                self.bytes.clear();
            } else {
                self.bytes.drain(..n);
            }
        }
        // A burst of large writes leaves no large buffer behind.
        if self.bytes.capacity() > GATHER_LIMIT {
            self.bytes = Vec::new();
        }
        Poll::Ready(Ok(()))
    }

    /// Gathers `bufs`, or writes them through to `w` after what was
    /// gathered when they are large ([`PASS_THROUGH`]) or would take the
    /// gathered bytes over [`GATHER_LIMIT`]. Returns how many bytes of
    /// `bufs` were taken, as a write does.
    pub fn poll_write<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.check()?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total >= PASS_THROUGH || self.bytes.len() + total > GATHER_LIMIT {
            // What came first goes first.
            ready!(self.poll_drain(w, cx))?;
        }
        if total >= PASS_THROUGH {
            return Pin::new(w).poll_write_vectored(cx, bufs);
        }
        for b in bufs {
            self.bytes.extend_from_slice(b);
        }
        Poll::Ready(Ok(total))
    }

    /// Writes what was gathered, then shuts `w` down.
    pub fn poll_shutdown<W: AsyncWrite + Unpin>(&mut self, w: &mut W, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        ready!(self.poll_drain(w, cx))?;
        Pin::new(w).poll_shutdown(cx)
    }
}

/// When a [`Gathered`] connection writes what it gathered: asked at each
/// flush that finds bytes waiting.
pub trait WhenToWrite: Default {
    /// The first `taken` bytes of `bufs` were gathered or written.
    fn took(&mut self, bufs: &[IoSlice<'_>], taken: usize) {
        let _ = (bufs, taken);
    }

    /// A read began (h2 begins each poll of its connection with one).
    fn read(&mut self) {}

    /// This flush leaves the gathered bytes for a later one. A policy that
    /// holds beyond the current poll of the connection's task wakes `cx`.
    fn hold(&mut self, cx: &mut Context<'_>) -> bool;

    /// What was gathered has been written.
    fn written(&mut self) {}
}

/// A connection whose writes are gathered in a [`WriteBuffer`] and written
/// at the flushes its policy `P` does not hold. Its connect info is its
/// inner stream's, so that a TLS client's certificate still reaches the
/// request.
#[derive(Debug)]
pub struct Gathered<T, P> {
    io: T,
    buffer: WriteBuffer,
    policy: P,
}

impl<T, P: WhenToWrite> Gathered<T, P> {
    /// Gathers the writes on `io`.
    pub fn new(io: T) -> Self {
        Self { io, buffer: WriteBuffer::default(), policy: P::default() }
    }
}

impl<T: AsyncRead + Unpin, P: WhenToWrite + Unpin> AsyncRead for Gathered<T, P> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.policy.read();
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin, P: WhenToWrite + Unpin> AsyncWrite for Gathered<T, P> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let taken = ready!(this.buffer.poll_write(&mut this.io, cx, bufs))?;
        this.policy.took(bufs, taken);
        Poll::Ready(Ok(taken))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.buffer.is_empty() && this.policy.hold(cx) {
            return Poll::Ready(Ok(()));
        }
        ready!(this.buffer.poll_drain(&mut this.io, cx))?;
        this.policy.written();
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.buffer.poll_shutdown(&mut this.io, cx)
    }
}

impl<T: tonic::transport::server::Connected, P> tonic::transport::server::Connected for Gathered<T, P> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
