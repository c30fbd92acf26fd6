"""`autolab`: the kubectl-like command line of a lab on one machine.

Every command takes `--lab DIR` (default: the current directory). The verbs
follow kubectl's: `apply -f`, `get [-o wide|json|yaml]`, `describe`, `logs`,
`delete`; `run` is the controller loop itself (reconcile until every
experiment is finished, or forever with `--watch`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from controller.core.reconcile import TERMINAL
from controller.core.spec import API_VERSION, SpecError
from controller.ledger import Ledger
from controller.backends.local import UNSAFE_ENV
from controller.local import LAB_FILE, BaselineFailed, LocalLab, load_yaml_file

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_FILES = ("prepare.py", "train.py", "run.py", "evaluate.py", "sandbox.py", "README.md")


class CliError(Exception):
    pass


def bench_source_dir() -> Path:
    d = REPO_ROOT / "bench"
    if not (d / "prepare.py").exists():
        raise CliError(f"cannot find the benchmark sources at {d}; install autolab from a "
                       "checkout (pip install -e .)")
    return d


# --- init -------------------------------------------------------------------------------------

RESEARCH_FILES = {
    "notes.md": "# Lab notes\n\nHand-written: what we believe, what we tried, what to try next.\n",
    "do-not-repeat.md": "# Do not repeat\n\nIdeas that regressed or were duplicates, by campaign."
                        " The controller appends here; people may annotate.\n",
}


def init_lab(target: Path, profile: str = "default", data: str = "hub", name: str = "default",
             budget: int | None = None) -> LocalLab:
    target = target.resolve()
    if (target / LAB_FILE).exists():
        raise CliError(f"{target} is already a lab ({LAB_FILE} exists)")
    target.mkdir(parents=True, exist_ok=True)
    src = bench_source_dir()
    (target / "bench").mkdir(exist_ok=True)
    for f in BENCH_FILES:
        if (src / f).exists():
            shutil.copy2(src / f, target / "bench" / f)
    research = target / "research"
    for sub in ("experiments", "campaigns", "live", "templates"):
        (research / sub).mkdir(parents=True, exist_ok=True)
        (research / sub / ".gitkeep").touch()
    for fname, text in RESEARCH_FILES.items():
        if not (research / fname).exists():
            (research / fname).write_text(text)
    templates = REPO_ROOT / "research" / "templates"
    if templates.exists():
        for t in templates.glob("*.md"):
            shutil.copy2(t, research / "templates" / t.name)
    (target / "experiments").mkdir(exist_ok=True)
    (target / "experiments" / ".gitkeep").touch()
    spec: dict = {"profile": profile, "data": data, "backend": "local"}
    if budget:
        spec["budgetSeconds"] = budget
    lab_doc = {"apiVersion": API_VERSION, "kind": "Lab", "metadata": {"name": name},
               "spec": spec}
    (target / LAB_FILE).write_text(yaml.safe_dump(lab_doc, sort_keys=False))
    (target / ".gitignore").write_text(".autolab/\n__pycache__/\n*.lock\n")
    git = ["git", "-c", "user.name=autolab", "-c", "user.email=autolab@localhost",
           "-c", "commit.gpgsign=false"]
    if not (target / ".git").exists():
        subprocess.run(git + ["init", "-q", "-b", "main"], cwd=target, check=True)
    subprocess.run(git + ["add", "-A"], cwd=target, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "Seed the lab"], cwd=target, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=target, capture_output=True,
                            text=True, check=True).stdout.strip()
    lab = LocalLab(target)
    lab.repo.seed_master(commit)
    return lab


# --- output helpers ---------------------------------------------------------------------------

def _age(ts: str | None) -> str:
    if not ts:
        return ""
    import datetime as dt
    t = dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    s = int((dt.datetime.now(dt.timezone.utc) - t).total_seconds())
    return f"{s}s" if s < 120 else (f"{s // 60}m" if s < 7200 else f"{s // 3600}h")


def _fmt(v, nd=6) -> str:
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def table_rows(rows, wide: bool = False) -> tuple[list[str], list[list[str]]]:
    head = ["NAME", "PHASE", "OUTCOME", "VAL_BPB", "DELTA", "SLOT", "CAMPAIGN", "AGE"]
    if wide:
        head += ["CANDIDATE", "PARENT", "MESSAGE"]
    out = []
    for name, st, spec in rows:
        job = st.get("job") or {}
        slot = job.get("slot", "") if st.get("phase") in ("Queued", "Running") else ""
        line = [name, st.get("phase", "Pending"), st.get("outcome", ""),
                _fmt((st.get("metrics") or {}).get("val_bpb")),
                ("" if st.get("delta") is None else f"{st['delta']:+.6f}"), str(slot or ""),
                spec.get("campaign", ""), _age(st.get("createdAt"))]
        if wide:
            line += [(st.get("candidateHash") or "")[:12], (st.get("parentHash") or "")[:12],
                     (st.get("message") or "").split("\n")[0][:100]]
        out.append(line)
    return head, out


def print_table(head: list[str], rows: list[list[str]], out=None) -> None:
    out = out or sys.stdout
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    for r in [head] + rows:
        out.write("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def item(name: str, record: dict) -> dict:
    return {"apiVersion": API_VERSION, "kind": "Experiment",
            "metadata": {"name": name, "generation": record.get("generation", 1)},
            "spec": record.get("spec") or {}, "status": record.get("status") or {}}


# --- commands ---------------------------------------------------------------------------------

def cmd_init(a) -> int:
    lab = init_lab(Path(a.dir), profile=a.profile, data=a.data, name=a.name, budget=a.budget)
    m = lab.repo.master()
    print(f"lab {lab.name} initialised in {lab.root}")
    print(f"master {m.hash[:12]} (commit {m.commit[:10]}); profile {a.profile}, data {a.data}")
    print(f"next: write a spec (autolab new), `autolab apply -f FILE --lab {a.dir}`, "
          f"`autolab run --lab {a.dir}`")
    return 0


def _read_sources(paths: list[str]) -> list[tuple[str, dict]]:
    docs: list[tuple[str, dict]] = []
    for p in paths:
        if p == "-":
            text = sys.stdin.read()
            try:
                found = [d for d in yaml.safe_load_all(text) if d is not None]
            except yaml.YAMLError as e:
                raise SpecError(f"<stdin>: malformed YAML: {e}") from None
            docs += [("<stdin>", d) for d in found]
            continue
        path = Path(p)
        if path.is_dir():
            files = sorted(f for f in path.iterdir() if f.suffix in (".yaml", ".yml"))
        elif path.exists():
            files = [path]
        else:
            raise SpecError(f"{p}: no such file or directory")
        for f in files:
            docs += [(str(f), d) for d in load_yaml_file(f)]
    return docs


def cmd_apply(a) -> int:
    lab = LocalLab(a.lab)
    docs = _read_sources(a.filename)
    from controller.core.spec import validate_document
    errors = []
    for src, doc in docs:  # all or nothing: check every document before writing any
        try:
            validate_document(doc, source=src, kind="Experiment")
        except SpecError as e:
            errors.append(str(e))
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 1
    for src, doc in docs:
        verb = lab.apply_file(doc, src)
        print(f"experiment.autolab.dev/{doc['metadata']['name']} {verb}")
    return 0


class Progress:
    """Shows the lab while `run` loops: a live table on a terminal, transitions otherwise."""

    def __init__(self, quiet: bool = False):
        self.live = None
        self.seen: dict[str, tuple] = {}
        self.quiet = quiet
        if sys.stdout.isatty() and not quiet:
            from rich.live import Live
            self.live = Live(auto_refresh=False)
            self.live.start()

    def update(self, summary) -> None:
        if self.live is not None:
            from rich.table import Table
            head, rows = table_rows(summary.rows)
            head, rows = head[:6], [r[:6] for r in rows]  # what a run needs; `get` shows the rest
            t = Table(title="autolab run" + (" — measuring the master's baseline"
                                             if summary.baseline_pending else ""))
            for i, h in enumerate(head):  # names, phases and numbers never shrink; the rest may
                keep = h in ("NAME", "PHASE", "OUTCOME", "VAL_BPB", "DELTA", "SLOT")
                widest = max([len(h)] + [len(r[i]) for r in rows])
                t.add_column(h, no_wrap=True, min_width=widest if keep else None,
                             overflow="ellipsis")
            for r in rows:
                t.add_row(*r)
            self.live.update(t, refresh=True)
            return
        if self.quiet:
            return
        for name, st, _ in summary.rows:
            key = (st.get("phase"), st.get("outcome"), (st.get("job") or {}).get("slot"))
            if self.seen.get(name) != key:
                self.seen[name] = key
                slot = key[2] if key[0] in ("Queued", "Running") and key[2] else ""
                extra = f" on slot {slot}" if slot and key[0] == "Running" else ""
                val = (st.get("metrics") or {}).get("val_bpb")
                res = f" val_bpb={val:.6f}" if val is not None else ""
                print(f"{name}: {key[0]}{' ' + key[1] if key[1] else ''}{extra}{res}", flush=True)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()


def run_loop(lab: LocalLab, watch: bool = False, interval: float = 1.0, quiet: bool = False,
             timeout: float | None = None) -> int:
    progress = Progress(quiet=quiet)
    shown_errors: set[str] = set()
    started = time.time()
    try:
        while True:
            summary = lab.step()
            for e in summary.errors:
                if e not in shown_errors:
                    shown_errors.add(e)
                    print(f"error: {e}", file=sys.stderr, flush=True)
            progress.update(summary)
            if summary.done and not watch:
                break
            if timeout and time.time() - started > timeout:
                print("run: timed out", file=sys.stderr)
                return 1
            time.sleep(interval)
    except BaselineFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        progress.stop()
    return 0


def cmd_run(a) -> int:
    lab = LocalLab(a.lab)
    if a.unsafe_no_sandbox:
        os.environ[UNSAFE_ENV] = "1"
        print("autolab: WARNING: candidates run WITHOUT a sandbox (--unsafe-no-sandbox): a hostile "
              "train.py can forge its metric and change the lab; every result says so",
              file=sys.stderr)
    else:
        problem = lab.backends["local"].sandbox_problem()
        if problem:
            raise CliError(f"cannot isolate candidates on this machine: {problem}. Install "
                           "bubblewrap, or pass --unsafe-no-sandbox for candidates you trust")
    return run_loop(lab, watch=a.watch, interval=a.interval)


def cmd_get(a) -> int:
    lab = LocalLab(a.lab)
    names = [a.name] if a.name else lab.names()
    records = {}
    for n in names:
        r = lab.read_record(n)
        if not r:
            raise CliError(f"experiment {n!r} not found (it has not been reconciled yet: "
                           "`autolab run`)")
        records[n] = r
    if a.output in ("json", "yaml"):
        items = [item(n, r) for n, r in records.items()]
        doc = items[0] if a.name else {"apiVersion": "v1", "kind": "List", "items": items}
        print(json.dumps(doc, indent=2) if a.output == "json"
              else yaml.safe_dump(doc, sort_keys=False), end="\n" if a.output == "json" else "")
        return 0
    head, rows = table_rows([(n, r.get("status") or {}, r.get("spec") or {})
                             for n, r in records.items()], wide=a.output == "wide")
    print_table(head, rows)
    return 0


_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Text a spec carried, safe for a terminal: control characters and lone surrogates escaped."""
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


