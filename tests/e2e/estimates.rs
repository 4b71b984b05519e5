//! Estimates (issue 12 item 7, DESIGN §14): a check that names what its
//! generation will use reserves it on the caller's tokens and cost quotas,
//! as a call reserves its slot on `calls`, so concurrent generations pass a
//! cap only by the error of their estimates, not by their number. Over two
//! gateway processes on one Redis view.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::Utc;
use rand::Rng;
use serde_json::{Value, json};
use tokio::sync::Barrier;

use crate::harness::*;

/// What every generation of these tests uses: 600 input and 400 output
/// tokens of one model, 1,000 billable tokens.
fn generation() -> Value {
    json!([{"provider": "openai", "model": "gpt-est", "input": 600, "output": 400}])
}

fn tokens_event(id: &str, project: &str, key: &str, reservation: &str) -> Value {
    json!({
        "id": id, "type": "tokens", "project_id": project, "api_key_id": key,
        "occurred_at": Utc::now().to_rfc3339(), "reservation_id": reservation, "tokens": generation(),
    })
}

/// `clients` generations at once, spread over the gateways: each checks
/// with `estimate` (none when null), holds a random time in `hold` (ms) as
/// a model would, then
/// settles its reservation with the tokens it used; a refused one tries
/// again until it has tried `tries` times. All first checks start together.
/// The number admitted.
struct Run {
    estimate: Value,
    clients: usize,
    tries: u32,
    hold: std::ops::RangeInclusive<u64>,
}

