//! Signing in to the console: a session cookie and the CSRF token of every form.
//!
//! The operator types the admin token into the sign-in form once. The
//! cookie the console then sets does not hold the token itself but a
//! session derived from it: `v1.<issued, unix seconds>.<HMAC-SHA256 of the
//! issue time, keyed by the admin token>`. So the cookie cannot be used as a
//! bearer token on `/v1`, a session lasts [`SESSION_TTL`], and changing the
//! admin token signs every session out. It is `HttpOnly` (no script reads
//! it), `SameSite=Strict` (no other site's page sends it) and `Path=/console`.
//!
//! Every form carries a CSRF token derived from the session cookie (an
//! HMAC of it, keyed by the admin token): a POST is carried out only when
//! its `csrf` field is that token, compared in constant time, so a page of
//! another origin that cannot read the cookie cannot forge a form. The
//! sign-in form, posted before there is a session, carries a random value
//! that must match a cookie set with the form (double submit).
//!
//! Nothing here logs, and no token or session is ever put in a URL.

use axum::extract::FromRequestParts;
use axum::http::header::{COOKIE, SET_COOKIE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::state::{AppState, random_token, same_secret};

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "tollgate_console";
/// The sign-in form's double-submit cookie.
pub const SIGN_IN_COOKIE: &str = "tollgate_console_sign_in";
/// How long a session lasts after signing in.
pub const SESSION_TTL: chrono::Duration = chrono::Duration::hours(12);
/// Where a request without a session is sent.
pub const SIGN_IN_PATH: &str = "/console/sign-in";

type HmacSha256 = Hmac<Sha256>;

/// The HMAC of `data` for `purpose`, keyed by `secret`.
fn mac(secret: &str, purpose: &str, data: &str) -> Option<HmacSha256> {
    // HMAC takes a key of any length; `new_from_slice` cannot refuse one.
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret.as_bytes()).ok()?;
    m.update(purpose.as_bytes());
    m.update(&[0]);
    m.update(data.as_bytes());
    Some(m)
}

fn tag(secret: &str, purpose: &str, data: &str) -> String {
    mac(secret, purpose, data).map(|m| hex::encode(m.finalize().into_bytes())).unwrap_or_default()
}

/// Whether `tag_hex` is the HMAC of `data` for `purpose`, compared in constant time.
fn verify(secret: &str, purpose: &str, data: &str, tag_hex: &str) -> bool {
    match (hex::decode(tag_hex), mac(secret, purpose, data)) {
        (Ok(bytes), Some(m)) => m.verify_slice(&bytes).is_ok(),
        _ => false,
    }
}

/// A new session's cookie value, issued at `at`.
pub fn new_session(s: &AppState, at: chrono::DateTime<chrono::Utc>) -> String {
    let issued = at.timestamp().to_string();
    format!("v1.{issued}.{}", tag(&s.settings.admin_token, "session", &issued))
}

/// Whether a cookie value is a session of this admin token, still young enough.
fn valid_session(s: &AppState, value: &str) -> bool {
    let mut parts = value.splitn(3, '.');
    let (Some("v1"), Some(issued), Some(t)) = (parts.next(), parts.next(), parts.next()) else { return false };
    let Ok(secs) = issued.parse::<i64>() else { return false };
    let age = s.clock.now().timestamp().saturating_sub(secs);
    (0..=SESSION_TTL.num_seconds()).contains(&age) && verify(&s.settings.admin_token, "session", issued, t)
}

/// The value of a cookie of the request.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find_map(|(k, v)| (k == name).then_some(v))
}

/// A `Set-Cookie` value: HttpOnly, SameSite=Strict, on `path`, for
/// `max_age` seconds (0 removes it), and `Secure` when the request came
/// over HTTPS (see [`over_https`]).
pub fn set_cookie(name: &str, value: &str, path: &str, max_age: i64, secure: bool) -> Option<HeaderValue> {
    let secure = if secure { "; Secure" } else { "" };
    HeaderValue::from_str(&format!("{name}={value}; HttpOnly; SameSite=Strict; Path={path}; Max-Age={max_age}{secure}"))
        .ok()
}

