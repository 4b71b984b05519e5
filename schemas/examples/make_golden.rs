//! Writes the golden vectors of the current usage schema version:
//! `golden/usage_event.v<N>.<name>.bin` and their expected decoded facts in
//! `golden/usage_event.v<N>.json`.
//!
//! Golden vectors are written once per schema version and then never
//! changed: they are what old writers put on the log, and
//! `tests/golden.rs` checks that the current code still decodes them. So
//! this refuses to overwrite anything; run it after adding a new version:
//!
//! ```text
//! cargo run -p schemas --example make_golden
//! ```

use std::error::Error;
use std::fs;
use std::path::Path;

use chrono::{DateTime, Utc};
use meter::{
    ApiKeyId, Counter, CounterKey, Dimension, EventId, EventKind, LoggedBreach, MeterType, Outcome, ProjectId, QuotaId,
    ReservationId, TokenUsage, UsageFact, WindowKind,
};
use schemas::{encode_usage, usage_schema_version};

fn main() -> Result<(), Box<dyn Error>> {
    let version = usage_schema_version().version;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden");
    fs::create_dir_all(&dir)?;
    let json_path = dir.join(format!("usage_event.v{version}.json"));
    if json_path.exists() {
        println!("{} exists; golden vectors are never rewritten", json_path.display());
        return Ok(());
    }
    let mut expected = Vec::new();
    for (name, fact) in facts()? {
        let file = format!("usage_event.v{version}.{name}.bin");
        let path = dir.join(&file);
        if path.exists() {
            return Err(format!("{} exists without {}", path.display(), json_path.display()).into());
        }
        fs::write(&path, encode_usage(&fact)?)?;
        println!("wrote {}", path.display());
        expected.push(serde_json::json!({ "file": file, "fact": fact }));
    }
    fs::write(&json_path, serde_json::to_string_pretty(&expected)? + "\n")?;
    println!("wrote {}", json_path.display());
    Ok(())
}

fn at(s: &str) -> Result<DateTime<Utc>, Box<dyn Error>> {
    Ok(DateTime::parse_from_rfc3339(s)?.with_timezone(&Utc))
}

