//! Export schedules (issue 11 item 6), end to end: a schedule defined
//! through the admin API, run by the notifier — two `tollgate notify`
//! processes over PostgreSQL, or `tollgate dev`'s own — when an admin says
//! "run now"; each run's end reaches a local receiver as a signed
//! `export.completed` (or `export.failed`) webhook, and the files land under
//! the destination, their rows the events to the unit.

use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use testkit::webhooks::Receiver;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_schedules_run_on_the_notifier_and_announce_each_run() {
    schedules(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_schedules_run_on_the_notifier_and_announce_each_run_dev() {
    schedules(Mode::Dev).await;
}

/// The bodies of what the receiver got, in order.
fn bodies(receiver: &Receiver) -> Vec<Value> {
    receiver.received().iter().map(|r| serde_json::from_slice(&r.body).expect("a JSON body")).collect()
}

/// Every file under `dir`, recursively.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for e in entries {
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

/// The calls a CSV file bills per API key.
fn calls_in(path: &Path) -> i64 {
    let mut reader = csv::Reader::from_path(path).expect("a CSV file");
    let headers = reader.headers().expect("a header").clone();
    let col = |name: &str| headers.iter().position(|h| h == name).expect("a column");
    let (metric, kind, quantity) = (col("metric"), col("customer_type"), col("consumed_quantity"));
    reader
        .records()
        .map(|r| r.expect("a row"))
        .filter(|r| &r[metric] == "calls" && &r[kind] == "api_key")
        .map(|r| r[quantity].parse::<i64>().expect("a quantity"))
        .sum()
}

async fn schedules(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.extra_env.push(("TOLLGATE_WEBHOOK_ALLOW_PRIVATE".into(), "true".into()));
    env.start_gateway().await;
    env.start_projector();
    if mode == Mode::Distributed {
        // Two notifiers: a schedule run once, whoever claims it.
        for _ in 0..2 {
            env.start_notifier_with(&[("TOLLGATE_NOTIFY_POLL", "50ms")]);
        }
    }
    let tz = safe_timezone();
    let (pid, kid, _) = env.project_with_key(tz).await;
    let receiver = Receiver::start(vec![]).await;
    let (s, w) = env
        .admin_post(
            &format!("/v1/projects/{pid}/webhooks"),
            json!({"url": receiver.url("/exports"), "event_types": ["export.*"]}),
        )
        .await;
    assert_eq!(s, 201, "{w}");
    let secret = w["secret"].as_str().expect("secret").to_owned();

    let events: Vec<Value> = (0..6).map(|i| call_event(&format!("c{i}"), &pid, &kid, None, 3)).collect();
    let (s, b) = post_events(&env.http, env.gw(), events).await;
    assert_eq!(s, 202, "{b}");
    let folded = |calls: i64| {
        let (env, pid) = (&env, pid.clone());
        async move { env.durable(&pid, "p", "day").await.1 == calls }
    };
    env.eventually(60, "6 calls folded", || folded(6)).await;

    // Bad input is refused by field, and creates nothing.
    let good = json!({"project_ids": [pid], "period": "day", "dimensions": ["api_key"], "format": "csv",
                      "destination": "finance/daily", "cadence": "daily"});
    let with = |k: &str, v: Value| {
        let mut b = good.clone();
        b[k] = v;
        b
    };
    for (body, field) in [
        (with("destination", json!("../outside")), "destination"),
        (with("destination", json!("/etc")), "destination"),
        (with("cadence", json!("weekly")), "cadence"),
        (with("format", json!("xls")), "format"),
        (with("dimensions", json!([])), "dimensions"),
        (with("timezone", json!("Mars/Olympus")), "timezone"),
        (with("project_ids", json!([])), "project_ids"),
        (with("all_projects", json!(true)), "all_projects"),
        (with("grace_seconds", json!(300000)), "grace_seconds"),
        (with("colour", json!("red")), "colour"),
    ] {
        let (s, b) = env.admin_post("/v1/export-schedules", body).await;
        assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!(field)), "{b}");
    }
    let (s, _) = env.admin_post("/v1/export-schedules", with("project_ids", json!(["proj_nope"]))).await;
    assert_eq!(s, 404);
    let (_, list) = env.admin_get("/v1/export-schedules").await;
    assert_eq!(list["data"], json!([]), "nothing was created");

    // A daily schedule in the project's zone: due once yesterday has closed.
    let (s, sched) = env.admin_post("/v1/export-schedules", good.clone()).await;
    assert_eq!(s, 201, "{sched}");
    let id = sched["id"].as_str().expect("schedule id").to_owned();
    assert_eq!(sched["timezone"], tz);
    let next: DateTime<Utc> = sched["next_run_at"].as_str().expect("next run").parse().expect("an instant");
    let zone: chrono_tz::Tz = tz.parse().expect("zone");
    let local = next.with_timezone(&zone);
    assert!(next > Utc::now(), "{next}");
    assert_eq!(local.format("%H:%M").to_string(), "01:00", "midnight in {tz} plus the 1 h grace: {local}");
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(receiver.received().is_empty(), "not due: nothing ran");

    // Run now: one run, announced once, signed; its file bills the calls.
    let (s, due) = env.admin_post(&format!("/v1/export-schedules/{id}/run"), json!({})).await;
    assert_eq!(s, 202, "{due}");
    env.eventually(60, "export.completed at the receiver", || async { !receiver.received().is_empty() }).await;
    receiver.verify_all(&[&secret]);
    let first = bodies(&receiver).remove(0);
    assert_eq!(first["type"], "export.completed", "{first}");
    let d = &first["data"];
    assert_eq!((d["schedule_id"].as_str(), d["project_id"].as_str()), (Some(id.as_str()), Some(pid.as_str())));
    assert_eq!((d["status"].as_str(), d["reconciled"].as_bool()), (Some("complete"), Some(true)), "{d}");
    assert_eq!(d["export_key"], format!("{pid}/day/api_key"));
    let run1 = d["run_id"].as_str().expect("run id").to_owned();
    let dest = env.data_dir.join("exports").join("finance").join("daily").join(format!("project={pid}"));
    let written = files(&dest);
    assert_eq!(written.len(), 1, "one file, today's: {written:?}");
    assert!(written[0].ends_with(format!("part-{run1}.csv")), "{written:?}");
    assert_eq!(calls_in(&written[0]), 6);

    // The schedule shows its run, and keeps its cadence.
    let (s, detail) = env.admin_get(&format!("/v1/export-schedules/{id}")).await;
    assert_eq!(s, 200, "{detail}");
    assert_eq!(detail["runs"][0]["id"], run1.as_str(), "{detail}");
    assert_eq!(detail["runs"].as_array().map(Vec::len), Some(1), "run once, by one notifier: {detail}");
    assert!(detail["schedule"]["last_run_at"].is_string(), "{detail}");
    assert_eq!(detail["schedule"]["next_run_at"], sched["next_run_at"], "back on its cadence");

    // More calls, run again: the second run adds only them.
    let more: Vec<Value> = (6..10).map(|i| call_event(&format!("c{i}"), &pid, &kid, None, 1)).collect();
    assert_eq!(post_events(&env.http, env.gw(), more).await.0, 202);
    env.eventually(60, "10 calls folded", || folded(10)).await;
    let (s, _) = env.admin_post(&format!("/v1/export-schedules/{id}/run"), json!({})).await;
    assert_eq!(s, 202);
    env.eventually(60, "a second export.completed", || async { receiver.received().len() >= 2 }).await;
    let second = bodies(&receiver).remove(1);
    assert_eq!(second["type"], "export.completed", "{second}");
    let run2 = second["data"]["run_id"].as_str().expect("run id").to_owned();
    assert_ne!(run2, run1);
    let part2 = files(&dest).into_iter().find(|p| p.ends_with(format!("part-{run2}.csv"))).expect("run 2's file");
    assert_eq!(calls_in(&part2), 4, "only what was folded since the first run");

    // A destination that cannot be written: the run fails, says so, and
    // leaves no file; the next run that can write writes it all.
    std::fs::create_dir_all(env.data_dir.join("exports")).expect("export dir");
    std::fs::write(env.data_dir.join("exports").join("blocked"), b"a file, not a directory").expect("a file");
    let (s, b) = env
        .admin_req(
            reqwest::Method::PATCH,
            &format!("/v1/export-schedules/{id}"),
            Some(json!({"destination": "blocked/x"})),
        )
        .await;
    assert_eq!((s, b["destination"].as_str()), (200, Some("blocked/x")), "{b}");
    let extra = vec![call_event("c10", &pid, &kid, None, 1)];
    assert_eq!(post_events(&env.http, env.gw(), extra).await.0, 202);
    env.eventually(60, "11 calls folded", || folded(11)).await;
    let (s, _) = env.admin_post(&format!("/v1/export-schedules/{id}/run"), json!({})).await;
    assert_eq!(s, 202);
    env.eventually(60, "export.failed at the receiver", || async { receiver.received().len() >= 3 }).await;
    let failed = bodies(&receiver).remove(2);
    assert_eq!(failed["type"], "export.failed", "{failed}");
    assert!(failed["data"]["error"].as_str().is_some_and(|e| !e.is_empty()), "{failed}");
    let (s, b) = env
        .admin_req(
            reqwest::Method::PATCH,
            &format!("/v1/export-schedules/{id}"),
            Some(json!({"destination": "finance/daily"})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    let (s, _) = env.admin_post(&format!("/v1/export-schedules/{id}/run"), json!({})).await;
    assert_eq!(s, 202);
    env.eventually(60, "a fourth message", || async { receiver.received().len() >= 4 }).await;
    let fourth = bodies(&receiver).remove(3);
    assert_eq!(fourth["type"], "export.completed", "{fourth}");
    let run4 = fourth["data"]["run_id"].as_str().expect("run id").to_owned();
    let part4 = files(&dest).into_iter().find(|p| p.ends_with(format!("part-{run4}.csv"))).expect("run 4's file");
    assert_eq!(calls_in(&part4), 1, "the failed run's row, written again");
    receiver.verify_all(&[&secret]);

    // Disabled: refused to run now; every change was audited.
    let (s, b) = env
        .admin_req(reqwest::Method::PATCH, &format!("/v1/export-schedules/{id}"), Some(json!({"enabled": false})))
        .await;
    assert_eq!((s, b["enabled"].as_bool()), (200, Some(false)), "{b}");
    let (s, b) = env.admin_post(&format!("/v1/export-schedules/{id}/run"), json!({})).await;
    assert_eq!((s, b["error"]["meta"]["field"].as_str()), (400, Some("enabled")), "{b}");
    let (s, _) = env.admin_req(reqwest::Method::DELETE, &format!("/v1/export-schedules/{id}"), None).await;
    assert_eq!(s, 204);
    let (s, _) = env.admin_get(&format!("/v1/export-schedules/{id}")).await;
    assert_eq!(s, 404);
    let entries = env
        .audit_when(&pid, 60, "the schedule's audit entries", |e| {
            e.iter().any(|x| x["action"] == "exports:DeleteSchedule")
        })
        .await;
    let of = |action: &str| entries.iter().filter(|x| x["action"] == action).count();
    assert_eq!(of("exports:CreateSchedule"), 1);
    assert_eq!(of("exports:UpdateSchedule"), 7, "four run-nows and three changes");
    assert_eq!(of("exports:RunExport"), 4, "four runs");
    assert!(
        entries.iter().filter(|x| x["action"] == "exports:RunExport").all(|x| x["principal_type"] == "schedule"),
        "{entries:?}"
    );
}
