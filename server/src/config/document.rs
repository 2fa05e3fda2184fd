//! The config document before it is typed: every key checked against the
//! fields the raw structs declare, and every value's span and field path,
//! so that each problem names its line and its field.
//!
//! The raw structs stay the single source of which keys exist: their field
//! lists are read from their `Deserialize` impls ([`fields_of`]), so a new
//! field is known here without a second list to keep in step.

use std::{fmt, ops::Range};

use serde::{de, de::DeserializeOwned};
use toml::{
    Spanned,
    de::{DeTable, DeValue},
};

/// The field names a struct's `Deserialize` impl accepts.
pub(super) fn fields_of<T: DeserializeOwned>() -> &'static [&'static str] {
    match T::deserialize(Introspect) {
        Err(Found(Some(fields))) => fields,
        _ => &[],
    }
}

/// A deserializer that only records the field list it is asked for.
struct Introspect;

#[derive(Debug)]
struct Found(Option<&'static [&'static str]>);

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("introspection")
    }
}

impl std::error::Error for Found {}

impl de::Error for Found {
    fn custom<T: fmt::Display>(_: T) -> Self {
        Found(None)
    }
}

impl<'de> de::Deserializer<'de> for Introspect {
    type Error = Found;

    fn deserialize_struct<V: de::Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Found> {
        Err(Found(Some(fields)))
    }

    fn deserialize_any<V: de::Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Found> {
        Err(Found(None))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
        unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
    }
}

/// A table's fields, and which of them hold tables (or arrays of tables)
/// of a known shape.
pub(super) struct Shape {
    /// The keys the table may have.
    pub fields: fn() -> &'static [&'static str],
    /// The shape of the table under a key; `None` for plain values and
    /// free-form tables (a tool's input, a schema).
    pub child: fn(&str) -> Option<&'static Shape>,
}

/// One problem found while walking the document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct KeyProblem {
    /// Where.
    pub span: Range<usize>,
    /// The field path.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

/// The walk's result: unknown keys, and the path of every value by span.
#[derive(Debug, Default)]
pub(super) struct Walk {
    /// Keys the shapes don't have.
    pub unknown: Vec<KeyProblem>,
    /// Every value's span and field path.
    paths: Vec<(Range<usize>, String)>,
}

impl Walk {
    /// Walks `table` (at `path`, "" for the root) against `shape`.
    pub fn table(&mut self, table: &DeTable<'_>, shape: &Shape, path: &str) {
        let fields = (shape.fields)();
        for (key, value) in table.iter() {
            let name: &str = key.get_ref();
            let here = if path.is_empty() { name.to_owned() } else { format!("{path}.{name}") };
            self.paths.push((value.span(), here.clone()));
            if !fields.contains(&name) {
                let message = match suggest(name, fields) {
                    Some(near) => format!("unknown key {name:?}; did you mean {near:?}?"),
                    None => format!("unknown key {name:?} (known here: {})", fields.join(", ")),
                };
                self.unknown.push(KeyProblem { span: key.span(), field: here, message });
                continue;
            }
            if let Some(child) = (shape.child)(name) {
                self.value(value, child, &here);
            }
        }
    }

    fn value(&mut self, value: &Spanned<DeValue<'_>>, shape: &Shape, path: &str) {
        match value.get_ref() {
            DeValue::Table(t) => self.table(t, shape, path),
            DeValue::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let here = format!("{path}[{i}]");
                    self.paths.push((item.span(), here.clone()));
                    if let DeValue::Table(t) = item.get_ref() {
                        self.table(t, shape, &here);
                    }
                }
            }
            _ => {}
        }
    }

    /// The span of the value at `path`.
    pub fn span_of(&self, path: &str) -> Option<Range<usize>> {
        self.paths.iter().find(|(_, p)| p == path).map(|(s, _)| s.clone())
    }

    /// The path of the innermost value whose span holds `span`.
    pub fn path_of(&self, span: &Range<usize>) -> Option<&str> {
        self.paths
            .iter()
            .filter(|(s, _)| s.start <= span.start && span.end <= s.end)
            .min_by_key(|(s, _)| s.end - s.start)
            .map(|(_, p)| p.as_str())
    }
}

/// The known key closest to `key`, if it is a likely typo of it.
fn suggest(key: &str, known: &[&'static str]) -> Option<&'static str> {
    known
        .iter()
        .map(|k| (edit_distance(key, k), *k))
        .filter(|(d, k)| *d <= (k.len() / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1).min(row[j] + 1).min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Removes the value at `path` (`hooks[1].deadline_ms`, relative to
/// `table`) when it is a key's value; returns whether it did. A table or an
/// array element is left alone: removing it would renumber its siblings.
pub(super) fn remove_key(table: &mut DeTable<'_>, path: &str) -> bool {
    let Some((parents, key)) = split_last(path) else { return false };
    let mut here = table;
    for segment in parents {
        let (name, index) = match segment.split_once('[') {
            Some((name, rest)) => (name, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (segment, None),
        };
        let Some(value) = here.get_mut(name) else { return false };
        let value = match (value.get_mut(), index) {
            (DeValue::Array(items), Some(i)) => match items.get_mut(i) {
                Some(item) => item.get_mut(),
                None => return false,
            },
            (other, None) => other,
            _ => return false,
        };
        let DeValue::Table(t) = value else { return false };
        here = t;
    }
    here.remove(key).is_some()
}

/// `a[1].b.c` → (["a[1]", "b"], "c"), unless the last segment is indexed.
fn split_last(path: &str) -> Option<(Vec<&str>, &str)> {
    let mut segments: Vec<&str> = path.split('.').collect();
    let last = segments.pop()?;
    (!last.contains('[')).then_some((segments, last))
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Example {
        max_turns: u32,
        name: String,
    }

    #[test]
    fn field_lists_come_from_the_structs() {
        assert_eq!(fields_of::<Example>(), &["max_turns", "name"]);
    }

    #[test]
    fn a_keys_value_can_be_removed_by_path() {
        let text = "a = 1\n[[hooks]]\nx = 1\n[[hooks]]\nx = 2\ny = 3\n";
        let mut doc = DeTable::parse(text).unwrap().into_inner();
        assert!(remove_key(&mut doc, "hooks[1].x"));
        assert!(!remove_key(&mut doc, "hooks[1]"), "an element stays");
        assert!(!remove_key(&mut doc, "hooks[5].x"));
        assert!(remove_key(&mut doc, "a"));
        let DeValue::Array(hooks) = doc.get("hooks").unwrap().get_ref() else { panic!() };
        let DeValue::Table(second) = hooks[1].get_ref() else { panic!() };
        assert!(second.get("x").is_none() && second.get("y").is_some());
    }

    #[test]
    fn near_misses_are_suggested() {
        let known = &["max_turns", "name", "hooks"];
        assert_eq!(suggest("max_turnz", known), Some("max_turns"));
        assert_eq!(suggest("hook", known), Some("hooks"));
        assert_eq!(suggest("colour", known), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
