//! Canonical JSON, the one writer of the format's JSON files and of the plan
//! fingerprint's input.
//!
//! Canonical means sorted keys: a value goes through [`serde_json::Value`], whose map
//! is a `BTreeMap` (serde_json's `preserve_order` feature is off, and must stay off),
//! so every object comes out in key order whatever the struct's field order. The
//! pretty form (`manifest.json`, `verified-install.json`) is two-space indented with a
//! trailing newline; the compact form (the plan fingerprint) has no whitespace.

use serde::Serialize;

/// Sorted keys, two-space indent, trailing newline.
pub fn to_pretty(value: &impl Serialize) -> serde_json::Result<Vec<u8>> {
    let mut out = serde_json::to_vec_pretty(&serde_json::to_value(value)?)?;
    out.push(b'\n');
    Ok(out)
}

/// Sorted keys, no whitespace.
pub fn to_compact(value: &impl Serialize) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&serde_json::to_value(value)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Unsorted {
        b: u32,
        a: Vec<u32>,
        c: std::collections::HashMap<&'static str, u32>,
    }

    #[test]
    fn keys_come_out_sorted_in_both_forms() {
        let v = Unsorted {
            b: 1,
            a: vec![2],
            c: [("y", 3), ("x", 4)].into_iter().collect(),
        };
        assert_eq!(
            String::from_utf8(to_pretty(&v).unwrap()).unwrap(),
            "{\n  \"a\": [\n    2\n  ],\n  \"b\": 1,\n  \"c\": {\n    \"x\": 4,\n    \"y\": 3\n  }\n}\n"
        );
        assert_eq!(
            String::from_utf8(to_compact(&v).unwrap()).unwrap(),
            r#"{"a":[2],"b":1,"c":{"x":4,"y":3}}"#
        );
    }

    #[test]
    fn a_failing_serializer_is_an_error_not_null() {
        let bad: std::collections::BTreeMap<(u8, u8), u8> = [((1, 2), 3)].into_iter().collect();
        assert!(to_pretty(&bad).is_err());
        assert!(to_compact(&bad).is_err());
    }
}
