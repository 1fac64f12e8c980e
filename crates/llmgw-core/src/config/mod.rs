//! The filter's configuration (JSON in Envoy's plugin `configuration`), validated at load with
//! errors that name the offending field ([`filter_config`], the weights in [`weights`]), then
//! compiled ([`compiled`]) into what a request needs.

mod compiled;
mod filter_config;
mod weights;
pub use compiled::{Compiled, CompiledProfile, HashPins, MemoSettings};
pub use filter_config::{
    ConfigError, FilterConfig, Profile, TokenizerEndpoint, DEFAULT_APPROX_PREFIX_BYTES, DEFAULT_DESTINATION_HEADER,
};
pub use weights::WeightsConfig;
