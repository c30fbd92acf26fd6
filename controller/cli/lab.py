"""The commands of a lab on one machine: init, apply, run, get, describe, logs, delete,
ledger, master, crds."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml

from controller.core import figures
from controller.core.status import TERMINAL
from controller.core.noise import hard_cap
from controller.core.spec import SpecError
from controller.backends.local import UNSAFE_ENV
from controller.lab.init import default_max_pairs
from controller.engine import BaselineFailed, measure_noise, noise_record
from controller.local import LocalLab, init_lab, load_yaml_file, queue_places
from controller.cli.listing import select, sort_records
from controller.cli.output import (CliError, activate_hint, autolab_command, gain_interval, item,
                                   number, one_line, print_table, printable, table_rows)


def cmd_init(a) -> int:
    if a.keep_metric and not a.seed:
        raise CliError("--keep-metric needs --from SEED_DIR (it reads the seed's master record)")
    max_pairs = a.max_pairs if a.max_pairs is not None else default_max_pairs(a.profile, a.min_delta)
    if a.seed:
        from controller.lab.seed import import_seed

        root, found = import_seed(Path(a.dir), Path(a.seed), profile=a.profile, data=a.data,
                                  name=a.name, budget=a.budget, keep_metric=a.keep_metric,
                                  min_delta=a.min_delta, max_pairs=max_pairs)
        lab = LocalLab(root)
        print(f"imported the seed lab {found.source}: train.py is the master, "
              f"{len(found.rows)} ledger rows kept (reason Imported), {len(found.prose)} "
              "research files copied")
        if found.repeated_runs:
            print(f"  {found.repeated_runs} rows repeated a run id and were left out")
        if found.dropped_columns:
            print(f"  columns not kept: {' '.join(found.dropped_columns)}")
        print("  the master's val_bpb: " + (f"{found.metric} (from the seed's record)"
                                           if found.metric is not None else
                                           "measured again by the first `autolab run`"))
    else:
        lab = init_lab(Path(a.dir), profile=a.profile, data=a.data, name=a.name,
                       budget=a.budget, min_delta=a.min_delta, max_pairs=max_pairs)
    m = lab.repo.master()
    print(f"lab {lab.name} initialised in {lab.root}")
    print(f"master {m.hash[:12]} (commit {m.commit[:10]}); profile {a.profile}, data {a.data}")
    if not lab.lab.one_pair_decides:
        print(f"promotion: each candidate runs on the master's secret seeds, one at a time, and "
              f"is judged on its paired differences after each run (at most "
              f"{lab.lab.pairs_cap} pairs): a clear loser stops after one run; `autolab noise` "
              "says which gains this machine and budget can show")
    cmd = autolab_command()
    print(f"next: `cd {a.dir}`, write a spec (`{cmd} worktree NAME`, `{cmd} new NAME`), then "
          f"`{cmd} apply -f FILE` and `{cmd} run`{activate_hint()}")
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
    refused = 0
    for src, doc in docs:  # like kubectl: each document on its own; a refusal writes nothing
        try:
            verb = lab.apply_file(doc, src)
        except SpecError as e:
            refused += 1
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            continue
        print(f"experiment.autolab.dev/{doc['metadata']['name']} {verb}", flush=True)
    return 1 if refused else 0


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(round(seconds))
    return f"{s}s" if s < 60 else (f"{s // 60}m{s % 60:02d}s" if s < 3600
                                   else f"{s // 3600}h{s % 3600 // 60:02d}m")


def _progress_cells(p: dict | None) -> list[str]:
    """ELAPSED, STEP and ETA (training seconds left of the budget) of a run, as far as known."""
    if not p:
        return ["", "", ""]
    eta = ""
    if p.get("budget") is not None:
        eta = "~" + _duration(max(0.0, p["budget"] - p["training"]))
    return [_duration(p.get("elapsed")), str(p.get("step", "")), eta]


class Progress:
    """Shows the lab while `run` loops: a live table on a terminal; otherwise (a pipe, a log)
    one line per transition and, for each run in flight, a progress line every `every` seconds
    (AUTOLAB_PROGRESS_SECONDS, default 30), the master's baseline included."""

    IN_FLIGHT = ("Running", "Confirming")

    def __init__(self, lab: LocalLab | None = None, quiet: bool = False,
                 every: float | None = None):
        self.lab = lab
        self.live = None
        self.seen: dict[str, tuple] = {}
        self.quiet = quiet
        self.every = every if every is not None else float(
            os.environ.get("AUTOLAB_PROGRESS_SECONDS") or 30)
        self.told: dict[str, float] = {}  # run -> when its last progress line went out
        self.extra_seen: set[str] = set()
        self.baseline_pending: bool | None = None
        if sys.stdout.isatty() and not quiet:
            from rich.live import Live
            self.live = Live(auto_refresh=False)
            self.live.start()

    def _progress(self, run: str | None) -> dict | None:
        if self.lab is None or not run:
            return None
        try:
            return self.lab.run_progress(run)
        except OSError:
            return None

    def _runs(self, summary) -> list[tuple[str, str, str | None]]:
        """(label, phase, local run) of every row, and of runs no experiment owns (the master's
        baseline and noise runs) as extra rows."""
        out = []
        owned = set()
        for name, st, _ in summary.rows:
            job = st.get("job") or {}
            run = job.get("name") if job.get("backend") == "local" else None
            owned.add(job.get("name"))
            out.append((name, st.get("phase", "Pending"), run))
        if self.lab is not None:
            try:
                flying = self.lab.runs_in_flight()
            except OSError:
                flying = []
            out += [(run, "Running", run) for run, _ in flying if run not in owned]
        return out

    def update(self, summary) -> None:
        if self.live is not None:
            self._table(summary)
        elif not self.quiet:
            self._lines(summary)

    def _table(self, summary) -> None:
        from rich.table import Table
        head, rows = table_rows(summary.rows)
        head, rows = head[:6], [r[:6] for r in rows]  # what a run needs; `get` shows the rest
        runs = self._runs(summary)
        rows += [[label, phase, "", "", "", ""] for label, phase, _ in runs[len(rows):]]
        head += ["ELAPSED", "STEP", "ETA"]
        rows = [r + (_progress_cells(self._progress(run)) if phase in self.IN_FLIGHT
                     else ["", "", ""]) for r, (_, phase, run) in zip(rows, runs)]
        t = Table(title="autolab run" + (" — measuring the master's baseline"
                                         if summary.baseline_pending else ""))
        for i, h in enumerate(head):  # names, phases and numbers never shrink; the rest may
            keep = h not in ("CAMPAIGN",)
            widest = max([len(h)] + [len(r[i]) for r in rows])
            t.add_column(h, no_wrap=True, min_width=widest if keep else None,
                         overflow="ellipsis")
        for r in rows:
            t.add_row(*r)
        self.live.update(t, refresh=True)

    def _lines(self, summary) -> None:
        if self.baseline_pending is None and summary.baseline_pending:
            print("the master has no val_bpb yet: measuring its baseline first", flush=True)
        elif self.baseline_pending and not summary.baseline_pending and self.lab is not None:
            v = self.lab.repo.master().val_bpb
            print(f"the master's baseline: val_bpb={number(v)}", flush=True)
        self.baseline_pending = summary.baseline_pending
        for name, st, _ in summary.rows:
            key = (st.get("phase"), st.get("outcome"), (st.get("job") or {}).get("slot"))
            if self.seen.get(name) != key:
                self.seen[name] = key
                slot = key[2] if key[0] in ("Queued", "Running") and key[2] else ""
                extra = f" on slot {slot}" if slot and key[0] == "Running" else ""
                val = (st.get("metrics") or {}).get("val_bpb")
                res = f" val_bpb={val:.6f}" if val is not None else ""
                print(f"{name}: {key[0]}{' ' + key[1] if key[1] else ''}{extra}{res}", flush=True)
        now = time.monotonic()
        for label, phase, run in self._runs(summary):
            if phase not in self.IN_FLIGHT or not run:
                continue
            if label == run and run not in self.extra_seen:  # a baseline or noise run
                self.extra_seen.add(run)
                print(f"{run}: Running", flush=True)
                self.told[run] = now
                continue
            if now - self.told.setdefault(run, now) < self.every:
                continue
            self.told[run] = now
            elapsed, step, eta = _progress_cells(self._progress(run))
            if not elapsed:
                continue
            facts = [f"{elapsed} elapsed"] + ([f"step {step}"] if step else []) \
                + ([f"{eta} of training left"] if eta else [])
            print(f"{label}: {phase}, {', '.join(facts)}", flush=True)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def run_loop(lab: LocalLab, watch: bool = False, interval: float = 1.0, quiet: bool = False,
             timeout: float | None = None) -> int:
    progress = Progress(lab, quiet=quiet)
    shown_errors: set[str] = set()
    started = time.time()
    try:
        while True:
            summary = lab.step()
            for e in summary.errors:
                if e not in shown_errors:
                    shown_errors.add(e)
                    print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            progress.update(summary)
            if summary.done and not watch:
                break
            if timeout and time.time() - started > timeout:
                print("run: timed out", file=sys.stderr)
                return 1
            time.sleep(interval)
    except BaselineFailed as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        progress.stop()
        lab.stop_runs_started_ahead()
        print(interrupted_note(lab), file=sys.stderr, flush=True)
        return 130
    finally:
        progress.stop()
        lab.stop_runs_started_ahead()
    return 0


