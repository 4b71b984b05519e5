//! Billing export benchmark (issue 11): the rate at which `tollgate export`
//! writes a run over `LINES` folded lines, in each format, and the peak
//! memory of that process, against a baseline measured in the same run: a
//! plain read of the same counters from the same SQLite file written as CSV
//! with the `csv` crate (no watermark, no reconciliation, no format).
//!
//! It makes an embedded store (the SQLite file of `tollgate dev`) with one
//! project and `ACTORS` actors, each with a `calendar_month` counter of
//! calls and rows (two lines each), written straight into the fold's table,
//! and a project a tenth that size, whose CSV run's peak memory against the
//! big one's shows whether a run's memory grows with its period.
//! Each format's run is the export's first (what the runs wrote is cleared
//! between formats), in its own `tollgate export --data-dir` process, timed
//! by `/usr/bin/time` (its maximum resident set size is the peak memory).
//! The run's wall time includes the process's start, its reconciliation
//! (every line read again and compared) and the file's sync.
//!
//! Run it with `cargo bench --bench export_rate` or `scripts/bench` (no
//! service needed). Under `cargo test --all-targets` it returns at once. It
//! prints a markdown report and writes it to `target/bench-export.md`.

use std::io::Write;
use std::process::Command;
use std::time::Instant;

mod support;
use support::{AnyResult, bench_main};

const ACTORS: usize = 500_000;
/// Two lines (calls, rows) per actor.
const LINES: usize = 2 * ACTORS;
const PROJECT: &str = "proj_bench_export";
/// A project a tenth the size: its run's peak memory against the big one's
/// shows whether memory grows with the period.
const SMALL: &str = "proj_bench_small";

fn main() {
    bench_main("export_rate", run);
}

struct Measured {
    what: String,
    rows: u64,
    bytes: u64,
    secs: f64,
    peak_kib: Option<u64>,
}

impl Measured {
    fn rows_per_sec(&self) -> f64 {
        self.rows as f64 / self.secs.max(1e-9)
    }

    fn mb_per_sec(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.secs.max(1e-9)
    }
}