def cmd_describe(a) -> int:
    lab = LocalLab(a.lab)
    r = lab.read_record(a.name)
    if not r:
        raise CliError(f"experiment {a.name!r} not found")
    st, spec = r.get("status") or {}, r.get("spec") or {}
    out = [f"Name:         {a.name}", f"Lab:          {spec.get('lab', 'default')}",
           f"Campaign:     {spec.get('campaign', '')}", f"Hypothesis:   {spec.get('hypothesis')}",
           f"Parent:       {spec.get('parent')}", f"Phase:        {st.get('phase')}",
           f"Outcome:      {st.get('outcome', '')}", f"Reason:       {st.get('reason', '')}",
           f"Message:      {st.get('message', '')}"]
    for k in ("candidateHash", "semanticHash", "parentHash", "rebasedFrom", "duplicateOf",
              "commit", "delta", "masterValBpb"):
        if st.get(k) is not None:
            out.append(f"{k + ':':<14}{st[k]}")
    if st.get("job"):
        out.append(f"Run:          {json.dumps(st['job'])}")
    if st.get("metrics"):
        out.append("Metrics:")
        out += [f"  {k}: {v}" for k, v in st["metrics"].items()]
    out.append("Conditions:")
    for c in st.get("conditions", []):
        out.append(f"  {c['type']:<18}{c['status']:<7}{c['reason']:<22}{c['message']}")
    out.append("Events:")
    for e in lab.events(a.name):
        out.append(f"  {e['time']}  {e['type']:<8}{e['reason']:<20}{e['message']}")
    out.append("Diff:")
    out += ["  " + line for line in (spec.get("diff") or "").splitlines()]
    print(printable("\n".join(out)))
    return 0


