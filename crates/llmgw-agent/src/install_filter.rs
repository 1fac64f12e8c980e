//! `install-filter`: copy the filter the image carries to where Envoy loads it. The agent's image
//! has no shell and no `cp` (a static binary on an empty base), so the init container that fills
//! Envoy's volume runs this instead.

use clap::Args;
use std::path::{Path, PathBuf};

/// Where the agent's image keeps `llmgw.wasm`.
pub const IMAGE_FILTER_PATH: &str = "/usr/share/llmgw/llmgw.wasm";

/// The first bytes of every WebAssembly binary module: `\0asm`, version 1.
const WASM_HEADER: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00];

#[derive(Args)]
pub struct InstallFilterArgs {
    /// The filter to copy.
    #[arg(long, default_value = IMAGE_FILTER_PATH)]
    from: PathBuf,
    /// Where to write it (Envoy's `code.local.filename`).
    #[arg(long)]
    to: PathBuf,
}

/// Copies `from` to `to` through a temporary file in `to`'s directory, renamed into place, so
/// Envoy never sees half a module; refuses a source that is not a WebAssembly module.
pub fn install(a: &InstallFilterArgs) -> Result<(), String> {
    let bytes = std::fs::read(&a.from).map_err(|e| format!("{}: {e}", a.from.display()))?;
    if !bytes.starts_with(&WASM_HEADER) {
        return Err(format!("{}: not a WebAssembly module (no \\0asm version 1 header)", a.from.display()));
    }
    let dir = a.to.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = a.to.file_name().ok_or_else(|| format!("{}: not a file path", a.to.display()))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    std::fs::write(&tmp, &bytes).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &a.to).map_err(|e| format!("{} -> {}: {e}", tmp.display(), a.to.display()))?;
    println!("{} -> {} ({} bytes)", a.from.display(), a.to.display(), bytes.len());
    Ok(())
}
