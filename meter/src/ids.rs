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

/// How many characters an id keeps inline. Every id Tollgate makes
/// (`<prefix>_<32 hex digits>`, 36 characters) fits, and so do most that
/// callers choose (a UUID is 36); a longer one (up to the alphabet's 128)
/// goes on the heap. The request path copies ids a few dozen times per
/// call (into events, counters, reservations), so a copy that allocates
/// nothing is most of what an id costs there.
const INLINE: usize = 48;

/// An id's characters, already checked against the alphabet: inline when
/// they fit (56 bytes in all, where a `String` is 24 and a heap block).
#[derive(Clone)]
enum Chars {
    Inline(arrayvec::ArrayString<INLINE>),
    Heap(Box<str>),
}

impl Chars {
    fn new(s: &str) -> Self {
        match arrayvec::ArrayString::from(s) {
            Ok(inline) => Chars::Inline(inline),
            Err(_) => Chars::Heap(s.into()),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            Chars::Inline(s) => s,
            Chars::Heap(s) => s,
        }
    }
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// Compared, ordered and hashed as its string.
        #[derive(Clone, Deserialize)]
        #[serde(try_from = "String")]
        pub struct $name(Chars);

        impl $name {
            /// Parses an id, refusing anything outside the id alphabet.
            pub fn parse(s: impl AsRef<str>) -> Result<Self, IdError> {
                let s = s.as_ref();
                check_id(s)?;
                Ok(Self(Chars::new(s)))
            }
            pub fn as_str(&self) -> &str {
                self.0.as_str()
            }
        }

        impl PartialEq for $name {
            fn eq(&self, other: &Self) -> bool {
                self.as_str() == other.as_str()
            }
        }

        impl Eq for $name {}

        impl PartialOrd for $name {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }

        impl Ord for $name {
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                self.as_str().cmp(other.as_str())
            }
        }

        impl std::hash::Hash for $name {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                self.as_str().hash(state)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_tuple(stringify!($name)).field(&self.as_str()).finish()
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
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
                match id.0 {
                    Chars::Inline(s) => s.as_str().to_owned(),
                    Chars::Heap(s) => s.into_string(),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
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

    #[test]
    fn an_id_is_its_string_whether_inline_or_on_the_heap() {
        // Every length from one to the alphabet's 128, on both sides of
        // what fits inline: the same string back, in every form it leaves in.
        for n in 1..=128 {
            let s: String = "abcdefghij0123456789_-.:".chars().cycle().take(n).collect();
            let id = EventId::parse(&s).unwrap();
            assert_eq!(id.as_str(), s);
            assert_eq!(id.to_string(), s);
            assert_eq!(String::from(id.clone()), s);
            assert_eq!(format!("{id:?}"), format!("EventId({s:?})"));
            assert_eq!(serde_json::to_string(&id).unwrap(), serde_json::to_string(&s).unwrap());
            let back: EventId = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
            assert_eq!(back, id);
        }
        assert!(serde_json::from_str::<EventId>("\"a b\"").is_err());
        assert_eq!(std::mem::size_of::<EventId>(), 56);
    }

    #[test]
    fn ids_compare_order_and_hash_as_their_strings() {
        use std::hash::BuildHasher;
        let long = "z".repeat(INLINE + 1);
        let mut ids: Vec<EventId> =
            ["b", "a", long.as_str(), "ab", "zz"].iter().map(|s| EventId::parse(s).unwrap()).collect();
        ids.sort();
        let strs: Vec<&str> = ids.iter().map(EventId::as_str).collect();
        assert_eq!(strs, ["a", "ab", "b", "zz", long.as_str()]);
        let hasher = std::collections::hash_map::RandomState::new();
        for id in &ids {
            assert_eq!(hasher.hash_one(id), hasher.hash_one(id.as_str()));
            assert_eq!(id, &EventId::parse(id.as_str()).unwrap());
        }
    }
}