def cmd_logs(a) -> int:
    lab = LocalLab(a.lab)
    r = lab.read_record(a.name)
    job = ((r.get("status") or {}).get("job") or {}) if r else {}
    if not job:
        raise CliError(f"experiment {a.name!r} has no run (yet); see `autolab describe "
                       f"{a.name}`")
    backend = lab.backend_for(job["backend"])
    path = backend.log_path(job["name"]) if hasattr(backend, "log_path") else None
    if path is None or not Path(path).exists():
        raise CliError(f"no log for run {job['name']} on this machine")
    with open(path, encoding="utf-8", errors="replace") as f:
        sys.stdout.write(f.read())
        while a.follow:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
                continue
            st = (lab.read_record(a.name).get("status") or {})
            if st.get("phase") in TERMINAL:
                break
            time.sleep(0.5)
    return 0


def cmd_delete(a) -> int:
    lab = LocalLab(a.lab)
    d = lab.delete(a.name)
    phase = d.status.get("phase") if d else "removed"
    print(f"experiment.autolab.dev/{a.name} deleted ({phase})")
    return 0


def cmd_ledger(a) -> int:
    lab = LocalLab(a.lab)
    rows = Ledger(lab.root / "research" / "results.tsv").rows()
    if a.output == "tsv":
        sys.stdout.write((lab.root / "research" / "results.tsv").read_text()
                         if rows else "")
        return 0
    head = ["RUN_ID", "STATUS", "EXPERIMENT", "CAMPAIGN", "VAL_BPB", "DELTA", "PROMOTED",
            "CANDIDATE", "COMMENT"]
    print_table(head, [[r.get("run_id", ""), r.get("status", ""), r.get("experiment_id", ""),
                        r.get("campaign", ""), r.get("val_bpb", ""), r.get("delta", ""),
                        r.get("promoted", ""), r.get("candidate_hash", "")[:12],
                        r.get("comment", "")[:70]] for r in rows])
    return 0


