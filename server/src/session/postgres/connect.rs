//! New connections to PostgreSQL, as the pool asks for them: the
//! connection string read again for each when it is a file (`url_file`),
//! its hosts tried one at a time as libpq does, each with the whole of
//! `sslmode` (TLS: see `tls`), and, when none can be used, why for each
//! (see `failure`), never the connection string.

use std::{sync::Arc, time::Duration};

use deadpool_postgres::Connect;
use futures_util::future::BoxFuture;
use tokio::task::JoinHandle;
use tokio_postgres::{
    Client, Config, NoTls, Socket,
    config::{Host, LoadBalanceHosts, SslMode as PgSslMode},
    tls::{MakeTlsConnect, TlsConnect},
};
use tracing::warn;

use super::{
    conn::LastSaid,
    failure::reason,
    tls::Rustls,
    url::{SslMode, TlsParams},
};

/// Makes the pool's connections.
#[derive(Debug, Clone)]
pub struct Connector {
    tls: TlsParams,
    /// Told each time a connection is made (shared by every clone).
    made: Arc<tokio::sync::Notify>,
    /// Why each listed host failed, once said (while it stays so).
    hosts_failed: Arc<LastSaid>,
    /// The file the connection string is read from again for each new
    /// connection (`[sessions] url_file`), if any.
    reread: Option<Arc<Reread>>,
}

/// A connection string read again for each new connection: a rotated
/// password (or host, or TLS file) reaches new connections without a
/// restart.
#[derive(Debug)]
struct Reread {
    path: std::path::PathBuf,
    timeout: Duration,
    /// The last string that parsed, as connections use it.
    last: std::sync::Mutex<Option<(Config, TlsParams)>>,
    /// Why the file could not be used, once said (while it stays so).
    said: LastSaid,
}

impl Connector {
    /// Connections with `tls`.
    pub fn new(tls: TlsParams) -> Self {
        Self { tls, made: Arc::default(), hosts_failed: Arc::default(), reread: None }
    }

    /// Connections as the file `path` says when each is made (see
    /// [`prepared`] for `timeout`).
    pub fn reread(mut self, path: std::path::PathBuf, timeout: Duration) -> Self {
        let reread = Reread { path, timeout, last: Default::default(), said: Default::default() };
        self.reread = Some(Arc::new(reread));
        self
    }

    /// The settings a new connection uses: the file's, read now, when the
    /// string is read again and it can be used; else the last that could
    /// (or `given`, as read at start-up), and the log says why once.
    fn current(&self, given: &Config) -> (Config, TlsParams) {
        let Some(reread) = &self.reread else { return (given.clone(), self.tls.clone()) };
        let read = std::fs::read_to_string(&reread.path)
            .map_err(|e| format!("cannot read it: {}", e.kind()))
            .and_then(|text| super::url::parse(&text));
        let mut last = crate::sync::lock(&reread.last);
        match read {
            Ok(target) => {
                let now = (prepared(target.config, reread.timeout), target.tls);
                *last = Some(now.clone());
                reread.said.clear();
                now
            }
            Err(why) => {
                if reread.said.anew(&why) {
                    let file = reread.path.display().to_string();
                    warn!(
                        file,
                        reason = why.as_str(),
                        "session store: the connection string's file cannot be used; new connections use the last one that could"
                    );
                }
                last.clone().unwrap_or_else(|| (given.clone(), self.tls.clone()))
            }
        }
    }

