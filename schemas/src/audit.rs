//! The audit entry on the wire: `tollgate.AuditEntry`, Avro single-object
//! encoded, on the `tollgate.audit` topic.
//!
//! Why it exists: the audit trail is derived from the log (DESIGN §12), so
//! an entry must outlive the store that first wrote it; a rebuilt store
//! folds it back from these bytes. The framing is that of the usage events
//! (`0xC3 0x01`, the writer schema's fingerprint, the datum), with the
//! audit schema versions of the [`registry`](crate::registry).
//!
//! What it guarantees:
//!
//! - `decode_audit(&encode_audit(&entry)?)? == entry` for every entry whose
//!   time is whole microseconds (what both stores keep).
//! - The writer writes `audit_entry.v2`, whose `project_id` is nullable
//!   (null: an installation-wide entry, a write of prices); the reader
//!   reads v1 and v2 (a v1 record always names its project). A v1 reader
//!   meeting a v2 record reads it unless its `project_id` is null, which it
//!   cannot hold; so, as for every new version, readers (the audit folder)
//!   are deployed before writers (the relay).
//! - The action travels as its string and the detail as its JSON (tagged by
//!   `kind`, as `GET /v1/audit` shows it): a new action or detail kind is
//!   not a schema change. A reader that does not know one refuses the
//!   record with [`SchemaError::Invalid`] naming the field.
//! - Every failure is a [`SchemaError`], permanent: the audit folder
//!   dead-letters the record with its `Display` as the reason.

use chrono::DateTime;
use meter::{AuditAction, AuditDetail, AuditEntry, AuditId, Principal, ProjectId};
use serde::{Deserialize, Serialize};

use crate::SchemaError;
use crate::registry::{audit_schema_version, find_audit_schema};
use crate::single_object::{frame, unframe};

/// One `tollgate.AuditEntry` record, field for field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    pub id: String,
    /// `None` for an installation-wide entry.
    pub project_id: Option<String>,
    pub action: String,
    pub principal_type: Option<String>,
    pub principal_id: Option<String>,
    pub resource: String,
    /// [`AuditDetail`] as JSON text.
    pub detail: String,
    /// Microseconds since the Unix epoch (`timestamp-micros`).
    pub created_at: i64,
}

impl AuditRecord {
    /// The record of an entry (its time truncated to the microsecond).
    pub fn of(entry: &AuditEntry) -> Result<AuditRecord, SchemaError> {
        let detail = serde_json::to_string(&entry.detail).map_err(|e| SchemaError::Encode(e.to_string()))?;
        Ok(AuditRecord {
            id: entry.id.to_string(),
            project_id: entry.project_id.as_ref().map(ToString::to_string),
            action: entry.action.as_str().to_owned(),
            principal_type: entry.principal.as_ref().map(|p| p.kind.clone()),
            principal_id: entry.principal.as_ref().map(|p| p.id.clone()),
            resource: entry.resource.clone(),
            detail,
            created_at: entry.created_at.timestamp_micros(),
        })
    }
}

impl TryFrom<AuditRecord> for AuditEntry {
    type Error = SchemaError;

    fn try_from(r: AuditRecord) -> Result<AuditEntry, SchemaError> {
        let principal = match (r.principal_type, r.principal_id) {
            (Some(kind), Some(id)) => Some(Principal { kind, id }),
            (None, None) => None,
            _ => return Err(SchemaError::invalid("principal_id", "principal_type and principal_id go together")),
        };
        Ok(AuditEntry {
            id: AuditId::parse(r.id).map_err(|e| SchemaError::invalid("id", e.to_string()))?,
            project_id: r
                .project_id
                .map(ProjectId::parse)
                .transpose()
                .map_err(|e| SchemaError::invalid("project_id", e.to_string()))?,
            action: r.action.parse::<AuditAction>().map_err(|e| SchemaError::invalid("action", e.to_string()))?,
            principal,
            resource: r.resource,
            detail: serde_json::from_str::<AuditDetail>(&r.detail)
                .map_err(|e| SchemaError::invalid("detail", e.to_string()))?,
            created_at: DateTime::from_timestamp_micros(r.created_at)
                .ok_or_else(|| SchemaError::invalid("created_at", format!("{} is out of range", r.created_at)))?,
        })
    }
}

