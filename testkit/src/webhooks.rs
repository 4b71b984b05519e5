//! A webhook receiver on a local port, and an implementation of the
//! Standard Webhooks v1 signature of its own (HMAC-SHA256 and base64
//! written out here, sharing no code with the notifier), so a test can hold
//! every delivery it receives to the spec.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::IntoResponse;
use sha2::{Digest, Sha256};

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub fn b64_encode(data: &[u8]) -> String {
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Standard base64, padding optional.
pub fn b64_decode(text: &str) -> Vec<u8> {
    let mut bits: u32 = 0;
    let mut count = 0;
    let mut out = Vec::new();
    for c in text.bytes().filter(|c| *c != b'=') {
        let v = B64.iter().position(|x| *x == c).expect("a base64 character") as u32;
        bits = (bits << 6) | v;
        count += 6;
        if count >= 8 {
            count -= 8;
            out.push((bits >> count) as u8);
        }
    }
    out
}

/// HMAC-SHA256 (RFC 2104), written out.
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> Vec<u8> {
    let mut k = if key.len() > 64 { Sha256::digest(key).to_vec() } else { key.to_vec() };
    k.resize(64, 0);
    let inner: Vec<u8> = k.iter().map(|b| b ^ 0x36).chain(message.iter().copied()).collect();
    let inner = Sha256::digest(&inner);
    let outer: Vec<u8> = k.iter().map(|b| b ^ 0x5c).chain(inner.iter().copied()).collect();
    Sha256::digest(&outer).to_vec()
}

/// The `v1,` signature the spec gives for a message: base64 of
/// HMAC-SHA256, keyed by the secret's bytes, of `{id}.{timestamp}.{body}`.
pub fn expected_signature(secret: &str, id: &str, timestamp: &str, body: &[u8]) -> String {
    let key = b64_decode(secret.strip_prefix("whsec_").expect("a whsec_ secret"));
    let mut signed = format!("{id}.{timestamp}.").into_bytes();
    signed.extend_from_slice(body);
    format!("v1,{}", b64_encode(&hmac_sha256(&key, &signed)))
}

/// One request the receiver got.
#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub id: String,
    pub timestamp: String,
    pub signatures: Vec<String>,
    pub body: Vec<u8>,
}

#[derive(Default)]
struct Script {
    statuses: Vec<u16>,
    delays: Vec<Duration>,
    location: Option<String>,
    received: Vec<Received>,
}

/// A receiver on 127.0.0.1: answers the scripted statuses in turn (then
/// 204), after the scripted delays in turn (then none), and keeps every
/// request. Stops with the test's runtime.
#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    script: Arc<Mutex<Script>>,
}

impl Receiver {
    pub async fn start(statuses: Vec<u16>) -> Receiver {
        let script = Arc::new(Mutex::new(Script { statuses, ..Script::default() }));
        let app = Router::new().fallback(receive).with_state(script.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a receiver");
        let addr = listener.local_addr().expect("the receiver's address");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Receiver { addr, script }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn script(&self) -> std::sync::MutexGuard<'_, Script> {
        self.script.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Delays of the next answers, in turn.
    pub fn delay_next(&self, delays: Vec<Duration>) {
        self.script().delays = delays;
    }

    /// A `Location` header on every answer (for redirects).
    pub fn set_location(&self, location: String) {
        self.script().location = Some(location);
    }

    pub fn received(&self) -> Vec<Received> {
        self.script().received.clone()
    }

    /// Holds every request to the spec: each of `secrets` signs it.
    pub fn verify_all(&self, secrets: &[&str]) {
        for r in self.received() {
            assert!(r.id.starts_with("msg_"), "a webhook-id: {r:?}");
            assert!(r.timestamp.parse::<i64>().is_ok(), "a webhook-timestamp in seconds: {r:?}");
            for secret in secrets {
                let want = expected_signature(secret, &r.id, &r.timestamp, &r.body);
                assert!(r.signatures.contains(&want), "{} is signed with {secret}: {:?}", r.id, r.signatures);
            }
        }
    }
}

async fn receive(
    State(script): State<Arc<Mutex<Script>>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let (status, delay, location) = {
        let mut s = script.lock().unwrap_or_else(|e| e.into_inner());
        s.received.push(Received {
            path: uri.path().to_owned(),
            id: header("webhook-id"),
            timestamp: header("webhook-timestamp"),
            signatures: header("webhook-signature").split(' ').map(str::to_owned).collect(),
            body: body.to_vec(),
        });
        let status = if s.statuses.is_empty() { 204 } else { s.statuses.remove(0) };
        let delay = if s.delays.is_empty() { Duration::ZERO } else { s.delays.remove(0) };
        (status, delay, s.location.clone())
    };
    tokio::time::sleep(delay).await;
    let mut h = HeaderMap::new();
    if let Some(l) = location.and_then(|l| l.parse().ok()) {
        h.insert("location", l);
    }
    (StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), h, format!("answered {status}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_test_vector() {
        assert_eq!(
            expected_signature(
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                "1614265330",
                br#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        assert_eq!(b64_decode(&b64_encode(b"any carnal pleas")), b"any carnal pleas");
        assert_eq!(b64_encode(b"ab"), "YWI=");
    }
}