    /// A connection to the first of the string's hosts that takes one,
    /// tried in order one at a time as libpq does: each with the whole of
    /// `sslmode` (`allow` tries plaintext, then TLS, on a host before the
    /// next) and `target_session_attrs`. When none does, the log says why
    /// for each host (by its place in the list, never its name), once
    /// while the reasons stay the same; the error is the last host's.
    /// With `load_balance_hosts=random`, tokio-postgres picks the order
    /// and says only the last host's reason.
    async fn connect_in_turn(
        &self,
        pg: &Config,
        tls: &TlsParams,
    ) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error> {
        let n = pg.get_hosts().len().max(pg.get_hostaddrs().len());
        if n <= 1 || pg.get_load_balance_hosts() == LoadBalanceHosts::Random {
            return Self::connect_as_sslmode(pg, tls).await;
        }
        let mut reasons = Vec::new();
        for i in 0..n - 1 {
            match Self::connect_as_sslmode(&one_host(pg, i), tls).await {
                Ok(made) => return Ok(self.hosts_answered(made)),
                Err(e) => reasons.push(format!("host {} of {n}: {}", i + 1, reason(&e))),
            }
        }
        let e = match Self::connect_as_sslmode(&one_host(pg, n - 1), tls).await {
            Ok(made) => return Ok(self.hosts_answered(made)),
            Err(e) => e,
        };
        reasons.push(format!("host {n} of {n}: {}", reason(&e)));
        let reasons = reasons.join("; ");
        if self.hosts_failed.anew(&reasons) {
            warn!(reasons, "session store: no host in the connection string could be used");
        }
        Err(e)
    }

    fn hosts_answered<T>(&self, made: T) -> T {
        self.hosts_failed.clear();
        made
    }

    /// Resolves when a connection is next made: the database, if it was
    /// away, is back. (Registered when called, before it is polled.)
    pub fn made(&self) -> tokio::sync::futures::Notified<'_> {
        self.made.notified()
    }

    /// A connection as the string's `sslmode` says.
    async fn connect_as_sslmode(
        pg: &Config,
        params: &TlsParams,
    ) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error> {
        let tls = Rustls { params: params.clone() };
        match params.mode {
            SslMode::Disable => Self::connect_with(pg, PgSslMode::Disable, NoTls).await,
            // Plaintext first; TLS when the server refuses plaintext.
            SslMode::Allow => match Self::connect_with(pg, PgSslMode::Disable, NoTls).await {
                Err(e) if refuses_plaintext(&e) => Self::connect_with(pg, PgSslMode::Require, tls).await,
                other => other,
            },
            SslMode::Prefer => Self::connect_with(pg, PgSslMode::Prefer, tls).await,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                Self::connect_with(pg, PgSslMode::Require, tls).await
            }
        }
    }

    async fn connect_with<T>(
        pg: &Config,
        mode: PgSslMode,
        tls: T,
    ) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error>
    where
        T: MakeTlsConnect<Socket> + Send,
        T::Stream: Send + 'static,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        let mut pg = pg.clone();
        pg.ssl_mode(mode);
        let (client, connection) = pg.connect(tls).await?;
        // How a connection ended is for the next statement on it to say;
        // its error's text is the server's, so it is not logged here.
        let task = tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok((client, task))
    }
}

impl Connect for Connector {
    fn connect(&self, pg: &Config) -> BoxFuture<'_, Result<(Client, JoinHandle<()>), tokio_postgres::Error>> {
        let (pg, tls) = self.current(pg);
        Box::pin(async move {
            let made = self.connect_in_turn(&pg, &tls).await;
            if made.is_ok() {
                self.made.notify_waiters();
            }
            made
        })
    }
}

/// The connection string's settings as the store uses them: a connection
/// made within `timeout` (the string's `connect_timeout` if shorter),
/// named `lattice`, and a server that vanished without a reset (a
/// failover's old primary, a cut network) noticed by the kernel, not only
/// by the store's timers: unanswered keepalives, and data left
/// unacknowledged for `timeout`, close the connection. (The string's own
/// settings win.)
pub(super) fn prepared(mut pg: Config, timeout: Duration) -> Config {
    pg.connect_timeout(pg.get_connect_timeout().copied().unwrap_or(timeout).min(timeout));
    pg.application_name("lattice");
    pg.keepalives(true);
    if pg.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
        pg.keepalives_idle(Duration::from_secs(10));
    }
    if pg.get_keepalives_interval().is_none() {
        pg.keepalives_interval(Duration::from_secs(5));
    }
    if pg.get_keepalives_retries().is_none() {
        pg.keepalives_retries(3);
    }
    if pg.get_tcp_user_timeout().is_none() {
        pg.tcp_user_timeout(timeout);
    }
    pg
}

