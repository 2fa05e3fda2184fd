//! Peers that misbehave below gRPC, written on raw TCP: a server that closes
//! each connection before HTTP/2, one that reads the request and then resets
//! the connection, and one that answers with a GOAWAY frame carrying chosen
//! debug data (the bytes a transport crate might log).

use std::time::Duration;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

/// What the raw peer does with each connection.
#[derive(Debug, Clone)]
pub enum Misbehaviour {
    /// Accepts, then closes at once (no HTTP/2 at all).
    CloseAtOnce,
    /// Reads what the client sends (its preface, settings, and the request
    /// itself), then resets the connection (RST).
    ResetAfterRead,
    /// Reads the client's preface, sends SETTINGS, then GOAWAY
    /// (PROTOCOL_ERROR) with these bytes as its debug data, and a PING with
    /// the first 8 of them as payload.
    GoAway(Vec<u8>),
}

/// A running raw peer; it stops when dropped.
pub struct RawPeer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    task: JoinHandle<()>,
}

impl Drop for RawPeer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawPeer {
    /// Starts one on a fresh loopback port.
    pub async fn start(what: Misbehaviour) -> RawPeer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, what.clone()));
            }
        });
        RawPeer { url, task }
    }
}

/// An HTTP/2 frame: 9-byte header, then the payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

async fn serve(mut conn: TcpStream, what: Misbehaviour) {
    let mut buf = vec![0u8; 64 * 1024];
    match what {
        Misbehaviour::CloseAtOnce => drop(conn),
        Misbehaviour::ResetAfterRead => {
            // Everything the client sends up front: preface, SETTINGS,
            // HEADERS and DATA of the call.
            let _ = tokio::time::timeout(Duration::from_millis(100), async {
                loop {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                }
            })
            .await;
            let _ = conn.set_zero_linger();
            drop(conn);
        }
        Misbehaviour::GoAway(debug) => {
            // The client's preface is 24 bytes; wait for it.
            let mut got = 0;
            while got < 24 {
                match conn.read(&mut buf[got..]).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got += n,
                }
            }
            let mut out = frame(0x4, 0, 0, &[]); // SETTINGS
            let mut ping = [0u8; 8];
            for (p, d) in ping.iter_mut().zip(&debug) {
                *p = *d;
            }
            out.extend(frame(0x6, 0, 0, &ping)); // PING
            let mut goaway = 0u32.to_be_bytes().to_vec(); // last stream id
            goaway.extend(1u32.to_be_bytes()); // PROTOCOL_ERROR
            goaway.extend(&debug);
            out.extend(frame(0x7, 0, 0, &goaway)); // GOAWAY
            let _ = conn.write_all(&out).await;
            // Keep reading until the client closes.
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            })
            .await;
        }
    }
}

/// What a [`Gate`] does with the next request (the next new HTTP/2 stream
/// a client opens, on any connection); after that one it proxies again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Proxies it.
    Proxy,
    /// Keeps it from the service and answers GOAWAY(NO_ERROR) whose
    /// last-stream-id is the previous stream (so this one was not
    /// processed), then closes the connection 2 s later: a service shutting
    /// down while other calls finish.
    GoAwayUnprocessed,
    /// Keeps it from the service and refuses it (RST_STREAM
    /// REFUSED_STREAM); the connection stays.
    RefuseStream,
    /// Reads the request, then resets the connection (RST): the request
    /// was received, and may have been acted on.
    ResetAfterRead,
}

/// An HTTP/2-aware TCP proxy in front of a real service that can, for one
/// request, refuse or break it instead (see [`Next`]).
pub struct Gate {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    next: Armed,
    task: JoinHandle<()>,
}

type Armed = std::sync::Arc<std::sync::Mutex<Next>>;

impl Drop for Gate {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Gate {
    /// A gate on a fresh loopback port, proxying to `to`.
    pub async fn start(to: std::net::SocketAddr) -> Gate {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let next: Armed = std::sync::Arc::new(std::sync::Mutex::new(Next::Proxy));
        let armed = next.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(gate(conn, to, armed.clone()));
            }
        });
        Gate { url, next, task }
    }

    /// What to do with the next request.
    pub fn arm(&self, next: Next) {
        *self.next.lock().unwrap() = next;
    }

    /// Whether the armed behaviour has been used (the gate proxies again).
    pub fn spent(&self) -> bool {
        *self.next.lock().unwrap() == Next::Proxy
    }
}

/// Reads one frame: its 9-byte header and its payload.
async fn read_frame(r: &mut (impl AsyncReadExt + Unpin)) -> Option<([u8; 9], Vec<u8>)> {
    let mut header = [0u8; 9];
    r.read_exact(&mut header).await.ok()?;
    let len = (usize::from(header[0]) << 16) | (usize::from(header[1]) << 8) | usize::from(header[2]);
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await.ok()?;
    Some((header, payload))
}

async fn gate(conn: TcpStream, to: std::net::SocketAddr, armed: Armed) {
    let Ok(upstream) = TcpStream::connect(to).await else { return };
    let _ = upstream.set_nodelay(true);
    let _ = conn.set_nodelay(true);
    let (mut client_r, client_w) = conn.into_split();
    let (mut up_r, mut up_w) = upstream.into_split();
    let client_w = std::sync::Arc::new(tokio::sync::Mutex::new(client_w));
    let down = {
        let client_w = client_w.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n) = up_r.read(&mut buf).await {
                if n == 0 || client_w.lock().await.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        })
    };
    let mut preface = [0u8; 24];
    if client_r.read_exact(&mut preface).await.is_err() || up_w.write_all(&preface).await.is_err() {
        return;
    }
    let (mut last, mut dropped) = (0u32, None::<u32>);
    while let Some((header, payload)) = read_frame(&mut client_r).await {
        let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
        if header[3] == 0x1 && stream > last {
            let what = std::mem::replace(&mut *armed.lock().unwrap(), Next::Proxy);
            match what {
                Next::Proxy => last = stream,
                Next::GoAwayUnprocessed => {
                    let mut goaway = last.to_be_bytes().to_vec();
                    goaway.extend(0u32.to_be_bytes()); // NO_ERROR
                    let _ = client_w.lock().await.write_all(&frame(0x7, 0, 0, &goaway)).await;
                    // Open a while longer, as a server whose other calls
                    // are still running keeps it.
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    down.abort();
                    let _ = client_w.lock().await.shutdown().await;
                    return;
                }
                Next::RefuseStream => {
                    let _ = client_w.lock().await.write_all(&frame(0x3, 0, stream, &7u32.to_be_bytes())).await;
                    dropped = Some(stream);
                    continue;
                }
                Next::ResetAfterRead => {
                    // Its DATA too, then RST.
                    let _ = tokio::time::timeout(Duration::from_millis(100), read_frame(&mut client_r)).await;
                    down.abort();
                    let _ = down.await;
                    let conn = client_r.reunite(std::sync::Arc::try_unwrap(client_w).ok().unwrap().into_inner());
                    if let Ok(conn) = conn {
                        let _ = conn.set_zero_linger();
                    }
                    return;
                }
            }
        }
        if dropped == Some(stream) && stream != 0 {
            continue;
        }
        let mut out = header.to_vec();
        out.extend(payload);
        if up_w.write_all(&out).await.is_err() {
            break;
        }
    }
    down.abort();
}
