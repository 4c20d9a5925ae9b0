"""The ``Method`` interface and its registry: a fine-tuning method as one class bound to its spec.

A method trains a model with DP-SGD for ``T`` epochs in consecutive
*phases* (:class:`~sparta_tf.method_spec.Phase`): e.g. SPARTA's ``warmup``
(``T0`` epochs), ``selection`` (1 epoch that releases row scores and
updates nothing) and ``sparse`` (the rest). Every step of every phase is
one Poisson-subsampled Gaussian mechanism with the run's ``(q, sigma)``.
Some methods also run mechanisms *before* training (DP-FROST's selection
rounds, DP-SNIP, the selection epoch of a loaded mask). The same phases and
mechanisms feed the privacy plan (:mod:`sparta_tf.privacy.plan`) and the
fit, so the plan's ledger events are the run's.

A method is one class that names its spec, the TensorFlow-free data of
:mod:`sparta_tf.method_spec` (name, options with defaults and valid values,
phase templates, privacy)::

    class BitFit(RoleMethod, spec=method_spec.SPECS["bitfit"]): ...

Creating the class registers it in :data:`METHODS` under ``spec.name``
(one class per name; a built-in name only with the built-in spec object),
and its ``name``, ``options`` and ``private`` follow from the spec. Its
own options, checked and defaulted by the spec, become attributes of the
same names (a number option a ``float``); every method also takes ``head``,
``head_learning_rate_scale``, ``mask_dir`` and ``verbose``
(:data:`COMMON_OPTIONS`).

The hooks, all with defaults but :meth:`Method.enter`:

* plan: :meth:`~Method.phases`, :meth:`~Method.mechanisms_before_training`,
  :attr:`~Method.training_share`, :meth:`~Method.nonprivate_reasons`,
  :meth:`~Method.make_dp_model`, and on the model before any data is touched
  :meth:`~Method.check` and :meth:`~Method.planned_trainable` (the dry run's
  column);
* phases, driven by :class:`sparta_tf.callbacks.MethodCallback` inside
  ``DPModel.fit``::

    dp = method.make_dp_model(model, **dp_kwargs)              # DPModel, or DP-SSGD's SSGDModel
    info = method.prepare(dp, x, y, loss, plan, first_epoch)   # before fit (users=ids at user level)
    method.start(dp, epochs, first_epoch)                      # on_train_begin: masks, provenance
    method.enter(phase, dp)                                    # first epoch of each phase
    method.leave(phase, dp)                                    # after its last epoch

* checkpoints: :attr:`~Method.trained_selections`, the coordinates chosen from data that the method trains
  with now (a mask, DP-FROST's partitions, DP-SSGD's kept entries), whose digest a checkpoint records so
  that a resumed run cannot train others.
"""

from __future__ import annotations

import abc
import weakref
from typing import Any, ClassVar

import tensorflow as tf

from sparta_tf import method_spec
from sparta_tf.method_spec import MethodSpec, Phase
from sparta_tf.privacy.plan import Mechanism

COMMON_OPTIONS = ("head", "head_learning_rate_scale", "mask_dir", "verbose")
"""The options every method takes besides its spec's."""

METHODS: dict[str, type[Method]] = {}
"""The registry: method name -> :class:`Method` class, the built-in methods in the order of
:data:`sparta_tf.method_spec.SPECS`, then the registered user methods."""


def user_level(dp, users) -> dict[str, Any]:
    """The keyword arguments that put a mechanism run before training (DP-SNIP, DP-FROST's rounds) at the DP
    model's privacy unit: ``users`` and ``examples_per_user`` at user level, none at example level."""
    if dp.users is None:
        return {}
    if users is None:
        raise ValueError("a user-level run's mechanism before training needs each example's user: fit(x, y, "
                         "users=ids)")
    return {"users": users, "examples_per_user": dp.users.examples_per_user}


