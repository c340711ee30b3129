//! A JSON object read without parsing its values: its fields in the order they were
//! written, each value as its text.
//!
//! For frames the bridge passes on mostly as they came: building a `serde_json::Value` (a
//! sorted map of owned strings) only to write it out again would be most of the cost of
//! relaying one, and would lose the sender's field order besides.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// Beyond this many fields, repeats are found through an index rather than by looking
/// through the fields, so a frame of many fields costs linear time, not quadratic.
const SCANNED_FIELDS: usize = 16;

/// A name written twice keeps its first place and its last value, as JavaScript's
/// `JSON.parse` does (and a `Value` keeps the last value too).
#[derive(Debug)]
pub struct RawObject<'a> {
    fields: Vec<(Cow<'a, str>, &'a RawValue)>,
}

impl<'a> RawObject<'a> {
    /// Reads `json`, which must hold one object and nothing after it. serde_json's errors;
    /// `is_data()` when `json` is JSON but not an object.
    pub fn parse(json: &'a str) -> Result<RawObject<'a>, serde_json::Error> {
        serde_json::from_str(json)
    }

    /// Reads the object a deserializer has reached, from inside a visitor's `visit_map`.
    pub fn from_map<A: MapAccess<'a>>(map: A) -> Result<RawObject<'a>, A::Error> {
        ObjectVisitor.visit_map(map)
    }

    /// The object as a `Value`, each field parsed (for the frames not worth the trouble).
    pub fn to_value(&self) -> Result<Value, serde_json::Error> {
        self.fields
            .iter()
            .map(|(name, value)| Ok((name.to_string(), serde_json::from_str(value.get())?)))
            .collect::<Result<Map<String, Value>, _>>()
            .map(Value::Object)
    }

    /// The value of field `name`, as written.
    pub fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.fields
            .iter()
            .find(|(field, _)| field == name)
            .map(|(_, value)| *value)
    }

    /// Every field, in the order written.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &'a RawValue)> {
        self.fields.iter().map(|(name, value)| (&**name, *value))
    }
}

/// A string value's text when it has no escapes, which is then the string itself; `None`
/// for a string with escapes, or a value that is not a string. serde_json's `RawValue`
/// holds no whitespace around the value and refuses raw control characters in a string,
/// and a `"` without a `\` before it ends one: quoted text with no `\` is the string.
pub fn plain_string(value: &RawValue) -> Option<&str> {
    let inner = value.get().strip_prefix('"')?.strip_suffix('"')?;
    memchr::memchr(b'\\', inner.as_bytes())
        .is_none()
        .then_some(inner)
}

impl<'de> Deserialize<'de> for RawObject<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ObjectVisitor)
    }
}

struct ObjectVisitor;

impl<'de> Visitor<'de> for ObjectVisitor {
    type Value = RawObject<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawObject<'de>, A::Error> {
        let mut fields: Vec<(Cow<'de, str>, &'de RawValue)> = Vec::with_capacity(8);
        let mut index: Option<HashMap<Cow<'de, str>, usize>> = None;
        while let Some(FieldName(name)) = map.next_key()? {
            let value: &'de RawValue = map.next_value()?;
            let seen = match &index {
                Some(index) => index.get(&name).copied(),
                None => fields.iter().position(|(field, _)| *field == name),
            };
            if let Some(at) = seen {
                fields[at].1 = value;
                continue;
            }
            if let Some(index) = &mut index {
                index.insert(name.clone(), fields.len());
            }
            fields.push((name, value));
            if index.is_none() && fields.len() > SCANNED_FIELDS {
                index = Some(
                    fields
                        .iter()
                        .enumerate()
                        .map(|(at, (field, _))| (field.clone(), at))
                        .collect(),
                );
            }
        }
        Ok(RawObject { fields })
    }
}

/// A field name, borrowed from the text unless it had escapes to undo.
pub struct FieldName<'a>(pub Cow<'a, str>);

impl<'de> Deserialize<'de> for FieldName<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NameVisitor;
        impl<'de> Visitor<'de> for NameVisitor {
            type Value = FieldName<'de>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }

            fn visit_borrowed_str<E>(self, name: &'de str) -> Result<FieldName<'de>, E> {
                Ok(FieldName(Cow::Borrowed(name)))
            }

            fn visit_str<E>(self, name: &str) -> Result<FieldName<'de>, E> {
                Ok(FieldName(Cow::Owned(name.to_owned())))
            }
        }
        deserializer.deserialize_str(NameVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(object: &RawObject<'_>) -> Vec<(String, String)> {
        object
            .iter()
            .map(|(name, value)| (name.to_owned(), value.get().to_owned()))
            .collect()
    }

    #[test]
    fn a_plain_string_is_read_from_its_text_and_no_other_value_is() {
        let object = RawObject::parse(
            r#"{"a":"chat","b":"","c":"h\u00e9","d":"q\"","e":1,"f":null,"g":["x"],"h":"é ✓"}"#,
        )
        .unwrap();
        let plain: Vec<_> = object
            .iter()
            .map(|(name, value)| (name, plain_string(value)))
            .collect();
        assert_eq!(
            plain,
            [
                ("a", Some("chat")),
                ("b", Some("")),
                ("c", None),
                ("d", None),
                ("e", None),
                ("f", None),
                ("g", None),
                ("h", Some("é ✓")),
            ]
        );
    }

    #[test]
    fn fields_keep_their_order_and_their_text() {
        let object =
            RawObject::parse(r#" {"b": [1, 2], "a\u0041": {"x":"y"}, "c":1.50} "#).unwrap();
        assert_eq!(
            fields(&object),
            [
                ("b".into(), "[1, 2]".into()),
                ("aA".into(), r#"{"x":"y"}"#.into()),
                ("c".into(), "1.50".into()),
            ]
        );
        assert_eq!(object.get("aA").unwrap().get(), r#"{"x":"y"}"#);
        assert!(object.get("d").is_none());
    }

    #[test]
    fn a_repeated_name_keeps_its_place_and_its_last_value() {
        let object = RawObject::parse(r#"{"a":1,"b":2,"a":3}"#).unwrap();
        assert_eq!(
            fields(&object),
            [("a".into(), "3".into()), ("b".into(), "2".into())]
        );
        // The same past the point where repeats are looked up in an index.
        let many: Vec<String> = (0..40).map(|i| format!(r#""f{i}":{i}"#)).collect();
        let text = format!(r#"{{{},"f3":"again","f30":"again"}}"#, many.join(","));
        let object = RawObject::parse(&text).unwrap();
        assert_eq!(object.iter().count(), 40);
        assert_eq!(object.get("f3").unwrap().get(), r#""again""#);
        assert_eq!(object.iter().nth(30).unwrap().1.get(), r#""again""#);
    }

    #[test]
    fn anything_but_one_object_is_refused() {
        assert!(RawObject::parse("[1]").unwrap_err().is_data());
        assert!(RawObject::parse("null").unwrap_err().is_data());
        assert!(RawObject::parse(r#"{"a":1} x"#).unwrap_err().is_syntax());
        assert!(RawObject::parse(r#"{"a":}"#).unwrap_err().is_syntax());
        assert!(RawObject::parse(r#"{"a":1"#).unwrap_err().is_eof());
    }
}