async fn run() -> AnyResult<()> {
    let dir = std::env::temp_dir().join(format!("tg-bench-export-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let db = dir.join("tollgate.db");
    let store = store::SqliteStore::open(&db).await?;
    store.migrate().await?;
    let pool = store.pool().clone();
    let seeded = Instant::now();
    for (project, actors) in [(PROJECT, ACTORS), (SMALL, ACTORS / 10)] {
        sqlx::query("INSERT INTO projects (id, name, timezone, created_at) VALUES (?, 'bench', 'UTC', ?)")
            .bind(project)
            .bind("2026-01-01T00:00:00Z")
            .execute(&pool)
            .await?;
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO usage_aggregates (project_id, dimension, window_kind, window_key, resets_at, requests, calls, \"rows\")
             SELECT ?2, 'a:cust_' || printf('%07d', i), 'calendar_month', '2026-11', '2026-12-01T00:00:00Z', 0,
                    1 + i % 97, 10 * (1 + i % 89)
             FROM n",
        )
        .bind(i64::try_from(actors - 1)?)
        .bind(project)
        .execute(&pool)
        .await?;
    }
    println!("seeded {ACTORS} actors ({LINES} lines) in {:.1} s", seeded.elapsed().as_secs_f64());

    // The baseline: the same counters, read and written as CSV, in this process.
    let started = Instant::now();
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT dimension, calls, \"rows\" FROM usage_aggregates WHERE project_id = ? AND window_kind = 'calendar_month' \
         ORDER BY dimension",
    )
    .bind(PROJECT)
    .fetch_all(&pool)
    .await?;
    let path = dir.join("baseline.csv");
    let mut w = csv::Writer::from_writer(std::io::BufWriter::new(std::fs::File::create(&path)?));
    w.write_record(["customer_id", "metric", "consumed_quantity"])?;
    for (d, calls, r) in &rows {
        w.write_record([d.as_str(), "calls", &calls.to_string()])?;
        w.write_record([d.as_str(), "rows", &r.to_string()])?;
    }
    w.flush()?;
    drop(w);
    let baseline = Measured {
        what: "baseline: read + CSV".into(),
        rows: 2 * rows.len() as u64,
        bytes: std::fs::metadata(&path)?.len(),
        secs: started.elapsed().as_secs_f64(),
        peak_kib: None,
    };
    drop(rows);
    pool.close().await;

    let mut runs = vec![baseline];
    let cases = [(PROJECT, "csv"), (PROJECT, "jsonl"), (PROJECT, "parquet"), (SMALL, "csv")];
    for (project, format) in cases {
        let lines = if project == PROJECT { LINES } else { LINES / 10 };
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display())).await?;
        sqlx::query("DELETE FROM export_lines").execute(&pool).await?;
        sqlx::query("DELETE FROM export_runs").execute(&pool).await?;
        pool.close().await;
        let out = dir.join(format!("run.{format}"));
        let started = Instant::now();
        let o = Command::new("/usr/bin/time")
            .args(["-f", "peak_kib=%M"])
            .arg(env!("CARGO_BIN_EXE_tollgate"))
            .args(["export", "--data-dir"])
            .arg(&dir)
            .args(["--project", project, "--period", "calendar_month", "--dimensions", "actor", "--format", format])
            .arg("--out")
            .arg(&out)
            .env("TOLLGATE_LOG", "warn")
            .output()?;
        let secs = started.elapsed().as_secs_f64();
        let stdout = String::from_utf8_lossy(&o.stdout);
        let stderr = String::from_utf8_lossy(&o.stderr);
        if !o.status.success() {
            return Err(format!("tollgate export --format {format} failed: {stdout}{stderr}").into());
        }
        let written = stdout
            .split_whitespace()
            .zip(stdout.split_whitespace().skip(1))
            .find(|(_, w)| w.starts_with("rows"))
            .and_then(|(n, _)| n.parse::<u64>().ok())
            .unwrap_or(0);
        if written != lines as u64 || !stdout.contains(", 0 differ") {
            return Err(format!("the {format} run wrote {written} rows, not {lines}, or differs: {stdout}").into());
        }
        let peak = stderr.lines().find_map(|l| l.strip_prefix("peak_kib=")).and_then(|v| v.trim().parse().ok());
        runs.push(Measured {
            what: if project == PROJECT {
                format!("`tollgate export --format {format}`")
            } else {
                format!("`tollgate export --format {format}`, a tenth the size")
            },
            rows: written,
            bytes: std::fs::metadata(&out)?.len(),
            secs,
            peak_kib: peak,
        });
    }

    let base = runs[0].rows_per_sec();
    let mut report = String::new();
    report.push_str(&format!(
        "Export of {LINES} folded lines ({ACTORS} actors × calls, rows; one calendar month), SQLite store; \
         each run in its own process, wall time from spawn to exit; the last run exports a project a tenth the \
         size.\n\n"
    ));
    report.push_str(
        "| run | rows | rows/s | × baseline | file MB | MB/s | peak RSS MiB |\n|---|---|---|---|---|---|---|\n",
    );
    for m in &runs {
        report.push_str(&format!(
            "| {} | {} | {:.0} | {:.2} | {:.1} | {:.1} | {} |\n",
            m.what,
            m.rows,
            m.rows_per_sec(),
            m.rows_per_sec() / base,
            m.bytes as f64 / 1e6,
            m.mb_per_sec(),
            m.peak_kib.map_or("-".to_owned(), |k| format!("{:.0}", k as f64 / 1024.0)),
        ));
    }
    println!("{report}");
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    std::fs::File::create(std::path::Path::new(&target).join("bench-export.md"))?.write_all(report.as_bytes())?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
