//! Prometheus metrics, served as text at `GET /metrics` on the admin port
//! (`server.admin_listen`, plain HTTP/1.1, so any scraper reads it), never
//! on the API port.
//!
//! Label values are names from the config (agent, hook, tool, provider),
//! status codes and outcome kinds: never anything from a request's payload.
//! A name that is not in the config (a tool the model invented, an agent a
//! client asked for) is counted as `(unknown)`.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::time::Instant;

/// Histogram buckets, in seconds: from a loopback hook call (~0.1 ms) to a
/// long query.
const BUCKETS: [f64; 20] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0,
];

/// The bucket a duration falls in (none past the last: counted in +Inf).
fn bucket_of(secs: f64) -> Option<usize> {
    BUCKETS.iter().position(|le| secs <= *le)
}

/// A metric family: name, help and type, for the exposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    /// Queries, by agent and final gRPC code.
    Queries,
    /// Query duration, by agent.
    QueryDuration,
    /// Hook RPCs, by agent, hook, event and outcome.
    HookCalls,
    /// Hook RPC duration, by agent, hook and event.
    HookCallDuration,
    /// Tool calls, by agent, tool and outcome.
    ToolCalls,
    /// Model requests (with their retries), by agent, provider and outcome.
    ModelRequests,
    /// Model request duration, by agent and provider.
    ModelRequestDuration,
    /// Ready addresses of each hook, by agent and hook.
    HookReadyAddresses,
    /// Trace events dropped because the trace writer's queue was full.
    TraceEventsDropped,
    /// Model tokens, by agent, provider and direction (input, output).
    ModelTokens,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Family::Queries => "lattice_queries_total",
            Family::QueryDuration => "lattice_query_duration_seconds",
            Family::HookCalls => "lattice_hook_calls_total",
            Family::HookCallDuration => "lattice_hook_call_duration_seconds",
            Family::ToolCalls => "lattice_tool_calls_total",
            Family::ModelRequests => "lattice_model_requests_total",
            Family::ModelRequestDuration => "lattice_model_request_duration_seconds",
            Family::HookReadyAddresses => "lattice_hook_ready_addresses",
            Family::TraceEventsDropped => "lattice_trace_events_dropped_total",
            Family::ModelTokens => "lattice_model_tokens_total",
        }
    }

    fn help(self) -> &'static str {
        match self {
            Family::Queries => "Queries by agent and final gRPC status code.",
            Family::QueryDuration => "Query duration from start to final result or error.",
            Family::HookCalls => {
                "Hook RPCs by outcome (ok, deadline, unavailable, status, invalid_reply, request_too_large, cancelled)."
            }
            Family::HookCallDuration => "Hook RPC duration, connecting included.",
            Family::ToolCalls => "Tool calls by outcome (executed, failed, blocked, cancelled).",
            Family::ModelRequests => {
                "Model requests (retries included) by outcome (ok, deadline, cancelled, or the error kind)."
            }
            Family::ModelRequestDuration => "Model request duration, retries included.",
            Family::HookReadyAddresses => {
                "Addresses of each hook that can take calls now (resolved, connecting, not draining)."
            }
            Family::TraceEventsDropped => {
                "Trace events not written: the trace writer's queue was full (a stalled disk)."
            }
            Family::ModelTokens => "Model tokens by direction: input (the requests) and output (the replies).",
        }
    }
}

