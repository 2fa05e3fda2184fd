//! PostgreSQL for the tests: a real server from Debian's packages.
//!
//! [`Cluster::shared`] is one cluster for every test process: the one at
//! `LATTICE_TEST_POSTGRES_URL` if set, else one kept in
//! `$TMPDIR/lattice-test-pg` (the first test process to need it starts it,
//! under a file lock; `tests/run.sh` stops it at the end). Each test takes
//! a fresh database of its own ([`Cluster::database`]). [`Cluster::private`]
//! starts a cluster a test may stop and start again (a database outage).

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use tokio::sync::OnceCell;

/// The variable `tests/run.sh` sets to its cluster's URL (no database).
pub const SHARED_URL_ENV: &str = "LATTICE_TEST_POSTGRES_URL";

/// A PostgreSQL cluster.
pub struct Cluster {
    /// `postgres://postgres@127.0.0.1:PORT` (add `/DATABASE`).
    pub url: String,
    /// When this process started it: its data directory and port.
    own: Option<(PathBuf, u16)>,
}

/// Where Debian installs the server's binaries.
fn bin(name: &str) -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is not installed: apt-get install postgresql (.ci/run does)")
        .flatten()
        .map(|e| e.path().join("bin").join(name))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop().unwrap_or_else(|| panic!("no {name} under /usr/lib/postgresql"))
}

/// Runs a command as the `postgres` user (the server refuses root).
fn as_postgres(program: PathBuf) -> Command {
    let mut c = Command::new("runuser");
    c.args(["-u", "postgres", "--"]).arg(program);
    c
}

static SHARED: OnceCell<Cluster> = OnceCell::const_new();

impl Cluster {
    /// The shared cluster (see the module docs).
    pub async fn shared() -> &'static Cluster {
        SHARED
            .get_or_init(|| async {
                match std::env::var(SHARED_URL_ENV) {
                    Ok(url) => Cluster { url, own: None },
                    Err(_) => Cluster::well_known().await,
                }
            })
            .await
    }

    /// The cluster in `$TMPDIR/lattice-test-pg`, started if it isn't running.
    async fn well_known() -> Cluster {
        let dir = std::env::temp_dir().join("lattice-test-pg");
        std::fs::create_dir_all(&dir).unwrap();
        let lock = std::fs::File::create(dir.join("lock")).unwrap();
        lock.lock().unwrap();
        let port_file = dir.join("port");
        if let Some(port) = std::fs::read_to_string(&port_file).ok().and_then(|p| p.trim().parse::<u16>().ok()) {
            let url = format!("postgres://postgres@127.0.0.1:{port}");
            if tokio_postgres::connect(&format!("{url}/postgres"), tokio_postgres::NoTls).await.is_ok() {
                return Cluster { url, own: None };
            }
        }
        let mut cluster = Cluster::init(dir.join("cluster"), None).await;
        let (_, port) = cluster.own.take().unwrap();
        std::fs::write(&port_file, port.to_string()).unwrap();
        // Left running for the next test process (no `own`: not stopped on drop).
        cluster
    }

    /// A cluster of this test's own, on a free port, stopped when dropped.
    pub async fn private() -> Cluster {
        Cluster::private_on(None).await
    }

    /// [`Cluster::private`], also listening on `address` and trusting
    /// clients from `subnet` (a Docker network's gateway and subnet, so
    /// that containers on it reach the host's database).
    pub async fn private_on(network: Option<(&str, &str)>) -> Cluster {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "lattice-test-pg-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        Cluster::init(dir, network).await
    }

    /// initdb in `dir` (made anew), then start on a free port.
    async fn init(dir: PathBuf, network: Option<(&str, &str)>) -> Cluster {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let chown = Command::new("chown").arg("postgres:postgres").arg(&dir).status().unwrap();
        assert!(chown.success(), "chown of {}", dir.display());
        let init = as_postgres(bin("initdb"))
            .args(["-D"])
            .arg(dir.join("data"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync"])
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(init.success(), "initdb failed");
        let mut listen = "127.0.0.1".to_owned();
        if let Some((address, subnet)) = network {
            listen = format!("{listen},{address}");
            let hba = dir.join("data/pg_hba.conf");
            let mut text = std::fs::read_to_string(&hba).unwrap();
            text.push_str(&format!("host all all {subnet} trust\n"));
            std::fs::write(&hba, text).unwrap();
        }
        std::fs::write(dir.join("listen"), &listen).unwrap();
        let (listener, addr) = crate::bind().await;
        drop(listener);
        let url = format!("postgres://postgres@127.0.0.1:{}", addr.port());
        let cluster = Cluster { url, own: Some((dir, addr.port())) };
        cluster.start().await;
        cluster
    }

    /// Starts a private cluster (again) and waits until it accepts queries.
    pub async fn start(&self) {
        let (dir, port) = self.own.as_ref().expect("only a private cluster can be started");
        let status = as_postgres(bin("pg_ctl"))
            .arg("-D")
            .arg(dir.join("data"))
            .arg("-l")
            .arg(dir.join("log"))
            .arg("-o")
            .arg(format!(
                "-p {port} -k {} -c listen_addresses={} -c fsync=off",
                dir.display(),
                std::fs::read_to_string(dir.join("listen")).unwrap_or_else(|_| "127.0.0.1".into())
            ))
            .arg("start")
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(
            status.success(),
            "pg_ctl start failed: {}",
            std::fs::read_to_string(dir.join("log")).unwrap_or_default()
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio_postgres::connect(&format!("{}/postgres", self.url), tokio_postgres::NoTls).await.is_err() {
            assert!(Instant::now() < deadline, "PostgreSQL did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops a private cluster (fast: open connections are closed).
    pub fn stop(&self) {
        let (dir, _) = self.own.as_ref().expect("only a private cluster can be stopped");
        let _ = as_postgres(bin("pg_ctl"))
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-m", "fast", "stop"])
            .stdout(Stdio::null())
            .status();
    }

    /// A new, empty database: its URL.
    pub async fn database(&self) -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("lattice_test_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let (client, connection) =
            tokio_postgres::connect(&format!("{}/postgres", self.url), tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
        format!("{}/{name}", self.url)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.own.is_some() {
            self.stop();
        }
        if let Some((dir, _)) = &self.own {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