async fn generate(env: &Env, secret: &str, pid: &str, kid: &str, run: Run) -> u64 {
    let Run { estimate, clients, tries, hold } = run;
    let admitted = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(clients));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let gw = env.gateways[c % env.gateways.len()].clone();
        let (http, secret, pid, kid) = (env.http.clone(), secret.to_owned(), pid.to_owned(), kid.to_owned());
        let (admitted, start, estimate, hold) = (admitted.clone(), start.clone(), estimate.clone(), hold.clone());
        tasks.push(tokio::spawn(async move {
            let body = if estimate.is_null() { json!({}) } else { json!({ "estimate": estimate }) };
            start.wait().await;
            for attempt in 0..tries {
                let r = check(&http, &gw, &secret, body.clone()).await;
                let status = r.status().as_u16();
                let b: Value = r.json().await.expect("check body");
                match status {
                    200 => {
                        admitted.fetch_add(1, Ordering::SeqCst);
                        let ms = rand::rng().random_range(hold.clone());
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        let rid = b["reservation_id"].as_str().expect("reservation");
                        let ev = tokens_event(&format!("gen-{c}-{attempt}"), &pid, &kid, rid);
                        let (s, body) = post_events(&http, &gw, vec![ev]).await;
                        assert_eq!(s, 202, "settle: {body}");
                        return;
                    }
                    429 => {
                        assert_eq!(b["error"]["code"], "QUOTA_EXCEEDED", "{b}");
                        tokio::time::sleep(Duration::from_millis(15)).await;
                    }
                    other => panic!("unexpected status {other}: {b}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    admitted.load(Ordering::SeqCst)
}

/// A project, a key, and an enforce quota on it; (project, key id, secret, quota).
async fn setup(env: &Env, metric: &str, limit: Value) -> (String, String, String, String) {
    let (pid, kid, secret) = env.project_with_key(safe_timezone()).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": metric, "window": "day", "limit": limit}))
        .await;
    (pid, kid, secret, qid)
}

async fn current_usage(env: &Env, qid: &str) -> Value {
    let (s, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(s, 200, "{q}");
    q["current_usage"]["count"].clone()
}

/// 32 generations of exactly 1,000 tokens against a cap of 10,000, each
/// estimating exactly what it uses: no more than 10 are admitted, however
/// many run at once, and (the refused ones retrying) exactly 10 are; the
/// quota ends at the cap, not past it. Then the same 32 without an
/// estimate, all checking at once and holding 300–400 ms: the reference's
/// bound, a generation per check in flight, is all that holds: every one
/// that checked before any settled is admitted, and the usage passes the
/// cap by their tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_generations_with_exact_estimates_never_pass_a_tokens_cap() {
    tokens_cap(Mode::Distributed).await;
}

/// The same in one `tollgate dev` process (the in-memory view).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_generations_with_exact_estimates_never_pass_a_tokens_cap_dev() {
    tokens_cap(Mode::Dev).await;
}

async fn tokens_cap(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    if mode == Mode::Distributed {
        env.start_gateway().await;
    }
    let (pid, kid, secret, qid) = setup(&env, "tokens", json!(10_000)).await;

    let admitted = generate(
        &env,
        &secret,
        &pid,
        &kid,
        Run { estimate: json!({"tokens": 1000}), clients: 32, tries: 200, hold: 20..=80 },
    )
    .await;
    assert_eq!(admitted, 10, "a cap of 10,000 holds ten generations of 1,000, over two gateways");
    assert_eq!(current_usage(&env, &qid).await, json!(10_000), "the estimates were replaced by the actual tokens");
    // Full: a further estimate is refused, and explained as such.
    let r = check(&env.http, env.gw(), &secret, json!({"estimate": {"tokens": 1}, "explain": true})).await;
    assert_eq!(r.status().as_u16(), 429);
    let b: Value = r.json().await.expect("body");
    let e = &b["explain"][0];
    assert_eq!(
        (e["used"].clone(), e["need"].clone(), e["verdict"].clone()),
        (json!(10_000), json!(1), json!("refused")),
        "{b}"
    );

    // Without estimates, 32 at once on a fresh cap.
    let (pid, kid, secret, qid) = setup(&env, "tokens", json!(10_000)).await;
    let admitted =
        generate(&env, &secret, &pid, &kid, Run { estimate: Value::Null, clients: 32, tries: 1, hold: 300..=400 })
            .await;
    let used = current_usage(&env, &qid).await.as_u64().expect("count");
    assert_eq!(used, admitted * 1000, "each admitted generation's tokens");
    assert!(admitted > 10, "without an estimate the cap is passed by the generations in flight ({admitted} admitted)");
    assert!(used < 10_000 + 32 * 1000, "by at most one generation per check in flight: {used}");
}

/// An estimate given as token counts per model is priced from the price
/// book: with $0.001 an input token and $0.002 an output one, a generation
/// costs $1.40, and a `cost_usd` cap of $7 admits five of 16 at once. A
/// lease that lapses frees its estimate: a check that is never settled
/// holds its $1.40 only until its lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_per_model_estimate_is_priced_and_reserved_on_a_cost_cap() {
    let Some(mut env) = Env::new().await else { return };
    env.extra_env.push(("TOLLGATE_LEASE".into(), "3s".into()));
    env.start_gateway().await;
    env.start_gateway().await;
    let price = |component: &str, usd: &str| {
        json!({"provider": "openai", "model": "gpt-est", "component": component, "unit_price_usd": usd,
               "effective_from": "2020-01-01T00:00:00Z"})
    };
    let (s, b) = env
        .admin_req(
            reqwest::Method::PUT,
            "/v1/prices",
            Some(json!({"prices": [price("input_tokens", "0.001"), price("output_tokens", "0.002")]})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    let (pid, kid, secret, qid) = setup(&env, "cost_usd", json!("7")).await;

    let admitted = generate(
        &env,
        &secret,
        &pid,
        &kid,
        Run { estimate: json!({"models": generation()}), clients: 16, tries: 200, hold: 20..=80 },
    )
    .await;
    assert_eq!(admitted, 5, "$7 holds five generations of $1.40");
    assert_eq!(current_usage(&env, &qid).await, json!("7"), "five settled at their actual cost");

    // A fresh cap of $2: one estimate held and never settled refuses a second
    // until its lease (3 s) lapses.
    let (_, _, secret, qid) = setup(&env, "cost_usd", json!("2")).await;
    let est = json!({"estimate": {"models": generation()}});
    let r = check(&env.http, env.gw(), &secret, est.clone()).await;
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(current_usage(&env, &qid).await, json!("1.4"), "the held estimate is in the quota's usage");
    let r = check(&env.http, &env.gateways[1], &secret, est.clone()).await;
    assert_eq!(r.status().as_u16(), 429, "$1.40 held + $1.40 > $2, on the other gateway too");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let r = check(&env.http, &env.gateways[1], &secret, est).await;
    assert_eq!(r.status().as_u16(), 200, "the lapsed lease freed its estimate");
}

/// A bad estimate is a 400 naming the field, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_estimate_is_refused_naming_the_field() {
    let Some(mut env) = Env::new().await else { return };
    env.start_gateway().await;
    let (_, _, secret, qid) = setup(&env, "tokens", json!(10)).await;
    for (estimate, field) in [
        (json!({"tokens": -1}), "estimate.tokens"),
        (json!({"tokens": 0}), "estimate.tokens"),
        (json!({"cost_usd": "-1"}), "estimate.cost_usd"),
        (json!({"cost_usd": "0.0000000000001"}), "estimate.cost_usd"),
        (json!({"tokens": 5, "models": generation()}), "estimate.models"),
        (json!({"models": []}), "estimate.models"),
        (json!({"models": [{"model": "m", "input": 1}]}), "estimate.models[0].provider"),
        (
            json!({"models": [{"provider": "p", "model": "m", "input": 9_007_199_254_740_993u64}]}),
            "estimate.models[0].input",
        ),
        (json!({"models": vec![json!({"provider": "p", "model": "m", "input": 1}); 65]}), "estimate.models"),
        (json!({"tokens": 9_007_199_254_740_993u64}), "estimate.tokens"),
        (json!({"calls": 1}), "estimate.calls"),
        (json!("lots"), "estimate"),
    ] {
        let r = check(&env.http, env.gw(), &secret, json!({ "estimate": estimate })).await;
        let status = r.status().as_u16();
        let b: Value = r.json().await.expect("body");
        assert_eq!((status, b["error"]["meta"]["field"].as_str()), (400, Some(field)), "{estimate}: {b}");
    }
    assert_eq!(current_usage(&env, &qid).await, json!(0), "nothing reserved or counted");
}

/// A held estimate is on the log (its check's request event), so a view
/// lost to a `FLUSHALL` holds it again when the next check reseeds it: the
/// reseeded view refuses what the estimate leaves no room for, on the other
/// gateway, and admits what fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_estimate_survives_the_loss_of_the_view() {
    testkit::require!(Postgres, Kafka);
    let redis = testkit::RedisServer::start().await;
    let mut env = Env::with_redis(redis.url()).await;
    env.start_gateway().await;
    env.start_gateway().await;
    let (pid, _, secret, qid) = setup(&env, "tokens", json!(2_000)).await;
    let r = check(&env.http, &env.gateways[0], &secret, json!({"estimate": {"tokens": 1500}})).await;
    assert_eq!(r.status().as_u16(), 200);
    // Its request event reaches the log (published in the background), the
    // estimate with it.
    let on_log = || async {
        crate::invariants::LogAudit::of(&env).await.facts().into_iter().any(|(_, _, f)| {
            f.project_id.as_str() == pid && f.kind == meter::EventKind::Request && f.estimate.tokens == 1500
        })
    };
    env.eventually(30, "the request event with its estimate is on the log", on_log).await;
    let client = redis::Client::open(redis.url()).expect("redis client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect to own redis");
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("flushall");
    let r = check(&env.http, &env.gateways[1], &secret, json!({"estimate": {"tokens": 1000}})).await;
    assert_eq!(r.status().as_u16(), 429, "1,500 held (from the log) + 1,000 > 2,000");
    assert_eq!(current_usage(&env, &qid).await, json!(1_500), "the reseeded view holds the estimate");
    let r = check(&env.http, &env.gateways[1], &secret, json!({"estimate": {"tokens": 500}})).await;
    assert_eq!(r.status().as_u16(), 200, "what fits is admitted");
    drop(env);
    drop(redis);
}