/// Label pairs, in a fixed order per family.
pub type Labels = Vec<(&'static str, String)>;

#[derive(Debug, Default, Clone)]
struct Histogram {
    buckets: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

#[derive(Debug, Default)]
struct Registry {
    counters: BTreeMap<(Family, Labels), u64>,
    histograms: BTreeMap<(Family, Labels), Histogram>,
    /// Read when rendered; whoever owns the value keeps it current.
    gauges: BTreeMap<(Family, Labels), Arc<AtomicUsize>>,
    /// Call metrics updated without this lock, read when rendered.
    handles: Vec<Arc<CallMetric>>,
}

/// The metrics of one server.
#[derive(Debug, Default)]
pub struct Metrics {
    registry: Mutex<Registry>,
    in_flight: AtomicI64,
}

impl Metrics {
    /// Adds one to a counter.
    pub fn count(&self, family: Family, labels: Labels) {
        if let Ok(mut r) = self.registry.lock() {
            *r.counters.entry((family, labels)).or_default() += 1;
        }
    }

    /// Shows `value` as a gauge (read at each scrape).
    pub fn gauge(&self, family: Family, labels: Labels, value: Arc<AtomicUsize>) {
        if let Ok(mut r) = self.registry.lock() {
            r.gauges.insert((family, labels), value);
        }
    }

    /// A call metric for one label set, updated without a lock (for the
    /// hot path: make it once, at start-up). `outcomes` are the outcomes it
    /// counts itself; any other is counted through the registry. The
    /// counter is labelled with `labels` and the outcome (as `outcome`);
    /// the histogram, if any, with `labels`.
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
    pub fn call_metric_as(
        &self,
        counter: Family,
        histogram: Option<Family>,
        labels: Labels,
        outcome_label: &'static str,
        outcomes: &'static [&'static str],
    ) -> Arc<CallMetric> {
        let metric = Arc::new(CallMetric {
            counter,
            histogram,
            labels,
            outcome_label,
            outcomes,
            counts: outcomes.iter().map(|_| AtomicU64::new(0)).collect(),
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
        });
        if let Ok(mut r) = self.registry.lock() {
            r.handles.push(metric.clone());
        }
        metric
    }

    /// Records a duration.
    pub fn observe(&self, family: Family, labels: Labels, took: Duration) {
        let secs = took.as_secs_f64();
        if let Ok(mut r) = self.registry.lock() {
            let h = r.histograms.entry((family, labels)).or_default();
            if let Some(i) = bucket_of(secs) {
                h.buckets[i] += 1;
            }
            h.sum += secs;
            h.count += 1;
        }
    }

    /// A query started; the guard counts it in flight until dropped.
    pub fn query_started(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# HELP lattice_build_info Lattice's version, as a label; the value is 1.");
        let _ = writeln!(out, "# TYPE lattice_build_info gauge");
        let _ = writeln!(out, "lattice_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"));
        process_metrics(&mut out);
        let _ = writeln!(out, "# HELP lattice_queries_in_flight Queries running now.");
        let _ = writeln!(out, "# TYPE lattice_queries_in_flight gauge");
        let _ = writeln!(out, "lattice_queries_in_flight {}", self.in_flight.load(Ordering::Relaxed));
        let Ok(r) = self.registry.lock() else { return out };
        // The handles' values, merged into the registry's for rendering.
        let (mut counters, mut histograms) = (r.counters.clone(), r.histograms.clone());
        for m in &r.handles {
            for (outcome, n) in m.outcomes.iter().zip(&m.counts) {
                let n = n.load(Ordering::Relaxed);
                if n > 0 {
                    let mut labels = m.labels.clone();
                    labels.push((m.outcome_label, (*outcome).to_owned()));
                    *counters.entry((m.counter, labels)).or_default() += n;
                }
            }
            let count = m.count.load(Ordering::Relaxed);
            if let (Some(histogram), true) = (m.histogram, count > 0) {
                let h = histograms.entry((histogram, m.labels.clone())).or_default();
                for (b, v) in h.buckets.iter_mut().zip(&m.buckets) {
                    *b += v.load(Ordering::Relaxed);
                }
                h.count += count;
                h.sum += m.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
            }
        }
        let mut last = None;
        for ((family, labels), value) in &r.gauges {
            if last != Some(*family) {
                // A value owned elsewhere: a counter when it only grows.
                let kind = if *family == Family::TraceEventsDropped { "counter" } else { "gauge" };
                header(&mut out, *family, kind);
                last = Some(*family);
            }
            let _ = writeln!(out, "{}{} {}", family.name(), label_text(labels, None), value.load(Ordering::Relaxed));
        }
        for ((family, labels), value) in &counters {
            if last != Some(*family) {
                header(&mut out, *family, "counter");
                last = Some(*family);
            }
            let _ = writeln!(out, "{}{} {value}", family.name(), label_text(labels, None));
        }
        for ((family, labels), h) in &histograms {
            if last != Some(*family) {
                header(&mut out, *family, "histogram");
                last = Some(*family);
            }
            let name = family.name();
            let mut cumulative = 0;
            for (n, le) in h.buckets.iter().zip(BUCKETS) {
                cumulative += n;
                let _ = writeln!(out, "{name}_bucket{} {cumulative}", label_text(labels, Some(&le.to_string())));
            }
            let _ = writeln!(out, "{name}_bucket{} {}", label_text(labels, Some("+Inf")), h.count);
            let _ = writeln!(out, "{name}_sum{} {}", label_text(labels, None), h.sum);
            let _ = writeln!(out, "{name}_count{} {}", label_text(labels, None), h.count);
        }
        out
    }
}