def interrupted_note(lab: LocalLab) -> str:
    """What Ctrl-C on `autolab run` left behind. Runs live in their own process session by
    design (a controller that stops, or crashes, never loses a run), so they go on; the next
    `autolab run` adopts them and records their results. The note says so and how to follow
    or stop them."""
    cmd = autolab_command()
    try:
        running = lab.runs_in_flight()
    except OSError:
        running = []
    if not running:
        return f"{cmd} run: stopped; no run is in flight. `{cmd} run` goes on where it stopped."
    known = set(lab_records(lab))
    names = [e for _, e in running if e in known]
    lines = [f"{cmd} run: stopped, but {len(running)} run(s) go on in the background: "
             + ", ".join(r for r, _ in running) + ".",
             f"  They finish on their own; `{cmd} run` again records their results (it adopts "
             "them, never starts one twice)."]
    follow = [f"`{cmd} logs -f {n}`" for n in names[:2]]
    follow += [f"`tail -f {lab.paths.run_dir(r) / 'log.txt'}`" for r, e in running
               if e not in known][:1]
    lines.append(f"  Follow: `{cmd} get -w`, " + ", ".join(follow) + ".")
    if names:
        lines.append(f"  Stop them: `{cmd} delete {' '.join(names)}` (cancels and records "
                     f"them), or `{cmd} delete --all`.")
    return "\n".join(lines)


