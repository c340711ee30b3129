//! Who may use the operations listener beyond `/healthz`, `/readyz` and `/metrics`: with
//! `[admin] token`, a request carries it as a bearer token, or a browser signs in once
//! (`POST /login`) and carries a session cookie derived from it. Without a token (a
//! loopback listener) everything is open to the host's own users.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use sha2::{Digest, Sha256};

/// The session cookie's name.
const COOKIE: &str = "agentbridge_admin";

/// The sign-in page, answered with 401 to a browser that is not signed in.
const LOGIN_PAGE: &str = include_str!("login.html");

/// The admin token as configured (and reloaded), shared with the middleware.
#[derive(Clone, Default)]
pub struct Token(Arc<ArcSwapOption<String>>);

impl Token {
    pub fn new(token: Option<String>) -> Token {
        Token(Arc::new(ArcSwapOption::from(token.map(Arc::new))))
    }

    /// Whether no token is set (a loopback listener, open to the host's own users).
    fn is_none(&self) -> bool {
        self.0.load().is_none()
    }

    /// Takes a token read again from the config.
    pub fn set(&self, token: Option<String>) {
        self.0.store(token.map(Arc::new));
    }

    /// Whether `headers` carry the token (as a bearer token or the session cookie); always
    /// when there is none.
    fn admits(&self, headers: &HeaderMap) -> bool {
        let Some(token) = self.0.load_full() else {
            return true;
        };
        let bearer = (headers.get(header::AUTHORIZATION))
            .and_then(|v| v.to_str().ok())
            .and_then(crate::shared::text::bearer_token);
        if bearer.is_some_and(|given| same(given.as_bytes(), token.as_bytes())) {
            return true;
        }
        cookie(headers).is_some_and(|given| same(given.as_bytes(), session(&token).as_bytes()))
    }

    /// The session cookie for `given`, when it is the token.
    fn sign_in(&self, given: &str) -> Option<String> {
        let token = self.0.load_full()?;
        same(given.as_bytes(), token.as_bytes()).then(|| session(&token))
    }
}

/// The session cookie's value for `token`: not the token itself, so that the cookie jar
/// does not hold it.
fn session(token: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"agentbridge-console-session:")
        .chain_update(token.as_bytes())
        .finalize();
    crate::shared::text::hex(&digest)
}

/// Whether `a` and `b` are equal, in a time that tells nothing of where they differ: their
/// digests are compared whole, so not even their lengths show.
fn same(a: &[u8], b: &[u8]) -> bool {
    let (a, b) = (Sha256::digest(a), Sha256::digest(b));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

fn cookie(headers: &HeaderMap) -> Option<&str> {
    (headers.get_all(header::COOKIE).iter())
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))
}

/// Whether `headers` come from this host's own pages and tools: the `Host` is an address
/// or `localhost` (a page of another site that rebinds its name to 127.0.0.1 sends its
/// own name), and a request a page sent (`Origin`) comes from that same host.
fn same_host(headers: &HeaderMap) -> bool {
    let host = (headers.get(header::HOST)).and_then(|v| v.to_str().ok());
    let Some(host) = host else {
        return true;
    };
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    if name != "localhost" && name.parse::<std::net::IpAddr>().is_err() {
        return false;
    }
    match (headers.get(header::ORIGIN)).and_then(|v| v.to_str().ok()) {
        Some(origin) => origin.split_once("://").is_some_and(|(_, o)| o == host),
        None => true,
    }
}

/// Lets a request through when it carries the token; a browser asking for a page is shown
/// the sign-in page, anything else a 401 in JSON. Without a token (a loopback listener),
/// only a request from this host's own pages and tools goes through.
pub async fn require(State(token): State<Token>, request: Request, next: Next) -> Response {
    if token.is_none() && !same_host(request.headers()) {
        let answer = serde_json::json!({
            "error": "the admin listener answers this host's own pages and tools only"
        });
        return (StatusCode::FORBIDDEN, axum::Json(answer)).into_response();
    }
    if token.admits(request.headers()) {
        return next.run(request).await;
    }
    let wants_page = (request.headers().get(header::ACCEPT))
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"));
    if wants_page {
        return (StatusCode::UNAUTHORIZED, Html(LOGIN_PAGE)).into_response();
    }
    let answer = serde_json::json!({
        "error": "this needs the admin token: send `Authorization: Bearer <token>`"
    });
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        axum::Json(answer),
    )
        .into_response()
}

#[derive(serde::Deserialize)]
pub struct SignIn {
    token: String,
}

/// `POST /login`: the session cookie and the console, or the sign-in page again.
pub async fn login(State(token): State<Token>, form: axum::Form<SignIn>) -> Response {
    match token.sign_in(&form.token) {
        Some(session) => (
            StatusCode::SEE_OTHER,
            [
                (header::LOCATION, "/".to_owned()),
                (
                    header::SET_COOKIE,
                    format!("{COOKIE}={session}; Path=/; HttpOnly; SameSite=Strict"),
                ),
            ],
        )
            .into_response(),
        None => (StatusCode::UNAUTHORIZED, Html(LOGIN_PAGE)).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(name, value.parse().unwrap());
        }
        headers
    }

    #[test]
    fn without_a_token_only_this_hosts_pages_and_tools_get_in() {
        assert!(same_host(&headers(&[(header::HOST, "127.0.0.1:9464")])));
        assert!(same_host(&headers(&[(header::HOST, "localhost:9464")])));
        assert!(same_host(&headers(&[(header::HOST, "[::1]:9464")])));
        assert!(!same_host(&headers(&[(header::HOST, "evil.example:9464")])));
        assert!(same_host(&headers(&[
            (header::HOST, "127.0.0.1:9464"),
            (header::ORIGIN, "http://127.0.0.1:9464")
        ])));
        assert!(!same_host(&headers(&[
            (header::HOST, "127.0.0.1:9464"),
            (header::ORIGIN, "http://evil.example")
        ])));
    }

    #[test]
    fn the_token_is_taken_as_a_bearer_token_or_a_session_cookie() {
        let token = Token::new(Some("s3cret".into()));
        assert!(token.admits(&headers(&[(header::AUTHORIZATION, "Bearer s3cret")])));
        assert!(!token.admits(&headers(&[(header::AUTHORIZATION, "Bearer s3cre")])));
        assert!(!token.admits(&headers(&[])));
        let session = token.sign_in("s3cret").unwrap();
        assert_ne!(session, "s3cret");
        let cookie = format!("theme=dark; {COOKIE}={session}");
        assert!(token.admits(&headers(&[(header::COOKIE, cookie.as_str())])));
        assert!(token.sign_in("nope").is_none());
        assert!(Token::new(None).admits(&headers(&[])));
    }
}
