//! Explained verdicts: a check with `"explain": true` answers every quota
//! limit it evaluated — the usage split into durable, settled and reserved,
//! the limit, the need, the verdict and which one a refusal reports — from
//! the same step the verdict came from; a refusal's `error` is unchanged,
//! the explanation beside it; without `explain` nothing is added.

use serde_json::{Value, json};

use crate::harness::*;

#[tokio::test]
async fn a_check_explains_every_limit_it_evaluated() {
    explained(Mode::Distributed).await;
}

#[tokio::test]
async fn a_check_explains_every_limit_it_evaluated_dev() {
    explained(Mode::Dev).await;
}

async fn explain_check(env: &Env, secret: &str, explain: bool) -> (u16, Value) {
    let r = check(&env.http, env.gw(), secret, json!({"explain": explain})).await;
    let s = r.status().as_u16();
    (s, r.json().await.expect("json body"))
}

/// The explanation's entry of one quota.
fn entry<'a>(body: &'a Value, quota: &str) -> &'a Value {
    body["explain"]
        .as_array()
        .and_then(|l| l.iter().find(|e| e["quota_id"] == quota))
        .unwrap_or_else(|| panic!("{quota} explained: {body}"))
}

/// durable + settled + reserved, and reserved.
fn split(e: &Value) -> (i64, u64) {
    let n = |f: &str| e[f].as_i64().unwrap_or_else(|| panic!("{f}: {e}"));
    (n("durable") + n("settled") + n("reserved"), e["reserved"].as_u64().expect("reserved"))
}

async fn explained(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    if mode == Mode::Distributed {
        env.start_projector();
    }
    let (pid, kid, secret) = env.project_with_key(safe_timezone()).await;
    let enforce = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day", "limit": 3}))
        .await;
    let watch = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 1, "mode": "monitor"}))
        .await;

    // First call: nothing used.
    let (s, a) = explain_check(&env, &secret, true).await;
    assert_eq!(s, 200, "{a}");
    let e = entry(&a, &enforce);
    assert_eq!(
        (e["scope"].clone(), e["scope_ref"].clone(), e["metric"].clone(), e["kind"].clone(), e["window"].clone()),
        (json!("api_key"), json!(kid), json!("calls"), json!("cap"), json!("day")),
        "{e}"
    );
    assert!(e["window_key"].as_str().is_some_and(|k| k.len() == 10), "{e}");
    assert_eq!((e["used"].clone(), e["limit"].clone(), e["need"].clone()), (json!(0), json!(3), json!(1)), "{e}");
    assert_eq!((e["verdict"].clone(), e["reported"].clone()), (json!("within"), json!(false)), "{e}");

    // Second: the first's reservation is reserved (a monitor quota holds
    // no reservation: it counts calls once they settle).
    let (s, b) = explain_check(&env, &secret, true).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(split(entry(&b, &enforce)), (1, 1), "{b}");
    assert_eq!(entry(&b, &enforce)["used"], 1, "{b}");
    assert_eq!(
        (entry(&b, &watch)["used"].clone(), entry(&b, &watch)["verdict"].clone()),
        (json!(0), json!("within")),
        "{b}"
    );

    // The first settles: durable or settled (as far as the fold has come), not reserved.
    let first = a["reservation_id"].as_str().expect("reservation");
    let (s, r) = post_events(&env.http, env.gw(), vec![call_event("x-1", &pid, &kid, Some(first), 0)]).await;
    assert_eq!(s, 202, "{r}");
    let (s, c) = explain_check(&env, &secret, true).await;
    assert_eq!(s, 200, "{c}");
    let e = entry(&c, &enforce);
    assert_eq!((split(e), e["used"].clone()), ((2, 1), json!(2)), "one settled, one reserved: {c}");
    let w = entry(&c, &watch);
    assert_eq!((split(w), w["verdict"].clone()), ((1, 0), json!("over")), "the monitor quota is over and admits: {c}");

    // The fourth is refused: the error is the one a check without explain
    // gets, and the explanation names the limit it reports.
    let (s, d) = explain_check(&env, &secret, true).await;
    assert_eq!(s, 429, "{d}");
    assert_eq!(d["error"]["code"], "QUOTA_EXCEEDED", "{d}");
    assert_eq!(d["error"]["meta"]["quota_id"], json!(enforce), "{d}");
    let e = entry(&d, &enforce);
    assert_eq!(
        (e["verdict"].clone(), e["reported"].clone(), e["used"].clone()),
        (json!("refused"), json!(true), json!(3)),
        "{d}"
    );
    assert_eq!(entry(&d, &watch)["reported"], false, "{d}");

    // Without explain, nothing is added to either answer.
    let (s, plain) = explain_check(&env, &secret, false).await;
    assert_eq!(s, 429, "{plain}");
    assert!(plain.get("explain").is_none(), "{plain}");
    assert_eq!(plain["error"], d["error"], "the refusal's error is unchanged");
}