/// A call metric for one label set (see [`Metrics::call_metric`]).
#[derive(Debug)]
pub struct CallMetric {
    counter: Family,
    histogram: Option<Family>,
    labels: Labels,
    outcome_label: &'static str,
    outcomes: &'static [&'static str],
    counts: Vec<AtomicU64>,
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
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
        // One bucket per observation; the exposition makes them cumulative.
        if let Some(i) = bucket_of(took.as_secs_f64()) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(took.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
        self.add(metrics, outcome);
    }

    /// Counts one more with `outcome` (no duration).
    pub fn add(&self, metrics: &Metrics, outcome: &str) {
        self.add_n(metrics, outcome, 1);
    }

    /// Counts `n` more with `outcome`.
    pub fn add_n(&self, metrics: &Metrics, outcome: &str, n: u64) {
        match self.outcomes.iter().position(|o| *o == outcome) {
            Some(i) => {
                self.counts[i].fetch_add(n, Ordering::Relaxed);
            }
            None => {
                let mut labels = self.labels.clone();
                labels.push((self.outcome_label, outcome.to_owned()));
                if let Ok(mut r) = metrics.registry.lock() {
                    *r.counters.entry((self.counter, labels)).or_default() += n;
                }
            }
        }
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
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The standard process metrics, from /proc/self (Linux; nothing elsewhere).
fn process_metrics(out: &mut String) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return };
    // The fields after the command name, which is in parentheses.
    let Some((_, rest)) = stat.rsplit_once(") ") else { return };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    // Clock ticks per second and the page size: 100 and 4 KiB on the
    // Linux platforms Lattice is built for.
    const TICKS: f64 = 100.0;
    const PAGE: f64 = 4096.0;
    let mut emit = |name: &str, kind: &str, help: &str, value: Option<f64>| {
        if let Some(v) = value {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        }
    };
    let cpu = field(14).zip(field(15)).map(|(u, s)| (u + s) / TICKS);
    emit("process_cpu_seconds_total", "counter", "User and system CPU time spent, in seconds.", cpu);
    emit("process_resident_memory_bytes", "gauge", "Resident memory size, in bytes.", field(24).map(|p| p * PAGE));
    emit("process_virtual_memory_bytes", "gauge", "Virtual memory size, in bytes.", field(23));
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as f64).ok();
    emit("process_open_fds", "gauge", "Open file descriptors.", fds);
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("btime ").and_then(|v| v.trim().parse::<f64>().ok())));
    let start = boot.zip(field(22)).map(|(b, ticks)| b + ticks / TICKS);
    emit("process_start_time_seconds", "gauge", "Start time of the process since the Unix epoch, in seconds.", start);
}

fn header(out: &mut String, family: Family, kind: &str) {
    let _ = writeln!(out, "# HELP {} {}", family.name(), family.help());
    let _ = writeln!(out, "# TYPE {} {kind}", family.name());
}

