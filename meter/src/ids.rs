//! Identifiers. Every id that crosses the API is parsed once, here, so the
//! rest of the system can rely on its shape: 1–128 characters of
//! `[A-Za-z0-9_.:-]`. That alphabet keeps ids safe inside Redis keys, Kafka
//! keys and log lines without escaping.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a string is not a valid id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("must not be empty")]
    Empty,
    #[error("must be at most 128 characters")]
    TooLong,
    #[error("may only contain letters, digits, '_', '-', '.' and ':'")]
    BadCharacter,
}

/// Checks the shared id alphabet.
pub fn check_id(s: &str) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty);
    }
    if s.len() > 128 {
        return Err(IdError::TooLong);
    }
    if !s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':')) {
        return Err(IdError::BadCharacter);
    }
    Ok(())
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Parses an id, refusing anything outside the id alphabet.
            pub fn parse(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                check_id(&s)?;
                Ok(Self(s))
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                Self::parse(s)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

id_type!(
    /// A tenant.
    ProjectId
);
id_type!(
    /// An API key (its public id, never its secret).
    ApiKeyId
);
id_type!(
    /// A quota.
    QuotaId
);
id_type!(
    /// A usage event; unique within its project for the dedup horizon.
    EventId
);
id_type!(
    /// A live reservation made by an admitted check.
    ReservationId
);
id_type!(
    /// A role: grants and a quota a key or a signed-in user takes.
    RoleId
);
id_type!(
    /// An audit-log entry; time-ordered, so ordering by id orders by time
    /// and the id of the last entry read is the cursor of the next page.
    AuditId
);

id_type!(
    /// A webhook endpoint.
    WebhookId
);
id_type!(
    /// A notification message: its `webhook-id`, the same on every attempt,
    /// resend and replay.
    MessageId
);
id_type!(
    /// A concurrency permit (a slot of a caller's `max_concurrent`).
    PermitId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_accept_the_alphabet_and_refuse_the_rest() {
        assert!(ProjectId::parse("proj_ABC-1.x:y").is_ok());
        assert_eq!(ProjectId::parse(""), Err(IdError::Empty));
        assert_eq!(ProjectId::parse("a b"), Err(IdError::BadCharacter));
        assert_eq!(ProjectId::parse("{x}"), Err(IdError::BadCharacter));
        assert_eq!(ProjectId::parse("x".repeat(129)), Err(IdError::TooLong));
        assert!(ProjectId::parse("x".repeat(128)).is_ok());
    }
}