class Method(abc.ABC):
    """One fine-tuning method (see the module doc). A concrete subclass names its spec:
    ``class MyMethod(Method, spec=MethodSpec(...))``."""

    spec: ClassVar[MethodSpec]
    """The method's name, options (defaults, valid values), phase templates and privacy, as data."""
    name: ClassVar[str]
    """``spec.name``."""
    options: ClassVar[tuple[str, ...]]
    """The method's own keyword options (``sparta-train``: keys of the ``method`` section): ``spec``'s."""
    private: ClassVar[bool]
    """False for a method whose choices look at private data without noise (``oracle``): ``spec``'s."""
    users_before_training: ClassVar[bool] = False
    """Whether the mechanisms the method runs before training count users at user level (its :meth:`prepare`
    takes ``users``, as DP-FROST's and DP-SSGD's do); a method with such mechanisms that does not is refused
    at user level, before anything is charged (their analysis would be per example)."""

    def __init_subclass__(cls, spec: MethodSpec | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if spec is not None:
            _register(cls, spec)

    def __init__(self, *, head=None, head_learning_rate_scale: float = 1.0, mask_dir: str | None = None,
                 verbose: int = 1, **options: Any):
        if "spec" not in vars(type(self)):
            raise TypeError(f"{type(self).__name__} has no spec of its own; declare it: "
                            f"class {type(self).__name__}(..., spec=MethodSpec(...))")
        options = self.spec.resolve(options)  # a one-line ValueError for an unknown option or a bad value
        if not head_learning_rate_scale > 0:
            raise ValueError(f"head_learning_rate_scale={head_learning_rate_scale!r} must be > 0")
        self.head = head
        self.head_learning_rate_scale = float(head_learning_rate_scale)
        self.mask_dir = mask_dir
        self.verbose = verbose
        self.option_values: dict[str, Any] = dict(options)
        """Every option of the spec as resolved (the given value or the default)."""
        for name, value in options.items():
            setattr(self, name, _attribute(self.spec.option(name), value))

    # ------------------------------------------------------------------ plan

    def phases(self, epochs: int) -> list[Phase]:
        """The training phases of a fit of ``epochs`` epochs, in order (their epochs sum to ``epochs``);
        default: the spec's only phase, every epoch."""
        (phase,) = self.spec.phases  # a spec of several phases has its class override this (checked)
        return [phase.lasting(epochs)]

    def mechanisms_before_training(self, n: int, sample_rate: float) -> list[Mechanism]:
        """Mechanisms charged before the first training step (noise multiplier None: calibrated)."""
        return []

    def unit_of_recorded_mechanisms(self) -> str | None:
        """The privacy unit of mechanisms before training that another run ran and this one only charges
        (a loaded mask's choice: ``"example"`` or ``"user"``), None when there are none. A run at another
        unit is refused: one example removed changes a user's unit, which a user-level analysis does not
        bound as one add or remove, and an example-level one says nothing about a person."""
        return None

    @property
    def training_share(self) -> float:
        """Fraction of the target epsilon the training steps are calibrated for on their own (DP-FROST's
        ``r_eps``); 1: calibrated together with the fixed mechanisms before training."""
        return 1.0

    @property
    def trained_selections(self) -> list | None:
        """The coordinates chosen (from data, or at random) that the method trains with now (a mask, selected partitions, kept
        entries: :class:`~sparta_tf.trainable.VariableSelection` s), None when it has chosen none (yet). A
        checkpoint records their digest, so that a resumed run cannot train others that its ledger never
        charged (:func:`~sparta_tf.private_training.check_same_mask`). Default: a ``mask_selections`` attribute."""
        return getattr(self, "mask_selections", None)

    def nonprivate_reasons(self) -> list[str]:
        """Why a run of this method is not differentially private (empty: it is)."""
        return []

    def make_dp_model(self, model: tf.keras.Model, **dp_kwargs: Any):
        """The DP model the method trains with (:class:`~sparta_tf.DPModel` by default)."""
        from sparta_tf.dp_model import DPModel  # late: dp_model imports the whole engine

        return DPModel(model, **dp_kwargs)

    def check(self, model: tf.keras.Model) -> None:
        """Raises ValueError when the method cannot run on ``model`` (before any data is touched)."""

    def planned_trainable(self, phase: Phase, model: tf.keras.Model) -> int | None:
        """Trainable coordinates in ``phase`` as far as known before the run (None: chosen during it)."""
        return None

    # ------------------------------------------------------------------ phases

    def prepare(self, dp, x, y, loss, plan, first_epoch: int = 0, users=None) -> dict[str, Any]:
        """Runs the choices made before training (charging ``plan.before_training``); returns info.
        ``first_epoch > 0``: a resumed run, whose choices were made (and charged) already. ``users``: with
        user-level DP (``dp.users``), each example's user id: a mechanism before training then counts
        users, each the mean of at most ``dp.users.examples_per_user`` of its examples, clipped once."""
        return {}

    def start(self, dp, epochs: int, first_epoch: int = 0) -> None:
        """``on_train_begin``: set up what the phases need (``first_epoch > 0``: a resumed run); refuse
        (one line) a DP model the method cannot run on as named."""

    @abc.abstractmethod
    def enter(self, phase: Phase, dp) -> None:
        """The first epoch of ``phase`` begins: set the trainable set (``dp.set_trainable_set``) or begin
        scoring."""

    def leave(self, phase: Phase, dp) -> None:
        """The last epoch of ``phase`` ended."""


def _attribute(option: method_spec.Option, value: Any) -> Any:
    """An option's value as the method keeps it: a number option's as a float (an int is valid for it), a
    mapping as the method's own copy, other values as they are."""
    if float in option.types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return dict(value) if isinstance(value, dict) else value


def _register(cls: type[Method], spec: MethodSpec) -> None:
    """Binds ``cls`` to ``spec`` and adds it to :data:`METHODS` (a one-line error for a clash)."""
    builtin = method_spec.SPECS.get(spec.name)
    if builtin is not None and builtin is not spec:
        raise ValueError(f"{cls.__qualname__}: {spec.name!r} is the name of a built-in method; give your spec "
                         "another name")
    if spec.name in METHODS:
        raise ValueError(f"{cls.__qualname__}: method {spec.name!r} is registered already "
                         f"({METHODS[spec.name].__qualname__}); give your spec another name")
    if len(spec.phases) != 1 and cls.phases is Method.phases:
        raise TypeError(f"{cls.__qualname__}: spec {spec.name!r} has {len(spec.phases)} phases; override "
                        "phases(epochs) to give each its epochs")
    cls.spec, cls.name, cls.options, cls.private = spec, spec.name, spec.option_names, spec.private
    order = list(method_spec.SPECS)
    METHODS[spec.name] = cls
    ranked = sorted(METHODS.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))
    METHODS.clear()
    METHODS.update(ranked)


