//! Names of tenants and functions. A [`Name`] is built only by the
//! validating constructors here, so whatever holds one (a handler, an
//! [`crate::app::App`] method) knows the name is well formed.

use std::fmt;

/// The naming rule, as error messages state it.
const RULE: &str = "names are 1 to 63 characters, each a lowercase letter (a-z), a digit (0-9) \
                    or `-`, i.e. [a-z0-9-]{1,63}";

/// A tenant's or a function's name: 1 to 63 of `a-z`, `0-9` and `-`, so
/// it fits a URL path segment and a metrics label as it is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Name(String);

/// What a name names, for the error message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Tenant,
    Function,
}

/// A name that breaks the rule; its message says what is allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameError {
    kind: Kind,
    name: String,
}

impl Name {
    /// Validates `name` as a tenant's name.
    pub fn tenant(name: &str) -> Result<Self, NameError> {
        Self::parse(Kind::Tenant, name)
    }

    /// Validates `name` as a function's name.
    pub fn function(name: &str) -> Result<Self, NameError> {
        Self::parse(Kind::Function, name)
    }

    fn parse(kind: Kind, name: &str) -> Result<Self, NameError> {
        let ok = (1..=63).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if ok {
            Ok(Self(name.to_owned()))
        } else {
            Err(NameError {
                kind,
                name: name.to_owned(),
            })
        }
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Tenant => "tenant",
            Kind::Function => "function",
        };
        write!(
            f,
            "invalid {kind} name `{}`: {RULE}",
            self.name.escape_default()
        )
    }
}

impl std::error::Error for NameError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_lowercase_letters_digits_and_dashes_up_to_63() {
        let (longest, too_long) = ("x".repeat(63), "x".repeat(64));
        for ok in ["a", "acme-2", "0", longest.as_str()] {
            assert_eq!(Name::tenant(ok).unwrap().as_str(), ok);
        }
        for bad in ["", "Acme", "a_b", "a.b", "a/b", "é", too_long.as_str()] {
            assert!(Name::function(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_error_names_what_was_named_and_the_rule() {
        let msg = Name::function("Bad.Name\n").unwrap_err().to_string();
        assert!(
            msg.starts_with("invalid function name `Bad.Name\\n`"),
            "{msg}"
        );
        assert!(msg.contains("[a-z0-9-]{1,63}"), "{msg}");
        let msg = Name::tenant("").unwrap_err().to_string();
        assert!(msg.starts_with("invalid tenant name ``"), "{msg}");
    }
}
