"""`autolab`: the kubectl-like command line of a lab on one machine.

Every command takes `--lab DIR` (default: the current directory). The verbs
follow kubectl's: `apply -f`, `get [-o wide|json|yaml]`, `describe`, `logs`,
`delete`; `run` is the controller loop itself (reconcile until every
experiment is finished, or forever with `--watch`).
"""

from __future__ import annotations

import argparse
import sys

from controller.cli import authoring, demo, hf, lab, operator
from controller.cli.output import REPO_ROOT, CliError
from controller.core.spec import SpecError
from controller.lab.init import LabInitError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autolab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, fn, help_, lab=True):
        sp = sub.add_parser(name, help=help_, description=help_)
        if lab:
            sp.add_argument("--lab", default=".", metavar="DIR", help="lab directory (default: .)")
        sp.set_defaults(fn=fn)
        return sp

    sp = add("init", lab.cmd_init, "create a new lab: git repo, bench/, research/, seeded master",
             lab=False)
    sp.add_argument("dir")
    sp.add_argument("--profile", choices=["tiny", "default"], default="default")
    sp.add_argument("--data", default="hub", help="synthetic | hub | dir:PATH")
    sp.add_argument("--name", default="default", help="the Lab's name")
    sp.add_argument("--budget", type=int, help="training seconds per run (default: profile's)")
    sp = add("apply", lab.cmd_apply, "create or update experiments from spec files")
    sp.add_argument("-f", "--filename", action="append", required=True,
                    help="FILE, DIR or - (stdin); repeatable")
    sp = add("run", lab.cmd_run, "reconcile until every experiment is finished")
    sp.add_argument("--watch", action="store_true", help="keep running and pick up new specs")
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between passes")
    sp.add_argument("--unsafe-no-sandbox", action="store_true",
                    help="run candidates without bubblewrap (only for code you trust; every "
                         "result says so)")
    sp = add("get", lab.cmd_get, "list experiments (or one)")
    sp.add_argument("name", nargs="?")
    sp.add_argument("-o", "--output", choices=["wide", "json", "yaml"])
    sp = add("describe", lab.cmd_describe, "everything about one experiment, with its events")
    sp.add_argument("name")
    sp = add("logs", lab.cmd_logs, "the run log of an experiment")
    sp.add_argument("name")
    sp.add_argument("-f", "--follow", action="store_true")
    sp = add("delete", lab.cmd_delete, "delete an experiment (cancels its run, records it)")
    sp.add_argument("name")
    sp = add("ledger", lab.cmd_ledger, "the ledger, research/results.tsv")
    sp.add_argument("-o", "--output", choices=["table", "tsv"], default="table")
    sp = add("master", lab.cmd_master, "the current master")
    sp.add_argument("-o", "--output", choices=["text", "json"], default="text")
    sp = add("demo", demo.cmd_demo, "a whole lab in a temporary directory: seven outcomes, tiny, CPU",
             lab=False)
    sp.add_argument("--keep", action="store_true", help="keep the demo lab directory")
    sp.add_argument("--dir", help="build the demo lab here instead of a temporary directory")
    sp = add("crds", lab.cmd_crds, "write the CRDs generated from the spec schema", lab=False)
    sp.add_argument("--out", default=str(REPO_ROOT / "crds"))
    authoring.add_commands(sub, add)
    hf.add_commands(sub, add)
    operator.add_arguments(add("operator", operator.cmd_operator,
                               "run the Kubernetes operator: Experiments and Labs in one namespace "
                               "become Jobs, ledger rows and promotions", lab=False))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return a.fn(a)
    except (SpecError, CliError, LabInitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130



if __name__ == "__main__":
    sys.exit(main())
