//! Prometheus metrics, served at `GET /metrics` on the admin port
//! (`server.admin_listen`, plain HTTP/1.1, so any scraper reads it), never
//! on the API port, in the OpenMetrics text format, encoded by
//! `prometheus-client`.
//!
//! Label values are names from the config (agent, hook, tool, provider),
//! status codes and outcome kinds: never anything from a request's payload.
//! A name that is not in the config (a tool the model invented, an agent a
//! client asked for) is counted as `(unknown)`.
//!
//! The hot path holds its series (a counter per outcome, a histogram) from
//! the first call on: an observation touches that series alone, never a
//! registry-wide lock.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicI64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        MetricType,
        counter::{ConstCounter, Counter},
        family::Family as Series,
        gauge::{ConstGauge, Gauge},
        histogram::Histogram,
        info::Info,
    },
    registry::Registry,
};
use tokio::time::Instant;

mod family;
pub use family::Family;

/// The exposition's content type.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Histogram buckets, in seconds: from a loopback hook call (~0.1 ms) to a
/// long query.
const BUCKETS: [f64; 20] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0,
];

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// Label pairs, in a fixed order per family.
pub type Labels = Vec<(&'static str, String)>;

type Counters = Series<Labels, Counter>;
type Histograms = Series<Labels, Histogram, fn() -> Histogram>;

/// Values owned elsewhere (a peer's ready addresses, the trace writer's
/// drops), read at each scrape.
#[derive(Debug, Default)]
struct Observed {
    values: Mutex<Vec<(Family, Labels, Arc<AtomicUsize>)>>,
}

impl Collector for Observed {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(values) = self.values.lock() else { return Ok(()) };
        let mut by_family: BTreeMap<Family, Vec<(&Labels, u64)>> = BTreeMap::new();
        for (family, labels, value) in values.iter() {
            by_family.entry(*family).or_default().push((labels, value.load(Ordering::Relaxed) as u64));
        }
        for (family, series) in by_family {
            let mut descriptor =
                encoder.encode_descriptor(family.base_name(), family.help_text(), None, family.kind())?;
            for (labels, value) in series {
                let metric = descriptor.encode_family(labels)?;
                match family.kind() {
                    MetricType::Counter => ConstCounter::new(value).encode(metric)?,
                    _ => ConstGauge::new(value as i64).encode(metric)?,
                }
            }
        }
        Ok(())
    }
}

/// The standard process metrics, from /proc/self (Linux; none elsewhere).
#[derive(Debug)]
struct Process;

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return Ok(()) };
        // The fields after the command name, which is in parentheses.
        let Some((_, rest)) = stat.rsplit_once(") ") else { return Ok(()) };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
        // Clock ticks per second and the page size: 100 and 4 KiB on the
        // Linux platforms Lattice is built for.
        const TICKS: f64 = 100.0;
        const PAGE: f64 = 4096.0;
        if let Some(cpu) = field(14).zip(field(15)).map(|(u, s)| (u + s) / TICKS) {
            let e = encoder.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time spent, in seconds",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(cpu).encode(e)?;
        }
        let mut gauge = |name: &str, help: &str, value: Option<f64>| -> Result<(), std::fmt::Error> {
            if let Some(v) = value {
                ConstGauge::new(v).encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)?;
            }
            Ok(())
        };
        gauge("process_resident_memory_bytes", "Resident memory size, in bytes", field(24).map(|p| p * PAGE))?;
        gauge("process_virtual_memory_bytes", "Virtual memory size, in bytes", field(23))?;
        let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as f64).ok();
        gauge("process_open_fds", "Open file descriptors", fds)?;
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| s.lines().find_map(|l| l.strip_prefix("btime ").and_then(|v| v.trim().parse::<f64>().ok())));
        let start = boot.zip(field(22)).map(|(b, ticks)| b + ticks / TICKS);
        gauge("process_start_time_seconds", "Start time of the process since the Unix epoch, in seconds", start)
    }
}

/// The metrics of one server.
pub struct Metrics {
    registry: Registry,
    counters: BTreeMap<Family, Counters>,
    histograms: BTreeMap<Family, Histograms>,
    observed: Arc<Observed>,
    in_flight: Gauge<i64, AtomicI64>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").field("in_flight", &self.in_flight.get()).finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let (mut counters, mut histograms) = (BTreeMap::new(), BTreeMap::new());
        for family in Family::ALL {
            match family.kind() {
                MetricType::Counter if !family.observed() => {
                    counters.entry(family).or_insert_with(|| {
                        let series = Counters::default();
                        registry.register(family.base_name(), family.help_text(), series.clone());
                        series
                    });
                }
                MetricType::Histogram => {
                    histograms.entry(family).or_insert_with(|| {
                        let series = Histograms::new_with_constructor(histogram as fn() -> Histogram);
                        registry.register(family.base_name(), family.help_text(), series.clone());
                        series
                    });
                }
                _ => {}
            }
        }
        let in_flight = Gauge::<i64, AtomicI64>::default();
        registry.register("lattice_queries_in_flight", "Queries running now", in_flight.clone());
        registry.register(
            "lattice_build",
            "Lattice's version, as a label",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        let observed = Arc::new(Observed::default());
        registry.register_collector(Box::new(observed.clone()));
        registry.register_collector(Box::new(Process));
        Metrics { registry, counters, histograms, observed, in_flight }
    }
}

