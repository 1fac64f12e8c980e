//! Where a `[hash]` section's seed comes from: written in the file (`seed`), or read when the
//! configuration is loaded from an environment variable (`seed_env`) or a file (`seed_file`), the
//! two ways a Kubernetes Secret reaches a container. The seed is the replicas' `PYTHONHASHSEED`:
//! whoever knows it can compute the block hashes of any prompt they guess, so a deployment keeps
//! its own in a Secret rather than in a manifest ([`generate`] makes one).
//!
//! ```toml
//! [hash]
//! seed_env = "LLMGW_HASH_SEED"     # or seed_file = "/etc/llmgw/hash-seed/seed"; not with seed
//! ```

use std::io::Read;
use std::path::{Path, PathBuf};

/// Longest seed file read (a seed is at most ten digits and a newline).
pub const MAX_SEED_FILE_BYTES: u64 = 256;

/// Where the seed of a `[hash]` section came from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SeedSource {
    /// `seed` in the file, or none at all.
    #[default]
    Written,
    /// `seed_env`: this environment variable.
    Env(String),
    /// `seed_file`: this file.
    File(PathBuf),
}

impl SeedSource {
    /// Whether the seed is kept out of the configuration file (a Secret's), and so out of the
    /// output of commands that print settings.
    pub fn is_secret(&self) -> bool {
        !matches!(self, SeedSource::Written)
    }

    /// How a shell started beside the replicas would obtain the seed (`vllm-args`' line):
    /// `"$NAME"` or `"$(cat PATH)"`; `None` for a written seed.
    pub fn shell_reference(&self) -> Option<String> {
        match self {
            SeedSource::Written => None,
            SeedSource::Env(name) => Some(format!("\"${name}\"")),
            SeedSource::File(path) => {
                Some(format!("\"$(cat '{}')\"", path.display().to_string().replace('\'', "'\\''")))
            }
        }
    }

    /// The seed as logs and doctor name it: the value only when it is written in the file.
    pub fn describe(&self, seed: Option<&str>) -> String {
        match (self, seed) {
            (SeedSource::Env(name), _) => format!("from ${name}"),
            (SeedSource::File(path), _) => format!("from {}", path.display()),
            (SeedSource::Written, Some(s)) => format!("\"{s}\""),
            (SeedSource::Written, None) => "unset".to_owned(),
        }
    }
}

/// Whether loading reads the seed's variable or file now.
#[derive(Clone, Copy)]
pub enum SeedLookup<'a> {
    /// Read it (`run`, `launch`, `doctor`, `check-config`), the variable through this lookup.
    Read(&'a dyn Fn(&str) -> Option<String>),
    /// Leave it unread (`vllm-args` prints a reference to it; `publish` never hashes).
    Defer,
}

/// The process environment, for [`SeedLookup::Read`].
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Checks a seed as CPython checks `PYTHONHASHSEED` at start (vLLM would not start with
/// anything else): a decimal integer from 0 to 4294967295. (`random` is refused too: vLLM would
/// hash that word, a seed everybody knows.)
pub fn check_python_hash_seed(seed: &str) -> Result<(), String> {
    let digits = !seed.is_empty() && seed.len() <= 10 && seed.bytes().all(|b| b.is_ascii_digit());
    if digits && seed.parse::<u64>().is_ok_and(|v| v <= u64::from(u32::MAX)) {
        return Ok(());
    }
    let shown: String = seed.chars().take(40).collect();
    Err(format!(
        "{shown:?} is not a PYTHONHASHSEED vLLM can start with: a decimal integer from 0 to 4294967295 \
         (`llmgw-agent gen-seed` makes one)"
    ))
}

/// A fresh seed from the operating system's randomness: a decimal integer below 2^32, the most
/// `PYTHONHASHSEED` can hold.
pub fn generate() -> std::io::Result<String> {
    let mut b = [0u8; 4];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b).to_string())
}

fn valid_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn read_seed_file(path: &Path) -> Result<String, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut text = String::new();
    f.take(MAX_SEED_FILE_BYTES.saturating_add(1))
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if u64::try_from(text.len()).map_or(true, |n| n > MAX_SEED_FILE_BYTES) {
        return Err(format!("{} holds more than {MAX_SEED_FILE_BYTES} bytes: not a seed", path.display()));
    }
    Ok(text)
}

/// The seed settings of one `[hash]` section, resolved: `seed` filled from `seed_env` or
/// `seed_file` (with [`SeedLookup::Read`]; both are emptied), where it came from, and checked.
/// An error names the field it is about (`seed`, `seed_env`, `seed_file`) and why.
pub fn resolve(
    seed: &mut Option<String>,
    seed_env: &mut Option<String>,
    seed_file: &mut Option<PathBuf>,
    lookup: SeedLookup<'_>,
) -> Result<SeedSource, (&'static str, String)> {
    let set = [seed.is_some(), seed_env.is_some(), seed_file.is_some()];
    if set.iter().filter(|s| **s).count() > 1 {
        return Err(("seed", "set one of seed, seed_env and seed_file".to_owned()));
    }
    if let Some(name) = seed_env.take() {
        if !valid_env_name(&name) {
            return Err(("seed_env", format!("{name:?} is not an environment variable name")));
        }
        if let SeedLookup::Read(env) = lookup {
            let value = env(&name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty()).ok_or_else(|| {
                (
                    "seed_env",
                    format!(
                        "the environment variable {name} is not set: the shipped manifests fill it from the Secret \
                         llmgw-hash-seed (key seed), which each deployment creates with its own seed \
                         (`llmgw-agent gen-seed`)"
                    ),
                )
            })?;
            check_python_hash_seed(&value).map_err(|m| ("seed_env", format!("${name}: {m}")))?;
            *seed = Some(value);
        }
        return Ok(SeedSource::Env(name));
    }
    if let Some(path) = seed_file.take() {
        if let SeedLookup::Read(_) = lookup {
            let value = read_seed_file(&path).map_err(|m| ("seed_file", m))?.trim().to_owned();
            if value.is_empty() {
                return Err(("seed_file", format!("{} is empty", path.display())));
            }
            check_python_hash_seed(&value).map_err(|m| ("seed_file", format!("{}: {m}", path.display())))?;
            *seed = Some(value);
        }
        return Ok(SeedSource::File(path));
    }
    if let Some(s) = seed.as_deref() {
        check_python_hash_seed(s).map_err(|m| ("seed", m))?;
    }
    Ok(SeedSource::Written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_seeds_are_valid_and_differ() {
        let a = generate().unwrap();
        let b = generate().unwrap();
        check_python_hash_seed(&a).unwrap();
        check_python_hash_seed(&b).unwrap();
        // 2^-32 of a false alarm.
        assert_ne!(a, b);
    }

    #[test]
    fn only_what_cpython_starts_with_is_a_seed() {
        for bad in ["REPLACE-ME", "random", "-1", "4294967296", "12345678901", " 7", "0x10", "", "+5"] {
            assert!(check_python_hash_seed(bad).is_err(), "{bad}");
        }
        for good in ["0", "4294967295", "42", "007"] {
            check_python_hash_seed(good).unwrap();
        }
    }
}
