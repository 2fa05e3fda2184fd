//! Served connections (the other side is the client) whose writes are
//! gathered. tonic runs their tasks, so what is gathered is written at a
//! flush that the connection's policy does not hold:
//!
//! - **Lattice's API listener** ([`Events`], policy [`NextPoll`]): the
//!   first flush of what was gathered wakes the task and returns, and the
//!   bytes are written on the task's next poll (which h2 starts with a
//!   read). Nothing waits longer than one turn of the runtime's queue,
//!   which is what lets the events of concurrent queries share writes.
//!   Plaintext and TLS.
//! - **the hook SDK's connections** ([`Replies`], policy
//!   [`AfterTheMessage`]): a reply in one write.
//!
//! ## A reply in one write
//!
//! h2 sends a DATA frame of 256 bytes or more without copying it, and
//! flushes right after it, before it encodes the frames behind it. A unary
//! reply with a message that large so left in two writes: its headers and
//! message, then its trailers: two `sendto`s on the hook's side, and often
//! two wake-ups of Lattice for one reply.
//!
//! [`Replies`] holds the bytes at that flush. When what was written since
//! the last flush ends with such a DATA frame, of a stream that goes on,
//! the flush returns without writing, and the bytes leave with the next
//! one. That flush comes before the connection's task waits: h2 flushes
//! after it has encoded every frame that was ready, and the flush after a
//! large DATA frame is the one inside that loop. Only one flush in a row is
//! held, and a flush with nothing written since the last one always
//! writes, so a stream whose next message is not ready yet (a streaming
//! reply) is not held back.
//!
//! Plaintext connections only: under TLS the bytes written are records,
//! not frames.

use std::{io::IoSlice, task::Context};

use crate::gather::{Gathered, WhenToWrite};

/// h2 sends DATA payloads from this size on without a copy, and flushes
/// after each (its `CHAIN_THRESHOLD` on IO that writes vectored).
const CHAINED: usize = 256;

/// HTTP/2's frame header: length (3 bytes), type, flags, stream id.
const HEADER: usize = 9;
const DATA: u8 = 0;
const END_STREAM: u8 = 0x1;

/// Where the bytes written so far stand in HTTP/2's frames. A server sends
/// no preface: its first bytes are a frame header.
#[derive(Debug, Default)]
struct Frames {
    header: [u8; HEADER],
    /// Bytes of the current frame header seen so far.
    have: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
    /// The last frame whose header was seen: its length, type and flags.
    last: (usize, u8, u8),
}

impl Frames {
    fn see(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let n = self.payload_left.min(bytes.len());
                self.payload_left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (HEADER - self.have).min(bytes.len());
            self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
            self.have += n;
            bytes = &bytes[n..];
            if self.have == HEADER {
                let h = self.header;
                let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                self.last = (len, h[3], h[4]);
                self.payload_left = len;
                self.have = 0;
            }
        }
    }

    /// What was written ends with a DATA frame that h2 sent without a copy,
    /// and its stream goes on: h2 flushed for that frame alone, and is
    /// about to encode what follows it.
    fn ends_with_chained_data(&self) -> bool {
        let (len, kind, flags) = self.last;
        self.have == 0 && self.payload_left == 0 && kind == DATA && flags & END_STREAM == 0 && len >= CHAINED
    }
}

/// A connection of the API listener (plaintext or TLS) whose writes are
/// gathered and written on the next poll of its task (see the module docs).
pub type Events<T> = Gathered<T, NextPoll>;

/// Holds what a flush finds for the task's next poll.
#[derive(Debug, Default)]
pub struct NextPoll {
    /// A flush found gathered bytes, woke the task and left them.
    waiting: bool,
    /// The task has been polled again since (h2 starts each poll of its
    /// connection with a read): the next flush writes.
    due: bool,
}

impl WhenToWrite for NextPoll {
    fn read(&mut self) {
        self.due |= self.waiting;
    }

    fn hold(&mut self, cx: &mut Context<'_>) -> bool {
        if self.due {
            return false;
        }
        // Written on the next poll: what other tasks queue until then goes
        // in the same write.
        if !self.waiting {
            self.waiting = true;
            cx.waker().wake_by_ref();
        }
        true
    }

    fn written(&mut self) {
        (self.waiting, self.due) = (false, false);
    }
}

/// A served connection whose flush after a large DATA frame is held for
/// the frames behind it (see the module docs).
pub type Replies<T> = Gathered<T, AfterTheMessage>;

/// Holds the flush that h2 makes right after a large DATA frame.
#[derive(Debug, Default)]
pub struct AfterTheMessage {
    frames: Frames,
    /// Bytes were taken since the last flush.
    wrote: bool,
    /// The last flush was held.
    held: bool,
}

impl WhenToWrite for AfterTheMessage {
    fn took(&mut self, bufs: &[IoSlice<'_>], taken: usize) {
        self.wrote |= taken > 0;
        let mut left = taken;
        for b in bufs {
            if left == 0 {
                break;
            }
            let n = left.min(b.len());
            self.frames.see(&b[..n]);
            left -= n;
        }
    }

    fn hold(&mut self, _: &mut Context<'_>) -> bool {
        let wrote = std::mem::take(&mut self.wrote);
        self.held = wrote && !self.held && self.frames.ends_with_chained_data();
        self.held
    }

    fn written(&mut self) {
        (self.wrote, self.held) = (false, false);
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io,
        pin::Pin,
        sync::{Arc, Mutex},
        task::Poll,
    };

    use tokio::io::{AsyncWrite, AsyncWriteExt};

    use super::*;

    /// Records each write that reaches it.
    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<Vec<u8>>>>);

