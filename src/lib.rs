//! llmgw.wasm: the Envoy (proxy-wasm) filter. It validates its configuration at load; routing
//! builds on `llmgw-core`.

use llmgw_core::config::FilterConfig;
use proxy_wasm::traits::{Context, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { config: None }) });
}}

struct Root {
    config: Option<FilterConfig>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = self.get_plugin_configuration().unwrap_or_default();
        match FilterConfig::from_json(&raw) {
            Ok(cfg) => {
                log::info!("llmgw: configured {} profile(s)", cfg.profiles.len());
                self.config = Some(cfg);
                true
            }
            Err(e) => {
                log::error!("{e}");
                false
            }
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        None
    }
}