/// Whether the request reached the proxy in front of Tollgate over HTTPS
/// (`X-Forwarded-Proto: https`, or `Forwarded: …proto=https`): then the
/// cookies are `Secure`. Tollgate itself serves plain HTTP (`tollgate dev`
/// on 127.0.0.1), where a `Secure` cookie would not be sent back.
pub fn over_https(headers: &HeaderMap) -> bool {
    let has = |name: &str, f: &dyn Fn(&str) -> bool| {
        headers.get_all(name).iter().filter_map(|v| v.to_str().ok()).any(|v| f(&v.to_ascii_lowercase()))
    };
    has("x-forwarded-proto", &|v| v.split(',').next().is_some_and(|p| p.trim() == "https"))
        || has("forwarded", &|v| v.split([';', ',']).any(|p| p.trim() == "proto=https"))
}

/// Whether the request carries a valid session.
pub fn signed_in(s: &AppState, headers: &HeaderMap) -> bool {
    cookie(headers, SESSION_COOKIE).is_some_and(|v| valid_session(s, v))
}

/// Adds a `Set-Cookie` header to a response.
pub fn with_cookie(mut res: Response, cookie: Option<HeaderValue>) -> Response {
    if let Some(c) = cookie {
        res.headers_mut().append(SET_COOKIE, c);
    }
    res
}

/// A signed-in operator: the request carried a valid session cookie.
/// Without one, a GET is sent to the sign-in page (303) and anything else
/// is answered 401.
#[derive(Debug, Clone)]
pub struct Session {
    /// The CSRF token every form of this session carries.
    pub csrf: String,
    cookie: String,
}

impl Session {
    /// Whether a form's `csrf` field is this session's token (constant time).
    pub fn csrf_ok(&self, s: &AppState, given: Option<&str>) -> bool {
        given.is_some_and(|g| verify(&s.settings.admin_token, "csrf", &self.cookie, g))
    }
}

impl FromRequestParts<AppState> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, Response> {
        match cookie(&parts.headers, SESSION_COOKIE).filter(|v| valid_session(s, v)) {
            Some(v) => Ok(Session { csrf: tag(&s.settings.admin_token, "csrf", v), cookie: v.to_owned() }),
            None if parts.method == Method::GET || parts.method == Method::HEAD => {
                Err(Redirect::to(SIGN_IN_PATH).into_response())
            }
            None => Err(super::html(
                StatusCode::UNAUTHORIZED,
                super::view::message_page("Sign in", "Sign in to the console first.", true),
            )),
        }
    }
}

/// A new random value for the sign-in form's double submit.
pub fn sign_in_nonce() -> String {
    random_token(32)
}

/// Whether the sign-in form's `csrf` field is the value of its cookie.
pub fn sign_in_csrf_ok(headers: &HeaderMap, given: Option<&str>) -> bool {
    match (cookie(headers, SIGN_IN_COOKIE), given) {
        (Some(c), Some(g)) => !c.is_empty() && same_secret(c, g),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_verifies_only_for_its_secret_purpose_and_data() {
        let t = tag("adm", "csrf", "v1.1.ab");
        assert!(verify("adm", "csrf", "v1.1.ab", &t));
        assert!(!verify("other", "csrf", "v1.1.ab", &t));
        assert!(!verify("adm", "session", "v1.1.ab", &t));
        assert!(!verify("adm", "csrf", "v1.1.ac", &t));
        assert!(!verify("adm", "csrf", "v1.1.ab", "zz"), "not hex");
        assert!(!verify("adm", "csrf", "v1.1.ab", &t[..10]), "a prefix of the tag");
    }

    #[test]
    fn cookies_are_secure_behind_https() {
        let mut h = HeaderMap::new();
        assert!(!over_https(&h));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        assert!(over_https(&h));
        let mut h = HeaderMap::new();
        h.insert("forwarded", HeaderValue::from_static("for=1.2.3.4;Proto=HTTPS;host=x"));
        assert!(over_https(&h));
        h.insert("forwarded", HeaderValue::from_static("for=1.2.3.4;proto=http"));
        assert!(!over_https(&h));
        let c = set_cookie("a", "b", "/console", 60, true).expect("a header");
        assert_eq!(c, "a=b; HttpOnly; SameSite=Strict; Path=/console; Max-Age=60; Secure");
    }

    #[test]
    fn cookies_are_read_by_name() {
        let mut h = HeaderMap::new();
        h.append(COOKIE, HeaderValue::from_static("a=1; tollgate_console=v1.2.3"));
        h.append(COOKIE, HeaderValue::from_static("b=2"));
        assert_eq!(cookie(&h, SESSION_COOKIE), Some("v1.2.3"));
        assert_eq!(cookie(&h, "b"), Some("2"));
        assert_eq!(cookie(&h, "c"), None);
    }
}
