//! JSON schemas read as OpenAI's strict mode and the open-source servers read
//! them: an object whose schema declares its properties and does not say
//! `additionalProperties` takes only those properties.
//!
//! JSON Schema itself lets such an object carry any other property, and a
//! grammar built from it lets a small model invent keys until its token limit
//! cuts the JSON (SmolLM2 asked for `{"city": {...}, "tags": [...]}` wrote
//! `"population_density_by_city": [...` without end). OpenAI's strict mode
//! accepts only declared properties, and llama.cpp's json-schema-to-grammar
//! and xgrammar default `additionalProperties` to false for the same reason.
//! llguidance has no option for it, so [`close_objects`] rewrites the schema
//! before it reaches llguidance, for strict and non-strict requests alike:
//!
//! - every object schema with `properties` or `patternProperties` and neither
//!   `additionalProperties` nor `unevaluatedProperties` gets
//!   `additionalProperties: false`, wherever it sits (`properties`, `items`,
//!   `prefixItems`, `anyOf` / `oneOf` / `allOf`, `$defs`, ...);
//!   `additionalProperties: true` or a schema for it keeps the object open, and
//!   an object that declares no properties (`{"type": "object"}`, JSON mode)
//!   stays any object;
//! - in-place compositions are closed as a whole: `allOf`, `anyOf` and
//!   `oneOf` branches apply to the same object as their parent, so a closed
//!   branch also accepts the names its parent and the other applicators
//!   declare (as `true`, the parent's own schema still applies), and a closed
//!   parent accepts its branches' names; otherwise closing each part would
//!   forbid what the others declare. A branch that is a local `$ref` (to a
//!   definition, closed on its own elsewhere), or a `$ref` beside
//!   `properties`, is inlined there for the same reason;
//! - a schema that cannot be honoured once closed is an error naming the
//!   keyword and where it is: `required` naming a property nothing declares,
//!   `minProperties` above the declared count, `additionalProperties` or
//!   `properties` of the wrong type.
//!
//! The rewrite is idempotent, and `not` / `if` / `then` / `else` are left as
//! they are (closing inside a negation would invert it; llguidance refuses
//! those keywords anyway, naming them).

use std::fmt;

use serde_json::{Map, Value};

/// A schema that cannot be honoured: the keyword at fault and where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaError {
    /// A JSON pointer from the schema's root (`#/properties/city`).
    pub path: String,
    pub keyword: &'static str,
    pub message: String,
}

impl fmt::Display for SchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` at {}: {}", self.keyword, self.path, self.message)
    }
}

impl std::error::Error for SchemaError {}

/// Deeper schemas are refused rather than risk the stack (llguidance's own
/// limits are of the same order).
const MAX_DEPTH: usize = 128;

/// The in-place applicators: their branches describe the same value as the
/// schema that holds them.
const IN_PLACE: [&str; 3] = ["allOf", "anyOf", "oneOf"];

/// Keywords whose value is one subschema (of a new value: its own object).
const ONE_SCHEMA: [&str; 7] = ["additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems", "contains", "propertyNames", "items"];

/// Keywords whose value maps names to subschemas.
const SCHEMA_MAPS: [&str; 5] = ["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"];

/// `schema` with every object that declares its properties and does not say
/// `additionalProperties` closed to them (the module doc has the rules).
pub fn close_objects(schema: &Value) -> Result<Value, SchemaError> {
    let mut out = schema.clone();
    let mut path = String::from("#");
    close(&mut out, schema, &mut path, 0, &[])?;
    Ok(out)
}

fn error(path: &str, keyword: &'static str, message: String) -> SchemaError {
    SchemaError { path: path.to_string(), keyword, message }
}

/// JSON pointer escaping of one path segment.
fn segment(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The target of a local `$ref` (`#/$defs/x`) in the original schema, where
/// it is one and it resolves; refs to other documents are llguidance's to
/// resolve or refuse.
fn local_target<'a>(root: &'a Value, reference: &Value) -> Option<&'a Value> {
    let r = reference.as_str()?;
    let pointer = r.strip_prefix('#')?;
    let target = if pointer.is_empty() { root } else { root.pointer(pointer)? };
    // A target with its own `$id` changes how the refs inside it resolve: not inlined.
    target.as_object().filter(|t| !t.contains_key("$id")).map(|_| target)
}

