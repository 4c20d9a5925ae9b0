"""The supported lines: pyproject's markers pick TF 2.15 + Keras 2 (Python 3.11) or TF 2.21 + Keras 3
(3.12/3.13); requirements/ pins the opt-in ones (the Keras detection is tests/test_keras2.py's)."""

import pathlib
import tomllib

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _selected(requirements: list[str], python: str) -> dict[str, str]:
    """name -> specifier of the requirements whose markers hold on CPython ``python`` (Linux)."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    chosen = {}
    for text in requirements:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            assert req.name not in chosen, f"{req.name} selected twice on Python {python}"
            chosen[req.name] = str(req.specifier)
    return chosen


def test_python_311_gets_the_tf215_line_with_tf_privacy_in_the_test_extra():
    core = _selected(PROJECT["dependencies"], "3.11")
    assert core["tensorflow"] == "==2.15.1" and core["keras"] == "==2.15.0"
    assert core["dp-accounting"] == "==0.4.3" and "tf-keras" not in core
    test = _selected(PROJECT["optional-dependencies"]["test"], "3.11")
    assert test["tensorflow-privacy"] == "==0.9.0"


@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_python_312_and_313_get_tf221_with_keras3_without_tf_keras_tf_privacy_or_keras_cv(python):
    core = _selected(PROJECT["dependencies"], python)
    assert core["tensorflow"] == "==2.21.0" and core["keras"].startswith("==3.")
    assert "keras-hub" in core and core["dp-accounting"] == "==0.6.0"
    assert "keras-cv" not in core and "tf-keras" not in core
    for extra in ("test", "benchmark"):
        assert "tensorflow-privacy" not in _selected(PROJECT["optional-dependencies"][extra], python)


def test_requires_python_admits_311_to_313_only():
    from packaging.specifiers import SpecifierSet

    allowed = SpecifierSet(PROJECT["requires-python"])
    assert [v for v in ("3.10", "3.11", "3.12", "3.13", "3.14") if v in allowed] == ["3.11", "3.12", "3.13"]


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[req.name] = str(req.specifier)
    return pins


def test_requirements_file_of_the_keras3_line_matches_the_py312_markers():
    test_extra = _selected(PROJECT["optional-dependencies"]["test"], "3.12")
    assert _pins("keras3.txt") == {**_selected(PROJECT["dependencies"], "3.12"), **test_extra}


def test_requirements_file_of_the_tf_keras_line_is_the_py312_line_with_tf_keras_for_keras3():
    line = {k: v for k, v in _selected(PROJECT["dependencies"], "3.12").items() if k not in ("keras", "keras-hub")}
    test_extra = _selected(PROJECT["optional-dependencies"]["test"], "3.12")
    assert _pins("tf-2.21.txt") == {**line, "tf-keras": "==2.21.0", **test_extra}
