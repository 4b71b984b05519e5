//! # schemas — Tollgate's events on the wire
//!
//! Why this crate exists: the log is the source of truth, so the bytes on it
//! must outlive the code that wrote them. Everything that knows the byte
//! layout of an event lives here, nowhere else; `meter` stays free of Avro,
//! and the gateway and projector only call [`encode_usage`] and
//! [`decode_usage`].
//!
//! What it guarantees:
//!
//! - Events are Avro records (`avro/usage_event.v*.avsc`), framed with Avro
//!   [single-object encoding]: `0xC3 0x01`, the 8-byte little-endian
//!   CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form,
//!   then the Avro binary datum. The fingerprint follows the specification
//!   (see [`registry`]), so any Avro implementation can find the schema.
//! - [`decode_usage`] reads every schema version this crate has ever shipped
//!   and resolves it to the current one; the golden vectors in `golden/`
//!   and the compatibility tests keep that true.
//! - `decode_usage(&encode_usage(&fact)?)? == fact` for every valid fact
//!   (times are kept to the microsecond; a property test checks this).
//! - Every failure is a [`SchemaError`], permanent by nature: the same bytes
//!   fail the same way on every attempt, so the caller dead-letters them with
//!   the error's `Display` as the reason and never retries.
//!
//! [single-object encoding]: https://avro.apache.org/docs/current/specification/#single-object-encoding

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod audit;
pub mod error;
pub mod event;
pub mod registry;
pub mod single_object;

pub use audit::{AuditRecord, decode_audit, encode_audit};
pub use error::SchemaError;
pub use event::{HeldCounter, QuotaBreach, TokenUsage, UsageEvent};
pub use registry::{
    SchemaVersion, audit_schema_version, audit_schema_versions, find_audit_schema, find_usage_schema, usage_schema,
    usage_schema_version, usage_schema_versions,
};
pub use single_object::{decode_event, decode_event_via_value, decode_usage, encode_event, encode_usage};