/// The property names an object schema declares in `properties`.
fn own_names(map: &Map<String, Value>) -> Vec<String> {
    map.get("properties").and_then(Value::as_object).map(|p| p.keys().cloned().collect()).unwrap_or_default()
}

/// The property names a schema declares in `properties` (through a local `$ref`).
fn declared(schema: &Value, root: &Value) -> Vec<String> {
    let Some(map) = schema.as_object() else { return vec![] };
    match map.get("$ref").and_then(|r| local_target(root, r)) {
        Some(target) if !map.contains_key("properties") => target.as_object().map(own_names).unwrap_or_default(),
        _ => own_names(map),
    }
}

fn push_unique(names: &mut Vec<String>, more: impl IntoIterator<Item = String>) {
    for n in more {
        if !names.contains(&n) {
            names.push(n);
        }
    }
}

/// Keywords that annotate a schema without constraining it: a `$ref` beside
/// only these is a plain reference.
const ANNOTATIONS: [&str; 5] = ["title", "description", "default", "examples", "$comment"];

/// Inlines the local refs of a composition, where the object is closed as a
/// whole (it declares properties, its parent's names reach it, or it has several
/// `allOf` branches): a branch of `allOf` / `anyOf` / `oneOf` that is a plain
/// `{"$ref": ...}`, and a `$ref` beside `properties` (moved into `allOf`). A
/// referenced definition is closed on its own; inlined, it is closed together
/// with the rest of the object, so it accepts their names.
fn inline_refs(map: &mut Map<String, Value>, root: &Value, extra: &[String]) {
    if map.contains_key("properties") {
        if let Some(target) = map.get("$ref").and_then(|r| local_target(root, r)).cloned() {
            map.remove("$ref");
            match map.get_mut("allOf").and_then(Value::as_array_mut) {
                Some(all) => all.push(target),
                None => {
                    map.insert("allOf".into(), Value::Array(vec![target]));
                }
            }
        }
    }
    let composed = map.contains_key("properties") || !extra.is_empty() || map.get("allOf").and_then(Value::as_array).is_some_and(|a| a.len() > 1);
    if !composed {
        return;
    }
    for keyword in IN_PLACE {
        let Some(branches) = map.get_mut(keyword).and_then(Value::as_array_mut) else { continue };
        for branch in branches.iter_mut() {
            let plain = branch.as_object().filter(|b| b.keys().all(|k| k == "$ref" || ANNOTATIONS.contains(&k.as_str())));
            if let Some(target) = plain.and_then(|b| b.get("$ref")).and_then(|r| local_target(root, r)).cloned() {
                *branch = target;
            }
        }
    }
}