def cmd_run(a) -> int:
    with LocalLab(a.lab) as lab:
        _sandbox_or_refuse(lab, a.unsafe_no_sandbox)
        reaped = lab.reap_stale()
        if reaped:
            print(f"{autolab_command()} run: reaped {len(reaped)} run(s) started ahead by a controller "
                  "that is gone: " + "; ".join(reaped), file=sys.stderr, flush=True)
        return run_loop(lab, watch=a.watch, interval=a.interval)


def _sandbox_or_refuse(lab: LocalLab, unsafe: bool) -> None:
    if unsafe:
        os.environ[UNSAFE_ENV] = "1"
        print("autolab: WARNING: candidates run WITHOUT a sandbox (--unsafe-no-sandbox): a hostile "
              "train.py can forge its metric and change the lab; every result says so",
              file=sys.stderr)
        return
    problem = lab.backends["local"].sandbox_problem()
    if problem:
        raise CliError(problem)


def cmd_noise(a) -> int:
    """`autolab noise --runs N`: the master at places 1..N (kept for its candidates) and once
    more at each; what the lab can see at this budget (`controller.engine.noise`)."""
    if a.runs < 2:
        raise CliError(f"--runs {a.runs}: the spread needs at least 2 runs; pass --runs 3 or more")
    lab = LocalLab(a.lab)
    _sandbox_or_refuse(lab, a.unsafe_no_sandbox)
    engine = lab.engine
    print(f"noise: the master at {a.runs} of the lab's secret seeds, and each again "
          f"({lab.lab.profile} profile, budget {lab.lab.budget_seconds or 'the profile default'}"
          " s); values the master has already are reused", flush=True)
    shown = None
    while True:
        state = engine.baseline() if engine.master.master().place(1) is None \
            else measure_noise(engine, a.runs)
        if engine.master.master().place(1) is not None and state.state == "measured" \
                and noise_record(engine) is not None:
            break
        if state.state == "failed":
            raise CliError(f"{state.message}; see the runs' logs under "
                           f"{lab.paths.state / 'runs'}, fix the cause, then run again")
        if state.run and state.run != shown:
            print(f"  {state.run}: {state.state}", flush=True)
            shown = state.run
        time.sleep(a.interval)
    doc = noise_record(engine) or {}
    pairs = ", ".join(f"{p:.6f}/{r:.6f}" for p, r in zip(doc["places"], doc["repeats"]))
    print(f"master {doc['master'][:12]} ({doc.get('experiment') or 'seed'}), place by place "
          f"(run/again): {pairs}")
    print(f"across seeds: sd {doc['acrossSeeds']:.6f} val_bpb (what an unpaired comparison "
          "fights)")
    print(f"paired, the same seed twice: sd {doc['paired']:.6f} (the GPU's own noise; a "
          "change that moves the initialisation spreads wider, and its own pairs say so)")
    print(f"smallest gain the first test against this master promotes 9 times in 10 within "
          f"{doc['cap']} pairs: {doc['detectable']:.6f} ({doc['detectableSds']} paired sds)")
    print(f"written to {lab.paths.noise_file}; no decision waits for it or reads it")
    return 0


