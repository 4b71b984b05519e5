//! The one error type of this crate.
//!
//! Why it exists: a message that cannot be decoded goes to the DLQ with a
//! reason, so every variant's `Display` is a short, lowercase sentence that
//! says what is wrong with the bytes, fit for a DLQ header or a log field.
//! None of them is transient: decoding is a pure function of the bytes.

/// Why an event could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    /// The message does not start with the single-object marker `0xC3 0x01`.
    #[error("not an avro single-object message: missing the 0xc3 0x01 marker")]
    BadMarker,
    /// The writer schema's fingerprint is not one this release knows.
    #[error("unknown writer schema fingerprint {0:#018x}")]
    UnknownFingerprint(u64),
    /// The bytes do not hold a datum of the writer schema (truncated, trailing
    /// bytes, or a datum that does not resolve to the current schema).
    #[error("malformed avro datum: {0}")]
    Malformed(String),
    /// The datum decoded but a field's value is not a valid usage fact.
    #[error("invalid {field}: {message}")]
    Invalid { field: String, message: String },
    /// A value could not be encoded with the current schema.
    #[error("cannot encode usage event: {0}")]
    Encode(String),
}

impl SchemaError {
    pub(crate) fn invalid(field: &str, message: impl Into<String>) -> Self {
        SchemaError::Invalid { field: field.to_owned(), message: message.into() }
    }

    /// A stable, low-cardinality name for the variant, for metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            SchemaError::BadMarker => "bad_marker",
            SchemaError::UnknownFingerprint(_) => "unknown_fingerprint",
            SchemaError::Malformed(_) => "malformed",
            SchemaError::Invalid { .. } => "invalid",
            SchemaError::Encode(_) => "encode",
        }
    }
}
