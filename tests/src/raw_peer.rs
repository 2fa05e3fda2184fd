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