def lab_records(lab: LocalLab) -> dict[str, dict]:
    """Every experiment the lab knows, by name: its record, or (a spec file the loop has not
    read yet) the spec as Pending, as kubectl shows an object the moment it is created."""
    records = {n: lab.read_record(n) for n in lab.names()}
    for n, sf in lab.load_specs().specs.items():
        if sf.doc is None or not isinstance(sf.doc.get("metadata"), dict):
            continue
        if n in records:  # the labels are the spec file's (metadata may change; spec may not)
            created = (records[n].get("metadata") or {}).get("creationTimestamp")
            records[n] = {**records[n], "metadata": {**sf.doc["metadata"], **(
                {"creationTimestamp": created} if created else {})}}
        elif sf.error is None:
            records[n] = {"spec": sf.doc.get("spec") or {}, "status": {"phase": "Pending"},
                          "metadata": sf.doc["metadata"]}
    return dict(sorted(records.items()))


def not_found(lab: LocalLab, name: str, known=None) -> CliError:
    """`experiment 'x' not found`, with the closest known names when there are some."""
    import difflib
    close = difflib.get_close_matches(name, list(known if known is not None
                                                 else lab_records(lab)), n=3, cutoff=0.6)
    if not close:
        return CliError(f"experiment {name!r} not found")
    return CliError(f"experiment {name!r} not found; did you mean {' or '.join(close)}? "
                    "(`autolab get` lists them)")


def record_of(lab: LocalLab, name: str) -> dict:
    records = lab_records(lab)
    if name not in records:
        raise not_found(lab, name, records)
    return records[name]


def listed(lab: LocalLab, a) -> dict[str, dict]:
    """The experiments `get` shows: one by name, or all that match `-l`, in `--sort-by` order.

    Each waiting one carries its place in the lab's queue (`status.queuePosition`, the QUEUE
    column), worked out as it is listed: the controller stores no such field."""
    records = lab_records(lab)
    places = queue_places(records)
    records = {n: {**r, "status": {**(r.get("status") or {}), "queuePosition": places[n]}}
               if n in places else r for n, r in records.items()}
    if a.name:
        if a.name not in records:
            raise not_found(lab, a.name, records)
        records = {a.name: records[a.name]}
    return sort_records(select(records, a.selector), a.sort_by)


def _show(a, records: dict[str, dict], header: bool = True,
          widths: list[int] | None = None) -> list[int] | None:
    if a.output == "name":
        for n in records:
            print(f"experiment.autolab.dev/{n}")
        return None
    if a.output in ("json", "yaml"):
        items = [item(n, r) for n, r in records.items()]
        if a.watch:  # one document per change, as `kubectl get -w -o json` streams them
            for i in items:
                print(json.dumps(i, indent=2) if a.output == "json"
                      else "---\n" + yaml.safe_dump(i, sort_keys=False), end="\n"
                      if a.output == "json" else "")
            return None
        doc = items[0] if a.name else {"apiVersion": "v1", "kind": "List", "items": items}
        print(json.dumps(doc, indent=2) if a.output == "json"
              else yaml.safe_dump(doc, sort_keys=False), end="\n" if a.output == "json" else "")
        return None
    head, rows = table_rows([(n, r.get("status") or {}, r.get("spec") or {})
                             for n, r in records.items()], wide=a.output == "wide")
    if not rows and not header:
        return widths
    return print_table(head, rows, widths=widths, header=header)


def cmd_get(a) -> int:
    lab = LocalLab(a.lab)
    records = listed(lab, a)
    if not a.watch:
        _show(a, records)
        return 0
    return watch(lab, a, records)


