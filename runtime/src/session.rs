//! The session-affinity key of a model call: read once from the HTTP
//! request, applied by one rule to guests' calls and to API calls alike.

/// The HTTP header that names a request's session.
pub const SESSION_HEADER: &str = "x-session-affinity";

/// A request's `x-session-affinity` header, and the one rule that gives a
/// model call its session key (which picks the decode pool holding the
/// session's cached prefix).
///
/// Precedence, the same for a guest's `kiln:ai` call and for the
/// OpenAI-compatible API: the request's header wins; a key the call names
/// itself (a guest's `params.session`, the API's `prompt_cache_key`)
/// counts only when the request has no header. The header is the one key
/// that a client, or a proxy in front of Kiln, sets the same way for every
/// route, so it decides where all of a request's model calls land.
///
/// A header value that is not visible ASCII counts as no header.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionAffinity(Option<String>);

impl SessionAffinity {
    /// The session that `headers` name, if they name one.
    pub fn from_headers(headers: &http::HeaderMap) -> Self {
        Self(
            headers
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        )
    }

    /// The header's value, if the request had one.
    pub fn header(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// A call's session key by the precedence above: the header's value if
    /// there is one, else the call's own key `own`.
    pub fn session(&self, own: Option<String>) -> Option<String> {
        self.0.clone().or(own)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn affinity(value: Option<&'static [u8]>) -> SessionAffinity {
        let mut headers = http::HeaderMap::new();
        if let Some(v) = value {
            let v = http::HeaderValue::from_bytes(v).expect("a header value");
            headers.insert(SESSION_HEADER, v);
        }
        SessionAffinity::from_headers(&headers)
    }

    #[test]
    fn the_header_wins_over_the_calls_own_key() {
        let got = affinity(Some(b"header")).session(Some("own".into()));
        assert_eq!(got.as_deref(), Some("header"));
    }

    #[test]
    fn without_a_header_the_calls_own_key_or_none_stays() {
        for own in [Some("own"), None] {
            let got = affinity(None).session(own.map(str::to_owned));
            assert_eq!(got.as_deref(), own);
        }
    }

    #[test]
    fn a_header_that_is_not_visible_ascii_counts_as_none() {
        let a = affinity(Some(b"caf\xe9"));
        assert_eq!(a.header(), None);
        assert_eq!(a.session(Some("own".into())).as_deref(), Some("own"));
    }
}
