//! The model names metrics may carry as a label. A client names any model it likes, so a
//! label taken from the request would let clients grow the label set without bound: names
//! outside a known list are counted as `other`.
//!
//! The list is `--metric-models` when it is given (fixed), else the upstream's own
//! `GET /v1/models` ids, which the upstream probe hands to [`ModelLabels::replace`] whenever
//! it reads them. The built-in source's model is always known. A turn resolves its label once,
//! at its start ([`ModelLabels::label`]); nothing per token looks at the list.

use std::{collections::BTreeSet, sync::Arc};

use arc_swap::ArcSwap;

use crate::source::builtin::MODEL_NAME;

/// The label of a model outside the list.
pub const OTHER: &str = "other";
/// The label of a request that named no model (refused before its body was read, health
/// checks, `/v1/models`).
pub const NONE: &str = "none";
/// Most names the list keeps (an upstream's list beyond it is cut, in its sorted order).
pub const MAX_MODELS: usize = 64;

/// The known model names.
#[derive(Debug)]
pub struct ModelLabels {
    known: ArcSwap<BTreeSet<Arc<str>>>,
    /// Set by `--metric-models`: the upstream's list does not replace it.
    fixed: bool,
}

impl Default for ModelLabels {
    fn default() -> Self {
        ModelLabels {
            known: ArcSwap::from_pointee(Self::with_builtin(Vec::new())),
            fixed: false,
        }
    }
}

impl ModelLabels {
    /// A fixed list (`--metric-models`), or, when `configured` is empty, an empty list the
    /// upstream's model ids fill.
    pub fn new(configured: &[String]) -> Self {
        ModelLabels {
            known: ArcSwap::from_pointee(Self::with_builtin(configured.to_vec())),
            fixed: !configured.is_empty(),
        }
    }

    fn with_builtin(names: Vec<String>) -> BTreeSet<Arc<str>> {
        let mut set: BTreeSet<Arc<str>> = names
            .into_iter()
            .filter(|n| !n.is_empty())
            .map(Into::into)
            .collect();
        while set.len() > MAX_MODELS {
            set.pop_last();
        }
        set.insert(MODEL_NAME.into());
        set
    }

    /// The upstream's model ids (from its `GET /v1/models`): the new list, unless
    /// `--metric-models` fixed it. Returns whether it was applied. Callable from any thread;
    /// turns that started before keep the label they resolved.
    pub fn replace(&self, ids: Vec<String>) -> bool {
        if self.fixed {
            return false;
        }
        self.known.store(Arc::new(Self::with_builtin(ids)));
        true
    }

    /// The label for `model`: its name if known, else `other` (`none` when no model was named).
    pub fn label(&self, model: Option<&str>) -> Arc<str> {
        let Some(model) = model else {
            return NONE.into();
        };
        self.known
            .load()
            .get(model)
            .map_or_else(|| OTHER.into(), Arc::clone)
    }

    /// Whether the list is `--metric-models`'s.
    pub fn is_fixed(&self) -> bool {
        self.fixed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_outside_the_list_are_other_and_builtin_is_always_known() {
        let m = ModelLabels::default();
        assert_eq!(&*m.label(Some(MODEL_NAME)), MODEL_NAME);
        assert_eq!(&*m.label(Some("llama-3")), OTHER);
        assert_eq!(&*m.label(None), NONE);
        assert!(m.replace(vec!["llama-3".into(), "qwen".into()]));
        assert_eq!(&*m.label(Some("llama-3")), "llama-3");
        assert_eq!(&*m.label(Some("qwen")), "qwen");
        assert_eq!(&*m.label(Some("made-up")), OTHER);
        assert_eq!(&*m.label(Some(MODEL_NAME)), MODEL_NAME);
        assert!(m.replace(vec!["qwen".into()]));
        assert_eq!(&*m.label(Some("llama-3")), OTHER, "replaced, not merged");
    }

    #[test]
    fn a_configured_list_is_fixed_and_the_list_is_bounded() {
        let m = ModelLabels::new(&["a".into()]);
        assert!(m.is_fixed());
        assert!(!m.replace(vec!["b".into()]));
        assert_eq!(&*m.label(Some("a")), "a");
        assert_eq!(&*m.label(Some("b")), OTHER);
        let many: Vec<String> = (0..1000).map(|i| format!("m{i:04}")).collect();
        let m = ModelLabels::default();
        m.replace(many);
        assert_eq!(&*m.label(Some("m0000")), "m0000");
        assert_eq!(&*m.label(Some("m0999")), OTHER, "beyond {MAX_MODELS}");
        assert_eq!(m.known.load().len(), MAX_MODELS + 1);
    }
}