def _row_key(r: dict) -> str:
    st = dict(r.get("status") or {})
    st.pop("conditions", None)  # a condition's time moves without anything to show
    return json.dumps([st, (r.get("metadata") or {}).get("labels")], sort_keys=True,
                      default=str)


def watch(lab: LocalLab, a, records: dict[str, dict]) -> int:
    """`get -w`: the list, then every experiment again each time it changes, until Ctrl-C."""
    widths = _show(a, records)
    sys.stdout.flush()
    seen = {n: _row_key(r) for n, r in records.items()}
    while True:
        time.sleep(a.interval)
        try:
            records = listed(lab, a)
        except CliError:
            if a.name:  # `get -w NAME` of an experiment deleted meanwhile: it is gone
                return 0
            raise
        changed = {n: r for n, r in records.items() if seen.get(n) != _row_key(r)}
        if changed:
            widths = _show(a, changed, header=False, widths=widths) or widths
            sys.stdout.flush()
            seen.update({n: _row_key(r) for n, r in changed.items()})


def cmd_describe(a) -> int:
    lab = LocalLab(a.lab)
    r = record_of(lab, a.name)
    st, spec = r.get("status") or {}, r.get("spec") or {}
    def field(label: str, value: object) -> str:  # a space after the colon, however long
        return f"{label + ':':<15} {'' if value is None else value}".rstrip()

    out = [field("Name", a.name), field("Lab", spec.get("lab", "default")),
           field("Campaign", spec.get("campaign", "")), field("Hypothesis", spec.get("hypothesis")),
           field("Parent", spec.get("parent")), field("Phase", st.get("phase", "Pending")),
           field("Outcome", st.get("outcome", "")), field("Reason", st.get("reason", "")),
           field("Message", st.get("message", ""))]
    for k in ("candidateHash", "semanticHash", "parentHash", "rebasedFrom", "duplicateOf",
              "commit", "delta", "masterValBpb"):
        if st.get(k) is not None:
            shown = number(st[k], signed=k == "delta") if k in ("delta", "masterValBpb") \
                else st[k]
            out.append(field(k, shown))
    if st.get("job"):
        out.append(field("Run", json.dumps(st["job"])))
    if st.get("metrics"):
        out.append("Metrics:")
        own = figures.of_status(st)
        out += [f"  {k}: " + ("not measured" if v is None else
                              f"{v}  ({figures.EXPLAINED})" if k in own else str(v))
                for k, v in st["metrics"].items()]
    out += describe_pairs(st)
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


def describe_pairs(st: dict) -> list[str]:
    """The lines of `describe` about a decision: each pair, the estimate, why it stopped."""
    p = st.get("pairs")
    if not isinstance(p, dict):
        return []
    against = (st.get("parentHash") or "")[:12]
    out = [f"Pairs:        against master {against}, its values at the lab's places; the spread "
           "is these pairs' own (place: candidate - master = gain; positive is better)"]
    for i, (c, m) in enumerate(zip(p.get("candidate") or [], p.get("master") or []), 1):
        out.append(f"  {i}: {c:.6f} - {m:.6f} = {m - c:+.6f}")
    step = p.get("verdict") or p.get("estimate")
    if isinstance(step, dict):
        se = step.get("standardError")
        out.append(f"  gain {gain_interval(step)} (95 % interval)" +
                   (f", standard error {se:.6f}, t {step.get('t')}" if se is not None else ""))
        crit = step.get("critical")
        cap = step.get("cap")
        alpha = step.get("alpha")
        alpha = f"{alpha:.3g}" if isinstance(alpha, (int, float)) else alpha
        out.append(f"  test {step.get('tries')} against its master, level {alpha} "
                   "(the campaign's online FDR control); "
                   + (f"t had to pass {crit}" if crit is not None else "no look before 3 pairs")
                   + f"; at most {cap} pairs"
                   + (f", {hard_cap(cap)} while its interval excludes no effect"
                      if isinstance(cap, int) else ""))
        if step.get("morePairs"):
            out.append(f"  about {step['morePairs']} more pairs would likely decide it: apply the "
                       "same change again under a new name, and it continues from these pairs")
        out.append(f"  {'stopped' if p.get('verdict') else 'so far'}: {step.get('why')}")
    return out