/// Closes `node` (at `path`) and everything inside it; `extra`: names the
/// value's other in-place schemas declare, which it must also accept.
fn close(node: &mut Value, root: &Value, path: &mut String, depth: usize, extra: &[String]) -> Result<(), SchemaError> {
    if depth > MAX_DEPTH {
        return Err(error(path, "$ref", format!("the schema nests deeper than {MAX_DEPTH} levels")));
    }
    let Some(map) = node.as_object_mut() else { return Ok(()) };
    // Inlined definitions may hold compositions with refs of their own: the
    // depth bound keeps a definition that includes itself finite.
    inline_refs(map, root, extra);
    if let Some(p) = map.get("properties") {
        if !p.is_object() {
            return Err(error(path, "properties", format!("must be an object mapping names to schemas, not {p}")));
        }
    }
    if let Some(a) = map.get("additionalProperties") {
        if !a.is_object() && !a.is_boolean() {
            return Err(error(path, "additionalProperties", format!("must be true, false or a schema, not {a}")));
        }
    }
    let own = own_names(map);
    // The names each applicator's branches declare.
    let branch_names: Vec<(&str, Vec<Vec<String>>)> = IN_PLACE
        .iter()
        .filter_map(|&k| map.get(k).and_then(Value::as_array).map(|bs| (k, bs.iter().map(|b| declared(b, root)).collect())))
        .collect();
    for &(keyword, _) in &branch_names {
        let mut base: Vec<String> = extra.to_vec();
        push_unique(&mut base, own.iter().cloned());
        for (other, other_names) in &branch_names {
            // Every allOf branch applies, so each accepts its siblings' names;
            // of anyOf / oneOf alternatives, only the ones it is.
            if *other != keyword || keyword == "allOf" {
                push_unique(&mut base, other_names.iter().flatten().cloned());
            }
        }
        let branches = map.get_mut(keyword).and_then(Value::as_array_mut).expect("listed above");
        for (i, branch) in branches.iter_mut().enumerate() {
            let mark = path.len();
            path.push_str(&format!("/{keyword}/{i}"));
            close(branch, root, path, depth + 1, &base)?;
            path.truncate(mark);
        }
    }
    for keyword in SCHEMA_MAPS {
        if let Some(Value::Object(children)) = map.get_mut(keyword) {
            for (name, child) in children.iter_mut() {
                let mark = path.len();
                path.push_str(&format!("/{keyword}/{}", segment(name)));
                close(child, root, path, depth + 1, &[])?;
                path.truncate(mark);
            }
        }
    }
    for keyword in ONE_SCHEMA {
        match map.get_mut(keyword) {
            Some(child @ Value::Object(_)) => {
                let mark = path.len();
                path.push_str(&format!("/{keyword}"));
                close(child, root, path, depth + 1, &[])?;
                path.truncate(mark);
            }
            // `items` as a list (drafts before 2020-12) is `prefixItems`.
            Some(Value::Array(children)) if keyword == "items" => close_list(children, keyword, root, path, depth)?,
            _ => {}
        }
    }
    if let Some(Value::Array(children)) = map.get_mut("prefixItems") {
        close_list(children, "prefixItems", root, path, depth)?;
    }
    let declares = map.contains_key("properties") || map.contains_key("patternProperties");
    let says = map.contains_key("additionalProperties") || map.contains_key("unevaluatedProperties");
    if declares && !says {
        let mut accepted: Vec<String> = extra.to_vec();
        push_unique(&mut accepted, branch_names.iter().flat_map(|(_, n)| n.iter().flatten().cloned()));
        let properties = map.entry("properties").or_insert_with(|| Value::Object(Map::new())).as_object_mut().expect("checked above");
        for name in accepted {
            properties.entry(name).or_insert(Value::Bool(true));
        }
        map.insert("additionalProperties".into(), Value::Bool(false));
    }
    if map.get("additionalProperties") == Some(&Value::Bool(false)) && !map.contains_key("patternProperties") {
        check_closed(map, path, !says)?;
    }
    Ok(())
}

fn close_list(children: &mut [Value], keyword: &str, root: &Value, path: &mut String, depth: usize) -> Result<(), SchemaError> {
    for (i, child) in children.iter_mut().enumerate() {
        let mark = path.len();
        path.push_str(&format!("/{keyword}/{i}"));
        close(child, root, path, depth + 1, &[])?;
        path.truncate(mark);
    }
    Ok(())
}