impl Metrics {
    /// Adds one to a counter.
    pub fn count(&self, family: Family, labels: Labels) {
        if let Some(series) = self.counters.get(&family) {
            series.get_or_create(&labels).inc();
        }
    }

    /// Shows `value` as a gauge (a counter for a family that only grows),
    /// read at each scrape; it replaces the value shown under the same
    /// labels (a hook's ready addresses after a config reload).
    pub fn gauge(&self, family: Family, labels: Labels, value: Arc<AtomicUsize>) {
        let mut values = crate::sync::lock(&self.observed.values);
        match values.iter_mut().find(|(f, l, _)| *f == family && *l == labels) {
            Some(kept) => kept.2 = value,
            None => values.push((family, labels, value)),
        }
    }

    /// A call metric for one label set (for the hot path: make it once, at
    /// start-up). The counter is labelled with `labels` and the outcome
    /// (as `outcome`); the histogram, if any, with `labels`.
    pub fn call_metric(
        &self,
        counter: Family,
        histogram: Option<Family>,
        labels: Labels,
        outcomes: &'static [&'static str],
    ) -> Arc<CallMetric> {
        self.call_metric_as(counter, histogram, labels, "outcome", outcomes)
    }

    /// [`Metrics::call_metric`], with the outcome as label `outcome_label`.
    /// `outcomes` are the outcomes it keeps a series of its own for; any
    /// other is counted through the family.
    pub fn call_metric_as(
        &self,
        counter: Family,
        histogram: Option<Family>,
        labels: Labels,
        outcome_label: &'static str,
        outcomes: &'static [&'static str],
    ) -> Arc<CallMetric> {
        Arc::new(CallMetric {
            counters: self.counters.get(&counter).cloned().unwrap_or_default(),
            histograms: histogram.and_then(|h| self.histograms.get(&h).cloned()),
            labels,
            outcome_label,
            outcomes,
            counts: outcomes.iter().map(|_| OnceLock::new()).collect(),
            histogram: OnceLock::new(),
        })
    }

    /// Records a duration.
    pub fn observe(&self, family: Family, labels: Labels, took: Duration) {
        if let Some(series) = self.histograms.get(&family) {
            series.get_or_create(&labels).observe(took.as_secs_f64());
        }
    }

    /// A query started; the guard counts it in flight until dropped.
    pub fn query_started(self: &Arc<Self>) -> InFlight {
        self.in_flight.inc();
        InFlight(self.clone())
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// A call metric for one label set (see [`Metrics::call_metric`]).
#[derive(Debug)]
pub struct CallMetric {
    counters: Counters,
    histograms: Option<Histograms>,
    labels: Labels,
    outcome_label: &'static str,
    outcomes: &'static [&'static str],
    /// Each outcome's series, made on its first use (a series appears in
    /// the exposition once something happened).
    counts: Vec<OnceLock<Counter>>,
    histogram: OnceLock<Histogram>,
}

impl CallMetric {
    /// Starts timing one call (a hook RPC, a model request). It is
    /// recorded by [`CallRecord::finish`] with its outcome or, if the
    /// call's future is dropped first (an abort, a deadline cut), as
    /// `deadline` when `deadline` has passed and `cancelled` otherwise.
    pub fn start<'a>(&'a self, metrics: &'a Metrics, deadline: Instant) -> CallRecord<'a> {
        CallRecord { metric: self, metrics, done: false, started: Instant::now(), deadline }
    }

    /// Records one call that took `took` and ended with `outcome`.
    pub fn record(&self, metrics: &Metrics, outcome: &str, took: Duration) {
        if let Some(series) = &self.histograms {
            self.histogram.get_or_init(|| series.get_or_create(&self.labels).clone()).observe(took.as_secs_f64());
        }
        self.add(metrics, outcome);
    }

    /// Counts one more with `outcome` (no duration).
    pub fn add(&self, metrics: &Metrics, outcome: &str) {
        self.add_n(metrics, outcome, 1);
    }

    /// Counts `n` more with `outcome`.
    pub fn add_n(&self, _metrics: &Metrics, outcome: &str, n: u64) {
        let series = |outcome: &str| {
            let mut labels = self.labels.clone();
            labels.push((self.outcome_label, outcome.to_owned()));
            self.counters.get_or_create(&labels).clone()
        };
        match self.outcomes.iter().position(|o| *o == outcome) {
            Some(i) => self.counts[i].get_or_init(|| series(outcome)).inc_by(n),
            None => series(outcome).inc_by(n),
        };
    }
}

/// One call being timed; see [`CallMetric::start`].
#[derive(Debug)]
pub struct CallRecord<'a> {
    metric: &'a CallMetric,
    metrics: &'a Metrics,
    /// Set once recorded, so that a call is recorded once.
    done: bool,
    started: Instant,
    deadline: Instant,
}