class SetMethod(Method):
    """A method whose every phase trains a set known from the model alone (or once a choice is made):
    :meth:`trainable_set` says which; :meth:`enter` sets it and :meth:`planned_trainable` counts it."""

    @abc.abstractmethod
    def trainable_set(self, phase: Phase, model: tf.keras.Model):
        """The :class:`~sparta_tf.trainable.TrainableSet` ``phase`` trains, or None while it depends on a
        choice not made yet."""

    def planned_trainable(self, phase: Phase, model: tf.keras.Model) -> int | None:
        selections = self.trainable_set(phase, model)
        return None if selections is None else selections.size

    def enter(self, phase: Phase, dp) -> None:
        dp.set_trainable_set(self.trainable_set(phase, dp.model))


class PreparedMethod(Method):
    """A method that makes choices in :meth:`prepare`, before training (DP-FROST's partitions, DP-SSGD's
    pre-pruning), or needs a DP model class of its own (:attr:`dp_model_class`): :meth:`start` refuses a
    fit that would train something other than the method (one line saying what to call)."""

    dp_model_class: ClassVar[type | None] = None
    """The DP model class :meth:`make_dp_model` builds when a plain ``DPModel`` cannot run the method
    (DP-SSGD's ``SSGDModel``); None: any ``DPModel``."""

    _prepared_for: weakref.ref | None = None  # the DP model prepare() last ran for

    @property
    @abc.abstractmethod
    def preparation(self) -> str | None:
        """What :meth:`prepare` does before ``fit`` (a phrase, e.g. "chooses the partitions it trains
        before training"), or None when it needs no preparation."""

    def mark_prepared(self, dp) -> None:
        """Records that :meth:`prepare` ran for ``dp``."""
        self._prepared_for = weakref.ref(dp)

    def need_arrays(self, x, y) -> None:
        """Refuses (one line) a ``tf.data.Dataset`` or a missing ``y``: the preparation reads arrays."""
        if isinstance(x, tf.data.Dataset) or y is None:
            raise ValueError(f"method {self.name!r} {self.preparation}: give fit arrays x, y (not a tf.data.Dataset)")

    def start(self, dp, epochs: int, first_epoch: int = 0) -> None:
        self.check_ready(dp)

    def check_ready(self, dp, *, before_prepare: bool = False) -> None:
        """Raises a one-line ValueError when ``fit`` on ``dp`` would not run this method as named: ``dp``
        is not a :attr:`dp_model_class`, or (unless ``before_prepare``) the method has a
        :attr:`preparation` and :meth:`prepare` did not run for ``dp``."""
        problems = []
        if self.dp_model_class is not None and not isinstance(dp, self.dp_model_class):
            problems.append(f"it needs the {self.dp_model_class.__name__} that method.make_dp_model builds")
        prepared = self._prepared_for is not None and self._prepared_for() is dp
        unprepared = self.preparation is not None and not prepared
        if unprepared and not before_prepare:
            problems.append(f"it {self.preparation} and method.prepare did not run for this model")
        if not problems:
            return
        todo = "build the DP model with method.make_dp_model(model, ...)"
        if unprepared:
            todo += " and call method.prepare(dp, x, y, loss, plan) before fit"
        raise ValueError(f"method {self.name!r} cannot run on this {type(dp).__name__}: {'; '.join(problems)}; "
                         f"{todo} (as sparta-train does)")
