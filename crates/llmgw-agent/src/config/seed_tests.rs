//! The `[hash]` seed sources as the configuration reads them: fields, errors, deferral.

use super::file::tests::{error_of, OK};
use super::file::{Config, ConfigError};
use super::seed::{SeedLookup, SeedSource};

const SECRET: &str = "3141592653";

fn env(name: &str) -> Option<String> {
    (name == "LLMGW_HASH_SEED").then(|| format!("{SECRET}\n"))
}

fn with_env(text: &str) -> Result<Config, ConfigError> {
    Config::parse_with(text, SeedLookup::Read(&env))
}

fn from_env(section: &str) -> String {
    OK.replace("seed = \"0\"", section)
}

#[test]
fn the_seed_is_read_from_the_named_variable_and_never_shown() {
    let cfg = with_env(&from_env("seed_env = \"LLMGW_HASH_SEED\"")).unwrap();
    assert_eq!(cfg.hash.seed.as_deref(), Some(SECRET));
    assert_eq!(cfg.hash.seed_source, SeedSource::Env("LLMGW_HASH_SEED".to_owned()));
    assert_eq!(cfg.hash.spec().seed.as_deref(), Some(SECRET), "the feed carries the value to the filters");
    assert_eq!(cfg.hash.seed_source.describe(cfg.hash.seed.as_deref()), "from $LLMGW_HASH_SEED");
    // Validating again (as `run` does after its flags) keeps it.
    cfg.validate().unwrap();
}

#[test]
fn a_missing_or_empty_variable_is_refused_with_the_secret_to_create() {
    let e = with_env(&from_env("seed_env = \"OTHER_SEED\"")).unwrap_err();
    assert_eq!(e.field, "hash.seed_env", "{e}");
    assert!(e.message.contains("OTHER_SEED is not set") && e.message.contains("gen-seed"), "{e}");
    let empty = |_: &str| Some("  \n".to_owned());
    let e = Config::parse_with(&from_env("seed_env = \"S\""), SeedLookup::Read(&empty)).unwrap_err();
    assert_eq!(e.field, "hash.seed_env", "{e}");
}

#[test]
fn a_seed_vllm_could_not_start_with_is_refused() {
    for bad in ["REPLACE-ME", "random", "-1", "4294967296", "12345678901", "0x10", ""] {
        let e = error_of(&OK.replace("seed = \"0\"", &format!("seed = {bad:?}")));
        assert_eq!(e.field, "hash.seed", "{bad}: {e}");
        assert!(e.message.contains("PYTHONHASHSEED"), "{e}");
        let value = bad.to_owned();
        let lookup = move |_: &str| Some(value.clone());
        let e = Config::parse_with(&from_env("seed_env = \"S\""), SeedLookup::Read(&lookup)).unwrap_err();
        assert_eq!(e.field, "hash.seed_env", "{bad}: {e}");
    }
    for good in ["0", "4294967295", "42"] {
        with_env(&OK.replace("seed = \"0\"", &format!("seed = {good:?}"))).unwrap();
    }
}

#[test]
fn one_source_at_most() {
    let e = error_of(&OK.replace("seed = \"0\"", "seed = \"0\"\nseed_env = \"LLMGW_HASH_SEED\""));
    assert_eq!(e.field, "hash.seed", "{e}");
    assert!(e.message.contains("one of"), "{e}");
    let e = error_of(&OK.replace("seed = \"0\"", "seed_file = \"/s\"\nseed_env = \"LLMGW_HASH_SEED\""));
    assert_eq!(e.field, "hash.seed", "{e}");
    let e = error_of(&OK.replace("seed = \"0\"", "seed_env = \"1BAD\""));
    assert_eq!(e.field, "hash.seed_env", "{e}");
    // A replica's own section is checked alike.
    let e = error_of(&OK.replace("name = \"b\"", "name = \"b\"\nhash = { seed = \"1\", seed_env = \"X\" }"));
    assert_eq!(e.field, "replicas[1].hash.seed", "{e}");
}

#[test]
fn the_seed_file_is_read_trimmed_and_bounded() {
    let dir = std::env::temp_dir().join(format!("llmgw-seed-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("seed");
    std::fs::write(&path, format!("{SECRET}\n")).unwrap();
    let text = from_env(&format!("seed_file = {:?}", path.display().to_string()));
    let cfg = with_env(&text).unwrap();
    assert_eq!((cfg.hash.seed.as_deref(), &cfg.hash.seed_source), (Some(SECRET), &SeedSource::File(path.clone())));
    std::fs::write(&path, "7".repeat(300)).unwrap();
    let e = with_env(&text).unwrap_err();
    assert!(e.field == "hash.seed_file" && e.message.contains("more than"), "{e}");
    std::fs::remove_file(&path).unwrap();
    let e = with_env(&text).unwrap_err();
    assert!(e.field == "hash.seed_file" && e.message.contains("cannot read"), "{e}");
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn deferred_loading_reads_nothing_and_keeps_the_source() {
    let text = from_env("algo = \"xxhash\"\nseed_env = \"UNSET_IN_THIS_TEST\"").replace("algo = \"sha256_cbor\"\n", "");
    let cfg = Config::parse_with(&text, SeedLookup::Defer).unwrap();
    assert!(cfg.hash.seed_deferred());
    assert_eq!(cfg.hash.seed_source.shell_reference().as_deref(), Some("\"$UNSET_IN_THIS_TEST\""));
    // Read now, the same text is refused: the variable is not set.
    assert!(with_env(&text).is_err());
}