impl CallRecord<'_> {
    /// Records the call with `outcome`.
    pub fn finish(mut self, outcome: &str) {
        self.record(outcome);
    }

    fn record(&mut self, outcome: &str) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        self.metric.record(self.metrics, outcome, self.started.elapsed());
    }
}

impl Drop for CallRecord<'_> {
    fn drop(&mut self) {
        let outcome = if Instant::now() >= self.deadline { "deadline" } else { "cancelled" };
        self.record(outcome);
    }
}

/// Counts a query in flight while it lives.
#[derive(Debug)]
pub struct InFlight(Arc<Metrics>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}

/// Serves `GET /metrics` (HTTP/1.1) on the admin listener until the
/// process ends; any other path is 404.
pub async fn serve_admin(listener: tokio::net::TcpListener, metrics: Arc<Metrics>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let response = if req.uri().path() == "/metrics" {
                    http::Response::builder().header(http::header::CONTENT_TYPE, OPENMETRICS).body(metrics.render())
                } else {
                    http::Response::builder().status(http::StatusCode::NOT_FOUND).body(String::new())
                };
                std::future::ready(response)
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::default();
        m.count(Family::Queries, vec![("agent", "a\"b".into()), ("code", "OK".into())]);
        m.count(Family::Queries, vec![("agent", "a\"b".into()), ("code", "OK".into())]);
        m.observe(Family::QueryDuration, vec![("agent", "a".into())], Duration::from_millis(30));
        let text = m.render();
        assert!(text.contains("lattice_queries_total{agent=\"a\\\"b\",code=\"OK\"} 2"), "{text}");
        assert!(text.contains("lattice_query_duration_seconds_bucket{le=\"0.025\",agent=\"a\"} 0"), "{text}");
        assert!(text.contains("lattice_query_duration_seconds_bucket{le=\"0.05\",agent=\"a\"} 1"), "{text}");
        assert!(text.contains("lattice_query_duration_seconds_count{agent=\"a\"} 1"), "{text}");
        assert_eq!(text.matches("# TYPE lattice_queries counter").count(), 1);
        assert!(text.contains("lattice_build_info{version=\""), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn call_metrics_count_every_outcome_once() {
        let m = Metrics::default();
        let labels = || vec![("agent", "a".to_owned()), ("hook", "h".to_owned())];
        let handle = m.call_metric(Family::HookCalls, Some(Family::HookCallDuration), labels(), &["ok", "deadline"]);
        let far = Instant::now() + Duration::from_secs(60);
        handle.start(&m, far).finish("ok");
        handle.start(&m, far).finish("ok");
        handle.start(&m, far).finish("unavailable");
        // Dropped unfinished before its deadline: cancelled.
        drop(handle.start(&m, far));
        let text = m.render();
        assert!(text.contains("lattice_hook_calls_total{agent=\"a\",hook=\"h\",outcome=\"ok\"} 2"), "{text}");
        assert!(text.contains("lattice_hook_calls_total{agent=\"a\",hook=\"h\",outcome=\"unavailable\"} 1"), "{text}");
        assert!(text.contains("lattice_hook_calls_total{agent=\"a\",hook=\"h\",outcome=\"cancelled\"} 1"), "{text}");
        assert!(!text.contains("outcome=\"deadline\""), "no series before something happened: {text}");
        assert!(text.contains("lattice_hook_call_duration_seconds_count{agent=\"a\",hook=\"h\"} 4"), "{text}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_dropped_after_its_deadline_counts_as_deadline() {
        let m = Metrics::default();
        let handle = m.call_metric(Family::HookCalls, None, vec![("hook", "h".to_owned())], &["ok", "deadline"]);
        let record = handle.start(&m, Instant::now() + Duration::from_millis(100));
        tokio::time::sleep(Duration::from_millis(150)).await;
        drop(record);
        assert!(m.render().contains("lattice_hook_calls_total{hook=\"h\",outcome=\"deadline\"} 1"));
    }

    #[test]
    fn observed_values_and_the_token_counter_render_with_their_types() {
        let m = Metrics::default();
        let ready = Arc::new(AtomicUsize::new(2));
        m.gauge(Family::HookReadyAddresses, vec![("hook", "h".to_owned())], ready.clone());
        m.gauge(Family::TraceEventsDropped, vec![], Arc::new(AtomicUsize::new(7)));
        let tokens = m.call_metric_as(
            Family::ModelTokens,
            None,
            vec![("agent", "a".to_owned())],
            "direction",
            &["input", "output"],
        );
        tokens.add_n(&m, "input", 120);
        ready.store(1, Ordering::Relaxed);
        let text = m.render();
        assert!(text.contains("# TYPE lattice_hook_ready_addresses gauge"), "{text}");
        assert!(text.contains("lattice_hook_ready_addresses{hook=\"h\"} 1"), "{text}");
        assert!(text.contains("# TYPE lattice_trace_events_dropped counter"), "{text}");
        assert!(text.contains("lattice_trace_events_dropped_total 7"), "{text}");
        assert!(text.contains("lattice_model_tokens_total{agent=\"a\",direction=\"input\"} 120"), "{text}");
    }
}