/// `pg` narrowed to its host `i` (with its `hostaddr`, and its port, or
/// the one port all share), every other setting as it was.
fn one_host(pg: &Config, i: usize) -> Config {
    let mut one = Config::new();
    if let Some(user) = pg.get_user() {
        one.user(user);
    }
    if let Some(password) = pg.get_password() {
        one.password(password);
    }
    if let Some(dbname) = pg.get_dbname() {
        one.dbname(dbname);
    }
    if let Some(options) = pg.get_options() {
        one.options(options);
    }
    if let Some(name) = pg.get_application_name() {
        one.application_name(name);
    }
    match pg.get_hosts().get(i) {
        Some(Host::Tcp(host)) => {
            one.host(host);
        }
        Some(Host::Unix(path)) => {
            one.host_path(path);
        }
        None => {}
    }
    if let Some(addr) = pg.get_hostaddrs().get(i) {
        one.hostaddr(*addr);
    }
    let ports = pg.get_ports();
    if let Some(port) = if ports.len() == 1 { ports.first() } else { ports.get(i) } {
        one.port(*port);
    }
    if let Some(timeout) = pg.get_connect_timeout() {
        one.connect_timeout(*timeout);
    }
    if let Some(timeout) = pg.get_tcp_user_timeout() {
        one.tcp_user_timeout(*timeout);
    }
    one.keepalives(pg.get_keepalives()).keepalives_idle(pg.get_keepalives_idle());
    if let Some(interval) = pg.get_keepalives_interval() {
        one.keepalives_interval(interval);
    }
    if let Some(retries) = pg.get_keepalives_retries() {
        one.keepalives_retries(retries);
    }
    one.ssl_mode(pg.get_ssl_mode())
        .ssl_negotiation(pg.get_ssl_negotiation())
        .target_session_attrs(pg.get_target_session_attrs())
        .channel_binding(pg.get_channel_binding())
        .load_balance_hosts(pg.get_load_balance_hosts());
    one
}

/// Whether the server refused a plaintext connection for want of TLS
/// (its pg_hba.conf has `hostssl` lines only, or `hostnossl … reject`).
fn refuses_plaintext(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| db.code().code() == "28000" && db.message().contains("no encryption"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host of a list, narrowed to, is the same string naming it alone
    /// (every setting kept: `Config` compares them all).
    #[test]
    fn one_host_of_a_list_keeps_every_setting() {
        let settings = "user=u password=p dbname=d options='-c x=1' application_name=a connect_timeout=7 \
                        tcp_user_timeout=9 keepalives=1 keepalives_idle=11 keepalives_interval=3 \
                        keepalives_retries=4 target_session_attrs=read-write channel_binding=require \
                        sslmode=require sslnegotiation=direct";
        let list: Config =
            format!("host=a,/run/pg,c hostaddr=10.0.0.1,10.0.0.2,10.0.0.3 port=1,2,3 {settings}").parse().unwrap();
        for (i, alone) in [
            "host=a hostaddr=10.0.0.1 port=1",
            "host=/run/pg hostaddr=10.0.0.2 port=2",
            "host=c hostaddr=10.0.0.3 port=3",
        ]
        .iter()
        .enumerate()
        {
            let alone: Config = format!("{alone} {settings}").parse().unwrap();
            assert_eq!(one_host(&list, i), alone, "host {i}");
        }
        // One port for all.
        let shared: Config = "host=a,b port=5 user=u".parse().unwrap();
        assert_eq!(one_host(&shared, 1), "host=b port=5 user=u".parse::<Config>().unwrap());
        // No port: the default.
        let none: Config = "host=a,b".parse().unwrap();
        assert_eq!(one_host(&none, 0), "host=a".parse::<Config>().unwrap());
    }
}
