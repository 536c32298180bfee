//! Who may act: the action token, cross-site checks, and the Host check that keeps a
//! loopback dashboard from being read through DNS rebinding.
//!
//! **Guarantee:** an action (a POST that writes) runs only if the request carries the
//! token printed at start (form field `token` or header `x-docwarden-token`, compared in
//! constant time), is not marked cross-site by the browser (`Sec-Fetch-Site`), and, when it
//! names an `Origin`, comes from the dashboard's own origin. A cross-site form cannot know
//! the token, so the check is CSRF-safe even in browsers that send no fetch metadata.
//! Reads (GET) never write. **Limits:** the token travels in clear over plain HTTP; bind to
//! loopback (the default) or put TLS in front.

use axum::http::{HeaderMap, StatusCode, header};
use subtle::ConstantTimeEq;

/// The header an API client may send the token in.
pub(crate) const TOKEN_HEADER: &str = "x-docwarden-token";

/// Why an action was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The dashboard runs with `--read-only`.
    ReadOnly,
    /// No token in the request.
    NoToken,
    /// A token that is not the one printed at start.
    BadToken,
    /// The browser says the request comes from another site, or its Origin is not ours.
    CrossSite,
}

impl Refusal {
    /// The HTTP status: 401 without a token, 403 otherwise.
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Refusal::NoToken => StatusCode::UNAUTHORIZED,
            _ => StatusCode::FORBIDDEN,
        }
    }

    /// A sentence for the operator.
    pub(crate) fn message(self) -> &'static str {
        match self {
            Refusal::ReadOnly => "the dashboard runs with --read-only: actions are disabled",
            Refusal::NoToken => {
                "an action needs the token printed when `docwarden ui` started (field `token` or header x-docwarden-token)"
            }
            Refusal::BadToken => "wrong token",
            Refusal::CrossSite => "cross-site request refused",
        }
    }

    /// The label of the `docwarden_ui_actions_total` counter.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Refusal::ReadOnly => "refused_read_only",
            Refusal::NoToken => "refused_no_token",
            Refusal::BadToken => "refused_bad_token",
            Refusal::CrossSite => "refused_cross_site",
        }
    }
}

/// Whether `given` is `expected`, in time independent of where they differ.
pub(crate) fn token_matches(expected: &str, given: &str) -> bool {
    expected.len() == given.len() && bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
}

/// A fresh action token: 128 random bits, hex.
pub(crate) fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Checks an action request; `form_token` is the form's `token` field, if any.
pub(crate) fn check_action(
    expected: Option<&str>,
    headers: &HeaderMap,
    form_token: Option<&str>,
) -> Result<(), Refusal> {
    let Some(expected) = expected else {
        return Err(Refusal::ReadOnly);
    };
    if headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("cross-site"))
    {
        return Err(Refusal::CrossSite);
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
        let origin = origin.to_str().unwrap_or("");
        let same = host.is_some_and(|h| {
            origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"))
                .is_some_and(|o| o.eq_ignore_ascii_case(h))
        });
        if !same {
            return Err(Refusal::CrossSite);
        }
    }
    let given = headers
        .get(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .or(form_token)
        .map(str::trim)
        .filter(|t| !t.is_empty());
    match given {
        None => Err(Refusal::NoToken),
        Some(t) if token_matches(expected, t) => Ok(()),
        Some(_) => Err(Refusal::BadToken),
    }
}

/// Whether the `Host` of a request names a loopback address, so a page served on
/// 127.0.0.1 cannot be read by another site through a DNS name rebound to it.
pub(crate) fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        // HTTP/1.0 without Host: nothing to rebind.
        return true;
    };
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(h, _)| h)
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn actions_need_the_token_and_the_same_site() {
        let t = "abc123";
        assert_eq!(
            check_action(None, &headers(&[]), Some(t)),
            Err(Refusal::ReadOnly)
        );
        assert_eq!(
            check_action(Some(t), &headers(&[]), None),
            Err(Refusal::NoToken)
        );
        assert_eq!(
            check_action(Some(t), &headers(&[]), Some("abc124")),
            Err(Refusal::BadToken)
        );
        assert_eq!(check_action(Some(t), &headers(&[]), Some(t)), Ok(()));
        assert_eq!(
            check_action(Some(t), &headers(&[("x-docwarden-token", "abc123")]), None),
            Ok(())
        );
        assert_eq!(
            check_action(
                Some(t),
                &headers(&[("sec-fetch-site", "cross-site")]),
                Some(t)
            ),
            Err(Refusal::CrossSite)
        );
        assert_eq!(
            check_action(
                Some(t),
                &headers(&[("origin", "http://evil.example"), ("host", "127.0.0.1:80")]),
                Some(t)
            ),
            Err(Refusal::CrossSite)
        );
        assert_eq!(
            check_action(
                Some(t),
                &headers(&[("origin", "http://127.0.0.1:80"), ("host", "127.0.0.1:80")]),
                Some(t)
            ),
            Ok(())
        );
    }

    #[test]
    fn only_loopback_hosts_pass() {
        assert!(loopback_host(&headers(&[("host", "127.0.0.1:8080")])));
        assert!(loopback_host(&headers(&[("host", "localhost:1")])));
        assert!(loopback_host(&headers(&[("host", "[::1]:8080")])));
        assert!(!loopback_host(&headers(&[("host", "rebind.example:8080")])));
        assert!(!loopback_host(&headers(&[("host", "10.0.0.1")])));
    }
}
