//! Weights out of range: the error every policy's weights give.

/// A weight that is out of range: the field (as the configuration names it) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidWeight {
    pub field: &'static str,
    pub message: &'static str,
}

/// Checks that each of `values` is a finite, non-negative number.
pub fn non_negative(values: &[(&'static str, f64)]) -> Result<(), InvalidWeight> {
    match values.iter().find(|(_, v)| !v.is_finite() || *v < 0.0) {
        Some(&(field, _)) => Err(InvalidWeight { field, message: "must be a finite, non-negative number" }),
        None => Ok(()),
    }
}
