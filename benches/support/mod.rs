//! What the benchmarks share (`hot_path`, `in_process`, `replay`,
//! `notify`): their `main`, latency percentiles of a sequential run,
//! throughput of concurrent clients, and the load average to judge how
//! quiet the machine was.

#![allow(dead_code)]

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What a benchmark's run returns.
pub type AnyResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A benchmark's `main`: runs `run` on a multi-threaded runtime under
/// `cargo bench` (which passes `--bench`), and returns at once when
/// `cargo test --all-targets` runs the target without it. A failure is
/// printed under `name` and exits 1.
pub fn bench_main<F, Fut>(name: &str, run: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = AnyResult<()>>,
{
    if !std::env::args().any(|a| a == "--bench") {
        println!("benchmarks run with cargo bench");
        return;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot build the runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = rt.block_on(run()) {
        eprintln!("{name}: benchmark failed: {e}");
        std::process::exit(1);
    }
}

/// Latency percentiles of one sequential run, in microseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub n: usize,
    pub errors: usize,
}

impl Latency {
    pub fn of(mut us: Vec<f64>, errors: usize) -> Latency {
        us.sort_by(f64::total_cmp);
        let pick = |p: f64| {
            if us.is_empty() {
                return f64::NAN;
            }
            let i = ((p * us.len() as f64).ceil() as usize).clamp(1, us.len()) - 1;
            us[i]
        };
        Latency { p50: pick(0.50), p99: pick(0.99), n: us.len(), errors }
    }
}

/// Requests (or records) per second of one run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rate {
    pub per_sec: f64,
    pub done: u64,
    pub errors: u64,
    pub secs: f64,
    /// The benchmark process's CPU time (user + system) over the run, when
    /// measured: everything in the process, the clients included.
    pub cpu_secs: Option<f64>,
}

impl Rate {
    /// Process CPU per completed operation, in µs.
    pub fn cpu_us_per_op(&self) -> Option<f64> {
        let cpu = self.cpu_secs?;
        (self.done > 0).then(|| cpu * 1e6 / self.done as f64)
    }
}

/// This process's CPU time so far (user + system), from `/proc/self/stat`
/// (fields 14 and 15, in the kernel's fixed 100 ticks a second).
pub fn process_cpu_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces; the fields after it don't.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    // utime and stime are fields 14 and 15: indexes 11 and 12 from field 3 on.
    Some((ticks(11)? + ticks(12)?) as f64 / 100.0)
}

/// Runs `op` `n` times in sequence (after `warmup` untimed runs). With
/// `TOLLGATE_BENCH_DUMP=<file>` it also writes each timed call's latency
/// there (µs, one a line, in call order), replacing what the file held: for
/// a `TOLLGATE_BENCH_PROFILE` run, which measures one variant, to see when
/// the slow calls came and how they are spread.
pub async fn sequential<F, Fut>(warmup: usize, n: usize, mut op: F) -> Latency
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    for _ in 0..warmup {
        op().await;
    }
    let mut us = Vec::with_capacity(n);
    let mut errors = 0;
    for _ in 0..n {
        let t = Instant::now();
        let ok = op().await;
        us.push(t.elapsed().as_secs_f64() * 1e6);
        if !ok {
            errors += 1;
        }
    }
    if let Ok(path) = std::env::var("TOLLGATE_BENCH_DUMP") {
        let text: String = us.iter().map(|u| format!("{u:.1}\n")).collect();
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("TOLLGATE_BENCH_DUMP: cannot write {path}: {e}");
        }
    }
    Latency::of(us, errors)
}

