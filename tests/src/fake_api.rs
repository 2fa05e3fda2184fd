//! A fake model API over plain HTTP/1.1: records every request exactly
//! (method, path, headers, body) and answers with scripted replies — JSON
//! bodies, SSE streams (cut short where a test wants), any status and
//! headers. One request per connection (`connection: close`).

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A request as received.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// `POST`.
    pub method: String,
    /// `/v1/messages`.
    pub path: String,
    /// Lower-cased header names.
    pub headers: HashMap<String, String>,
    /// The raw body.
    pub body: String,
    /// When it arrived.
    pub at: Instant,
}

impl Recorded {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).expect("a JSON request body")
    }
}

/// A scripted reply.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A JSON (or any) body with a status and extra headers.
    Body {
        /// HTTP status.
        status: u16,
        /// The body, sent as is.
        body: String,
        /// Extra headers.
        headers: Vec<(String, String)>,
    },
    /// A 200 `text/event-stream` whose text is sent as is, then the
    /// connection closes (so a stream without its end event is cut short).
    Sse(String),
    /// A 200 `text/event-stream` that sends this text and then never ends;
    /// when the client closes the connection, the time is recorded in
    /// [`FakeApi::closed`].
    Hang(String),
}

impl Reply {
    /// 200 with a JSON body.
    pub fn json(v: serde_json::Value) -> Reply {
        Reply::Body { status: 200, body: v.to_string(), headers: vec![] }
    }

    /// A status with a JSON body.
    pub fn status(status: u16, v: serde_json::Value) -> Reply {
        Reply::Body { status, body: v.to_string(), headers: vec![] }
    }

    /// SSE from (event name, data JSON) pairs; `None` names send only data.
    pub fn sse(events: &[(Option<&str>, serde_json::Value)]) -> Reply {
        let mut s = String::new();
        for (name, data) in events {
            if let Some(n) = name {
                s.push_str(&format!("event: {n}\n"));
            }
            s.push_str(&format!("data: {data}\n\n"));
        }
        Reply::Sse(s)
    }
}

/// A running fake API.
pub struct FakeApi {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Requests received, in order.
    pub requests: Arc<Mutex<Vec<Recorded>>>,
    replies: Arc<Mutex<VecDeque<Reply>>>,
    /// Sent when the scripted replies run out.
    pub fallback: Arc<Mutex<Reply>>,
    /// When clients closed [`Reply::Hang`] connections.
    pub closed: Arc<Mutex<Vec<Instant>>>,
    /// Whether requests are kept in `requests` (on; a benchmark's many
    /// large requests are not).
    pub record: Arc<AtomicBool>,
}

impl FakeApi {
    /// Starts it with replies to send in order.
    pub async fn start(replies: Vec<Reply>) -> FakeApi {
        let (listener, addr) = crate::bind().await;
        let requests = Arc::new(Mutex::new(Vec::new()));
        let replies = Arc::new(Mutex::new(VecDeque::from(replies)));
        let fallback =
            Arc::new(Mutex::new(Reply::status(500, serde_json::json!({"error": {"type": "no_more_replies"}}))));
        let closed = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::new(AtomicBool::new(true));
        let (r, q, f, c, k) = (requests.clone(), replies.clone(), fallback.clone(), closed.clone(), record.clone());
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let (r, q, f, c, k) = (r.clone(), q.clone(), f.clone(), c.clone(), k.clone());
                tokio::spawn(async move {
                    let Some(req) = read_request(&mut sock).await else { return };
                    if k.load(Ordering::Relaxed) {
                        r.lock().unwrap().push(req);
                    }
                    let reply = q.lock().unwrap().pop_front().unwrap_or_else(|| f.lock().unwrap().clone());
                    let bytes = match reply {
                        Reply::Body { status, body, headers } => {
                            let mut head = format!(
                                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
                                body.len()
                            );
                            for (k, v) in headers {
                                head.push_str(&format!("{k}: {v}\r\n"));
                            }
                            head + "\r\n" + &body
                        }
                        Reply::Sse(text) => format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n{text}"
                        ),
                        Reply::Hang(text) => {
                            let head = format!(
                                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n{text}"
                            );
                            let _ = sock.write_all(head.as_bytes()).await;
                            let mut sink = [0u8; 1024];
                            // Until the client goes away.
                            while matches!(sock.read(&mut sink).await, Ok(n) if n > 0) {}
                            c.lock().unwrap().push(Instant::now());
                            return;
                        }
                    };
                    let _ = sock.write_all(bytes.as_bytes()).await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        FakeApi { url: format!("http://{addr}"), requests, replies, fallback, closed, record }
    }

    /// Requests so far.
    pub fn received(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    /// Queues more replies.
    pub fn push(&self, reply: Reply) {
        self.replies.lock().unwrap().push_back(reply);
    }
}

async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<Recorded> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, path) = (first.next()?.to_owned(), first.next()?.to_owned());
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some(Recorded { method, path, headers, body: String::from_utf8_lossy(&body).into_owned(), at: Instant::now() })
}
