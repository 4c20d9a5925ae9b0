"""One definition per method (issue 49): a method is one class registered with its spec.

* every spec of the TensorFlow-free table has exactly one registered class and every registered class
  is its spec's;
* a method written outside the package is one class: declaring it registers it, ``make_private`` runs
  it by name, and it trains exactly the set it says;
* a clash (a second class for a name, another spec under a built-in name, several phases without
  ``phases``) is refused when the class is created;
* one phase type from the spec's template to the plan; callbacks take their defaults from the spec;
* the ``Method`` interface is the plan hooks and the phase hooks, nothing more.
"""

import ast
import dataclasses
import inspect
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf import method_spec, methods, trainable
from sparta_tf.callbacks import MethodCallback, SpartaCallback
from sparta_tf.groups import parameter_table
from sparta_tf.method_spec import MethodSpec, Option, Phase
from sparta_tf.methods.base import Method, SetMethod
from sparta_tf.privacy.plan import make_privacy_plan
from sparta_tf.private_training import plan_method
from small_models import LOSS, small_data, small_mlp

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def registry():
    """The class registry as it was before the test (a test's own methods are removed after it)."""
    saved = dict(methods.METHODS)
    yield methods.METHODS
    methods.METHODS.clear()
    methods.METHODS.update(saved)


def _spec(name: str, phases=None) -> MethodSpec:
    return MethodSpec(name, "the head + the biases of the layer named `layer`",
                      (Option("layer", "d2", (str,), "the layer whose bias trains"),),
                      phases or (Phase(name, length="T", trains="head + one layer's bias"),))


def _head_and_bias(spec: MethodSpec) -> type[Method]:
    class HeadAndBias(SetMethod, spec=spec):
        def trainable_set(self, phase, model):
            chosen = [p.variable for p in parameter_table(model, self.head)
                      if p.role == "head" or (p.role == "bias" and p.layer == self.layer)]
            return trainable.TrainableSet.of_variables(chosen)

    return HeadAndBias


def test_every_spec_has_exactly_one_class_and_every_class_is_its_specs():
    assert list(methods.METHODS) == list(method_spec.SPECS)
    for name, spec in method_spec.SPECS.items():
        owners = [cls for cls in methods.METHODS.values() if cls.spec is spec]
        assert owners == [methods.METHODS[name]], name
        assert "spec" in vars(owners[0])  # its own, not inherited
    for name, cls in methods.METHODS.items():
        assert cls.spec is method_spec.SPECS[name] and cls.name == name


def test_no_module_builds_a_second_method_table():
    """The built-in classes name their spec where they are declared: no ``{name: class}`` table and no
    ``spec = ...`` assignment anywhere in sparta_tf/methods."""
    for path in (ROOT / "sparta_tf" / "methods").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assigned = [t.id for stmt in node.body if isinstance(stmt, ast.Assign) for t in stmt.targets
                            if isinstance(t, ast.Name)]
                assert "spec" not in assigned, f"{path.name}: {node.name} assigns spec; use class ...(spec=...)"
            if isinstance(node, ast.DictComp):
                assert "METHODS" not in ast.unparse(node), f"{path.name}: a second registry"


def test_a_method_written_outside_the_package_registers_and_runs_through_make_private(registry):
    cls = _head_and_bias(_spec("head_and_d2_bias"))
    assert methods.METHODS["head_and_d2_bias"] is cls and list(methods.METHODS)[-1] == "head_and_d2_bias"
    assert "head_and_d2_bias" not in method_spec.SPECS  # sparta-train's table holds the built-in methods
    model = small_mlp()
    x, y = small_data(64)
    before = {id(v): v.numpy() for v in model.weights}
    dp = sparta_tf.make_private(model, method="head_and_d2_bias", target_epsilon=8.0, delta=1e-5, epochs=2,
                                batch_size=16, dataset_size=64, seed=0)
    assert [p.name for p in dp.plan.phases] == ["head_and_d2_bias"]
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    dp.fit(x, y, verbose=0)
    changed = {id(v) for v in model.weights if not np.array_equal(before[id(v)], v.numpy())}
    trained = {id(v) for v in model.get_layer("head").weights} | {id(model.get_layer("d2").bias)}
    assert changed == trained
    assert dp.ledger.epsilon() == pytest.approx(dp.plan.epsilon)


