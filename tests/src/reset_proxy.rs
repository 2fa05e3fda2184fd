//! A TCP proxy that resets connections, put between Lattice and its
//! database: every 50–200 ms (or as told) it cuts one random connection
//! with a TCP reset toward Lattice, as a flaky network, a load balancer or
//! a failover does, whatever the connection was doing (a commit included).
//! It can also freeze the connections open at a moment: they stay open and
//! acknowledged by the kernel, but nothing more is relayed either way, as
//! with a proxy whose upstream vanished.

use std::{
    net::SocketAddr,
    ops::Range,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// The proxy; it stops when dropped.
pub struct ResetProxy {
    /// Where Lattice connects.
    pub addr: SocketAddr,
    live: Arc<Mutex<Vec<Relayed>>>,
    resetting: Arc<AtomicBool>,
    resets: Arc<AtomicUsize>,
    stop: CancellationToken,
}

/// A relayed connection: its id, and what cuts (resets) or freezes it.
struct Relayed {
    id: u64,
    cut: CancellationToken,
    freeze: CancellationToken,
}

/// A small xorshift: random enough to pick a connection and a pause.
fn next(state: &AtomicU64) -> u64 {
    let mut x = state.load(Ordering::Relaxed);
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    state.store(x, Ordering::Relaxed);
    x
}

impl ResetProxy {
    /// Forwards to `upstream`; resets nothing until [`ResetProxy::reset_every`].
    pub async fn start(upstream: SocketAddr) -> ResetProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let live: Arc<Mutex<Vec<Relayed>>> = Arc::default();
        let stop = CancellationToken::new();
        let (accepting, stopping) = (live.clone(), stop.clone());
        tokio::spawn(async move {
            let mut id = 0u64;
            loop {
                let (client, _) = tokio::select! {
                    () = stopping.cancelled() => return,
                    accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
                };
                id += 1;
                let (cut, freeze) = (stopping.child_token(), CancellationToken::new());
                accepting.lock().unwrap().push(Relayed { id, cut: cut.clone(), freeze: freeze.clone() });
                let registry = accepting.clone();
                tokio::spawn(async move {
                    relay(client, upstream, cut, freeze).await;
                    registry.lock().unwrap().retain(|r| r.id != id);
                });
            }
        });
        ResetProxy { addr, live, resetting: Arc::default(), resets: Arc::default(), stop }
    }

    /// Resets one random live connection after every pause drawn from
    /// `pause`, until [`ResetProxy::calm`].
    pub fn reset_every(&self, pause: Range<Duration>) {
        self.resetting.store(true, Ordering::SeqCst);
        let (live, resetting, resets, stop) =
            (self.live.clone(), self.resetting.clone(), self.resets.clone(), self.stop.clone());
        let seed = AtomicU64::new(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1,
        );
        tokio::spawn(async move {
            let span = (pause.end - pause.start).as_millis().max(1) as u64;
            while resetting.load(Ordering::SeqCst) && !stop.is_cancelled() {
                let wait = pause.start + Duration::from_millis(next(&seed) % span);
                tokio::time::sleep(wait).await;
                let victim = {
                    let live = live.lock().unwrap();
                    (!live.is_empty()).then(|| live[(next(&seed) % live.len() as u64) as usize].cut.clone())
                };
                if let Some(cut) = victim
                    && resetting.load(Ordering::SeqCst)
                {
                    cut.cancel();
                    resets.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
    }

    /// Stops resetting.
    pub fn calm(&self) {
        self.resetting.store(false, Ordering::SeqCst);
    }

    /// Freezes every connection open now (those made later relay as
    /// usual): nothing more is relayed on them either way and nothing
    /// closes them, until the proxy stops. Returns how many it froze.
    pub fn freeze_live(&self) -> usize {
        let live = self.live.lock().unwrap();
        live.iter().for_each(|r| r.freeze.cancel());
        live.len()
    }

    /// How many connections it has reset.
    pub fn resets(&self) -> usize {
        self.resets.load(Ordering::SeqCst)
    }
}

impl Drop for ResetProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Copies both ways until either side closes, or `cut`: then the client
/// side is reset (RST, not FIN) and the server's closed. Once `freeze`d it
/// copies nothing more but keeps both open until `cut`.
async fn relay(mut client: TcpStream, upstream: SocketAddr, cut: CancellationToken, freeze: CancellationToken) {
    let Ok(mut server) = TcpStream::connect(upstream).await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        () = cut.cancelled() => {
            let _ = client.set_zero_linger();
        }
        () = freeze.cancelled() => {
            cut.cancelled().await;
            let _ = client.set_zero_linger();
        }
    }
}
