//! Billing exports (issue 11): a known set of events — calls, rows, tokens
//! across two models (one unpriced), storage deltas and a snapshot, a late
//! event for a closed period, corrections, duplicates — exported by watermark
//! as Parquet through the API and the CLI, read back with the `parquet`
//! crate's own reader (testkit), and summed: the totals equal the
//! acknowledged events to the unit, a final period's late usage arrives as
//! correction rows in the open period, and `--verify` folds the log to the
//! run's watermark and finds no difference.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Duration, DurationRound, Utc};
use serde_json::{Value, json};
use testkit::parquet::{ParquetValue, read_parquet};

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exports_reconcile_to_the_events_to_the_unit() {
    exports(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exports_reconcile_to_the_events_to_the_unit_dev() {
    exports(Mode::Dev).await;
}

/// A summed line: (charge period, customer type, customer id, what).
type Key = (String, String, String, String);

/// What every row of the files adds up to, per line; and each row's
/// (charge class, billing period, charge period, what) as seen.
#[derive(Debug, Default)]
struct Tally {
    quantity: BTreeMap<Key, i128>,
    /// Cost in picodollars, where a row has one.
    cost: BTreeMap<Key, i128>,
    rows: Vec<BTreeMap<String, ParquetValue>>,
}

fn text(row: &BTreeMap<String, ParquetValue>, col: &str) -> String {
    match row.get(col) {
        Some(ParquetValue::Text(s)) => s.clone(),
        Some(ParquetValue::Null) | None => String::new(),
        // A UTC instant, as the CSV writes it.
        Some(ParquetValue::TimestampMicros(us)) => DateTime::<Utc>::from_timestamp_micros(*us)
            .expect("an instant")
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        Some(other) => panic!("{col} is not text: {other:?}"),
    }
}

fn picos(v: &ParquetValue) -> Option<i128> {
    match v {
        ParquetValue::Null => None,
        ParquetValue::Decimal { unscaled, scale: 12 } => Some(*unscaled),
        other => panic!("a money column is DECIMAL(38,12): {other:?}"),
    }
}

impl Tally {
    fn add_file(&mut self, path: &Path) {
        for row in read_parquet(path).expect("a Parquet file the reader reads") {
            let what = match text(&row, "provider").as_str() {
                "" => match text(&row, "meter_type").as_str() {
                    "" => text(&row, "metric"),
                    meter => format!("{}:{meter}", text(&row, "metric")),
                },
                p => format!("{p}/{}/{}", text(&row, "model"), text(&row, "component")),
            };
            let key = (text(&row, "charge_period_start"), text(&row, "customer_type"), text(&row, "customer_id"), what);
            if let Some(ParquetValue::Int(q)) = row.get("consumed_quantity") {
                *self.quantity.entry(key.clone()).or_default() += i128::from(*q);
            }
            if let Some(c) = row.get("cost_usd").and_then(picos) {
                *self.cost.entry(key).or_default() += c;
            }
            self.rows.push(row);
        }
        self.quantity.retain(|_, v| *v != 0);
        self.cost.retain(|_, v| *v != 0);
    }
}

/// Every file under `dir`, recursively.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("read the export directory") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

fn start_of(day: DateTime<Utc>) -> String {
    day.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

async fn exports(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    env.start_projector();
    let price = |component: &str, usd: &str| {
        json!({"provider": "openai", "model": "gpt-x", "component": component, "unit_price_usd": usd,
               "effective_from": "2020-01-01T00:00:00Z"})
    };
    let prices = json!({"prices": [price("input_tokens", "0.000002"), price("output_tokens", "0.000008")]});
    let (s, b) = env.admin_req(reqwest::Method::PUT, "/v1/prices", Some(prices)).await;
    assert_eq!(s, 200, "{b}");
    let (pid, kid, _) = env.project_with_key("UTC").await;

    // Days in UTC: today (open), and three before it (closed).
    let now = Utc::now();
    let today = now.duration_trunc(Duration::days(1)).expect("today");
    let at_today = (now - Duration::minutes(2)).max(today + Duration::seconds(1)).to_rfc3339();
    let day = |n: i64, h: i64| (today - Duration::days(n) + Duration::hours(h)).to_rfc3339();
    let call = |id: &str, actor: &str, rows: u64, at: &str| {
        json!({"id": id, "type": "call", "project_id": pid, "api_key_id": kid, "actor_id": actor,
               "occurred_at": at, "outcome": "success", "rows": rows})
    };
    let tokens = |id: &str, actor: &str, model: &str, input: u64, output: u64| {
        json!({"id": id, "type": "tokens", "project_id": pid, "actor_id": actor, "occurred_at": at_today,
               "tokens": [{"provider": "openai", "model": model, "input": input, "output": output}]})
    };
    let storage = |id: &str, kind: &str, bytes: i64, at: &str| json!({"id": id, "type": kind, "project_id": pid, "occurred_at": at, "storage_bytes": bytes});
    let correction = |id: &str, of: &str, extra: Value| {
        let mut e = json!({"id": id, "type": "correction", "project_id": pid, "corrects": of, "occurred_at": at_today});
        if let (Value::Object(e), Value::Object(x)) = (&mut e, extra) {
            e.extend(x);
        }
        e
    };
    let first = vec![
        call("c1", "cust-a", 10, &at_today),
        call("c2", "cust-b", 5, &at_today),
        call("c1", "cust-a", 10, &at_today), // a duplicate
        call("old", "cust-a", 7, &day(3, 12)),
        tokens("t1", "cust-a", "gpt-x", 1000, 500),
        tokens("t2", "cust-b", "llama-local", 300, 100), // no price: unpriced
        storage("s1", "storage_delta", 1000, &day(3, 12)),
        storage("s2", "storage_snapshot", 5000, &day(2, 12)),
        storage("s3", "storage_delta", 250, &at_today),
    ];
    let (s, b) = post_events(&env.http, env.gw(), first).await;
    assert_eq!((s, b["accepted"].clone(), b["duplicates"].clone()), (202, json!(8), json!(1)), "{b}");
    let folded = |calls: i64, rows: i64| {
        let (env, pid) = (&env, pid.clone());
        async move { env.durable(&pid, "p", "day").await == (0, calls, rows) }
    };
    env.eventually(60, "the first events folded", || folded(3, 22)).await;
    env.eventually(30, "the tokens folded", || async { env.durable_tokens(&pid, "p", "day").await == 1900 }).await;

    // Bad input changes nothing.
    for (body, field) in [
        (json!({"project_id": pid, "period": "day", "dimensions": ["team"], "format": "csv"}), "dimensions[0]"),
        (json!({"project_id": pid, "period": "week", "dimensions": ["project"], "format": "csv"}), "period"),
        (json!({"project_id": pid, "period": "day", "dimensions": [], "format": "csv"}), "dimensions"),
        (json!({"project_id": pid, "period": "day", "dimensions": ["actor"], "format": "xls"}), "format"),
        (
            json!({"project_id": pid, "period": "day", "dimensions": ["actor"], "format": "csv", "grace_seconds": 300000}),
            "grace_seconds",
        ),
        (json!({"project_id": pid, "period": "day", "dimensions": ["actor"], "format": "csv", "colour": 1}), "colour"),
    ] {
        let (s, b) = env.admin_post("/v1/exports", body).await;
        assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!(field)), "{b}");
    }
    let (s, _) = env
        .admin_post(
            "/v1/exports",
            json!({"project_id": "proj_nope", "period": "day", "dimensions": ["actor"], "format": "csv"}),
        )
        .await;
    assert_eq!(s, 404);

    // Run 1, through the API, as Parquet.
    let spec =
        json!({"project_id": pid, "period": "day", "dimensions": ["project", "actor", "api_key"], "format": "parquet"});
    let (s, run1) = env.admin_post("/v1/exports", spec.clone()).await;
    assert_eq!(s, 201, "{run1}");
    assert_eq!(run1["status"], "complete", "{run1}");
    assert_eq!(run1["reconciliation"]["fold"]["differences"], json!([]), "{run1}");
    let run1_id = run1["id"].as_str().expect("run id").to_owned();
    let (s, got) = env.admin_get(&format!("/v1/exports/{run1_id}")).await;
    assert_eq!((s, got["id"].clone(), got["rows"].clone()), (200, json!(run1_id), run1["rows"].clone()));
    let file = env
        .http
        .get(format!("{}/v1/exports/{run1_id}/file", env.gw()))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("download");
    assert_eq!(file.status().as_u16(), 200);
    let bytes = file.bytes().await.expect("the file");
    assert_eq!(bytes.len() as u64, run1["bytes"].as_u64().expect("bytes"), "the file is the run's");
    let dir = env.data_dir.join("downloaded");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("run1.parquet"), &bytes).expect("save");
    let mut tally = Tally::default();
    tally.add_file(&dir.join("run1.parquet"));
    assert_eq!(tally.rows.len() as u64, run1["rows"].as_u64().expect("rows"));
    let watermark = text(&tally.rows[0], "watermark");
    assert!(tally.rows.iter().all(|r| text(r, "export_run_id") == run1_id && text(r, "watermark") == watermark));
    // The first run bills closed days in their own period: nothing was final yet.
    assert!(tally.rows.iter().all(|r| text(r, "charge_class") == "usage"), "{:?}", tally.rows);
    let unpriced = tally
        .rows
        .iter()
        .find(|r| text(r, "model") == "llama-local" && text(r, "customer_type") == "actor")
        .expect("the unpriced model's row");
    assert_eq!(unpriced.get("cost_usd"), Some(&ParquetValue::Null), "an unpriced row has no cost");
    assert!(text(unpriced, "unpriced_reason").contains("no price"), "{unpriced:?}");

    // Later: a late call for a final day, a credit for it, an amend of
    // today's, late storage, and duplicates of what was folded.
    // (One project's events are one partition's, folded in order: once the
    // last correction is folded, all of them are.)
    let second = vec![
        storage("s4", "storage_delta", 100, &day(2, 18)),
        tokens("t1", "cust-a", "gpt-x", 1000, 500), // a duplicate
        call("late", "cust-a", 4, &day(3, 20)),
        correction("x1", "c2", json!({"rows": 2})),
        correction("x2", "old", json!({"void": true})),
    ];
    // (The resent t1 is refused by the fold, whatever the gateway saw of it:
    // the totals below count it once.)
    let (s, b) = post_events(&env.http, env.gw(), second).await;
    assert_eq!(s, 202, "{b}");
    env.eventually(60, "the late events folded", || folded(3, 16)).await;

    // Run 2, by the CLI, into a directory, verified against the log.
    let out = env.data_dir.join("finance");
    let out_arg = format!("{}/", out.display());
    let (code, stdout, stderr) = env.cli(&[
        "export",
        "--project",
        &pid,
        "--period",
        "day",
        "--dimensions",
        "project,actor,api_key",
        "--format",
        "parquet",
        "--out",
        &out_arg,
        "--verify",
    ]);
    assert_eq!(code, 0, "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("verify:") && stdout.contains(", 0 differ"), "{stdout}");
    let parts = files(&out);
    assert!(!parts.is_empty(), "{stdout}");
    for p in &parts {
        let rel = p.strip_prefix(&out).expect("under out").to_string_lossy().into_owned();
        assert!(rel.starts_with(&format!("project={pid}/period=")) && rel.contains("/part-exr_"), "{rel}");
    }
    let before = tally.rows.len();
    for p in &parts {
        tally.add_file(p);
    }
    let run2: Vec<&BTreeMap<String, ParquetValue>> = tally.rows[before..].iter().collect();
    let today_key = today.format("%Y-%m-%d").to_string();
    let day3 = start_of(today - Duration::days(3));
    // The final day's late call and credit: corrections billed today, keeping their own period.
    let late: Vec<_> = run2.iter().filter(|r| text(r, "charge_period_start") == day3).collect();
    assert!(!late.is_empty(), "{run2:?}");
    for r in &late {
        assert_eq!(
            (text(r, "charge_class"), text(r, "billing_period")),
            ("correction".into(), today_key.clone()),
            "{r:?}"
        );
    }
    let late_calls = late
        .iter()
        .find(|r| text(r, "customer_type") == "project" && text(r, "metric") == "rows")
        .expect("the project's rows of the final day");
    assert_eq!(late_calls.get("consumed_quantity"), Some(&ParquetValue::Int(4 - 7)), "late +4, voided -7");

    // Every line, over both runs, to the unit.
    let p = |n: i64| start_of(today - Duration::days(n));
    let key =
        |period: String, kind: &str, id: &str, what: &str| (period, kind.to_owned(), id.to_owned(), what.to_owned());
    let mut want: BTreeMap<Key, i128> = BTreeMap::new();
    for (kind, id) in [("project", pid.as_str()), ("api_key", kid.as_str())] {
        want.insert(key(p(3), kind, id, "calls"), 1);
        want.insert(key(p(3), kind, id, "rows"), 4);
        want.insert(key(p(0), kind, id, "calls"), 2);
        want.insert(key(p(0), kind, id, "rows"), 12);
    }
    want.insert(key(p(3), "actor", "cust-a", "calls"), 1);
    want.insert(key(p(3), "actor", "cust-a", "rows"), 4);
    want.insert(key(p(0), "actor", "cust-a", "calls"), 1);
    want.insert(key(p(0), "actor", "cust-a", "rows"), 10);
    want.insert(key(p(0), "actor", "cust-b", "calls"), 1);
    want.insert(key(p(0), "actor", "cust-b", "rows"), 2);
    want.insert(key(p(0), "project", &pid, "tokens"), 1900);
    want.insert(key(p(0), "actor", "cust-a", "tokens"), 1500);
    want.insert(key(p(0), "actor", "cust-b", "tokens"), 400);
    for (kind, id) in [("project", pid.as_str()), ("actor", "cust-a")] {
        want.insert(key(p(0), kind, id, "openai/gpt-x/input_tokens"), 1000);
        want.insert(key(p(0), kind, id, "openai/gpt-x/output_tokens"), 500);
    }
    for (kind, id) in [("project", pid.as_str()), ("actor", "cust-b")] {
        want.insert(key(p(0), kind, id, "openai/llama-local/input_tokens"), 300);
        want.insert(key(p(0), kind, id, "openai/llama-local/output_tokens"), 100);
    }
    // Storage: the footprint at each day's end (today: now), and the byte-days of ended days.
    for (n, bytes) in [(3, 1000), (2, 5100), (1, 5100)] {
        want.insert(key(p(n), "project", &pid, "storage_bytes"), bytes);
        want.insert(key(p(n), "project", &pid, "storage_byte_days"), bytes);
    }
    want.insert(key(p(0), "project", &pid, "storage_bytes"), 5350);
    assert_eq!(tally.quantity, want, "every line over both runs");
    let cost: BTreeMap<Key, i128> = BTreeMap::from([
        // 1000 × $0.000002 + 500 × $0.000008 = $0.006, exact.
        (key(p(0), "project", &pid, "cost_usd:llm_tokens"), 6_000_000_000),
        (key(p(0), "actor", "cust-a", "cost_usd:llm_tokens"), 6_000_000_000),
        (key(p(0), "project", &pid, "openai/gpt-x/input_tokens"), 2_000_000_000),
        (key(p(0), "project", &pid, "openai/gpt-x/output_tokens"), 4_000_000_000),
        (key(p(0), "actor", "cust-a", "openai/gpt-x/input_tokens"), 2_000_000_000),
        (key(p(0), "actor", "cust-a", "openai/gpt-x/output_tokens"), 4_000_000_000),
    ]);
    assert_eq!(tally.cost, cost, "every cost over both runs, to the picodollar");

    // Nothing folded since: a third run writes nothing, and is complete.
    let (s, run3) = env.admin_post("/v1/exports", spec).await;
    assert_eq!((s, run3["status"].clone(), run3["rows"].clone()), (201, json!("complete"), json!(0)), "{run3}");

    // A row cap: another export stops at 2 rows, marked ROWS, partial; the
    // next run writes the rest, and the two sum to the fold.
    let capped = ["export", "--project", &pid, "--period", "day", "--dimensions", "actor", "--format", "csv"];
    let csv1 = env.data_dir.join("actors-1.csv");
    let csv1_arg = csv1.display().to_string();
    let mut args = capped.to_vec();
    args.extend(["--out", &csv1_arg, "--max-rows", "2"]);
    let (code, stdout, _) = env.cli(&args);
    assert_eq!(code, 2, "a partial run exits 2: {stdout}");
    assert!(stdout.contains("partial") && stdout.contains("stopped at ROWS"), "{stdout}");
    let csv2 = env.data_dir.join("actors-2.csv");
    let csv2_arg = csv2.display().to_string();
    let mut args = capped.to_vec();
    args.extend(["--out", &csv2_arg]);
    let (code, stdout, stderr) = env.cli(&args);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let mut sums: BTreeMap<(String, String, String), i128> = BTreeMap::new();
    let mut data_rows = 0;
    for f in [&csv1, &csv2] {
        let mut r = csv::Reader::from_path(f).expect("a CSV file");
        let header: Vec<String> = r.headers().expect("header").iter().map(str::to_owned).collect();
        let col = |n: &str| header.iter().position(|h| h == n).expect("column");
        for rec in r.records() {
            let rec = rec.expect("record");
            data_rows += 1;
            if let Ok(q) = rec[col("consumed_quantity")].parse::<i128>() {
                let what = format!("{}{}", &rec[col("metric")], &rec[col("component")]);
                *sums
                    .entry((rec[col("charge_period_start")].to_owned(), rec[col("customer_id")].to_owned(), what))
                    .or_default() += q;
            }
        }
    }
    assert!(data_rows > 2, "the rest came in the second run");
    assert_eq!(sums.get(&(p(0), "cust-a".into(), "rows".into())), Some(&10));
    assert_eq!(sums.get(&(p(3), "cust-a".into(), "rows".into())), Some(&4));
    assert_eq!(sums.get(&(p(0), "cust-b".into(), "tokensoutput_tokens".into())), Some(&100));
    // One export per project at a time, whoever runs it: with a run of the
    // CLI under way (its row, as it starts), the API answers 429.
    let running = format!(
        "INSERT INTO export_runs (id, export_key, project_id, period_kind, dimensions, grace_secs, format, status, \
         watermark, started_at, \"rows\", bytes) VALUES ('exr_running', '{pid}/day/user', '{pid}', 'day', 'user', 3600, \
         'csv', 'running', '{{}}', '{}', 0, 0)",
        Utc::now().to_rfc3339()
    );
    env.execute(&running).await;
    let (s, b) = env
        .admin_post(
            "/v1/exports",
            json!({"project_id": pid, "period": "day", "dimensions": ["agent"], "format": "csv"}),
        )
        .await;
    assert_eq!((s, b["error"]["code"].clone()), (429, json!("too-many-heavy-requests")), "{b}");
    assert_eq!(
        (b["error"]["meta"]["endpoint"].clone(), b["error"]["meta"]["whose"].clone()),
        (json!("exports"), json!("project"))
    );

    env.execute("UPDATE export_runs SET status = 'failed' WHERE id = 'exr_running'").await;

    // A run that fails half-way (today's directory cannot be made) leaves
    // no file behind: what it wrote is not recorded, and the next run writes
    // it again.
    let blocked = env.data_dir.join("blocked");
    std::fs::create_dir_all(blocked.join(format!("project={pid}"))).expect("dir");
    std::fs::write(blocked.join(format!("project={pid}/period={today_key}")), b"in the way")
        .expect("a file in the way");
    let blocked_arg = format!("{}/", blocked.display());
    let keys = ["export", "--project", &pid, "--period", "day", "--dimensions", "api_key", "--out", &blocked_arg];
    let (code, stdout, stderr) = env.cli(&keys);
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(stdout.contains("failed"), "{stdout}{stderr}");
    let left: Vec<PathBuf> = files(&blocked).into_iter().filter(|f| f.extension().is_some()).collect();
    assert!(left.is_empty(), "a failed run's files are removed: {left:?}");
    std::fs::remove_file(blocked.join(format!("project={pid}/period={today_key}"))).expect("unblock");
    let (code, stdout, _) = env.cli(&keys);
    assert_eq!(code, 0, "{stdout}");
    let mut again = Tally::default();
    for f in files(&blocked).iter().filter(|f| f.extension().is_some()) {
        let mut r = csv::Reader::from_path(f).expect("csv");
        again.rows.extend(r.records().map(|_| BTreeMap::new()));
    }
    assert_eq!(again.rows.len(), 4, "the final day's calls and rows, and today's: {stdout}");

    // The partial run's audit entry says so.
    env.audit_when(&pid, 30, "the partial run's audit entry", |entries| {
        entries.iter().any(|e| {
            e["action"] == "exports:RunExport" && e["detail"]["status"] == "partial" && e["detail"]["mark"] == "ROWS"
        })
    })
    .await;
}