def test_a_clash_is_refused_when_the_class_is_created(registry):
    _head_and_bias(_spec("mine"))
    with pytest.raises(ValueError, match=r"method 'mine' is registered already \(.*HeadAndBias\); give your "
                                         r"spec another name"):
        _head_and_bias(_spec("mine"))
    with pytest.raises(ValueError, match="'bitfit' is the name of a built-in method; give your spec another name"):
        _head_and_bias(_spec("bitfit"))
    two = (Phase("a", length="1", trains="x"), Phase("b", length="the rest", trains="y"))
    with pytest.raises(TypeError, match=r"spec 'two' has 2 phases; override phases\(epochs\)"):
        _head_and_bias(_spec("two", two))
    assert "two" not in methods.METHODS and "bitfit" in methods.METHODS


def test_an_abstract_method_without_a_spec_cannot_be_built():
    class NoSpec(SetMethod):
        def trainable_set(self, phase, model):
            return None

    with pytest.raises(TypeError, match="NoSpec has no spec of its own"):
        NoSpec()


def test_one_phase_type_from_the_spec_to_the_plan():
    method = methods.make_method("sparta", warmup_epochs=2, verbose=0)
    phases = method.phases(10)
    spec = method_spec.SPECS["sparta"]
    assert phases == [dataclasses.replace(spec.phase(p.name), epochs=p.epochs) for p in phases]
    assert [p.epochs for p in phases] == [2, 1, 7]
    plan = plan_method(method, dataset_size=100, batch_size=10, epochs=10, delta=1e-5, target_epsilon=4.0)
    assert all(type(p) is Phase for p in plan.phases)
    assert [(p.name, p.epochs, p.steps) for p in plan.phases] == [("warmup", 2, 20), ("selection", 1, 10),
                                                                  ("sparse", 7, 70)]
    assert [p.epsilon_after for p in plan.phases] == sorted(p.epsilon_after for p in plan.phases)
    with pytest.raises(ValueError, match="phase 'warmup' has no epochs: plan a fit's phases"):
        make_privacy_plan(n=100, expected_batch_size=10, phases=spec.phases, delta=1e-5, target_epsilon=4.0)


def test_callbacks_take_their_defaults_from_the_spec():
    defaults = method_spec.SPECS["sparta"].defaults()
    for callback in (SpartaCallback(verbose=0), MethodCallback("sparta", verbose=0)):
        assert {name: getattr(callback.method, name) for name in defaults} == defaults
    assert SpartaCallback(density=0.5, verbose=0).method.density == 0.5
    assert inspect.signature(SpartaCallback).parameters.keys() == {"options"}  # no default of its own


def test_the_method_interface_is_the_plan_and_phase_hooks():
    hooks = {name for name, _ in inspect.getmembers(Method) if not name.startswith("_")}
    assert hooks == {"phases", "mechanisms_before_training", "users_before_training", "training_share",
                     "unit_of_recorded_mechanisms", "nonprivate_reasons", "make_dp_model", "check", "planned_trainable",
                     "prepare", "start", "enter", "leave", "trained_selections"}


def test_the_per_kind_integration_tests_keep_one_method_of_every_class():
    """sparta-train's and augmentation multiplicity's per-method tests run ONE_METHOD_OF_EACH_KIND: every
    class a registered method inherits its behaviour from (its direct base) has a method there."""
    from small_configs import ONE_METHOD_OF_EACH_KIND

    assert set(ONE_METHOD_OF_EACH_KIND) <= set(methods.METHODS)
    kinds = {cls.__mro__[1] for cls in methods.METHODS.values()}
    covered = {methods.METHODS[name].__mro__[1] for name in ONE_METHOD_OF_EACH_KIND}
    assert kinds == covered, sorted(k.__name__ for k in kinds - covered)