fn label_text(labels: &Labels, le: Option<&str>) -> String {
    let mut parts: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    if parts.is_empty() { String::new() } else { format!("{{{}}}", parts.join(",")) }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
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
                    http::Response::builder()
                        .header(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")
                        .body(metrics.render())
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
        assert!(text.contains("lattice_query_duration_seconds_bucket{agent=\"a\",le=\"0.025\"} 0"), "{text}");
        assert!(text.contains("lattice_query_duration_seconds_bucket{agent=\"a\",le=\"0.05\"} 1"), "{text}");
        assert!(text.contains("lattice_query_duration_seconds_count{agent=\"a\"} 1"), "{text}");
        assert_eq!(text.matches("# TYPE lattice_queries_total counter").count(), 1);
    }

    #[test]
    fn call_metrics_render_with_the_registry() {
        let m = Metrics::default();
        let labels = || vec![("agent", "a".to_owned()), ("hook", "h".to_owned())];
        let handle = m.call_metric(Family::HookCalls, Some(Family::HookCallDuration), labels(), &["ok", "deadline"]);
        let far = Instant::now() + Duration::from_secs(60);
        handle.start(&m, far).finish("ok");
        handle.start(&m, far).finish("ok");
        handle.start(&m, far).finish("unavailable");
        // Dropped unfinished before its deadline: cancelled.
        drop(handle.start(&m, far));
        // The registry's own counts of the same labels are added in.
        m.count(Family::HookCalls, vec![("agent", "a".to_owned()), ("hook", "h".to_owned()), ("outcome", "ok".into())]);
        m.observe(Family::HookCallDuration, labels(), Duration::from_millis(3));
        let text = m.render();
        assert!(text.contains("lattice_hook_calls_total{agent=\"a\",hook=\"h\",outcome=\"ok\"} 3"), "{text}");
        assert!(text.contains("lattice_hook_calls_total{agent=\"a\",hook=\"h\",outcome=\"unavailable\"} 1"), "{text}");
        assert!(text.contains("lattice_hook_calls_total{agent=\"a\",hook=\"h\",outcome=\"cancelled\"} 1"), "{text}");
        assert!(text.contains("lattice_hook_call_duration_seconds_count{agent=\"a\",hook=\"h\"} 5"), "{text}");
        assert_eq!(text.matches("# TYPE lattice_hook_calls_total counter").count(), 1);
    }

    #[test]
    fn call_metrics_take_their_outcome_label_and_may_have_no_histogram() {
        let m = Metrics::default();
        let agent = || vec![("agent", "a".to_owned())];
        let queries = m.call_metric_as(Family::Queries, Some(Family::QueryDuration), agent(), "code", &["OK"]);
        queries.record(&m, "OK", Duration::from_millis(30));
        queries.record(&m, "DATA_LOSS", Duration::from_millis(1));
        let tools = m.call_metric(Family::ToolCalls, None, vec![("tool", "t".to_owned())], &["executed"]);
        tools.add(&m, "executed");
        tools.add(&m, "blocked");
        let text = m.render();
        assert!(text.contains("lattice_queries_total{agent=\"a\",code=\"OK\"} 1"), "{text}");
        assert!(text.contains("lattice_queries_total{agent=\"a\",code=\"DATA_LOSS\"} 1"), "{text}");
        assert!(text.contains("lattice_query_duration_seconds_bucket{agent=\"a\",le=\"0.025\"} 1"), "{text}");
        assert!(text.contains("lattice_query_duration_seconds_count{agent=\"a\"} 2"), "{text}");
        assert!(text.contains("lattice_tool_calls_total{tool=\"t\",outcome=\"executed\"} 1"), "{text}");
        assert!(text.contains("lattice_tool_calls_total{tool=\"t\",outcome=\"blocked\"} 1"), "{text}");
        assert!(!text.contains("lattice_tool_calls_total_count"), "{text}");
        assert_eq!(text.matches("# TYPE lattice_queries_total counter").count(), 1);
    }
}
