//! `schema/config.schema.json`, the example config and the code agree: the
//! example validates and loads; every key the code accepts is in the schema
//! and every schema key is accepted; schema defaults are the code's defaults.
//! (No servers needed.)

use std::collections::BTreeSet;

use outbox_relay::config::Config;

const MINIMAL: &str = r#"
[postgres]
url = "postgres://u:p@127.0.0.1:5432/db"
[rabbitmq]
url = "amqp://u:p@127.0.0.1:5672/%2f"
exchange = "outbox"
"#;

fn schema() -> serde_json::Value {
    serde_json::from_str(include_str!("../../schema/config.schema.json")).unwrap()
}

fn load(text: &str) -> Result<Config, String> {
    Config::from_toml(text, "test.toml", std::iter::empty()).map_err(|e| e.to_string())
}

fn with_key(section: &str, key: &str, value: &toml::Value) -> String {
    let mut t: toml::Table = MINIMAL.parse().unwrap();
    t.entry(section)
        .or_insert_with(|| toml::Value::Table(Default::default()))
        .as_table_mut()
        .unwrap()
        .insert(key.to_owned(), value.clone());
    toml::to_string(&t).unwrap()
}

fn json_to_toml(v: &serde_json::Value) -> toml::Value {
    match v {
        serde_json::Value::String(s) => toml::Value::String(s.clone()),
        serde_json::Value::Number(n) => toml::Value::Integer(n.as_i64().unwrap()),
        serde_json::Value::Bool(b) => toml::Value::Boolean(*b),
        other => panic!("unexpected default {other}"),
    }
}

#[test]
fn example_config_validates_and_loads() {
    let text = include_str!("../../examples/outbox-relay.toml");
    let as_json = serde_json::to_value(text.parse::<toml::Table>().unwrap()).unwrap();
    let v = jsonschema::validator_for(&schema()).unwrap();
    let errors: Vec<String> = v.iter_errors(&as_json).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    load(text).unwrap();
}

#[test]
fn schema_keys_are_exactly_the_keys_the_code_accepts() {
    let schema = schema();
    for (section, spec) in schema["properties"].as_object().unwrap() {
        let in_schema: BTreeSet<String> = spec["properties"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        // serde lists the fields it expects when it meets an unknown one.
        let err = load(&with_key(section, "no_such_key", &toml::Value::Integer(1))).unwrap_err();
        let expected = err
            .split("expected ")
            .nth(1)
            .and_then(|s| s.lines().next())
            .unwrap_or_else(|| panic!("{err}"));
        let in_code: BTreeSet<String> = expected
            .trim_start_matches("one of ")
            .split(", ")
            .map(|s| s.trim().trim_matches('`').to_owned())
            .collect();
        assert_eq!(
            in_schema, in_code,
            "[{section}] keys differ between schema and code"
        );
    }
}

#[test]
fn schema_defaults_are_the_code_defaults() {
    let schema = schema();
    let baseline = format!("{:?}", load(MINIMAL).unwrap());
    let mut checked = 0;
    for (section, spec) in schema["properties"].as_object().unwrap() {
        for (key, prop) in spec["properties"].as_object().unwrap() {
            if let Some(default) = prop.get("default") {
                let text = with_key(section, key, &json_to_toml(default));
                let cfg =
                    load(&text).unwrap_or_else(|e| panic!("{section}.{key} = {default}: {e}"));
                assert_eq!(
                    format!("{cfg:?}"),
                    baseline,
                    "{section}.{key}: schema default {default} is not the code's default"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "only {checked} defaults checked");
}

#[test]
fn several_outboxes_validate_and_load() {
    let text = format!(
        "{MINIMAL}\n[[outbox]]\ntable = \"orders.outbox\"\n\n[[outbox]]\ntable = \"billing.outbox\"\n\
         exchange = \"billing\"\ndead_letter_exchange = \"billing.dead\"\n\n[[outbox]]\n\
         source = \"message\"\nprefix = \"audit\"\n"
    );
    let as_json = serde_json::to_value(text.parse::<toml::Table>().unwrap()).unwrap();
    let v = jsonschema::validator_for(&schema()).unwrap();
    let errors: Vec<String> = v.iter_errors(&as_json).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(load(&text).unwrap().outboxes.len(), 3);
    // An empty list, or a list of lists, is refused by both.
    for bad in ["outbox = []\n", "outbox = [[{ table = \"t\" }]]\n"] {
        let text = format!("{bad}{MINIMAL}");
        let as_json = serde_json::to_value(text.parse::<toml::Table>().unwrap()).unwrap();
        assert!(!v.is_valid(&as_json), "{bad}");
        assert!(load(&text).is_err(), "{bad}");
    }
}