fn facts() -> Result<Vec<(&'static str, UsageFact)>, Box<dyn Error>> {
    let base = UsageFact {
        id: EventId::parse("evt_01J9Z3Q8R2")?,
        project_id: ProjectId::parse("proj_acme")?,
        api_key_id: Some(ApiKeyId::parse("key_live_7f3a")?),
        agent_id: None,
        actor_id: None,
        user_id: None,
        tokens: Vec::new(),
        storage_bytes: None,
        meter_type: None,
        occurred_at: at("2026-03-01T09:15:30.123456Z")?,
        kind: EventKind::Request,
        outcome: Outcome::Success,
        rows: 0,
        reservation_id: None,
        gateway: "gw-eu-1".into(),
        // Version 3: the gateway stamps every event it accepts.
        received_at: Some(at("2026-03-01T09:15:30.200001Z")?),
        ..UsageFact::new(
            EventId::parse("evt_01J9Z3Q8R2")?,
            ProjectId::parse("proj_acme")?,
            EventKind::Request,
            at("2026-03-01T09:15:30.123456Z")?,
        )
    };
    Ok(vec![
        ("request", base.clone()),
        (
            "call_success",
            UsageFact {
                id: EventId::parse("evt_01J9Z3Q8R3")?,
                occurred_at: at("2026-03-01T09:15:30.481002Z")?,
                kind: EventKind::Call,
                rows: 42,
                reservation_id: Some(ReservationId::parse("rsv:proj_acme:0001")?),
                ..base.clone()
            },
        ),
        (
            "call_failure",
            UsageFact {
                id: EventId::parse("evt_01J9Z3Q8R4")?,
                occurred_at: at("2026-03-01T23:59:59.999999Z")?,
                kind: EventKind::Call,
                outcome: Outcome::Failure,
                reservation_id: Some(ReservationId::parse("rsv:proj_acme:0002")?),
                ..base.clone()
            },
        ),
        (
            "actor_agent",
            UsageFact {
                id: EventId::parse("evt_01J9Z3Q8R5")?,
                api_key_id: None,
                agent_id: Some("support-bot/2.1".into()),
                actor_id: Some("user:8812 (Zoë)".into()),
                occurred_at: at("2025-12-31T23:00:00Z")?,
                kind: EventKind::Call,
                rows: 3,
                gateway: "gw-us-2".into(),
                ..base.clone()
            },
        ),
        // Version 2: tokens, storage and signed-in users.
        (
            "tokens",
            UsageFact {
                id: EventId::parse("evt_01J9Z3Q8R6")?,
                api_key_id: None,
                agent_id: Some("support-bot".into()),
                actor_id: Some("cust_42".into()),
                kind: EventKind::Tokens,
                tokens: vec![
                    TokenUsage {
                        provider: "openai".into(),
                        model: "gpt-4o".into(),
                        input: 1200,
                        output: 350,
                        cached: 800,
                        reasoning: 120,
                        embedding: false,
                    },
                    TokenUsage {
                        provider: "openai".into(),
                        model: "text-embedding-3-small".into(),
                        input: 5000,
                        embedding: true,
                        ..TokenUsage::default()
                    },
                ],
                ..base.clone()
            },
        ),
        (
            "compute_meter",
            UsageFact {
                id: EventId::parse("evt_01J9Z3Q8R7")?,
                kind: EventKind::Tokens,
                meter_type: Some(MeterType::ComputeExecution),
                tokens: vec![TokenUsage {
                    provider: "tollgate".into(),
                    model: "sandbox-s".into(),
                    input: 30,
                    ..TokenUsage::default()
                }],
                ..base.clone()
            },
        ),
        (
            "storage_delta",
            UsageFact {
                id: EventId::parse("evt_01J9Z3Q8R8")?,
                kind: EventKind::StorageDelta,
                storage_bytes: Some(-4096),
                ..base.clone()
            },
        ),
        (
            "storage_snapshot",
            UsageFact {
                id: EventId::parse("evt_01J9Z3Q8R9")?,
                kind: EventKind::StorageSnapshot,
                storage_bytes: Some(5_241_041_920),
                ..base.clone()
            },
        ),
        (
            "user_call",
            UsageFact {
                id: EventId::parse("evt_01J9Z3Q8RA")?,
                api_key_id: None,
                user_id: Some("user:alice".into()),
                kind: EventKind::Call,
                rows: 7,
                ..base.clone()
            },
        ),
        // Version 3: what a check decided, and corrections.
        (
            "request_admitted",
            UsageFact {
                id: EventId::parse("req_01J9Z3Q8RB")?,
                reservation_id: Some(ReservationId::parse("res_01J9Z3Q8RB")?),
                admitted: Some(true),
                lease_until: Some(at("2026-03-01T09:16:30.123456Z")?),
                held: vec![
                    Counter {
                        key: CounterKey {
                            dimension: Dimension::ApiKey(ApiKeyId::parse("key_live_7f3a")?),
                            window: WindowKind::Day,
                            window_key: "2026-03-01".into(),
                        },
                        resets_at: Some(at("2026-03-02T00:00:00Z")?),
                    },
                    Counter {
                        key: CounterKey {
                            dimension: Dimension::Project,
                            window: WindowKind::Rolling1m,
                            window_key: "2026-03-01T09:15Z".into(),
                        },
                        resets_at: Some(at("2026-03-01T09:16:00Z")?),
                    },
                ],
                ..base.clone()
            },
        ),
        (
            "request_refused",
            UsageFact {
                id: EventId::parse("req_01J9Z3Q8RC")?,
                admitted: Some(false),
                breaches: vec![
                    LoggedBreach {
                        quota_id: QuotaId::parse("quota_day_calls")?,
                        window_key: "2026-03-01".into(),
                        limit: 1000,
                        observed: 1001,
                        enforce: true,
                    },
                    LoggedBreach {
                        quota_id: QuotaId::parse("quota_watch_rows")?,
                        window_key: "2026-03".into(),
                        limit: 50_000,
                        observed: 61_200,
                        enforce: false,
                    },
                ],
                ..base.clone()
            },
        ),
        (
            "correction_amend",
            UsageFact {
                id: EventId::parse("fix_01J9Z3Q8RD")?,
                kind: EventKind::Correction,
                corrects: Some(EventId::parse("evt_01J9Z3Q8R3")?),
                rows: 40,
                ..base.clone()
            },
        ),
        (
            "correction_void",
            UsageFact {
                id: EventId::parse("fix_01J9Z3Q8RE")?,
                kind: EventKind::Correction,
                corrects: Some(EventId::parse("evt_01J9Z3Q8R6")?),
                void: true,
                ..base
            },
        ),
    ])
}