/// A closed object must be able to hold what `required` and `minProperties`
/// ask of it. `defaulted`: closed here rather than by the schema's author,
/// which the message says, with the remedy.
fn check_closed(map: &Map<String, Value>, path: &str, defaulted: bool) -> Result<(), SchemaError> {
    let declared: Vec<&String> = map.get("properties").and_then(Value::as_object).map(|p| p.keys().collect()).unwrap_or_default();
    let why = if defaulted {
        "an object that does not say `additionalProperties` takes only its declared properties (OpenAI's strict mode; llama.cpp and xgrammar do the same); declare it in `properties`, or allow more with `\"additionalProperties\": true`"
    } else {
        "`additionalProperties` is false; declare it in `properties`"
    };
    if let Some(required) = map.get("required").and_then(Value::as_array) {
        if let Some(missing) = required.iter().filter_map(Value::as_str).find(|r| !declared.iter().any(|d| d.as_str() == *r)) {
            return Err(error(path, "required", format!("`{missing}` is required but not a declared property: {why}")));
        }
    }
    if let Some(min) = map.get("minProperties").and_then(Value::as_u64) {
        if min > declared.len() as u64 {
            return Err(error(path, "minProperties", format!("{min} properties are asked for but only {} are declared: {why}", declared.len())));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn closed(v: Value) -> Value {
        close_objects(&v).unwrap_or_else(|e| panic!("{v}: {e}"))
    }

    #[test]
    fn objects_that_declare_properties_take_only_them_at_every_depth() {
        let s = json!({
            "type": "object",
            "properties": {
                "city": {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}}},
                "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": "string"}}}},
                "pair": {"type": "array", "prefixItems": [{"type": "object", "properties": {"a": {}}}]},
                "either": {"anyOf": [{"type": "object", "properties": {"x": {}}}, {"type": "null"}]},
                "item": {"$ref": "#/$defs/item"}
            },
            "$defs": {"item": {"type": "object", "properties": {"price": {"type": "number"}}}}
        });
        let c = closed(s);
        for pointer in ["", "/properties/city", "/properties/tags/items", "/properties/pair/prefixItems/0", "/properties/either/anyOf/0", "/$defs/item"] {
            assert_eq!(c.pointer(&format!("{pointer}/additionalProperties")), Some(&json!(false)), "{pointer}: {c}");
        }
        // What is not an object schema with properties is left as it was.
        assert_eq!(c.pointer("/properties/either/anyOf/1"), Some(&json!({"type": "null"})));
        assert_eq!(c.pointer("/properties/item"), Some(&json!({"$ref": "#/$defs/item"})));
        assert_eq!(c.pointer("/properties/city/properties"), Some(&json!({"name": {"type": "string"}, "population": {"type": "integer"}})));
    }

    #[test]
    fn open_objects_and_objects_without_properties_stay_open() {
        for s in [
            json!({"type": "object"}),
            json!({"type": "object", "properties": {"a": {}}, "additionalProperties": true}),
            json!({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}),
            json!({"type": "object", "required": ["a"]}),
            json!({"type": "string", "enum": ["a"]}),
            json!(true),
            // `const` and `enum` values are data, never schemas.
            json!({"const": {"properties": {"a": 1}}}),
            // Negations keep their meaning.
            json!({"not": {"properties": {"a": {"const": 1}}}}),
        ] {
            assert_eq!(closed(s.clone()), s);
        }
        let c = closed(json!({"properties": {"a": {"properties": {"b": {}}}}, "additionalProperties": true}));
        assert_eq!(c.pointer("/additionalProperties"), Some(&json!(true)));
        assert_eq!(c.pointer("/properties/a/additionalProperties"), Some(&json!(false)), "an open parent does not open its children");
    }

    #[test]
    fn compositions_are_closed_as_one_object() {
        // The branches of anyOf accept the parent's names and their own, not each other's.
        let c = closed(json!({"type": "object", "properties": {"kind": {"type": "string"}}, "anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}));
        assert_eq!(c["properties"], json!({"kind": {"type": "string"}, "a": true, "b": true}));
        assert_eq!(c["anyOf"][0], json!({"properties": {"a": {}, "kind": true}, "additionalProperties": false}));
        assert_eq!(c["anyOf"][1], json!({"properties": {"b": {}, "kind": true}, "additionalProperties": false}));
        // allOf branches each accept every branch's names.
        let c = closed(json!({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}, "required": ["b"]}]}));
        assert_eq!(c["allOf"][0], json!({"properties": {"a": {}, "b": true}, "additionalProperties": false}));
        assert_eq!(c["allOf"][1], json!({"properties": {"b": {}, "a": true}, "required": ["b"], "additionalProperties": false}));
        assert!(c.get("additionalProperties").is_none(), "a parent that declares nothing is not closed itself");
        // A branch without properties (a `required` alternative) constrains nothing and stays as it is.
        let c = closed(json!({"properties": {"a": {}, "b": {}}, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}));
        assert_eq!(c["oneOf"], json!([{"required": ["a"]}, {"required": ["b"]}]));
        assert_eq!(c["additionalProperties"], json!(false));
        // A $ref among allOf branches is inlined, so the definition's closing does not forbid the sibling's names.
        let c = closed(json!({"$defs": {"base": {"properties": {"id": {"type": "integer"}}}}, "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"extra": {}}}]}));
        assert_eq!(c["allOf"][0], json!({"properties": {"id": {"type": "integer"}, "extra": true}, "additionalProperties": false}));
        assert_eq!(c.pointer("/$defs/base/additionalProperties"), Some(&json!(false)));
        // So is one among the alternatives of an object that declares properties of its own.
        let c = closed(json!({"$defs": {"a": {"properties": {"x": {}}}}, "properties": {"kind": {}}, "anyOf": [{"$ref": "#/$defs/a", "description": "an a"}, {"properties": {"y": {}}}]}));
        assert_eq!(c["anyOf"][0], json!({"properties": {"x": {}, "kind": true}, "additionalProperties": false}));
        // A union of references alone (pydantic's) keeps them: each definition is closed on its own.
        let union = json!({"$defs": {"a": {"properties": {"x": {}}}}, "properties": {"u": {"oneOf": [{"$ref": "#/$defs/a"}]}}});
        assert_eq!(closed(union).pointer("/properties/u/oneOf/0"), Some(&json!({"$ref": "#/$defs/a"})));
        // A $ref beside properties becomes a branch of allOf.
        let c = closed(json!({"$defs": {"base": {"properties": {"id": {}}}}, "$ref": "#/$defs/base", "properties": {"name": {}}}));
        assert!(c.get("$ref").is_none(), "{c}");
        assert_eq!(c["allOf"][0], json!({"properties": {"id": {}, "name": true}, "additionalProperties": false}));
        assert_eq!(c["properties"], json!({"name": {}, "id": true}));
    }

    #[test]
    fn closing_is_idempotent() {
        for s in [
            json!({"properties": {"a": {"properties": {"b": {}}}}, "anyOf": [{"properties": {"c": {}}}], "$defs": {"d": {"properties": {"e": {}}}}}),
            json!({"$defs": {"base": {"properties": {"id": {}}}}, "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"x": {}}}]}),
        ] {
            let once = closed(s);
            assert_eq!(closed(once.clone()), once);
        }
    }

    #[test]
    fn schemas_that_cannot_be_honoured_name_the_keyword_and_where() {
        for (s, keyword, path) in [
            (json!({"properties": {"a": {}}, "required": ["a", "b"]}), "required", "#"),
            (json!({"properties": {"c": {"properties": {"a": {}}, "minProperties": 2}}}), "minProperties", "#/properties/c"),
            (json!({"items": {"properties": {"a": {}}, "additionalProperties": 3}}), "additionalProperties", "#/items"),
            (json!({"$defs": {"x/y": {"properties": []}}}), "properties", "#/$defs/x~1y"),
            (json!({"properties": {"a": {}}, "required": ["b"], "additionalProperties": false}), "required", "#"),
        ] {
            let e = close_objects(&s).unwrap_err();
            assert_eq!((e.keyword, e.path.as_str()), (keyword, path), "{s}: {e}");
            assert!(e.to_string().contains(keyword), "{e}");
        }
        // Open objects may require what they do not declare.
        assert!(close_objects(&json!({"properties": {"a": {}}, "required": ["b"], "additionalProperties": true})).is_ok());
        // A definition that includes itself ends at the depth bound, as an error rather than a crash.
        let e = close_objects(&json!({"$defs": {"a": {"properties": {"x": {}}, "allOf": [{"$ref": "#/$defs/a"}, {"properties": {"y": {}}}]}}, "$ref": "#/$defs/a"})).unwrap_err();
        assert_eq!(e.keyword, "$ref", "{e}");
        assert!(e.path.starts_with("#/$defs/a/allOf/0/allOf/0"), "{e}");
    }
}