def cmd_master(a) -> int:
    lab = LocalLab(a.lab)
    d = lab.repo.master_doc()
    if a.output == "json":
        print(json.dumps(d, indent=2))
        return 0
    print(f"master:     {d['hash']}")
    print(f"val_bpb:    {d.get('val_bpb')}")
    print(f"experiment: {d.get('experiment') or '(seed)'}")
    print(f"commit:     {d['commit']}")
    print(f"promotions: {len(d.get('history', [])) - 1}")
    return 0


def cmd_demo(a) -> int:
    from controller.demo import run_demo
    return run_demo(keep=a.keep, directory=a.dir)


def cmd_crds(a) -> int:
    from controller.crds import write_crds
    for p in write_crds(Path(a.out)):
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autolab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, fn, help_, lab=True):
        sp = sub.add_parser(name, help=help_, description=help_)
        if lab:
            sp.add_argument("--lab", default=".", metavar="DIR", help="lab directory (default: .)")
        sp.set_defaults(fn=fn)
        return sp

    sp = add("init", cmd_init, "create a new lab: git repo, bench/, research/, seeded master",
             lab=False)
    sp.add_argument("dir")
    sp.add_argument("--profile", choices=["tiny", "default"], default="default")
    sp.add_argument("--data", default="hub", help="synthetic | hub | dir:PATH")
    sp.add_argument("--name", default="default", help="the Lab's name")
    sp.add_argument("--budget", type=int, help="training seconds per run (default: profile's)")
    sp = add("apply", cmd_apply, "create or update experiments from spec files")
    sp.add_argument("-f", "--filename", action="append", required=True,
                    help="FILE, DIR or - (stdin); repeatable")
    sp = add("run", cmd_run, "reconcile until every experiment is finished")
    sp.add_argument("--watch", action="store_true", help="keep running and pick up new specs")
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between passes")
    sp.add_argument("--unsafe-no-sandbox", action="store_true",
                    help="run candidates without bubblewrap (only for code you trust; every "
                         "result says so)")
    sp = add("get", cmd_get, "list experiments (or one)")
    sp.add_argument("name", nargs="?")
    sp.add_argument("-o", "--output", choices=["wide", "json", "yaml"])
    sp = add("describe", cmd_describe, "everything about one experiment, with its events")
    sp.add_argument("name")
    sp = add("logs", cmd_logs, "the run log of an experiment")
    sp.add_argument("name")
    sp.add_argument("-f", "--follow", action="store_true")
    sp = add("delete", cmd_delete, "delete an experiment (cancels its run, records it)")
    sp.add_argument("name")
    sp = add("ledger", cmd_ledger, "the ledger, research/results.tsv")
    sp.add_argument("-o", "--output", choices=["table", "tsv"], default="table")
    sp = add("master", cmd_master, "the current master")
    sp.add_argument("-o", "--output", choices=["text", "json"], default="text")
    sp = add("demo", cmd_demo, "a whole lab in a temporary directory: seven outcomes, tiny, CPU",
             lab=False)
    sp.add_argument("--keep", action="store_true", help="keep the demo lab directory")
    sp.add_argument("--dir", help="build the demo lab here instead of a temporary directory")
    sp = add("crds", cmd_crds, "write the CRDs generated from the spec schema", lab=False)
    sp.add_argument("--out", default=str(REPO_ROOT / "crds"))
    for register in EXTRA_COMMANDS.values():
        register(sub, add)
    return p


# Other modules (authoring, hf, operator) register their commands here, keyed by module.
EXTRA_COMMANDS: dict = {}


def main(argv: list[str] | None = None) -> int:
    _load_extras()
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return a.fn(a)
    except (SpecError, CliError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _load_extras() -> None:
    import importlib
    for mod in ("controller.authoring", "controller.hf", "controller.operator"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


if __name__ == "__main__":
    sys.exit(main())