/// Encodes an audit entry with the current audit schema, framed as a single object.
///
/// # Errors
///
/// [`SchemaError::Encode`] if the entry does not fit the schema (a bug, not
/// a property of the entry).
pub fn encode_audit(entry: &AuditEntry) -> Result<Vec<u8>, SchemaError> {
    frame(audit_schema_version(), AuditRecord::of(entry)?)
}

/// Decodes a single-object audit entry of any known audit schema version.
///
/// # Errors
///
/// As [`decode_usage`](crate::decode_usage): bad framing, an unknown
/// fingerprint, a malformed datum, or (with the field) a value that is not
/// a valid entry. All permanent.
pub fn decode_audit(bytes: &[u8]) -> Result<AuditEntry, SchemaError> {
    let record: AuditRecord =
        unframe(bytes, find_audit_schema, audit_schema_version(), ("audit schema", "audit entry"))?;
    AuditEntry::try_from(record)
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};
    use meter::correction::CorrectedQuantities;
    use meter::{Metric, MonitorBreach, QuotaId, WindowKind};

    use super::*;
    use crate::single_object::{MARKER, split_header};

    fn at() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-07-07T12:31:10.123456Z").expect("ts").with_timezone(&Utc)
    }

    fn entries() -> Vec<AuditEntry> {
        let breach = MonitorBreach {
            quota_id: QuotaId::parse("quota_1").expect("id"),
            project_id: ProjectId::parse("proj_1").expect("id"),
            metric: Metric::Calls,
            meter_type: None,
            window: WindowKind::Day,
            window_key: "2026-07-07".into(),
            limit: 5,
            observed_value: 6,
        };
        let mut change = breach.entry(AuditId::parse("aud_2").expect("id"), at());
        change.action = AuditAction::DeleteQuota;
        change.principal = Some(Principal::new("admin", "cli"));
        change.detail = AuditDetail::QuotaChange { before: None, after: None };
        let none = CorrectedQuantities { voided: false, rows: 3, tokens: 0, token_entries: vec![] };
        let correction = AuditEntry {
            id: AuditId::parse("aud_3").expect("id"),
            action: AuditAction::CorrectEvent,
            resource: "e1".into(),
            detail: AuditDetail::EventCorrection {
                original_id: "e1".into(),
                correction_id: "x1".into(),
                original_kind: "call".into(),
                void: true,
                before: none.clone(),
                after: CorrectedQuantities { voided: true, ..none },
            },
            ..breach.entry(AuditId::parse("aud_3").expect("id"), at())
        };
        let key = AuditEntry {
            id: AuditId::parse("aud_4").expect("id"),
            action: AuditAction::DeleteApiKey,
            principal: Some(Principal::new("admin", "admin_token")),
            resource: "key_1".into(),
            detail: AuditDetail::ApiKeyChange {
                before: Some(meter::KeyView {
                    name: "ci".into(),
                    prefix: "tg_abcdefg".into(),
                    role_id: None,
                    grants: meter::Grants::default(),
                }),
                after: None,
            },
            ..breach.entry(AuditId::parse("aud_4").expect("id"), at())
        };
        let prices = meter::price_change(
            AuditId::parse("aud_5").expect("id"),
            &meter::PriceBook::default(),
            &[meter::Price {
                key: meter::PriceKey {
                    provider: "openai".into(),
                    model: "gpt-4o".into(),
                    component: meter::Component::InputTokens,
                },
                unit_price_usd: meter::Usd::parse("0.0000025").expect("usd"),
                effective_from: at(),
            }],
            &Principal::new("admin", "admin_token"),
            at(),
        )
        .expect("an entry");
        vec![breach.entry(AuditId::parse("aud_1").expect("id"), at()), change, correction, key, prices]
    }

    #[test]
    fn an_entry_round_trips_framed_with_the_audit_fingerprint() {
        for e in entries() {
            let bytes = encode_audit(&e).expect("encode");
            assert_eq!(bytes[..2], MARKER);
            let (fp, _) = split_header(&bytes).expect("header");
            assert_eq!(fp, audit_schema_version().fingerprint);
            assert_eq!(decode_audit(&bytes).expect("decode"), e);
        }
    }

    #[test]
    fn a_usage_event_or_bad_bytes_are_not_an_audit_entry() {
        assert_eq!(decode_audit(b"{}"), Err(SchemaError::BadMarker));
        let mut bytes = encode_audit(&entries()[0]).expect("encode");
        bytes.push(0);
        assert!(matches!(decode_audit(&bytes), Err(SchemaError::Malformed(m)) if m.contains("trailing")));
        let usage = crate::usage_schema_version().fingerprint;
        let mut framed = MARKER.to_vec();
        framed.extend_from_slice(&usage.to_le_bytes());
        assert_eq!(decode_audit(&framed), Err(SchemaError::UnknownFingerprint(usage)));
    }

    #[test]
    fn an_unknown_action_or_detail_is_refused_naming_the_field() {
        let mut r = AuditRecord::of(&entries()[0]).expect("record");
        r.action = "quotas:Teleport".into();
        assert!(
            matches!(AuditEntry::try_from(r.clone()), Err(SchemaError::Invalid { field, .. }) if field == "action")
        );
        r.action = "quotas:MonitorBreach".into();
        r.detail = r#"{"kind":"nope"}"#.into();
        assert!(
            matches!(AuditEntry::try_from(r.clone()), Err(SchemaError::Invalid { field, .. }) if field == "detail")
        );
        r.detail = AuditRecord::of(&entries()[0]).expect("record").detail;
        r.principal_type = Some("admin".into());
        assert!(matches!(AuditEntry::try_from(r), Err(SchemaError::Invalid { field, .. }) if field == "principal_id"));
    }

    #[test]
    fn an_installation_wide_entry_travels_with_a_null_project() {
        let e = entries().pop().expect("the price change");
        assert_eq!(e.project_id, None);
        assert_eq!(AuditRecord::of(&e).expect("record").project_id, None);
        assert_eq!(decode_audit(&encode_audit(&e).expect("encode")).expect("decode"), e);
        let mut r = AuditRecord::of(&e).expect("record");
        r.project_id = Some("has space".into());
        assert!(matches!(AuditEntry::try_from(r), Err(SchemaError::Invalid { field, .. }) if field == "project_id"));
    }

    #[test]
    fn v2_is_frozen_and_current() {
        // Computed once with the specification's algorithm (CRC-64-AVRO of
        // the Parsing Canonical Form below), independently of this crate.
        // If this fails, audit_entry.v2.avsc was edited: restore it and add a v3.
        let v2 = &crate::registry::audit_schema_versions()[1];
        assert_eq!(
            v2.canonical_form,
            r#"{"name":"tollgate.AuditEntry","type":"record","fields":[{"name":"id","type":"string"},{"name":"project_id","type":["null","string"]},{"name":"action","type":"string"},{"name":"principal_type","type":["null","string"]},{"name":"principal_id","type":["null","string"]},{"name":"resource","type":"string"},{"name":"detail","type":"string"},{"name":"created_at","type":"long"}]}"#
        );
        assert_eq!(v2.fingerprint, 0x97e6_d16c_00c2_9024);
        assert_eq!(audit_schema_version().version, 2, "the writer writes v2");
    }

    #[test]
    fn v1_is_frozen() {
        // Computed once with the specification's algorithm (CRC-64-AVRO of
        // the Parsing Canonical Form below), independently of this crate.
        // If this fails, audit_entry.v1.avsc was edited: restore it and add a v2.
        let v1 = &crate::registry::audit_schema_versions()[0];
        assert_eq!(
            v1.canonical_form,
            r#"{"name":"tollgate.AuditEntry","type":"record","fields":[{"name":"id","type":"string"},{"name":"project_id","type":"string"},{"name":"action","type":"string"},{"name":"principal_type","type":["null","string"]},{"name":"principal_id","type":["null","string"]},{"name":"resource","type":"string"},{"name":"detail","type":"string"},{"name":"created_at","type":"long"}]}"#
        );
        assert_eq!(v1.fingerprint, 0x1917_1631_adad_8b95);
    }
}
