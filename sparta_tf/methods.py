"""Named fine-tuning methods: what each trains, and how its mask is chosen.

=============  ===========================================  ==========================================
method         trainable set                                mask selection (privacy cost)
=============  ===========================================  ==========================================
``all``        every trainable variable                     none
``last``       head + normalisation parameters              none
``bitfit``     biases + norms + head (DP-BitFit)            none
``mp``         biases + norms + head + top-``|W_old|``       public pre-trained weights (free)
               entries per layer (paper Alg. 4)
``random``     biases + norms + head + random rows          seeded, data-independent (free)
               (or entries) per layer
``sparta``     warm-up: biases + norms + head; then + the    one epoch of private row scores
               selected rows per layer                      ``sum_abs`` / ``abs_sum`` (= 1 epoch of DP-SGD)
``dpsgd_grad`` as sparta, entries                           one epoch of averaged noisy DP-SGD
                                                            gradients (paper Alg. 2; = 1 epoch)
``oracle``     as sparta, entries                           one epoch of true ``|g|`` (paper Alg. 3):
                                                            NOT differentially private
``x_bitfit``   X epochs every parameter, then bias terms    none (DP-BiTFiT two-phase, Bu et al. 2024)
               only (biases + normalisation offsets)
``dp_frost``   the partitions (layers) PSEL selects          T noisy partition-magnitude rounds at rate
                                                            q_ps; r_eps of the budget to training
``dp_ssgd``    kept entries after pre-pruning, a random or   random/Synflow free; DP-SNIP one Gaussian
               magnitude subset of them at every step       mechanism; dropping is free
=============  ===========================================  ==========================================

"Head" is the classifier (a freshly initialised layer in transfer learning),
"norms" the scale/offset of GroupNorm/LayerNorm; see :mod:`sparta_tf.groups`.
Variables with role ``other`` (embeddings, positional embeddings) are frozen
except by ``all``.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from sparta_tf import trainable
from sparta_tf.groups import parameter_table
from sparta_tf.trainable import TrainableSet, VariableSelection


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    name: str
    roles: tuple[str, ...]  # roles trained densely (after any warm-up)
    selection: str | None = None  # "static" (mask before training) or "private"/"nonprivate" (selection epoch)
    score: str | None = None  # selection score for selection-epoch methods
    granularity: str = "row"  # default granularity of the mask
    private: bool = True


_ALWAYS = ("bias", "norm", "head")

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("all", ("kernel", "bias", "norm", "head", "other")),
        MethodSpec("last", ("norm", "head")),
        MethodSpec("bitfit", _ALWAYS),
        MethodSpec("mp", _ALWAYS, selection="static", granularity="entry"),
        MethodSpec("random", _ALWAYS, selection="static", granularity="row"),
        MethodSpec("sparta", _ALWAYS, selection="epoch", score="sum_abs", granularity="row"),
        MethodSpec("dpsgd_grad", _ALWAYS, selection="epoch", score="signed", granularity="entry"),
        MethodSpec("oracle", _ALWAYS, selection="epoch", score="oracle", granularity="entry", private=False),
        MethodSpec("x_bitfit", ("bias",), selection="two_phase"),
        # Trainable sets chosen by their own modules before fit (sparta_tf.selection.frost, sparta_tf.ssgd):
        MethodSpec("dp_frost", (), selection="external"),
        MethodSpec("dp_ssgd", (), selection="external"),
    )
}


def method_spec(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    return METHODS[name]


def dense_selections(
    model: tf.keras.Model, roles: tuple[str, ...], head=None, head_learning_rate_scale: float = 1.0
) -> list[VariableSelection]:
    """Whole variables of the given roles, the head's with its learning-rate scale."""
    return [
        trainable.dense(p.variable, head_learning_rate_scale if p.role == "head" else 1.0)
        for p in parameter_table(model, head)
        if p.role in roles
    ]


def bias_terms_set(model: tf.keras.Model, head=None, learning_rate_scale: float = 1.0) -> TrainableSet:
    """DP-BiTFiT's trainable set: every bias term (layer biases and normalisation offsets).

    The head's kernel and the normalisation scales are frozen, as in the
    DP-BiTFiT paper's two-phase ``X+BiTFiT`` (its Appendix E.3 trains no
    last-layer weights in the bias phase).
    """
    selections = []
    for p in parameter_table(model, head):
        is_offset = p.role == "norm" and p.variable is getattr(_layer_of(model, p.layer), "beta", None)
        is_bias = p.role in ("bias", "head") and p.variable.name.endswith("bias:0")
        if is_bias or is_offset:
            selections.append(trainable.dense(p.variable, learning_rate_scale))
    return TrainableSet(selections)


def _layer_of(model: tf.keras.Model, name: str):
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if layer.name == name:
            return layer
    return None


def warmup_set(model: tf.keras.Model, head=None, head_learning_rate_scale: float = 1.0) -> TrainableSet:
    """The warm-up (DP-BitFit) set: biases + norms + head."""
    return TrainableSet(dense_selections(model, _ALWAYS, head, head_learning_rate_scale))


def trainable_set(
    model: tf.keras.Model,
    method: str,
    mask: list[VariableSelection] | None = None,
    head=None,
    head_learning_rate_scale: float = 1.0,
) -> TrainableSet:
    """The trainable set of ``method`` once its mask (if any) is known."""
    spec = method_spec(method)
    if spec.selection == "two_phase":
        return bias_terms_set(model, head)
    if spec.selection == "external":
        raise ValueError(f"method {method!r} chooses its trainable set itself (see sparta_tf.methods)")
    dense = dense_selections(model, spec.roles, head, head_learning_rate_scale)
    if spec.selection in ("static", "epoch") and mask is None:
        raise ValueError(f"method {method!r} needs a mask; select one first")
    return TrainableSet(dense + list(mask or []))
