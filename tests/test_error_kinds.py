"""Every failure the controller knows is an AutolabError of one kind: yours to fix (a spec, a
file or an argument you wrote) or the machine's (git, the disk, the cluster, a token, a file the
controller keeps that something damaged). `autolab` prints the kind after the message
(tests/test_cli_errors.py runs it); this table says which kind each failure is."""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil

import pytest

import controller
from controller.core.errors import INPUT, MACHINE, AutolabError, InputError, MachineError, kind_of

KINDS = {
    "controller.core.spec.SpecError": INPUT,
    "controller.core.spec.SpecUnreadable": MACHINE,  # a SpecError the machine must fix
    "controller.core.diffs.DiffRefused": INPUT,
    "controller.core.status.StatusError": MACHINE,
    "controller.cli.output.CliError": INPUT,
    "controller.lab.init.LabInitError": INPUT,
    "controller.lab.git.GitError": MACHINE,
    "controller.lab.ledger.LedgerError": MACHINE,
    "controller.lab.harness.HarnessError": MACHINE,
    "controller.lab.profiles.ProfileError": MACHINE,
    "controller.engine.engine.BaselineFailed": MACHINE,
    "controller.backends.BackendConfigError": MACHINE,
    "controller.backends.hf_api.HfBackendError": MACHINE,
    "controller.backends.hf_wire.BundleTooLarge": INPUT,
    "controller.kube.cluster.ClusterError": MACHINE,
    "controller.operator.runtime.LabMissing": INPUT,
    "controller.operator.runtime.LabUnusable": INPUT,  # its Lab's spec is invalid
}
# Not failures a user sees: a signal to wait (429), and the API emulator's wire model.
NOT_SHOWN = {"controller.backends.hf_api.RateLimited", "controller.kube.emulator.model.ApiError"}


@functools.cache
def controller_exceptions() -> dict[str, type]:
    found = {}
    for info in pkgutil.walk_packages(controller.__path__, "controller."):
        if info.name.endswith(".__main__"):  # a program, not a module to import
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Exception) and cls.__module__ == info.name:
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_every_failure_of_the_controller_says_whose_it_is_to_fix():
    found = controller_exceptions()
    roots = {f"controller.core.errors.{c.__name__}"
             for c in (AutolabError, InputError, MachineError)}
    assert set(found) - NOT_SHOWN - roots == set(KINDS)


@pytest.mark.parametrize("name, kind", KINDS.items(), ids=list(KINDS))
def test_each_failure_is_of_its_kind(name, kind):
    cls = controller_exceptions()[name]
    assert issubclass(cls, AutolabError)
    assert kind_of(cls.__new__(cls)) == kind