def cmd_logs(a) -> int:
    lab = LocalLab(a.lab)
    st = record_of(lab, a.name).get("status") or {}
    job = st.get("job") or {}
    if not job:
        phase = st.get("phase") or "Pending"
        if phase in TERMINAL:
            raise CliError(f"experiment {a.name!r} is {phase} and never ran, so it has no log; "
                           f"`autolab describe {a.name}` says why")
        raise CliError(f"experiment {a.name!r} is {phase} and has no run yet; `autolab run` "
                       f"starts it, `autolab get -w` shows when it does")
    backend = lab.backend_for(job["backend"])
    path = None
    # The experiment's first run (its place-1 run) where its log is kept; else its last run.
    for run in dict.fromkeys(r for r in (st.get("run"), job["name"]) if r):
        path = backend.log_path(run) if hasattr(backend, "log_path") else None
        if path is not None and Path(path).exists():
            break
    if path is None or not Path(path).exists():
        raise CliError(f"no log for run {job['name']} on this machine")
    # The log is the candidate's output: escape sequences in it would reach the reader's
    # terminal (retitle it, write the clipboard, repaint what was printed), so they are shown
    # escaped, like every other text a candidate or a spec carried.
    def write(text: str) -> None:
        sys.stdout.write(printable(text))

    with open(path, encoding="utf-8", errors="replace") as f:
        write(f.read())
        while a.follow:
            chunk = f.read()
            if chunk:
                write(chunk)
                sys.stdout.flush()
                continue
            st = (lab.read_record(a.name).get("status") or {})
            if st.get("phase") in TERMINAL:
                break
            if job["backend"] == "local" and backend.observe(job["name"]).state != "running":
                write(f.read())  # ended while no `autolab run` was looping
                break
            time.sleep(0.5)
    return 0


def cmd_delete(a) -> int:
    lab = LocalLab(a.lab)
    names = list(a.name)
    for src, doc in _read_sources(a.filename or []):
        meta = doc.get("metadata") if isinstance(doc, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or not name:
            raise CliError(f"{src}: metadata.name: required field is missing; it names the "
                           "experiment to delete")
        names.append(name)
    records = lab_records(lab)
    if a.all:
        if names:
            raise CliError("delete: give names (or -f FILE), or --all, not both")
        names = list(records)
        if not names:
            print("no experiments to delete", file=sys.stderr)
    elif not names:
        raise CliError("delete: name the experiment (`autolab delete NAME`), or pass -f FILE "
                       "or --all")
    missing = 0
    for n in dict.fromkeys(names):
        if n not in records:
            missing += 1
            print(f"error: {not_found(lab, n, records)}", file=sys.stderr, flush=True)
            continue
        d = lab.delete(n)
        phase = d.status.get("phase") if d else "removed"
        print(f"experiment.autolab.dev/{n} deleted ({phase})", flush=True)
    return 1 if missing else 0


def cmd_ledger(a) -> int:
    lab = LocalLab(a.lab)
    rows = lab.ledger.rows()
    if a.output == "tsv":
        sys.stdout.write(lab.paths.ledger.read_text()
                         if rows else "")
        return 0
    head = ["RUN_ID", "STATUS", "EXPERIMENT", "CAMPAIGN", "VAL_BPB", "DELTA", "PROMOTED",
            "CANDIDATE", "COMMENT"]
    print_table(head, [[r.get("run_id", ""), r.get("status", ""), r.get("experiment_id", ""),
                        r.get("campaign", ""), number(r.get("val_bpb", "")),
                        number(r.get("delta", ""), signed=True),
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
    v = d.get("val_bpb")
    print("val_bpb:    " + (number(v) if v is not None
                             else "not measured yet (`autolab run` measures it first)"))
    print(f"experiment: {d.get('experiment') or '(seed)'}")
    print(f"commit:     {d['commit']}")
    print(f"promotions: {len(d.get('history', [])) - 1}")
    places = d.get("places") or {}
    print("places:     " + (", ".join(f"{k}: {number(v)}" for k, v in sorted(
        places.items(), key=lambda kv: int(kv[0]))) if places else "none yet"))
    noise = noise_record(lab.engine)
    print("noise:      " + (f"across seeds sd {noise['acrossSeeds']}, paired sd "
                            f"{noise['paired']}, detectable {noise['detectable']} (measured on "
                            f"this master, {noise['master'][:12]}, budget "
                            f"{noise.get('budgetSeconds') or 'default'} s)"
                            if noise else "not measured on this master (`autolab noise --runs 5`)"))
    return 0

def cmd_crds(a) -> int:
    from controller.kube.crds import write_crds
    for p in write_crds(Path(a.out)):
        print(p)
    return 0

