"""The ``Method`` interface: a fine-tuning method as phases, mechanisms and phase boundaries.

A method trains a model with DP-SGD for ``T`` epochs in consecutive
*phases* (:class:`~sparta_tf.privacy.plan.TrainingPhase`): e.g. SPARTA's
``warmup`` (``T0`` epochs), ``selection`` (1 epoch that releases row scores
and updates nothing) and ``sparse`` (the rest). Every step of every phase is
one Poisson-subsampled Gaussian mechanism with the run's ``(q, sigma)``.
Some methods also run mechanisms *before* training
(:meth:`Method.mechanisms_before_training`: DP-FROST's selection rounds,
DP-SNIP, the selection epoch of a loaded mask). The same phase list and
mechanisms feed the dry-run plan (:mod:`sparta_tf.privacy.plan`) and the
fit, so the plan's ledger events are the run's.

Life cycle, driven by :class:`sparta_tf.callbacks.MethodCallback` inside
``DPModel.fit`` (and by ``sparta-train``)::

    dp = method.make_dp_model(model, **dp_kwargs)       # DPModel, or DP-SSGD's SSGDModel
    info = method.prepare(dp, x, y, loss, plan, first_epoch)  # before fit: choices made before training
    method.start(dp, epochs, first_epoch)               # on_train_begin: masks, provenance
    method.enter(phase, dp)                             # first epoch of each phase
    method.leave(phase, dp)                             # after its last epoch

Preparation: a method that makes choices before training (DP-FROST's
partition selection, DP-SSGD's pre-pruning) says so in
:attr:`Method.preparation`, and one that needs more than a plain
:class:`~sparta_tf.DPModel` names the class in :attr:`Method.dp_model_class`.
``MethodCallback`` calls :meth:`Method.check_ready` before every fit, which
refuses (one line saying what to call) a DP model of the wrong class or one
that :meth:`Method.prepare` did not run for: such a fit would train
something other than the named method.

Options: every method takes ``head`` (the classifier layer or its name;
default the layer named "head", else the last Dense),
``head_learning_rate_scale``, ``mask_dir`` (where masks are saved) and
``verbose``, plus its own options. Those, with their defaults and valid
values, are in the method's :class:`~sparta_tf.method_spec.MethodSpec`
(:attr:`Method.spec`, from :data:`sparta_tf.method_spec.METHODS`, the table
``sparta-train``'s config checker reads too): a subclass names its spec, and
its ``name``, ``options`` and ``private`` follow from it; :meth:`Method.configure`
receives every option, checked and defaulted.
"""

from __future__ import annotations

import abc
import weakref
from typing import Any, ClassVar

import tensorflow as tf

from sparta_tf.method_spec import MethodSpec
from sparta_tf.privacy.plan import Mechanism, TrainingPhase
from sparta_tf.trainable import TrainableSet

COMMON_OPTIONS = ("head", "head_learning_rate_scale", "mask_dir", "verbose")


