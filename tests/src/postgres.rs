//! PostgreSQL for the tests: a real server from Debian's packages.
//!
//! [`Cluster::shared`] is one cluster for every test process: the one at
//! `LATTICE_TEST_POSTGRES_URL` if set, else one kept in
//! `$TMPDIR/lattice-test-pg` (the first test process to need it starts it,
//! under a file lock; `tests/run.sh` stops it at the end). Each test takes
//! a fresh database of its own ([`Cluster::database`]); the first use in a
//! process drops those that ended processes made over an hour ago.
//! [`Cluster::private`]
//! starts a cluster a test may stop and start again (a database outage),
//! or freeze ([`Cluster::freeze`]: every server process stopped with
//! SIGSTOP, as a failover's old primary goes silent); [`Cluster::tls_only`]
//! one that accepts TLS connections only. [`PgBouncer`] pools in front of
//! one, in transaction mode.

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
    /// Whether TCP connections must use TLS (the tests' own connections
    /// then use the Unix socket in the data directory's parent).
    tls_only: bool,
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
                let cluster = match std::env::var(SHARED_URL_ENV) {
                    Ok(url) => Cluster { url, own: None, tls_only: false },
                    Err(_) => Cluster::well_known().await,
                };
                cluster.drop_leftovers().await;
                cluster
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
                return Cluster { url, own: None, tls_only: false };
            }
        }
        let mut cluster = Cluster::init(dir.join("cluster"), None, None, None, "trust").await;
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
        Cluster::init(dir, network, None, None, "trust").await
    }

    /// A private cluster that serves TLS with `cert_pem` and `key_pem` and
    /// refuses every plaintext TCP connection (`hostssl` lines only, and
    /// `hostnossl … reject`), as managed services commonly do.
    pub async fn tls_only(cert_pem: &str, key_pem: &str) -> Cluster {
        Cluster::init(Cluster::tls_dir(), None, Some((cert_pem, key_pem)), None, "trust").await
    }

    /// [`Cluster::tls_only`], and every client over TCP authenticates with
    /// a password (SCRAM-SHA-256, which over TLS PostgreSQL offers with
    /// channel binding too): set one with `ALTER ROLE` on
    /// [`Cluster::admin_url`].
    pub async fn tls_only_with_passwords(cert_pem: &str, key_pem: &str) -> Cluster {
        Cluster::init(Cluster::tls_dir(), None, Some((cert_pem, key_pem)), None, "scram-sha-256").await
    }

    /// [`Cluster::tls_only`], and every client must present a certificate
    /// signed by `client_ca_pem` (`clientcert=verify-ca`).
    pub async fn tls_only_with_client_certificates(cert_pem: &str, key_pem: &str, client_ca_pem: &str) -> Cluster {
        Cluster::init(Cluster::tls_dir(), None, Some((cert_pem, key_pem)), Some(client_ca_pem), "trust").await
    }

    fn tls_dir() -> PathBuf {
        static N: AtomicU32 = AtomicU32::new(0);
        std::env::temp_dir().join(format!(
            "lattice-test-pgtls-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// Writes a TLS-only cluster's certificate and key, and its clients'
    /// CA if it checks client certificates, anew, and has the server read
    /// them again (as an operator rotating them does): connections open
    /// keep theirs, new ones get the new.
    pub fn rotate_tls(&self, cert_pem: &str, key_pem: &str, client_ca_pem: Option<&str>) {
        let (dir, _) = self.own.as_ref().expect("only a private cluster's files can be rotated");
        let data = dir.join("data");
        // Written over: the files keep their owner and mode.
        std::fs::write(data.join("server.crt"), cert_pem).unwrap();
        std::fs::write(data.join("server.key"), key_pem).unwrap();
        if let Some(ca) = client_ca_pem {
            std::fs::write(data.join("client_ca.crt"), ca).unwrap();
        }
        let reload = as_postgres(bin("pg_ctl")).arg("-D").arg(&data).arg("reload").stdout(Stdio::null()).status();
        assert!(reload.is_ok_and(|s| s.success()), "pg_ctl reload failed");
    }

    /// Ends every client connection but the one asking (as a failover or
    /// an operator does): how many were ended.
    pub async fn cut_connections(&self) -> i64 {
        let ended = connect(&self.admin_url("postgres"))
            .await
            .query_one(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .unwrap();
        ended.get(0)
    }

    /// initdb in `dir` (made anew), then start on a free port; with `tls`,
    /// TCP clients authenticate by `auth` (a pg_hba.conf method).
    async fn init(
        dir: PathBuf,
        network: Option<(&str, &str)>,
        tls: Option<(&str, &str)>,
        client_ca: Option<&str>,
        auth: &str,
    ) -> Cluster {
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
        if let Some((cert, key)) = tls {
            let data = dir.join("data");
            std::fs::write(data.join("server.crt"), cert).unwrap();
            std::fs::write(data.join("server.key"), key).unwrap();
            let mut conf = std::fs::read_to_string(data.join("postgresql.conf")).unwrap();
            conf.push_str("\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
            let mut files = vec!["server.crt", "server.key"];
            // Client certificates checked: against this CA, on every line.
            let mut check_client = "";
            if let Some(ca) = client_ca {
                std::fs::write(data.join("client_ca.crt"), ca).unwrap();
                conf.push_str("ssl_ca_file = 'client_ca.crt'\n");
                files.push("client_ca.crt");
                check_client = " clientcert=verify-ca";
            }
            std::fs::write(data.join("postgresql.conf"), conf).unwrap();
            for f in files {
                let owned = Command::new("chown").arg("postgres:postgres").arg(data.join(f)).status().unwrap();
                assert!(owned.success());
            }
            let key_mode = Command::new("chmod").arg("600").arg(data.join("server.key")).status().unwrap();
            assert!(key_mode.success());
            // TCP: TLS only. The Unix socket (`local` lines) stays open for
            // the tests' own set-up.
            let hba = std::fs::read_to_string(data.join("pg_hba.conf")).unwrap();
            let mut tls_hba = String::from("hostnossl all all 0.0.0.0/0 reject\nhostnossl all all ::/0 reject\n");
            for line in hba.lines() {
                match line.strip_prefix("host ") {
                    Some(rest) => {
                        let rest = rest.strip_suffix("trust").map_or(rest.to_owned(), |r| format!("{r}{auth}"));
                        tls_hba.push_str(&format!("hostssl {rest}{check_client}\n"));
                    }
                    None => tls_hba.push_str(&format!("{line}\n")),
                }
            }
            std::fs::write(data.join("pg_hba.conf"), tls_hba).unwrap();
        }
        std::fs::write(dir.join("listen"), &listen).unwrap();
        let (listener, addr) = crate::bind().await;
        drop(listener);
        let url = format!("postgres://postgres@127.0.0.1:{}", addr.port());
        let cluster = Cluster { url, own: Some((dir, addr.port())), tls_only: tls.is_some() };
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
        while tokio_postgres::connect(&self.admin_url("postgres"), tokio_postgres::NoTls).await.is_err() {
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
        let name = database_name(std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let (client, connection) =
            tokio_postgres::connect(&self.admin_url("postgres"), tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
        format!("{}/{name}", self.url)
    }

    /// Drops the databases [`Cluster::database`] made over an hour ago for
    /// processes that have ended. The shared cluster outlives test
    /// processes, and nothing else drops theirs: run by hand (a bench, one
    /// test) again and again, it would fill the disk. A database whose
    /// process is still running (or whose process id another process took
    /// since) is left alone, and so is every one a test run now going on
    /// made: dropping them would only load the cluster under its tests.
    pub async fn drop_leftovers(&self) {
        let Ok((client, connection)) =
            tokio_postgres::connect(&self.admin_url("postgres"), tokio_postgres::NoTls).await
        else {
            return;
        };
        tokio::spawn(connection);
        let Ok(rows) =
            client.query("SELECT datname FROM pg_database WHERE datname LIKE 'lattice\\_test\\_%'", &[]).await
        else {
            return;
        };
        let hour_ago = since_epoch().saturating_sub(Duration::from_secs(3600).as_nanos());
        for name in rows.iter().map(|r| r.get::<_, String>(0)) {
            let Some((pid, made)) = database_process(&name) else { continue };
            if made > hour_ago || std::path::Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            // Another process may be dropping it too: an error is no matter.
            let _ = client.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
        }
    }

    /// A connection string for the tests' own use of `database`: over TCP,
    /// or, for a TLS-only cluster, over its Unix socket.
    pub fn admin_url(&self, database: &str) -> String {
        match &self.own {
            Some((dir, port)) if self.tls_only => {
                format!("host={} port={port} user=postgres dbname={database}", dir.display())
            }
            _ => format!("{}/{database}", self.url),
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.url.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port in the URL")
    }

    /// Every server process of a private cluster: the postmaster (the first
    /// line of `postmaster.pid`) and its children. None when not running.
    fn processes(&self) -> Option<Vec<u32>> {
        let (dir, _) = self.own.as_ref()?;
        let pid_file = std::fs::read_to_string(dir.join("data/postmaster.pid")).ok()?;
        let postmaster: u32 = pid_file.lines().next().and_then(|l| l.trim().parse().ok())?;
        let mut all = vec![postmaster];
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            // `pid (comm) state ppid …`: comm may hold spaces, so read after
            // its closing parenthesis.
            let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if ppid == Some(postmaster) {
                all.push(pid);
            }
        }
        Some(all)
    }

    /// Sends `signal` to every server process; whether there were any.
    fn signal(&self, signal: &str) -> bool {
        let Some(pids) = self.processes() else { return false };
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        // A child may have exited since it was listed: not an error here.
        Command::new("kill").arg(signal).args(&pids).stderr(Stdio::null()).status().is_ok()
    }

    /// Stops every server process with SIGSTOP: connections stay open and
    /// nothing answers (a failover's old primary). Undone by [`Cluster::thaw`]
    /// (and on drop).
    pub fn freeze(&self) {
        assert!(self.signal("-STOP"), "the cluster is not running");
    }

    /// Resumes a frozen cluster (SIGCONT).
    pub fn thaw(&self) {
        assert!(self.signal("-CONT"), "the cluster is not running");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.own.is_some() {
            // A frozen cluster would not stop.
            self.signal("-CONT");
            self.stop();
        }
        if let Some((dir, _)) = &self.own {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// PgBouncer (Debian's package) in transaction pooling mode in front of a
/// cluster, on a free port; stopped when dropped.
pub struct PgBouncer {
    /// `postgres://postgres@127.0.0.1:PORT` (add `/DATABASE`).
    pub url: String,
    child: std::process::Child,
    dir: PathBuf,
}

impl PgBouncer {
    /// Pools connections to `cluster` (any database), `pool_mode =
    /// transaction`, as PgBouncer is most often run: up to 20 server
    /// connections a database, the most recently freed handed out first.
    pub async fn transaction_pooling(cluster: &Cluster) -> PgBouncer {
        Self::transaction_pooling_with(cluster, 20, false).await
    }

    /// [`PgBouncer::transaction_pooling`] with up to `pool_size` server
    /// connections a database, handed out in turn when `round_robin`
    /// (`server_round_robin = 1`).
    pub async fn transaction_pooling_with(cluster: &Cluster, pool_size: u32, round_robin: bool) -> PgBouncer {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "lattice-test-pgbouncer-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (listener, addr) = crate::bind().await;
        drop(listener);
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").unwrap();
        std::fs::write(
            dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n* = host=127.0.0.1 port={}\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {}\n\
                 auth_type = trust\nauth_file = {}\npool_mode = transaction\nmax_client_conn = 200\n\
                 default_pool_size = {pool_size}\nserver_round_robin = {}\nunix_socket_dir =\nlogfile = {}\n",
                cluster.port(),
                addr.port(),
                dir.join("users.txt").display(),
                u8::from(round_robin),
                dir.join("pgbouncer.log").display(),
            ),
        )
        .unwrap();
        let owned = Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir).status().unwrap();
        assert!(owned.success());
        let binary = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("PgBouncer is not installed: apt-get install pgbouncer (tests/setup.sh does)");
        // Run as root, it switches to the postgres user itself (-u), and
        // stays this process (no runuser in between to outlive it).
        let child = Command::new(binary)
            .args(["-u", "postgres"])
            .arg(dir.join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let url = format!("postgres://postgres@127.0.0.1:{}", addr.port());
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(Instant::now() < deadline, "PgBouncer did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        PgBouncer { url, child, dir }
    }
}

/// A connection of the test's own to the database at `url` (plaintext).
pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// Returns once a statement on the database at `url` waits for a lock
/// (a test's own transaction holds it); panics, naming `what`, after 10 s.
pub async fn until_a_statement_waits_for_a_lock(url: &str, what: &str) {
    let observer = connect(url).await;
    let since = Instant::now();
    loop {
        let waiting: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            return;
        }
        assert!(since.elapsed() < Duration::from_secs(10), "{what} never waited for the lock");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The name of a test's new database: the `n`th of process `pid`, and
/// when. (The shared cluster outlives test processes, and a later one may
/// get an earlier one's process id.)
fn database_name(pid: u32, n: u32) -> String {
    format!("lattice_test_{pid}_{n}_{}", since_epoch())
}

/// Now, in nanoseconds since the epoch.
fn since_epoch() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

/// The process a database of [`database_name`]'s was made for, and when
/// (nanoseconds since the epoch).
fn database_process(name: &str) -> Option<(u32, u128)> {
    let mut parts = name.strip_prefix("lattice_test_")?.split('_');
    let pid = parts.next()?.parse().ok()?;
    Some((pid, parts.nth(1)?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two processes with the same id (one reusing an earlier one's) name
    /// their first databases apart.
    #[test]
    fn a_reused_process_id_names_a_new_database() {
        let first = database_name(7404, 0);
        std::thread::sleep(std::time::Duration::from_millis(1));
        let second = database_name(7404, 0);
        assert_ne!(first, second);
        assert!(second.len() <= 63, "PostgreSQL truncates longer names: {second}");
        assert_eq!(database_process(&second).map(|(pid, _)| pid), Some(7404));
    }

    /// The databases ended processes made over an hour ago are dropped
    /// from the shared cluster; this process's, and recent ones, are kept.
    #[tokio::test]
    async fn the_old_databases_of_ended_processes_are_dropped() {
        let cluster = Cluster::shared().await;
        let mine = cluster.database().await;
        // A process that has ended: its id, and databases made for it two
        // hours ago and just now.
        let mut child = Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        let two_hours_ago = since_epoch() - Duration::from_secs(7200).as_nanos();
        let gone = format!("lattice_test_{}_0_{two_hours_ago}", child.id());
        let recent = database_name(child.id(), 1);
        let client = connect(&cluster.admin_url("postgres")).await;
        for name in [&gone, &recent] {
            client.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
        }
        let exists = |name: String| {
            let client = &client;
            async move {
                let row = client.query_one("SELECT count(*) FROM pg_database WHERE datname = $1", &[&name]).await;
                row.unwrap().get::<_, i64>(0) == 1
            }
        };
        assert!(exists(gone.clone()).await);
        cluster.drop_leftovers().await;
        assert!(!exists(gone).await, "the ended process's old database is still there");
        assert!(exists(recent.clone()).await, "a database made a moment ago was dropped");
        client.batch_execute(&format!("DROP DATABASE {recent}")).await.unwrap();
        let mine = mine.rsplit('/').next().unwrap().to_owned();
        assert!(exists(mine).await, "this process's database was dropped");
    }
}
