//! Writes the golden vectors of the current usage schema version
//! (`golden/usage_event.v<N>.<name>.bin`, their expected decoded facts in
//! `golden/usage_event.v<N>.json`) and of the current audit entry schema
//! version (`golden/audit_entry.v<N>.<name>.bin`, their expected records in
//! `golden/audit_entry.v<N>.json`).
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
use meter::correction::CorrectedQuantities;
use meter::{
    ApiKeyId, AuditAction, AuditDetail, AuditEntry, AuditId, Component, Counter, CounterKey, Dimension, Estimate,
    EventId, EventKind, Grants, KeyView, LoggedBreach, MeterType, Metric, MonitorBreach, Outcome, Price, PriceBook,
    PriceKey, Principal, ProjectId, QuotaId, ReservationId, TokenUsage, UsageFact, Usd, WindowKind,
};
use schemas::{AuditRecord, audit_schema_version, encode_audit, encode_usage, usage_schema_version};
use serde::Serialize;

fn main() -> Result<(), Box<dyn Error>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden");
    fs::create_dir_all(&dir)?;
    let usage = facts()?
        .into_iter()
        .map(|(name, fact)| Ok((name, encode_usage(&fact)?, fact)))
        .collect::<Result<_, Box<dyn Error>>>()?;
    write(&dir, "usage_event", usage_schema_version().version, "fact", usage)?;
    let audit = audit_entries()?
        .into_iter()
        .map(|(name, entry)| Ok((name, encode_audit(&entry)?, AuditRecord::of(&entry)?)))
        .collect::<Result<_, Box<dyn Error>>>()?;
    write(&dir, "audit_entry", audit_schema_version().version, "record", audit)
}

/// Writes `<schema>.v<version>.<name>.bin` of each vector and
/// `<schema>.v<version>.json` listing them with what each decodes to (under
/// `what`), unless that version's vectors exist.
fn write<T: Serialize>(
    dir: &Path,
    schema: &str,
    version: u32,
    what: &str,
    vectors: Vec<(&'static str, Vec<u8>, T)>,
) -> Result<(), Box<dyn Error>> {
    let json_path = dir.join(format!("{schema}.v{version}.json"));
    if json_path.exists() {
        println!("{} exists; golden vectors are never rewritten", json_path.display());
        return Ok(());
    }
    let mut expected = Vec::new();
    for (name, bytes, decoded) in vectors {
        let file = format!("{schema}.v{version}.{name}.bin");
        let path = dir.join(&file);
        if path.exists() {
            return Err(format!("{} exists without {}", path.display(), json_path.display()).into());
        }
        fs::write(&path, bytes)?;
        println!("wrote {}", path.display());
        expected.push(serde_json::json!({ "file": file, what: decoded }));
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
    // Version 4: the reservation of an admitted request holds the check's
    // estimate on each held counter besides one call.
    let held = vec![
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
    ];
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
                held: held.clone(),
                // 4096 tokens at $0.000003: $0.012288 in picodollars.
                estimate: Estimate { tokens: 4096, cost: 12_288_000_000 },
                ..base.clone()
            },
        ),
        (
            // Only a tokens quota reserved: the cost component stays null.
            "request_estimated_tokens",
            UsageFact {
                id: EventId::parse("req_01J9Z3Q8RF")?,
                reservation_id: Some(ReservationId::parse("res_01J9Z3Q8RF")?),
                admitted: Some(true),
                lease_until: Some(at("2026-03-01T09:16:30.123456Z")?),
                held,
                estimate: Estimate { tokens: 1000, cost: 0 },
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

fn audit_entries() -> Result<Vec<(&'static str, AuditEntry)>, Box<dyn Error>> {
    let made = at("2026-03-01T09:15:31.000123Z")?;
    let project = ProjectId::parse("proj_acme")?;
    let breach = MonitorBreach {
        quota_id: QuotaId::parse("quota_watch_rows")?,
        project_id: project.clone(),
        metric: Metric::Rows,
        meter_type: None,
        window: WindowKind::CalendarMonth,
        window_key: "2026-03".into(),
        limit: 50_000,
        observed_value: 61_200,
    }
    .entry(AuditId::parse("aud_0195f1c2a0017000a000000000000001")?, made);
    let key = meter::audit::admin_change(
        AuditId::parse("aud_0195f1c2a0017000a000000000000002")?,
        &project,
        AuditAction::CreateApiKey,
        "key_live_7f3a",
        AuditDetail::ApiKeyChange {
            before: None,
            after: Some(KeyView {
                name: "ci (Zoë)".into(),
                prefix: "tg_abcdefg".into(),
                role_id: None,
                grants: Grants { max_concurrent: Some(4), query_timeout: None, max_rows: Some(10_000) },
            }),
        },
        &Principal::new("admin", "admin_token"),
        made,
    );
    let counted = CorrectedQuantities { voided: false, rows: 42, tokens: 0, token_entries: vec![] };
    let correction = AuditEntry {
        id: AuditId::parse("aud_0195f1c2a0017000a000000000000003")?,
        action: AuditAction::CorrectEvent,
        principal: None,
        resource: "evt_01J9Z3Q8R3".into(),
        detail: AuditDetail::EventCorrection {
            original_id: "evt_01J9Z3Q8R3".into(),
            correction_id: "fix_01J9Z3Q8RD".into(),
            original_kind: "call".into(),
            void: false,
            before: counted.clone(),
            after: CorrectedQuantities { rows: 40, ..counted },
        },
        ..breach.clone()
    };
    // Version 2: installation-wide entries (no project): a write of prices.
    let prices = meter::price_change(
        AuditId::parse("aud_0195f1c2a0017000a000000000000004")?,
        &PriceBook::new([Price {
            key: PriceKey { provider: "openai".into(), model: "gpt-4o".into(), component: Component::InputTokens },
            unit_price_usd: Usd::parse("0.0000025")?,
            effective_from: at("2026-01-01T00:00:00Z")?,
        }]),
        &[
            Price {
                key: PriceKey { provider: "openai".into(), model: "gpt-4o".into(), component: Component::InputTokens },
                unit_price_usd: Usd::parse("0.000003")?,
                effective_from: at("2026-03-01T00:00:00Z")?,
            },
            Price {
                key: PriceKey { provider: "openai".into(), model: "gpt-4o".into(), component: Component::OutputTokens },
                unit_price_usd: Usd::parse("0.00001")?,
                effective_from: at("2026-03-01T00:00:00Z")?,
            },
        ],
        &Principal::new("admin", "admin_token"),
        made,
    )
    .ok_or("a write of rows is an entry")?;
    Ok(vec![("monitor_breach", breach), ("key_created", key), ("correction", correction), ("price_change", prices)])
}