    impl Recorder {
        fn writes(&self) -> Vec<Vec<u8>> {
            self.0.lock().map(|w| w.clone()).unwrap_or_default()
        }
    }

    impl AsyncWrite for Recorder {
        fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            if let Ok(mut w) = self.0.lock() {
                w.push(buf.to_vec());
            }
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// A frame of `len` payload bytes.
    fn frame(kind: u8, flags: u8, stream: u32, len: u32) -> Vec<u8> {
        let l = len.to_be_bytes();
        let mut f = vec![l[1], l[2], l[3], kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.resize(HEADER + len as usize, 7);
        f
    }

    /// A connection over a [`Recorder`], and the recorder.
    fn recorded() -> (Replies<Recorder>, Recorder) {
        let rec = Recorder::default();
        (Replies::new(rec.clone()), rec)
    }

    const HEADERS: u8 = 1;
    const END_HEADERS: u8 = 0x4;

    /// Writes `bytes` as h2 would: the whole slice, one write call.
    async fn write(io: &mut Replies<Recorder>, bytes: &[u8]) {
        let written = io.write_all(bytes).await;
        assert!(written.is_ok(), "{written:?}");
    }

    /// One flush, as h2 calls it.
    async fn flush(io: &mut Replies<Recorder>) {
        let flushed = io.flush().await;
        assert!(flushed.is_ok(), "{flushed:?}");
    }

    /// A unary reply: headers and a large message, h2's flush, trailers,
    /// the final flush: one write, in order.
    #[tokio::test]
    async fn a_reply_with_a_large_message_leaves_in_one_write() {
        let (mut io, rec) = recorded();
        let head = [frame(HEADERS, END_HEADERS, 1, 20), frame(DATA, 0, 1, 1029)].concat();
        let trailers = frame(HEADERS, END_HEADERS | END_STREAM, 1, 12);
        write(&mut io, &head).await;
        flush(&mut io).await;
        assert!(rec.writes().is_empty(), "the flush after the message is held");
        write(&mut io, &trailers).await;
        flush(&mut io).await;
        assert_eq!(rec.writes(), vec![[head, trailers].concat()]);
    }

    /// A streaming reply's message whose next one is not ready: the flush
    /// with nothing written since the held one writes it.
    #[tokio::test]
    async fn a_message_with_nothing_behind_it_leaves_at_the_next_flush() {
        let (mut io, rec) = recorded();
        let message = frame(DATA, 0, 1, 4000);
        write(&mut io, &message).await;
        flush(&mut io).await;
        assert!(rec.writes().is_empty());
        flush(&mut io).await;
        assert_eq!(rec.writes(), vec![message]);
    }

    /// Two held flushes in a row never happen: the second large message
    /// goes out with the first.
    #[tokio::test]
    async fn only_one_flush_in_a_row_is_held() {
        let (mut io, rec) = recorded();
        let (one, two) = (frame(DATA, 0, 1, 300), frame(DATA, 0, 3, 300));
        write(&mut io, &one).await;
        flush(&mut io).await;
        write(&mut io, &two).await;
        flush(&mut io).await;
        assert_eq!(rec.writes(), vec![[one, two].concat()]);
    }

    /// Small messages (copied by h2, no flush of their own), the end of a
    /// stream and other frames are written at the flush.
    #[tokio::test]
    async fn other_frames_are_written_at_the_flush() {
        for bytes in [
            frame(DATA, 0, 1, CHAINED as u32 - 1),
            frame(DATA, END_STREAM, 1, 5000),
            frame(HEADERS, END_HEADERS, 1, 30),
            frame(4, 0, 0, 18), // SETTINGS
        ] {
            let (mut io, rec) = recorded();
            write(&mut io, &bytes).await;
            flush(&mut io).await;
            assert_eq!(rec.writes(), vec![bytes]);
        }
    }

    /// Frame headers and payloads split across writes are followed.
    #[tokio::test]
    async fn frames_are_followed_across_writes() {
        let (mut io, rec) = recorded();
        let bytes = [frame(HEADERS, END_HEADERS, 1, 20), frame(DATA, 0, 1, 2000)].concat();
        for chunk in bytes.chunks(7) {
            write(&mut io, chunk).await;
        }
        flush(&mut io).await;
        assert!(rec.writes().is_empty(), "the message was seen whole, as the last frame");

        // Part of a frame header after the message: not the last frame.
        let (mut io, rec) = recorded();
        let trailers = frame(HEADERS, END_HEADERS | END_STREAM, 1, 12);
        let cut = [bytes.as_slice(), &trailers[..4]].concat();
        write(&mut io, &cut).await;
        flush(&mut io).await;
        assert_eq!(rec.writes(), vec![cut]);
    }

    /// Shutting down writes what was held first.
    #[tokio::test]
    async fn shutdown_writes_what_was_held() {
        let (mut io, rec) = recorded();
        let message = frame(DATA, 0, 1, 1000);
        write(&mut io, &message).await;
        flush(&mut io).await;
        let shut = io.shutdown().await;
        assert!(shut.is_ok(), "{shut:?}");
        assert_eq!(rec.writes(), vec![message]);
    }
}