/// `clients` tasks calling `op` in a loop for `secs` seconds.
pub async fn throughput<F, Fut>(clients: usize, secs: f64, op: F) -> Rate
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    let ok = Arc::new(AtomicU64::new(0));
    let bad = Arc::new(AtomicU64::new(0));
    let cpu_before = process_cpu_secs();
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::with_capacity(clients);
    for _ in 0..clients {
        let (op, ok, bad) = (op.clone(), ok.clone(), bad.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                if op().await {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let done = ok.load(Ordering::Relaxed);
    let cpu_secs = cpu_before.zip(process_cpu_secs()).map(|(a, b)| b - a);
    Rate { per_sec: done as f64 / elapsed, done, errors: bad.load(Ordering::Relaxed), secs: elapsed, cpu_secs }
}

/// A baseline and a variant measured in alternating slices ([`interleave`]):
/// the machine's speed, which drifts by up to 2× within one run here, is
/// then the same for both, on average, in every pair.
#[derive(Debug, Clone, Default)]
pub struct Interleaved {
    /// (baseline, variant) operations per second of each pair, in order.
    pub pairs: Vec<(f64, f64)>,
    /// Each side's completed operations and process CPU seconds (`None`
    /// when `/proc/self/stat` cannot be read), summed over its slices.
    pub done: [u64; 2],
    pub cpu_secs: [Option<f64>; 2],
    /// Time spent settling before the slices (in neither side's time), and
    /// the longest such wait.
    pub waited: Duration,
    pub longest_wait: Duration,
    /// Slices that began unsettled (the settling step gave up).
    pub unsettled: usize,
}

impl Interleaved {
    /// The variant's operations over the baseline's, in equal time.
    pub fn ratio(&self) -> f64 {
        let (b, v) = self.pairs.iter().fold((0.0, 0.0), |(b, v), (x, y)| (b + x, v + y));
        if b > 0.0 { v / b } else { 0.0 }
    }

    /// The variant's process CPU per operation over the baseline's.
    pub fn cpu_ratio(&self) -> Option<f64> {
        let per_op = |i: usize| Some(self.cpu_secs[i]? / (self.done[i] > 0).then_some(self.done[i] as f64)?);
        let (b, v) = (per_op(0)?, per_op(1)?);
        (b > 0.0).then(|| v / b)
    }

    /// The lowest and highest of the pairs' ratios.
    pub fn pair_range(&self) -> (f64, f64) {
        let ratios = self.pairs.iter().map(|(b, v)| if *b > 0.0 { v / b } else { 0.0 });
        ratios.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| (lo.min(r), hi.max(r)))
    }

    /// The mean, lowest and highest rate of one side's slices (0: the
    /// baseline, 1: the variant).
    pub fn side(&self, i: usize) -> (f64, f64, f64) {
        let xs: Vec<f64> = self.pairs.iter().map(|p| if i == 0 { p.0 } else { p.1 }).collect();
        let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (xs.iter().sum::<f64>() / xs.len().max(1) as f64, lo, hi)
    }
}

/// A baseline and a variant in alternating slices of `slice_secs` with
/// `clients` clients, `pairs` pairs, each pair in the other order from the
/// one before (baseline, variant, variant, baseline, …), so a steady drift
/// of the machine's speed favours neither. Before every slice `settle`
/// runs (say, until a projector has folded what the variant logged, so
/// that no slice does another's work); it returns false if it gave up.
pub async fn interleave<B, BF, V, VF>(
    clients: usize,
    pairs: usize,
    slice_secs: f64,
    baseline: B,
    variant: V,
    mut settle: impl AsyncFnMut() -> bool,
) -> Interleaved
where
    B: Fn() -> BF + Clone + Send + Sync + 'static,
    BF: Future<Output = bool> + Send,
    V: Fn() -> VF + Clone + Send + Sync + 'static,
    VF: Future<Output = bool> + Send,
{
    let mut out = Interleaved { cpu_secs: [Some(0.0), Some(0.0)], ..Interleaved::default() };
    for pair in 0..pairs {
        let mut rates = [0.0; 2];
        for slot in 0..2 {
            let start = Instant::now();
            if !settle().await {
                out.unsettled += 1;
            }
            let waited = start.elapsed();
            out.waited += waited;
            out.longest_wait = out.longest_wait.max(waited);
            let side = (pair + slot) % 2;
            let rate = if side == 0 {
                throughput(clients, slice_secs, baseline.clone()).await
            } else {
                throughput(clients, slice_secs, variant.clone()).await
            };
            rates[side] = rate.per_sec;
            out.done[side] += rate.done;
            out.cpu_secs[side] = out.cpu_secs[side].zip(rate.cpu_secs).map(|(a, b)| a + b);
        }
        out.pairs.push((rates[0], rates[1]));
    }
    out
}

/// The 1, 5 and 15 minute load averages (Linux), to judge how quiet the machine was.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Microseconds as milliseconds with three decimals.
pub fn ms(us: f64) -> String {
    format!("{:.3} ms", us / 1000.0)
}

/// Serves `router` on a free port of 127.0.0.1 in the background: its URL.
pub async fn serve(router: axum::Router) -> AnyResult<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(format!("http://{addr}"))
}

/// A log that accepts everything and keeps nothing: a diagnostic's, or a
/// measurement's where the log is the same for every variant.
pub struct NullLog;

#[async_trait::async_trait]
impl meter::Log for NullLog {
    async fn publish(&self, _facts: &[meter::UsageFact]) -> meter::PortResult<()> {
        Ok(())
    }

    /// Queues at once, as the logs with an outbox do.
    fn queue(&self, _facts: &[meter::UsageFact]) -> Option<meter::PortResult<()>> {
        Some(Ok(()))
    }
}
