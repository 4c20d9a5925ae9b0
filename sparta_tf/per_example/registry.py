"""The per-layer rule registry: which rule computes a layer's per-example gradients and norms.

:func:`register_layer_rule` maps a Keras layer class to a rule; the built-in rules
(:mod:`sparta_tf.per_example.rules`, one module per layer family) are registered the same way,
and a user registers a rule for a layer of their own just like them. A rule is

* a :class:`~sparta_tf.per_example.rules.base.LayerRule` (materialising: per-example gradients
  ``g_i``); the book-keeping engine then reduces this layer's ``g_i`` to norms itself, one layer
  at a time;
* a :class:`~sparta_tf.per_example.rules.base.GhostRule` (book-keeping: ``||g_i||^2`` and
  ``sum_i c_i g_i``), which carries its materialising rule as ``reference``; or
* a factory ``layer -> rule or None`` for rules that depend on the layer's attributes
  (``data_format``, ``groups``, ``padding``); None means "no specific rule for this instance".

Lookup (:func:`rule_for`, :func:`ghost_rule_for`): the entry of the layer's exact class, else
the nearest base class registered with ``subclasses=True``, else the generic per-example VJP
(:class:`~sparta_tf.per_example.rules.base.VjpRule`), exact for any layer. Exact-class matching
is the default because a subclass may override ``call``: it then gets the VJP of its own call.

Every user rule (``verify=True``, the default) is checked before the first DP step, on a few
real examples, against the one-example-at-a-time tape gradient of the same variables
(:func:`sparta_tf.per_example.coverage.check_coverage`): a rule whose per-example gradients,
norms or clipped sums are wrong, or that misses a variable, is refused in one line naming the
layer and the rule. The built-in rules are tested exactly by ``tests/test_layer_zoo.py`` and
registered with ``verify=False``. The table per layer: docs/layers.md; how to add a rule:
docs/add-a-layer-rule.md.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Union

import tensorflow as tf

from sparta_tf.per_example.rules.base import VJP_RULE, GhostRule, LayerRule

Rule = Union[LayerRule, GhostRule]
RuleSource = Union[Rule, type, Callable[[tf.keras.layers.Layer], Union[Rule, None]]]


@dataclasses.dataclass(frozen=True)
class Registration:
    """One registry entry: ``resolve(layer)`` gives the rule for an instance (None: the generic VJP)."""

    layer_class: type
    resolve: Callable[[tf.keras.layers.Layer], Union[Rule, None]]
    name: str
    subclasses: bool
    verify: bool


_REGISTRY: dict[type, Registration] = {}


def _resolver(rule: RuleSource) -> tuple[Callable, str]:
    """``(layer -> rule or None, the rule's name)`` for a rule instance, a rule class or a factory."""
    if isinstance(rule, (LayerRule, GhostRule)):
        return (lambda layer: rule), type(rule).__name__
    if isinstance(rule, type) and issubclass(rule, (LayerRule, GhostRule)):
        instance = rule()
        return (lambda layer: instance), rule.__name__
    if callable(rule):
        return rule, getattr(rule, "__qualname__", repr(rule))
    raise TypeError(f"register_layer_rule: {rule!r} is not a LayerRule, a GhostRule, a rule class or a "
                    "factory layer -> rule; pass one of those")


def register_layer_rule(layer_class: type, rule: RuleSource | None = None, *, subclasses: bool = False,
                        verify: bool = True, replace: bool = False):
    """Registers ``rule`` for the layers of class ``layer_class``; returns ``rule``.

    ``rule``: a :class:`LayerRule` or :class:`GhostRule` instance, a subclass of either (created
    with no arguments), or a factory ``layer -> rule or None`` (None: the generic VJP for this
    instance). Without ``rule``, returns a decorator for the rule class or factory::

        @register_layer_rule(ScaledDense)
        class ScaledDenseRule(GhostRule): ...

    ``subclasses``: also for subclasses of ``layer_class`` that have no entry of their own
    (default: the exact class only, since a subclass may override ``call``). ``verify``: check the
    rule against the tape reference before the first DP step (module doc). ``replace``: allow
    replacing an existing entry of ``layer_class`` (else a second registration is an error).
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, tf.keras.layers.Layer)):
        raise TypeError(f"register_layer_rule: {layer_class!r} is not a Keras layer class; pass the class "
                        "whose instances the rule computes")
    if rule is None:
        return lambda decorated: register_layer_rule(layer_class, decorated, subclasses=subclasses,
                                                     verify=verify, replace=replace)
    if layer_class in _REGISTRY and not replace:
        raise ValueError(f"register_layer_rule: {layer_class.__name__} already has the rule "
                         f"{_REGISTRY[layer_class].name}; pass replace=True to replace it")
    resolve, name = _resolver(rule)
    _REGISTRY[layer_class] = Registration(layer_class, resolve, name, subclasses, verify)
    return rule


def registration_for(layer: tf.keras.layers.Layer) -> Registration | None:
    """The entry that applies to ``layer``: its exact class's, else the nearest base class's
    registered with ``subclasses=True``; None when none applies."""
    kind = type(layer)
    for base in kind.__mro__:
        entry = _REGISTRY.get(base)
        if entry is not None and (base is kind or entry.subclasses):
            return entry
    return None


def _resolved(layer: tf.keras.layers.Layer) -> Rule:
    entry = registration_for(layer)
    rule = None if entry is None else entry.resolve(layer)
    if rule is not None and not isinstance(rule, (LayerRule, GhostRule)):
        raise TypeError(f"the rule factory {entry.name} registered for {type(layer).__name__} returned "
                        f"{rule!r} for layer {layer.name!r}; return a LayerRule, a GhostRule or None")
    return VJP_RULE if rule is None else rule


def rule_for(layer: tf.keras.layers.Layer) -> LayerRule:
    """The materialising rule of ``layer`` (a ghost rule's ``reference``; the generic per-example
    VJP of its own call when no entry applies)."""
    rule = _resolved(layer)
    return rule.reference if isinstance(rule, GhostRule) else rule


def ghost_rule_for(layer: tf.keras.layers.Layer) -> GhostRule:
    """The book-keeping rule of ``layer``, with the same probe point as :func:`rule_for`'s rule (a
    registered materialising rule is wrapped: its ``g_i`` reduced to norms, one layer at a time)."""
    rule = _resolved(layer)
    return rule if isinstance(rule, GhostRule) else GhostRule(rule)


def rule_name(layer: tf.keras.layers.Layer) -> str:
    """The name of the registered rule of ``layer`` (for messages), or ``"VjpRule"``."""
    entry = registration_for(layer)
    return "VjpRule" if entry is None else entry.name
