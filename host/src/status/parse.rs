//! Prometheus text exposition, parsed back into samples.

use std::collections::BTreeMap;

/// One sample of the exposition.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Series {
    /// The sample's name, e.g. `kiln_kv_pages` or `kiln_model_tokens_total`.
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// The sample as `/metrics` writes it before the value, e.g.
    /// `kiln_kv_pages{model="m",pool="0",state="free"}`: the key a reader
    /// matches the page's figures to `/metrics` by.
    pub key: String,
    /// The value.
    pub value: f64,
}

/// The samples of `text`; comments and lines that do not parse are left
/// out.
pub fn parse(text: &str) -> Vec<Series> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Option<Series> {
    let (key, value) = match line.find('{') {
        Some(open) => {
            let close = open + closing_brace(&line[open..])?;
            let (key, rest) = line.split_at(close + 1);
            (key, rest.split_whitespace().next()?)
        }
        None => {
            let mut parts = line.split_whitespace();
            (parts.next()?, parts.next()?)
        }
    };
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    let (name, labels) = match key.split_once('{') {
        Some((name, body)) => (name, labels(body.strip_suffix('}')?)?),
        None => (key, BTreeMap::new()),
    };
    Some(Series {
        name: name.to_owned(),
        labels,
        key: key.to_owned(),
        value,
    })
}

/// The offset of the `}` that closes the label set `s` starts with,
/// skipping quoted values.
fn closing_brace(s: &str) -> Option<usize> {
    let (mut quoted, mut escaped) = (false, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

fn labels(body: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (name, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        out.insert(name.trim_start_matches(',').to_owned(), value);
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_keep_their_names_labels_keys_and_values() {
        let text = "# HELP kiln_kv_pages pages\n# TYPE kiln_kv_pages gauge\n\
            kiln_kv_pages{model=\"m\",pool=\"0\",state=\"free\"} 12\n\
            kiln_connections_refused_total 3\n\
            kiln_x_bucket{le=\"+Inf\",tenant=\"a\\\"b,c}\"} 7.5\n# EOF\n";
        let s = parse(text);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].name, "kiln_kv_pages");
        assert_eq!(
            s[0].key,
            "kiln_kv_pages{model=\"m\",pool=\"0\",state=\"free\"}"
        );
        assert_eq!(s[0].labels["state"], "free");
        assert_eq!(s[0].value, 12.0);
        assert_eq!(
            (s[1].name.as_str(), s[1].value),
            ("kiln_connections_refused_total", 3.0)
        );
        assert_eq!(s[2].labels["tenant"], "a\"b,c}");
        assert_eq!(s[2].labels["le"], "+Inf");
        assert_eq!(s[2].value, 7.5);
    }

    #[test]
    fn lines_that_do_not_parse_are_left_out() {
        assert!(parse("kiln_a{x=\"1\" 2\nkiln_b notanumber\n").is_empty());
    }
}