class Method(abc.ABC):
    """One fine-tuning method (see the module doc). A concrete subclass sets ``spec``."""

    spec: ClassVar[MethodSpec]
    """The method's name, options (defaults, valid values), phases and privacy, as data."""
    name: ClassVar[str]
    """``spec.name``."""
    options: ClassVar[tuple[str, ...]] = ()
    """The method's own keyword options (``sparta-train``: keys of the ``method`` section): ``spec``'s."""
    private: ClassVar[bool] = True
    """False for a method whose choices look at private data without noise (``oracle``): ``spec``'s."""
    dp_model_class: ClassVar[type | None] = None
    """The DP model class :meth:`make_dp_model` builds when a plain ``DPModel`` cannot run the method
    (DP-SSGD's ``SSGDModel``); None: any ``DPModel``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__:
            cls.name, cls.options, cls.private = cls.spec.name, cls.spec.option_names, cls.spec.private

    def __init__(self, *, head=None, head_learning_rate_scale: float = 1.0, mask_dir: str | None = None,
                 verbose: int = 1, **options: Any):
        options = self.spec.resolve(options)  # a one-line ValueError for an unknown option or a bad value
        if not head_learning_rate_scale > 0:
            raise ValueError(f"head_learning_rate_scale={head_learning_rate_scale!r} must be > 0")
        self.head = head
        self.head_learning_rate_scale = float(head_learning_rate_scale)
        self.mask_dir = mask_dir
        self.verbose = verbose
        self._prepared_for: weakref.ref | None = None  # the DP model prepare() last ran for
        self.configure(**options)

    def configure(self, **options: Any) -> None:
        """Stores the method's own options: every one of :attr:`spec`'s, checked, defaults filled in."""

    # ------------------------------------------------------------------ plan

    @abc.abstractmethod
    def phases(self, epochs: int) -> list[TrainingPhase]:
        """The training phases of a fit of ``epochs`` epochs, in order (their epochs sum to ``epochs``)."""

    def mechanisms_before_training(self, n: int, sample_rate: float) -> list[Mechanism]:
        """Mechanisms charged before the first training step (noise multiplier None: calibrated)."""
        return []

    @property
    def training_share(self) -> float:
        """Fraction of the target epsilon the training steps are calibrated for on their own (DP-FROST's
        ``r_eps``); 1: calibrated together with the fixed mechanisms before training."""
        return 1.0

    def nonprivate_reasons(self) -> list[str]:
        """Why a run of this method is not differentially private (empty: it is)."""
        return []

    def planned_trainable(self, phase: TrainingPhase, model: tf.keras.Model) -> int | None:
        """Trainable coordinates in ``phase`` as far as known before the run (None: chosen privately)."""
        selections = self.trainable_set(phase, model)
        return None if selections is None else selections.size

    @abc.abstractmethod
    def trainable_set(self, phase: TrainingPhase, model: tf.keras.Model) -> TrainableSet | None:
        """What ``phase`` trains, or None while it depends on a choice not made yet."""

    def check(self, model: tf.keras.Model) -> None:
        """Raises ValueError when the method cannot run on ``model`` (before any data is touched)."""

    # ------------------------------------------------------------------ run

    def make_dp_model(self, model: tf.keras.Model, **dp_kwargs: Any):
        """The DP model the method trains with (:class:`~sparta_tf.DPModel` by default)."""
        from sparta_tf.dp_model import DPModel  # late: dp_model imports the whole engine

        return DPModel(model, **dp_kwargs)

    @property
    def preparation(self) -> str | None:
        """What :meth:`prepare` must do before ``fit`` (a phrase, e.g. "chooses the partitions it trains
        before training"), or None when the method needs no preparation."""
        return None

    def prepare(self, dp, x, y, loss, plan, first_epoch: int = 0) -> dict[str, Any]:
        """Runs the choices made before training (charging ``plan.before_training``); returns info.
        ``first_epoch > 0``: a resumed run, whose choices were made (and charged) already. A method
        with a :attr:`preparation` calls :meth:`mark_prepared` once its choices are made."""
        return {}

    def mark_prepared(self, dp) -> None:
        """Records that :meth:`prepare` ran for ``dp`` (what :meth:`check_ready` looks for)."""
        self._prepared_for = weakref.ref(dp)

    def is_prepared_for(self, dp) -> bool:
        """Whether :meth:`prepare` ran for this very DP model."""
        return self._prepared_for is not None and self._prepared_for() is dp

    def check_ready(self, dp, *, before_prepare: bool = False) -> None:
        """Raises a one-line ValueError when ``fit`` on ``dp`` would not run this method as named: ``dp``
        is not a :attr:`dp_model_class`, or (unless ``before_prepare``) the method has a
        :attr:`preparation` and :meth:`prepare` did not run for ``dp``."""
        problems = []
        if self.dp_model_class is not None and not isinstance(dp, self.dp_model_class):
            problems.append(f"it needs the {self.dp_model_class.__name__} that method.make_dp_model builds")
        unprepared = self.preparation is not None and not self.is_prepared_for(dp)
        if unprepared and not before_prepare:
            problems.append(f"it {self.preparation} and method.prepare did not run for this model")
        if not problems:
            return
        todo = "build the DP model with method.make_dp_model(model, ...)"
        if unprepared:
            todo += " and call method.prepare(dp, x, y, loss, plan) before fit"
        raise ValueError(f"method {self.name!r} cannot run on this {type(dp).__name__}: {'; '.join(problems)}; "
                         f"{todo} (as sparta-train does)")

    def start(self, dp, epochs: int, first_epoch: int = 0) -> None:
        """``on_train_begin``: set up what the phases need (``first_epoch > 0``: a resumed run)."""

    def enter(self, phase: TrainingPhase, dp) -> None:
        """The first epoch of ``phase`` begins: set the trainable set (default) or begin scoring."""
        dp.set_trainable_set(self.trainable_set(phase, dp.model))

    def leave(self, phase: TrainingPhase, dp) -> None:
        """The last epoch of ``phase`` ended."""

    # ------------------------------------------------------------------ helpers

    def phase_of(self, epoch: int, epochs: int) -> TrainingPhase:
        """The phase epoch ``epoch`` (0-based) of a fit of ``epochs`` epochs belongs to."""
        first = 0
        for phase in self.phases(epochs):
            if epoch < first + phase.epochs:
                return phase
            first += phase.epochs
        raise ValueError(f"epoch {epoch} is past the {epochs} epochs of the plan")



def single_phase(name: str, epochs: int) -> list[TrainingPhase]:
    return [TrainingPhase(name, epochs)]
